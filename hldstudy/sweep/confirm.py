"""Confirming a sweep's picks on fresh seeds: each arm's best configuration, chosen on the
sweep's own seeds by the analysis' rule (`analysis.tables.best_table`), re-run at seeds
that chose nothing. Only those runs give best vs best a verdict
(`analysis.tables.confirm_table`); the picks are written down (WORKDIR/confirm.json)
before any of them runs, and never chosen again.

Design notes: `docs/sweeps.md`, under this file's name.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import json
from pathlib import Path

from hldstudy import rundir
from hldstudy.errors import InputError
from hldstudy.fileio import write_json_atomic
from hldstudy.sweep.spec import AXES, GRID_AXES, SEED_AXIS, Run, Sweep, expand

CONFIRM_FILE = "confirm.json"


def parse_seeds(text: str) -> tuple[int, ...]:
    """`--confirm 3,4,5` or `--confirm 3-12` -> the seeds, in order, each once."""
    seeds: list[int] = []
    try:
        for part in (p.strip() for p in text.split(",") if p.strip()):
            lo, _, hi = part.partition("-")
            seeds += range(int(lo), int(hi) + 1) if hi else [int(lo)]
    except ValueError:
        raise InputError(f"--confirm {text!r}: expected seeds like 3,4,5 or 3-12") from None
    if len(seeds) < 2:
        raise InputError(f"--confirm {text!r}: a confirmation needs at least 2 fresh seeds "
                         "(its interval needs 2 values)")
    return tuple(dict.fromkeys(seeds))


def choose(grid: list[Run], workdir: Path) -> dict:
    """The picks, by the analysis' own rule over the grid's finished runs: {arm: {"method",
    "params" (the run's swept values but the seed), "from_runs", "valid_ppl"}}. Refuses
    (naming the runs) while a grid run is unfinished."""
    from hldstudy.analysis.runs import load_runs
    from hldstudy.analysis.tables import best_table, dedupe, finished

    todo = [r.run_id for r in grid if rundir.status(workdir / r.run_id) != "done"]
    if todo:
        raise InputError(f"--confirm: {len(todo)} run(s) of the grid are not finished "
                         f"({', '.join(todo[:3])}{' ...' if len(todo) > 3 else ''}): the "
                         "picks are chosen on the whole grid; run the sweep without --confirm "
                         "first")
    df = load_runs(workdir)
    ids = {r.run_id for r in grid}
    df = df[df["run_id"].astype(str).isin(ids)]
    kept, _ = dedupe(finished(df))
    by_id = {r.run_id: r for r in grid}
    picks = {}
    for _, row in best_table(kept).iterrows():
        run = by_id[sorted(str(row["run_ids"]).split(","))[0]]
        picks[str(row["arm"])] = {
            "method": run.method,
            "params": {k: v for k, v in run.params.items() if k != SEED_AXIS},
            "from_runs": sorted(str(row["run_ids"]).split(",")),
            "valid_ppl": float(row["valid_ppl"])}
    return picks


def plan(sweep: Sweep, grid: list[Run], workdir: Path, seeds: tuple[int, ...] | None,
         overrides=(), write: bool = True) -> list[Run]:
    """The confirmation runs of WORKDIR: its written picks (chosen now and written when
    `seeds` are given and no picks exist yet) at every confirmation seed. `seeds` may add
    seeds to an existing confirmation; they never re-choose the picks. [] when there is
    no confirmation. `write=False` (a dry run): what would run, nothing written."""
    path = Path(workdir) / CONFIRM_FILE
    record = _read(path) if path.exists() else None
    if record is None and seeds is None:
        return []
    chosen_on = sorted({int(r.params[SEED_AXIS]) for r in grid if SEED_AXIS in r.params})
    if seeds is not None:
        clash = sorted(set(seeds) & set(chosen_on))
        if clash:
            raise InputError(f"--confirm: seed(s) {clash} chose the picks (the sweep's seeds "
                             f"are {chosen_on}); confirm on seeds the grid never ran")
    if record is None:
        record = {"written_utc": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
                  "selection_seeds": chosen_on, "seeds": list(seeds),
                  "picks": choose(grid, Path(workdir))}
        if write:
            write_json_atomic(path, record)
    elif seeds is not None and not set(seeds) <= set(record["seeds"]):
        record = {**record, "seeds": list(dict.fromkeys([*record["seeds"], *seeds]))}
        if write:
            write_json_atomic(path, record)
    return runs_at(sweep, record, overrides)


def _read(path: Path) -> dict:
    try:
        record = json.loads(path.read_text())
        if not isinstance(record.get("picks"), dict) or not record.get("seeds"):
            raise ValueError("expected picks and seeds")
    except (OSError, ValueError, AttributeError) as e:
        raise InputError(f"{path} cannot be read ({e}); restore it, or move it aside to "
                         "choose the picks again from the grid") from None
    return record


def runs_at(sweep: Sweep, record: dict, overrides=()) -> list[Run]:
    """The picks of a confirm.json record at each of its seeds, as grid runs of `sweep`
    (the same names, configs and budgets as the grid's own runs at those seeds)."""
    out = []
    for arm, p in record["picks"].items():
        point = {k: (v,) for k, v in p["params"].items()}
        one = dataclasses.replace(sweep, methods=(p["method"],),
                                  seeds=tuple(record["seeds"]),
                                  **{k: v for k, v in _sweep_axes(sweep, point).items()})
        runs = [r for r in expand(one, overrides)
                if {k: v for k, v in r.params.items() if k != SEED_AXIS} == p["params"]]
        if len(runs) != len(record["seeds"]):
            raise InputError(f"{CONFIRM_FILE}: the pick of {arm} ({p['params']}) is no longer "
                             f"a point of sweep {sweep.name}; restore the sweep file or move "
                             f"{CONFIRM_FILE} aside")
        out += runs
    return out


def _sweep_axes(sweep: Sweep, point: dict) -> dict:
    """The Sweep keywords that pin its axes to one point (`point`: {dotted field: (v,)})."""
    kw = {AXES[k]["column"]: point[k] for k in GRID_AXES if k in point}
    kw["extra_axes"] = tuple((k, point[k]) for k, _ in sweep.extra_axes if k in point)
    return kw
