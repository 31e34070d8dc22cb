"""Loading a sweep's run directories into one table.

Design notes: `docs/analysis.md`, under this file's name.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import re
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from hldstudy.config import (
    FILE_KEYS,
    Config,
    axis_names,
    config_to_dict,
    field_rules,
    fields_where,
    grid_axes,
    replicate_axis,
)
from hldstudy.distill import methods
from hldstudy.errors import InputError
from hldstudy.rundir import has_run_files
from hldstudy.teacher_source import is_remote

log = logging.getLogger("hldstudy.analysis")

CONFIG_FILE = "config.json"
RESULTS_FILE = "results.json"
SWEEP_FILE = "sweep.json"

# The sweep's axes (`hldstudy.config`: `knob(axis=, short=, aliases=)`), each a column
# named after its field: the grid axes, then the seed (the replicate axis).
AXES = axis_names()
AXIS_COLUMNS = {k: AXES[k]["column"] for k in (*grid_axes(), replicate_axis())}
SEED_AXIS = replicate_axis()
# Methods with their own knobs (hldf's stage-1 share, the alignment weight...) are
# split into "arms" by those knobs: `hldstudy.distill.methods.arm_fields`; an axis is
# labelled by its short name, these by theirs.
ARM_LABELS = {
    "distill.hldf_stage1_share": "s1",
    "distill.layer_pairs": "pairs",
    "distill.patient_pairs": "np",
}
# Config leaves that are columns of their own, or never change what is compared:
# tagged analysis="column" / "ignore" in hldstudy.config.
COLUMNS = fields_where("analysis", "column")
IGNORED = fields_where("analysis", "ignore")
BASE_COLUMNS = [
    "run_id", "dir", "status", "method", "arm", *AXIS_COLUMNS.values(), "budget",
    "count_teacher", "flops_budget", "flops_spent", "steps", "valid_ppl", "valid_nll",
]


# --------------------------------------------------------------------------- #
# Helpers
# --------------------------------------------------------------------------- #


def config_hash(config: dict) -> str:
    """sha256 hex of the canonical JSON of a config dict (see module docstring)."""
    text = json.dumps(config, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise InputError(f"{path}: not valid JSON ({e.msg} at line {e.lineno})") from None
    except OSError as e:
        raise InputError(f"{path}: cannot read ({e.strerror})") from None


def _flatten(d: dict, prefix: str = "") -> dict[str, Any]:
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out


_DEFAULTS = _flatten(config_to_dict(Config()))


def _cfg_get(flat: dict, key: str) -> Any:
    return flat.get(key, _DEFAULTS.get(key))


def _metric_name(name: str) -> str:
    # lm-eval >= 0.4 writes "acc,none" / "acc_stderr,none".
    return name.split(",", 1)[0]


def _flatten_eval(ev: Any) -> dict[str, float]:
    out: dict[str, float] = {}
    if not isinstance(ev, dict):
        return out
    for task, metrics in ev.items():
        if not isinstance(metrics, dict):
            continue
        for m, v in metrics.items():
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                continue
            out[f"{task}/{_metric_name(m)}"] = float(v)
    return out


def _fmt_value(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:g}"
    return str(v)


def _discover(root: Path) -> list[Path]:
    found = []
    for child in sorted(root.iterdir()):
        if not child.is_dir() or child.name.startswith("."):
            continue
        if has_run_files(child):
            found.append(child)
            continue
        for grand in sorted(child.iterdir()):
            if not grand.name.startswith(".") and has_run_files(grand):
                found.append(grand)
    return found


# --------------------------------------------------------------------------- #
# Name-encoded hyperparameters
# --------------------------------------------------------------------------- #

# Folder-name tokens: every name of every axis (its field name, short name, aliases).
_NAME_KEYS = {n: key for key, names in AXES.items() for n in names["names"]}
_NUM = r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?"
_SEP = r"[_,+/\s]"
_KEY_RE = re.compile(
    rf"(?:^|{_SEP})({'|'.join(sorted(map(re.escape, _NAME_KEYS), key=len, reverse=True))})"
    rf"(?:=|-)?({_NUM})(?=$|{_SEP})"
)


def _method_re() -> re.Pattern:
    """Bare method names in a folder name (every registered method, longest first)."""
    names = sorted(map(re.escape, methods.names()), key=len, reverse=True)
    return re.compile(rf"(?:^|[_,+/\s-])({'|'.join(names)})(?=$|[_,+/\s-])")


def _sig_digits(text: str) -> int:
    mant = re.split(r"[eE]", text.lstrip("+-"))[0]
    digits = mant.replace(".", "").lstrip("0")
    if "." not in mant:
        digits = digits.rstrip("0")
    return max(1, len(digits))


def _matches_at_precision(written: str, actual: Any) -> bool:
    try:
        w = float(written)
        a = float(actual)
    except (TypeError, ValueError):
        return False
    if math.isclose(w, a, rel_tol=1e-9, abs_tol=1e-15):
        return True
    if a == 0 or w == 0:
        return False
    sig = _sig_digits(written)
    rounded = float(f"{a:.{sig - 1}e}")
    return math.isclose(rounded, w, rel_tol=1e-9)


def name_mismatches(name: str, flat_cfg: dict) -> list[str]:
    """Hyperparameters encoded in a run folder name that disagree with its config."""
    problems = []
    for key, written in _KEY_RE.findall(name):
        field = _NAME_KEYS[key]
        actual = _cfg_get(flat_cfg, field)
        if not _matches_at_precision(written, actual):
            problems.append(f"name says {key}={written} but {field}={_fmt_value(actual)}")
    named = set(_method_re().findall(name))
    if len(named) == 1:
        (m,) = named
        actual = _cfg_get(flat_cfg, "distill.method")
        if m != actual:
            problems.append(f"name says method {m} but distill.method={actual}")
    return problems


def _recorded_mismatches(res: dict, flat_cfg: dict) -> list[str]:
    """What the trainer recorded in results.json at run time vs config.json now."""
    problems = []
    checks = (("method", "distill.method"), ("name", "name"),
              ("count_teacher", "budget.count_teacher"), ("flops_budget", "budget.flops"))
    for rkey, ckey in checks:
        if res.get(rkey) is None:
            continue
        want, have = res[rkey], _cfg_get(flat_cfg, ckey)
        if isinstance(want, (int, float)) and not isinstance(want, bool):
            same = isinstance(have, (int, float)) and math.isclose(
                float(want), float(have), rel_tol=1e-6, abs_tol=1e-9)
        else:
            same = want == have
        if not same:
            problems.append(f"results.json {rkey}={_fmt_value(want)} but config {ckey}="
                            f"{_fmt_value(have)}")
    return problems


def _param_mismatches(params: dict, flat_cfg: dict) -> list[str]:
    problems = []
    for key, want in params.items():
        if key not in _DEFAULTS and key not in flat_cfg:
            continue
        have = _cfg_get(flat_cfg, key)
        if isinstance(want, (int, float)) and not isinstance(want, bool) and \
                isinstance(have, (int, float)) and not isinstance(have, bool):
            same = math.isclose(float(want), float(have), rel_tol=1e-9, abs_tol=1e-15)
        else:
            same = str(want).lower() == str(have).lower()
        if not same:
            problems.append(f"sweep.json sets {key}={_fmt_value(want)} but config has {_fmt_value(have)}")
    return problems


def _sweep_params(entry: dict) -> dict:
    params: dict = {}
    ov = entry.get("overrides")
    if isinstance(ov, (list, tuple)):
        for item in ov:
            if isinstance(item, str) and "=" in item:
                k, v = item.split("=", 1)
                try:
                    v = json.loads(v)
                except (json.JSONDecodeError, ValueError):
                    pass
                params[k.strip()] = v
    for key in ("params", "hparams"):
        p = entry.get(key)
        if isinstance(p, dict):
            params.update(_flatten(p))
    return params


# --------------------------------------------------------------------------- #
# Loading
# --------------------------------------------------------------------------- #


def _budget_label(flops: float, count_teacher: bool) -> str:
    who = "teacher counted" if count_teacher else "student only"
    if not flops:
        return f"no FLOP budget ({who})"
    # 6 significant digits: budgets that differ only by float noise group together, real
    # differences (even 0.1%) stay apart.
    return f"{flops:.6g} FLOPs ({who})"


def _read_sweep(root: Path) -> list[dict] | None:
    path = root / SWEEP_FILE
    if not path.exists():
        return None
    data = _read_json(path)
    runs = data.get("runs") if isinstance(data, dict) else None
    if not isinstance(runs, list):
        raise InputError(f"{path}: expected {{\"runs\": [{{\"run_id\": ..., \"dir\": ...}}, ...]}}")
    out = []
    for i, e in enumerate(runs):
        if not isinstance(e, dict) or not (e.get("dir") or e.get("run_id")):
            raise InputError(f"{path}: runs[{i}] needs a \"dir\" or \"run_id\"")
        out.append(e)
    return out


def _resolve_entry_dir(root: Path, entry: dict) -> Path:
    d = entry.get("dir") or entry.get("run_id")
    p = Path(d)
    if not p.is_absolute():
        p = root / p
    return p


def _run_dirs(root: Path, warnings: list[str]) -> tuple[list[Path], dict[Path, dict], list[dict]]:
    """(run directories, sweep.json entry of each by resolved path, entries with no
    directory): the folders found, plus those sweep.json lists."""
    sweep = _read_sweep(root)
    dirs = _discover(root)
    entries_by_dir: dict[Path, dict] = {}
    missing: list[dict] = []
    if sweep is not None:
        for e in sweep:
            p = _resolve_entry_dir(root, e)
            if has_run_files(p):
                entries_by_dir[p.resolve()] = e
                if p.resolve() not in {d.resolve() for d in dirs}:
                    dirs.append(p)
            else:
                missing.append(e)
        extra = [d for d in dirs if d.resolve() not in entries_by_dir]
        if extra:
            warnings.append(f"{len(extra)} run director{'y' if len(extra) == 1 else 'ies'} not "
                            f"listed in sweep.json (included): "
                            + ", ".join(_rel(root, d) for d in extra[:5])
                            + (" ..." if len(extra) > 5 else ""))
    if not dirs and not missing:
        raise InputError(f"{root}: no run directories (folders with {CONFIG_FILE} / "
                         f"{RESULTS_FILE}) found, at top level or one level down")
    return dirs, entries_by_dir, missing


def _read_run(d: Path) -> tuple[dict, dict, dict | None]:
    """(config, flattened config, results or None) of one run directory."""
    cfg_path, res_path = d / CONFIG_FILE, d / RESULTS_FILE
    if not cfg_path.exists():
        raise InputError(f"{cfg_path}: missing; a run directory needs the config it ran with")
    cfg = _read_json(cfg_path)
    if not isinstance(cfg, dict):
        raise InputError(f"{cfg_path}: expected a JSON object (config_to_dict(Config))")
    flat = _flatten(cfg)
    method = _cfg_get(flat, "distill.method")
    if method not in methods.names():
        raise InputError(f"{cfg_path}: distill.method={method!r} is not one of "
                         f"{', '.join(methods.names())}")
    res = _read_json(res_path) if res_path.exists() else None
    if res is not None and not isinstance(res, dict):
        raise InputError(f"{res_path}: expected a JSON object")
    return cfg, flat, res


def _run_problems(d: Path, run_id: str, cfg: dict, flat: dict, res: dict | None,
                  entry: dict | None, check_names: bool) -> list[str]:
    """Where a run's config disagrees with its directory, results or sweep entry."""
    probs: list[str] = []
    if res is not None and res.get("run_id") is not None:
        rid = str(res["run_id"])
        if rid not in (d.name, run_id):
            probs.append(f"results.json run_id={rid!r} but the folder is {d.name!r}")
    if res is not None:
        probs += _recorded_mismatches(res, flat)
    recorded = None if res is None else (res.get("config_hash") or res.get("config_sha256"))
    if recorded:
        rec = str(recorded).lower()
        if len(rec) < 8 or not config_hash(cfg).startswith(rec):
            probs.append(f"config.json hash {config_hash(cfg)[:12]} != recorded {rec[:12]} "
                         f"(config edited after the run?)")
    if entry is not None:
        probs += _param_mismatches(_sweep_params(entry), flat)
    if check_names:
        probs += name_mismatches(d.name, flat)
    return probs


def _check_budgets(df: pd.DataFrame, flats: list[dict], done, allow_mixed: bool,
                   warnings: list[str]) -> None:
    """Refuses mixed FLOP budgets (unless allowed); warns where one budget holds several
    student architectures."""
    budgets = df.loc[done, "budget"].unique()
    if len(budgets) > 1 and not allow_mixed:
        parts = []
        for b in sorted(budgets):
            ids = df.loc[done & (df["budget"] == b), "run_id"].astype(str).tolist()
            parts.append(f"{b}: {len(ids)} run(s) ({', '.join(ids[:3])}{' ...' if len(ids) > 3 else ''})")
        raise InputError(
            "runs with different FLOP budgets cannot be compared as one grid: " + "; ".join(parts)
            + " (analyse one budget per RUNS_DIR, or pass --allow-mixed-budgets to report each "
            "budget separately)")
    for b in df.loc[done, "budget"].unique():
        idx = [i for i in range(len(df)) if done.iloc[i] and df["budget"].iloc[i] == b]
        archs = {json.dumps({k: v for k, v in flats[i].items() if k.startswith("model.")},
                            sort_keys=True, default=str) for i in idx}
        if len(archs) > 1:
            warnings.append(f"[{b}] {len(archs)} different student model configs share one "
                            "budget; model fields become grid dimensions and best-vs-best "
                            "selects across them")


def _left_out(df: pd.DataFrame, done, warnings: list[str]) -> None:
    not_done = df[~done & (df["status"] != "teacher")]
    if (df["status"] == "teacher").any():
        warnings.append("teacher run(s) found among the runs and left out: "
                        + ", ".join(df.loc[df["status"] == "teacher", "run_id"].astype(str)))
    if len(not_done):
        warnings.append(f"{len(not_done)} run(s) not done (unfinished, failed or missing) and "
                        f"left out of every comparison "
                        f"({_counts(not_done['status'])}): "
                        + ", ".join(not_done["run_id"].astype(str).head(8))
                        + (" ..." if len(not_done) > 8 else ""))


def _ordered(df: pd.DataFrame, extra_cols: list[str], metric_cols: list[str]) -> pd.DataFrame:
    ordered = BASE_COLUMNS + extra_cols + [c for m in metric_cols for c in (m, m + "_stderr")
                                           if c in df.columns]
    ordered += [c for c in df.columns if c not in ordered and c not in ("_flat",)]
    df = df[ordered].sort_values(["status", "budget", "method", "run_id"],
                                 key=lambda s: s.astype(str), kind="mergesort")
    return df.reset_index(drop=True)


def load_runs(runs_dir: str | Path, *, allow_mixed_budgets: bool = False,
              check_names: bool = True) -> pd.DataFrame:
    """One row per run (finished or not) of a sweep; see the module docstring.

    Columns: ``BASE_COLUMNS``, any extra config fields that vary across the
    distillation runs (dotted names, treated as further grid dimensions), and
    downstream metrics flattened as ``task/metric`` (and ``task/metric_stderr``).
    ``status`` is ``done``, ``unfinished`` (no results.json), ``missing``
    (listed in sweep.json, no directory) or the status results.json gives.
    ``df.attrs`` holds ``grid_cols`` (hyperparameter columns that define a
    point, seed excluded), ``extra_cols``, ``metric_cols``, ``warnings`` and
    ``runs_dir``.
    """
    root = Path(runs_dir)
    if not root.exists():
        raise InputError(f"{root}: runs directory does not exist")
    if not root.is_dir():
        raise InputError(f"{root}: not a directory")
    if has_run_files(root) and not (root / SWEEP_FILE).exists():
        raise InputError(f"{root} is a single run directory; pass the directory that holds the runs")

    warnings: list[str] = []
    dirs, entries_by_dir, missing = _run_dirs(root, warnings)
    rows: list[dict] = []
    flats: list[dict] = []
    mismatches: list[str] = []
    for d in dirs:
        run_id = _rel(root, d)
        cfg, flat, res = _read_run(d)
        probs = _run_problems(d, run_id, cfg, flat, res, entries_by_dir.get(d.resolve()),
                              check_names)
        if probs:
            mismatches.append(f"{run_id}: " + "; ".join(probs))
        rows.append(_row(run_id, d, root, flat, res, warnings))
        flats.append(flat)
    if mismatches:
        n = len(mismatches)
        raise InputError(
            f"{n} run{'s' if n > 1 else ''} whose config does not match its directory: "
            + " | ".join(mismatches[:5]) + (f" | ... ({n - 5} more)" if n > 5 else "")
            + " (re-run or fix the directory; --no-name-check skips the folder-name check)")

    # A teacher trained by hldstudy may sit next to its students; it is not a contestant.
    teachers = _teacher_dirs(root, dirs, flats)
    for row, d in zip(rows, dirs, strict=True):
        if d.resolve() in teachers:
            row["status"] = "teacher"
    for e in missing:
        rid = str(e.get("run_id") or Path(e.get("dir")).name)
        rows.append({"run_id": rid, "dir": str(e.get("dir") or rid), "status": "missing",
                     "method": None})
        flats.append({})

    df = pd.DataFrame(rows)
    for c in BASE_COLUMNS:
        if c not in df.columns:
            df[c] = np.nan
    done = df["status"] == "done"
    if not done.any():
        raise InputError(
            f"{root}: no finished runs - none of the {len(df)} run(s) has a {RESULTS_FILE} with "
            f'"status": "done" (statuses: {_counts(df["status"])})')
    _left_out(df, done, warnings)
    _check_budgets(df, flats, done, allow_mixed_budgets, warnings)
    # seeds: data.seed folds into the seed when it varies independently of train.seed
    _fold_data_seed(df, flats, done)
    extra_cols = _extra_dims(df, flats, done)  # arms and extra grid dimensions
    _assign_arms(df, flats, done)

    metric_cols = sorted(c for c in df.columns if "/" in c and not c.endswith("_stderr"))
    stderr_cols = sorted(c for c in df.columns if "/" in c and c.endswith("_stderr"))
    df = _ordered(df, extra_cols, metric_cols)
    for w in warnings:
        log.warning(w)
    projects = pd.Series([_cfg_get(f, "wandb.project") for f in flats if f]).dropna()
    df.attrs.update({
        "runs_dir": str(root),
        "wandb_project": str(projects.mode().iloc[0]) if len(projects) else None,
        "grid_cols": grid_columns() + extra_cols,
        "extra_cols": extra_cols,
        "metric_cols": metric_cols,
        "stderr_cols": stderr_cols,
        "warnings": warnings,
    })
    return df


def _rel(root: Path, d: Path) -> str:
    try:
        return d.resolve().relative_to(root.resolve()).as_posix()
    except ValueError:
        return d.name


def _counts(s: pd.Series) -> str:
    vc = s.astype(str).value_counts()
    return ", ".join(f"{k}: {v}" for k, v in vc.items())


def _num(x: Any) -> float:
    if x is None or isinstance(x, bool):
        return math.nan
    try:
        return float(x)
    except (TypeError, ValueError):
        return math.nan


def _row(run_id: str, d: Path, root: Path, flat: dict, res: dict | None,
         warnings: list[str]) -> dict:
    method = _cfg_get(flat, "distill.method")
    flops = float(_cfg_get(flat, "budget.flops") or 0.0)
    count_teacher = bool(_cfg_get(flat, "budget.count_teacher"))
    row: dict[str, Any] = {"run_id": run_id, "dir": _rel(root, d), "method": method}
    # An axis the method does not use is NaN (the baseline has no temperature); the seed
    # is an identifier, kept as written, and so is a categorical axis (train.stage_boundary).
    for key, column in AXIS_COLUMNS.items():
        value = _cfg_get(flat, key)
        kept = key == SEED_AXIS or isinstance(value, str)
        row[column] = (value if kept else _num(value)) if _applies(method, key, flat) \
            else math.nan
    row.update({
        "budget": _budget_label(flops, count_teacher),
        "budget_flops": flops,
        "count_teacher": count_teacher,
    })
    if res is None:
        row["status"] = "unfinished"
        return row
    status = str(res.get("status", "done"))
    row["status"] = status
    row["steps"] = _num(res.get("steps"))
    row["flops_spent"] = _num(res.get("flops_spent"))
    fb = _num(res.get("flops_budget"))
    row["flops_budget"] = fb if math.isfinite(fb) else (flops if flops else math.nan)
    nll, ppl = _num(res.get("valid_nll")), _num(res.get("valid_ppl"))
    if not math.isfinite(ppl) and math.isfinite(nll):
        ppl = math.exp(nll)
    if not math.isfinite(nll) and math.isfinite(ppl) and ppl > 0:
        nll = math.log(ppl)
    row["valid_ppl"], row["valid_nll"] = ppl, nll
    # Each validation batch's mean NLL and tokens (runs since 2026-12): the evaluation's
    # own noise, which a paired gap reads batch by batch (`ablation.eval_se_pct`).
    row["valid_batch_nll"] = res.get("valid_batch_nll")
    row["valid_batch_tokens"] = res.get("valid_batch_tokens")
    if status == "done" and not math.isfinite(ppl):
        warnings.append(f"{run_id}: finished but has no finite valid_ppl / valid_nll")
    row.update(_flatten_eval(res.get("eval")))
    return row


def _teacher_dirs(root: Path, dirs: list[Path], flats: list[dict]) -> set[Path]:
    refs = set()
    for f in flats:
        ck = _cfg_get(f, "teacher.checkpoint")
        if not ck or not isinstance(ck, str) or is_remote(ck):
            continue
        p = Path(ck)
        for cand in ([p] if p.is_absolute() else [Path.cwd() / p, root / p, root.parent / p]):
            try:
                refs.add(cand.resolve())
            except OSError:
                pass
    return {d.resolve() for d in dirs if d.resolve() in refs}


SEEDS_SPAN_DATA, SEEDS_SPAN_INIT = "initialisation and data order", "initialisation only"


def seeds_span(df: pd.DataFrame) -> str:
    """What a seed varies in these runs: SEEDS_SPAN_DATA when each seed has its own data
    order (`Sweep.seeds_vary_data_order`), SEEDS_SPAN_INIT when every seed read one order
    (sweeps before 2026-12: the seed spread then understates a new run's)."""
    sub = df[df["status"] == "done"] if "status" in df else df
    if "data_seed" not in sub or sub["seed"].nunique() < 2:
        return SEEDS_SPAN_INIT
    per_seed = sub.groupby(sub["seed"].astype(str))["data_seed"].nunique()
    distinct = sub.groupby(sub["seed"].astype(str))["data_seed"].first().nunique()
    return SEEDS_SPAN_DATA if per_seed.max() == 1 and distinct == len(per_seed) \
        else SEEDS_SPAN_INIT


def _fold_data_seed(df: pd.DataFrame, flats: list[dict], done: pd.Series) -> None:
    ds = pd.Series([_cfg_get(f, "data.seed") if f else None for f in flats], index=df.index)
    df["data_seed"] = ds
    ts = df["seed"]
    sub = pd.DataFrame({"t": ts[done].astype(str), "d": ds[done].astype(str)})
    if sub["d"].nunique() <= 1:
        return
    # one-to-one with train.seed -> carries no extra information
    if sub.groupby("t")["d"].nunique().max() == 1 and sub.groupby("d")["t"].nunique().max() == 1:
        return
    df["seed"] = [f"{t}/{d}" if f else t for t, d, f in zip(ts, ds, flats, strict=False)]


def _applies(method: str | None, key: str, flat: dict) -> bool:
    """Whether `key` changes what `method` trains, given the run's other fields."""
    if method not in methods.names() or not methods.applies(key, method):
        return False
    condition = field_rules().get(key, {}).get("relevant_if")
    return condition is None or _cfg_get(flat, condition[0]) == condition[1]


def _is_arm_field(key: str) -> bool:
    return any(key in methods.arm_fields(m) for m in methods.names())


def grid_columns() -> list[str]:
    """The columns of the grid axes every teacher method shares (the seed and a method's
    own knobs, which split it into arms, apart): what defines a grid point."""
    return [AXIS_COLUMNS[k] for k in grid_axes() if not _is_arm_field(k)]


def _arm_short(key: str) -> str:
    if key in AXES:
        return AXES[key]["short"]
    return ARM_LABELS.get(key, key.rsplit(".", 1)[-1])


def _extra_dims(df: pd.DataFrame, flats: list[dict], done: pd.Series) -> list[str]:
    keys = sorted({k for i, f in enumerate(flats) if done.iloc[i] for k in f})
    extras = []
    budgets = df["budget_flops"].fillna(0)
    for key in keys:
        if key in COLUMNS or key in IGNORED or key in FILE_KEYS or _is_arm_field(key):
            continue
        if key == "train.steps" and (budgets[done] > 0).all():
            continue  # steps follow from the FLOP budget
        vals = set()
        for i, f in enumerate(flats):
            if done.iloc[i] and _applies(df["method"].iloc[i], key, f):
                vals.add(json.dumps(_cfg_get(f, key), sort_keys=True, default=str))
        if len(vals) > 1:
            extras.append(key)
    for key in extras:
        df[key] = [
            (_fmt_value(_cfg_get(f, key)) if f and _applies(m, key, f) else None)
            for f, m in zip(flats, df["method"], strict=False)
        ]
    return extras


def _assign_arms(df: pd.DataFrame, flats: list[dict], done: pd.Series) -> None:
    arms = []
    varying: dict[str, list[str]] = {}
    for method in methods.names():
        params = methods.arm_fields(method)
        idx = [i for i in range(len(df)) if done.iloc[i] and df["method"].iloc[i] == method]
        varying[method] = [
            p for p in params
            if len({json.dumps(_cfg_get(flats[i], p), default=str) for i in idx}) > 1
        ]
    for i, f in enumerate(flats):
        method = df["method"].iloc[i]
        if method is None:
            arms.append(None)
            continue
        vs = varying.get(method, [])
        if vs:
            tag = ",".join(f"{_arm_short(p)}={_fmt_value(_cfg_get(f, p))}" for p in vs)
            arms.append(f"{method}[{tag}]")
        else:
            arms.append(method)
    df["arm"] = arms
