"""Sweep definitions and their expansion into runs.

Design notes: `docs/sweeps.md`, under this file's name.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hldstudy import rundir
from hldstudy.config import (
    FILE_KEYS,
    Config,
    apply_overrides,
    axis_names,
    config_to_dict,
    fields_where,
    flatten,
    grid_axes,
    import_entry_point,
    replicate_axis,
    validate,
)
from hldstudy.distill import methods
from hldstudy.errors import ConfigError, InputError
from hldstudy.flops import step_flops
from hldstudy.flops.budget import plan_stages
from hldstudy.model.loading import teacher_model_config
from hldstudy.teacher_source import is_remote

# The grid axes and their names, declared on the config fields (`knob(axis=, short=)`):
# {dotted field: {"column": Sweep keyword / entry key, "short": run-id name, ...}}.
AXES = axis_names()
GRID_AXES = grid_axes()
SEED_AXIS = replicate_axis()
DATA_ORDER = "data.seed"  # the field a seed also sets (Sweep.seeds_vary_data_order)

# Config leaves that may differ between a run directory and the grid without it being
# a different run (display, logging, checkpoint cadence, transport knobs, the mesh):
# the fields tagged drift=False in hldstudy.config.
IGNORED_DRIFT = fields_where("drift", False)
PATH_FIELDS = ("teacher.checkpoint", "data.tokenizer", "data.path", "data.valid_path")


@dataclass(frozen=True)
class _SweepSpec:
    """One student, one FLOP budget, one teacher, one grid.

    base: the student config every run starts from (its distill.method is replaced).
    methods: the methods compared (default: every registered method).
    lr / temperature / alpha / hidden_weight (every grid axis of the config, by its
        field name: `hldstudy.config.grid_axes`) / seeds (`train.seed`): the values of
        that axis. An empty tuple leaves that field at the base config's value (not swept).
    extra_axes: ((dotted config field, (values...)), ...) further axes; they apply
        to the methods that declare them (`hldstudy.distill.methods.applies`).
    budget_flops: the FLOP budget of every run; or
    budget_baseline_steps: budget = this many steps of the baseline (exactly one is set).
    teacher: teacher.checkpoint for every distillation run (hldstudy run dir, GGUF file,
        HF directory); `--set teacher.checkpoint=...` overrides it.
    teacher_preset: model preset used to count the teacher's FLOPs when the teacher's
        config cannot be read from its checkpoint (e.g. not yet trained / downloaded).
    overrides: `key=value` strings applied to the base config of every run.
    eval_tasks / eval_limit / eval_batch_size / eval_offline_data: passed to
        `hldstudy.eval.evaluate` after each run; the metrics land under `eval` in
        its results.json.
    shared_tokenizer: give every run (the baseline too) the teacher's tokenizer when
        the teacher is an hldstudy run directory and data.tokenizer is unset.
    seeds_vary_data_order: a seed sets the data order (`data.seed`) as well as the
        initialisation (`train.seed`), as a new run would vary both; False: the
        initialisation only (every seed reads one data order: the sweeps before 2026-12).
        `data.seed` is part of a run's data identity, so cohorts (one teacher forward
        per batch) then group the runs of one seed, not the seeds of one configuration.
    launch: the command that launches this sweep (documentation; shown by --dry-run).
    """

    name: str
    base: Config
    methods: tuple[str, ...] = field(default_factory=lambda: methods.names())
    seeds: tuple[int, ...] = (0,)
    extra_axes: tuple[tuple[str, tuple], ...] = ()
    budget_flops: float = 0.0
    budget_baseline_steps: int = 0
    teacher: str | None = None
    teacher_preset: str | None = None
    overrides: tuple[str, ...] = ()
    eval_tasks: tuple[str, ...] = ()
    eval_limit: int | None = None
    eval_batch_size: int = 8
    eval_offline_data: str | None = None
    shared_tokenizer: bool = True
    seeds_vary_data_order: bool = True
    launch: str = ""

    def axes(self) -> list[tuple[str, tuple]]:
        """(dotted field, values) of every swept axis, in run-id order: the grid axes,
        the extra axes, the seeds."""
        out = []
        for key in GRID_AXES:
            values = getattr(self, AXES[key]["column"])
            if values is not None and len(values):
                out.append((key, tuple(values)))
        for key, values in self.extra_axes:
            out.append((key, tuple(values)))
        out.append((SEED_AXIS, tuple(self.seeds)))
        return out


# The grid axes' keywords (`Sweep(lr=(3e-3,), temperature=(1.0, 2.0))`) are the config's
# axis fields by name, so a new axis declared in hldstudy.config is a keyword here too.
Sweep = dataclasses.make_dataclass(
    "Sweep", [(AXES[k]["column"], tuple, field(default=())) for k in GRID_AXES],
    bases=(_SweepSpec,), frozen=True,
    namespace={"__doc__": _SweepSpec.__doc__, "__module__": __name__})


@dataclass
class Run:
    """One point of the grid: a method, the swept values, its config and its compute."""

    run_id: str
    method: str
    params: dict[str, Any]            # dotted field -> swept value
    overrides: list[str]              # "field=value" for the method and every swept value
    config: Config
    stage_steps: dict[str, int]
    flops_per_step: dict[str, float]
    steps: int = 0
    flops: float = 0.0
    notes: list[str] = field(default_factory=list)

    def entry(self) -> dict:
        """The run's line in sweep.json and in --dry-run --json."""
        d = {"run_id": self.run_id, "dir": self.run_id, "method": self.method}
        for k, v in self.params.items():
            d[AXES[k]["column"] if k in AXES else k] = v
        d.update({"params": dict(self.params), "overrides": list(self.overrides),
                  "steps": self.steps, "stage_steps": dict(self.stage_steps),
                  "flops": self.flops, "flops_per_step": dict(self.flops_per_step),
                  "flops_budget": self.config.budget.flops,
                  "count_teacher": self.config.budget.count_teacher})
        return d


# --------------------------------------------------------------------------- #
# Loading
# --------------------------------------------------------------------------- #


def load_sweep(path: str | Path, **kwargs) -> Sweep:
    """Imports a sweep file and calls its `get_sweep(**kwargs)`."""
    module = import_entry_point(path, "get_sweep", "sweep file")
    sweep = module.get_sweep(**kwargs)
    if not isinstance(sweep, Sweep):
        raise InputError(f"{path}: get_sweep() must return hldstudy.sweep.Sweep, "
                         f"got {type(sweep).__name__}")
    if not sweep.launch and module.__doc__:
        sweep = dataclasses.replace(sweep, launch=_launch_line(module.__doc__))
    return sweep


def _launch_line(doc: str) -> str:
    for line in doc.splitlines():
        s = line.strip()
        if s.startswith("python -m hldstudy.sweep") or s.startswith("hldstudy "):
            return s
    return ""


# --------------------------------------------------------------------------- #
# Naming
# --------------------------------------------------------------------------- #


def fmt_value(v: Any) -> str:
    """Shortest exact text of a value for a run id: 0.003 -> 3e-3, 0.01 -> 1e-2, 2.0 -> 2,
    0.5 -> 0.5."""
    if isinstance(v, bool):
        return str(v).lower()
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if v == 0:
            return "0"
        if v.is_integer() and abs(v) < 1e6:
            return str(int(v))
        for p in range(1, 18):
            s = f"{v:.{p}g}"
            if float(s) == v:
                break
        if "e" in s or abs(v) < 0.1:
            m, e = f"{v:.{p - 1}e}".split("e")
            m = m.rstrip("0").rstrip(".") if "." in m else m
            return f"{m}e{int(e)}"
        return s
    s = str(v)
    return "".join(c if c.isalnum() or c in ".-" else "-" for c in s) or "none"


def _short(key: str) -> str:
    """An axis' declared short name; another field's name without underscores, and '='."""
    if key in AXES:
        return AXES[key]["short"]
    return key.rsplit(".", 1)[-1].replace("_", "") + "="


def run_id_for(method: str, params: dict[str, Any]) -> str:
    parts = [method]
    for key, value in params.items():
        parts.append(f"{_short(key)}{fmt_value(value)}")
    return "_".join(parts)


# --------------------------------------------------------------------------- #
# Expansion
# --------------------------------------------------------------------------- #


def _abs_path(value: str | None) -> str | None:
    if not value or is_remote(value) or "://" in value:
        return value
    return str(Path(value).expanduser().absolute())


def _stage_plan(cfg: Config, method: str, teacher_model) -> tuple[dict, dict]:
    """(steps per stage, FLOPs per step per stage), from the trainer's own planner."""
    plans = plan_stages(cfg, teacher_model, method)
    return ({p.stage.name: p.steps for p in plans},
            {p.stage.name: p.flops_per_step for p in plans})


def base_config(sweep: Sweep, overrides: tuple[str, ...] | list[str] = ()) -> Config:
    """The sweep's base config: sweep.teacher, sweep.overrides, the budget, then CLI --set."""
    cfg = sweep.base
    if sweep.teacher:
        cfg = apply_overrides(cfg, [f"teacher.checkpoint={sweep.teacher}"])
    if sweep.teacher_preset and not cfg.teacher.preset:  # every run names its teacher's shape
        cfg = dataclasses.replace(cfg, teacher=dataclasses.replace(cfg.teacher,
                                                                   preset=sweep.teacher_preset))
    cfg = apply_overrides(cfg, list(sweep.overrides))
    cfg = apply_overrides(cfg, ["train.progress=false"])
    if (sweep.budget_flops > 0) == (sweep.budget_baseline_steps > 0):
        raise ConfigError(f"sweep {sweep.name}: budget",
                          "set exactly one of budget_flops and budget_baseline_steps")
    if sweep.budget_flops > 0:
        budget = float(sweep.budget_flops)
    else:
        b = dataclasses.replace(cfg, distill=dataclasses.replace(cfg.distill,
                                                                 method=methods.BASELINE))
        budget = sweep.budget_baseline_steps * step_flops(b, methods.BASELINE).total
    cfg = dataclasses.replace(cfg, budget=dataclasses.replace(cfg.budget, flops=budget))
    cfg = apply_overrides(cfg, list(overrides))
    # Absolute paths: a run directory must not depend on the launch directory.
    cfg = dataclasses.replace(
        cfg,
        teacher=dataclasses.replace(cfg.teacher, checkpoint=_abs_path(cfg.teacher.checkpoint)),
        data=dataclasses.replace(cfg.data, tokenizer=_abs_path(cfg.data.tokenizer)))
    if sweep.shared_tokenizer and not cfg.data.tokenizer and cfg.teacher.checkpoint \
            and rundir.is_run_dir(cfg.teacher.checkpoint):
        tok = rundir.tokenizer_path(cfg.teacher.checkpoint)
        if tok is not None:
            cfg = dataclasses.replace(cfg, data=dataclasses.replace(
                cfg.data, tokenizer=str(Path(tok).absolute())))
    return cfg


def expand(sweep: Sweep, overrides: tuple[str, ...] | list[str] = (), *,
           check_paths: bool = False, warnings: list[str] | None = None) -> list[Run]:
    """Every run of the grid, with its steps and FLOPs. Raises InputError on an empty grid."""
    warnings = [] if warnings is None else warnings
    if not sweep.methods:
        raise InputError(f"sweep {sweep.name!r}: the grid is empty (no methods)")
    for m in sweep.methods:
        methods.get(m, f"sweep {sweep.name}: methods")
    axes = sweep.axes()
    for key, values in axes:
        if not values:
            raise InputError(f"sweep {sweep.name!r}: the grid is empty (axis {key} has no "
                             f"values{'; give at least one seed' if key == SEED_AXIS else ''})")
    base = base_config(sweep, overrides)
    teacher_model = teacher_model_config(base.teacher.checkpoint,
                                         sweep.teacher_preset or base.teacher.preset)
    runs: dict[str, Run] = {}
    deferred: dict[str, list[str]] = {}
    for method in dict.fromkeys(sweep.methods):
        mine = [(k, v) for k, v in axes if methods.applies(k, method)]
        for combo in itertools.product(*[v for _, v in mine]):
            params = {k: val for (k, _), val in zip(mine, combo, strict=True)}
            ovr = [f"distill.method={method}"] + [f"{k}={_literal(v)}" for k, v in params.items()]
            if sweep.seeds_vary_data_order and SEED_AXIS in params:
                ovr.append(f"{DATA_ORDER}={_literal(params[SEED_AXIS])}")
            cfg = apply_overrides(base, ovr)
            run_id = run_id_for(method, params)
            if run_id in runs:
                warnings.append(f"duplicate grid point {run_id} (an axis repeats a value); "
                                "kept once")
                continue
            cfg = dataclasses.replace(cfg, name=f"{sweep.name}-{run_id}")
            if methods.get(method).needs_teacher and teacher_model is None:
                raise ConfigError("teacher.checkpoint",
                                  f"run {run_id} needs a teacher and the sweep names none "
                                  "(or its config cannot be read)",
                                  "pass --set teacher.checkpoint=RUN_DIR|GGUF|HF_DIR, or set "
                                  "teacher_preset in the sweep file for a dry run")
            steps, fps = _stage_plan(cfg, method, teacher_model)
            total = sum(steps.values())
            cfg = apply_overrides(cfg, [f"train.steps={total}"])
            try:
                validate(cfg, check_paths=check_paths)
            except ConfigError as e:
                if check_paths or e.field not in ("teacher.checkpoint", "data.path",
                                                  "data.tokenizer"):
                    raise ConfigError(e.field, f"run {run_id}: {str(e)[len(e.field) + 2:]}") \
                        from None
                deferred.setdefault(str(e), []).append(run_id)
            runs[run_id] = Run(run_id=run_id, method=method, params=params, overrides=ovr,
                               config=cfg, stage_steps=steps, flops_per_step=fps, steps=total,
                               flops=float(sum(steps[s] * fps[s] for s in steps)))
    for msg, ids in deferred.items():
        who = ids[0] if len(ids) == 1 else f"{len(ids)} runs"
        warnings.append(f"{who}: {msg} (needed at launch, not for a dry run)")
    if not runs:
        raise InputError(f"sweep {sweep.name!r}: the grid is empty")
    return list(runs.values())


def _literal(v: Any) -> str:
    if isinstance(v, bool):
        return str(v).lower()
    if v is None:
        return "none"
    if isinstance(v, str):
        return v
    return json.dumps(v)


# --------------------------------------------------------------------------- #
# Run directories
# --------------------------------------------------------------------------- #


def _norm(key: str, v: Any) -> Any:
    if key in PATH_FIELDS and isinstance(v, str) and "://" not in v:
        return os.path.realpath(v)
    if isinstance(v, int) and not isinstance(v, bool):
        return float(v)
    return v


# config_drift's field for a run directory whose config.json cannot be read.
UNREADABLE = "config.json"


def config_drift(run: Run, run_dir: Path) -> list[tuple[str, Any, Any]]:
    """[(field, value in run_dir/config.json, value the grid asks for)]; [] when it matches.

    For a finished run, fields its method does not use (`methods.applies`: e.g. the baseline's
    distill.temperature) are not compared; a run still to be resumed is compared on every
    field, as the Trainer will when it resumes."""
    path = Path(run_dir) / "config.json"
    if not path.exists():
        return []
    finished = (Path(run_dir) / "results.json").exists()
    try:
        old = flatten(json.loads(path.read_text()))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        where = f"line {e.lineno}: {e.msg}" if isinstance(e, json.JSONDecodeError) else str(e)
        return [(UNREADABLE, f"{path} is not readable JSON ({where})", None)]
    new = flatten(config_to_dict(run.config))
    out = []
    for key in sorted(set(old) | set(new)):
        if key in IGNORED_DRIFT or key in FILE_KEYS:
            continue
        if key == "train.steps" and run.config.budget.flops > 0:
            continue  # follows from the budget
        if finished and not methods.applies(key, run.method):
            continue
        a, b = old.get(key), new.get(key)
        if _norm(key, a) != _norm(key, b):
            if isinstance(a, float) and isinstance(b, float) and math.isclose(a, b, rel_tol=1e-9):
                continue
            out.append((key, a, b))
    return out


def run_status(run: Run, run_dir: Path, eval_tasks: tuple[str, ...] = ()) -> str:
    """done | trained (eval missing) | partial (has a checkpoint) | failed | new."""
    return rundir.status(run_dir, eval_tasks)


def steps_done(run_dir: Path) -> int:
    """The last step a run logged (metrics.jsonl), for progress display."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        return 0
    try:
        with open(path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            size = fh.tell()
            fh.seek(max(0, size - 4096))
            tail = fh.read().decode(errors="ignore").splitlines()
    except OSError:
        return 0
    for line in reversed(tail):
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if "step" in rec:
            return int(rec["step"])
    return 0
