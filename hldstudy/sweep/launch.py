"""Preparing a runs directory for a launch: drift check, sweep.json, strays."""

from __future__ import annotations

import datetime as _dt
import json
import shutil
import sys
from pathlib import Path

from hldstudy.errors import ConfigError

PROG = "python -m hldstudy.sweep"


def prepare_workdir(sweep, runs, selected, workdir: Path, *, sweep_file, overrides=(),
                    force: bool = False) -> None:
    """Refuses stale run dirs (or moves them aside with force), writes WORKDIR/sweep.json
    listing every run of the grid, warns about run dirs the grid does not have."""
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    check_drift(selected, workdir, force)
    manifest = sweep_manifest(sweep, runs, sweep_file, workdir, overrides)
    tmp = workdir / ".sweep.json.tmp"
    tmp.write_text(json.dumps(manifest, indent=2) + "\n")
    tmp.replace(workdir / "sweep.json")
    listed = {r.run_id for r in runs}
    strays = [p.name for p in workdir.iterdir() if p.is_dir() and not p.name.startswith(".")
              and p.name not in listed and (p / "config.json").exists()]
    if strays:
        print(f"{PROG}: warning: {len(strays)} run director{'y' if len(strays) == 1 else 'ies'} "
              f"in {workdir} not part of this grid (the analysis will include them): "
              + ", ".join(strays[:5]), file=sys.stderr)


def sweep_manifest(sweep, runs, sweep_file: Path, workdir: Path, overrides) -> dict:
    first = runs[0].config
    return {
        "name": sweep.name,
        "sweep_file": str(Path(sweep_file).absolute()),
        "launch": sweep.launch,
        "overrides": list(overrides),
        "written": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "budget_flops": first.budget.flops,
        "count_teacher": first.budget.count_teacher,
        "teacher": first.teacher.checkpoint,
        "methods": list(dict.fromkeys(r.method for r in runs)),
        "eval_tasks": list(sweep.eval_tasks),
        "n_runs": len(runs),
        "runs": [r.entry() for r in runs],
    }


def check_drift(runs, workdir: Path, force: bool) -> list[str]:
    """Refuses (ConfigError naming the field) run dirs whose config differs from the grid;
    with force, moves them to WORKDIR/.sweep/stale/. Returns the moved run ids."""
    from hldstudy.sweep.spec import UNREADABLE, config_drift

    stale = []
    for r in runs:
        d = config_drift(r, workdir / r.run_id)
        if d:
            stale.append((r, d))
    if not stale:
        return []
    if not force:
        r, d = stale[0]
        key, old, new = d[0]
        if key == UNREADABLE:
            raise ConfigError(key, f"{old}: {workdir / r.run_id} cannot be compared with the "
                              "grid", "restore the file, use another --workdir, or pass --force "
                              "to move the run to WORKDIR/.sweep/stale/ and rerun it")
        more = f" (and {len(d) - 1} more field(s))" if len(d) > 1 else ""
        others = f"; {len(stale) - 1} other run(s) too" if len(stale) > 1 else ""
        raise ConfigError(key, f"{workdir / r.run_id} was trained with {old!r} but the grid now "
                               f"asks for {new!r}{more}{others}",
                          "restore the sweep, use another --workdir, or pass --force to move "
                          "the old run to WORKDIR/.sweep/stale/ and rerun it")
    moved = []
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    for r, d in stale:
        dest = workdir / ".sweep" / "stale" / f"{r.run_id}.{stamp}"
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(str(workdir / r.run_id), str(dest))
        print(f"{r.run_id}: config changed ({d[0][0]}: {d[0][1]!r} -> {d[0][2]!r}); moved the "
              f"old run to {dest}", file=sys.stderr)
        moved.append(r.run_id)
    return moved
