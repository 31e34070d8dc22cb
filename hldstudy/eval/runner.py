"""`evaluate()`: one checkpoint on a list of tasks -> {task: {metric: value}}.

Design notes: `docs/evaluation.md`, under this file's name.
"""

from __future__ import annotations

import math
import os
import tempfile
import time
from pathlib import Path
from typing import Any

from hldstudy import rundir
from hldstudy.errors import InputError
from hldstudy.eval import tasks as task_lib
from hldstudy.fileio import write_json_atomic, write_text_atomic


def json_safe(results: dict) -> dict:
    """`results` as strict JSON: a non-finite metric becomes null with a note beside it
    (JSON has no infinity; a diverged model's perplexity overflows)."""
    out = {}
    for task, metrics in results.items():
        clean, notes = {}, []
        for name, value in metrics.items():
            if isinstance(value, float) and not math.isfinite(value):
                clean[name] = None
                notes.append(f"{name} is {value} (written as null)")
            else:
                clean[name] = value
        if notes:
            clean["note"] = "; ".join(notes)
        out[task] = clean
    return out

def parse_tasks(tasks: str | list[str] | tuple[str, ...]) -> list[str]:
    if isinstance(tasks, str):
        tasks = tasks.split(",")
    out: list[str] = []
    for t in tasks:
        t = str(t).strip()
        if t and t not in out:
            out.append(t)
    if not out:
        raise InputError("--tasks: no task given")
    return out


def clean_metrics(raw: dict[str, Any]) -> dict[str, float]:
    out: dict[str, float] = {}
    for key, value in raw.items():
        if key in ("alias", "name", "sample_len", "samples") or isinstance(value, (str, dict)):
            continue
        metric, _, filt = key.partition(",")
        name = metric if filt in ("", "none") else key
        try:
            v = float(value)
        except (TypeError, ValueError):
            continue
        if math.isfinite(v):
            out[name] = v
    return out


def markdown_table(results: dict[str, dict[str, float]]) -> str:
    lines = ["| task | metric | value | stderr |", "|---|---|---:|---:|"]
    for task, metrics in results.items():
        for name, v in metrics.items():
            if name.endswith("_stderr"):
                continue
            se = metrics.get(f"{name}_stderr")
            lines.append(f"| {task} | {name} | {v:.4f} | {'' if se is None else f'{se:.4f}'} |")
    return "\n".join(lines) + "\n"


def _log_wandb(results, meta, lm, table_md: str) -> None:
    import wandb

    wcfg = lm.config.wandb if lm.config is not None else None
    # $WANDB_MODE wins (tests set "disabled": wandb then hands out a no-op run).
    mode = os.environ.get("WANDB_MODE") or (wcfg.mode if wcfg else "offline")
    name = (lm.config.name if lm.config is not None else Path(meta["checkpoint"]).name)
    run = wandb.init(project=wcfg.project if wcfg else "hldstudy",
                     entity=wcfg.entity if wcfg else None, group=wcfg.group if wcfg else None,
                     name=f"eval-{name}", job_type="eval", mode=mode, config=meta,
                     reinit="finish_previous")
    flat = {f"eval/{t}/{m}": v for t, ms in results.items() for m, v in ms.items()}
    run.log(flat)
    run.summary.update(flat)
    rows = [[t, m, v] for t, ms in results.items() for m, v in ms.items()]
    run.log({"eval/table": wandb.Table(columns=["task", "metric", "value"], data=rows)})
    run.finish()


def evaluate(checkpoint: str | Path | None, tasks: list[str] | str, *, limit: int | None = None,
             batch_size: int = 8, offline_data: str | Path | None = None,
             out: str | Path | None = None, bootstrap_iters: int = 1000,
             rolling_context: int | None = None, max_length: int | None = None,
             wandb: bool | None = None,
             progress: bool = True, lm=None) -> dict[str, dict[str, float]]:
    """Evaluates a checkpoint (hldstudy run dir, GGUF file or HF dir) on `tasks`.

    Task names and offline files are checked before the model loads. `lm`
    (an `HLDStudyLM`) may be passed instead of `checkpoint` to reuse a loaded model.
    Returns {task: {metric: value}} in the order of `tasks`.
    """
    from hldstudy.eval.adapter import HLDStudyLM

    names = parse_tasks(tasks)
    if limit is not None and int(limit) <= 0:
        raise InputError(f"--limit must be > 0, got {limit}")
    if int(batch_size) <= 0:
        raise InputError(f"--batch-size must be > 0, got {batch_size}")
    offline_dir = task_lib.resolve_offline_dir(offline_data)
    lm_tasks, corpus_tasks = task_lib.classify(names, offline_dir)
    if corpus_tasks and lm is None and checkpoint is not None:
        _check_corpora(checkpoint, corpus_tasks)  # before the model loads
    if lm is None:
        if checkpoint is None:
            raise InputError("--checkpoint is required")
        lm = HLDStudyLM(checkpoint=checkpoint, batch_size=batch_size, max_length=max_length,
                        rolling_context=rolling_context, progress=progress)
    t0 = time.time()
    results: dict[str, dict[str, float]] = {}
    samples: dict[str, int] = {}
    if lm_tasks:
        results_lm, samples = _run_lm_eval(lm, lm_tasks, offline_dir=offline_dir, limit=limit,
                                           bootstrap_iters=bootstrap_iters,
                                           progress=progress)
        results.update(results_lm)
    workdir = checkpoint if (checkpoint is not None and lm.kind == "run") else None
    for t in corpus_tasks:
        results[t] = _corpus(lm, t, limit=limit, workdir=workdir, progress=progress)
    results = {t: results[t] for t in names if t in results}
    meta = {"checkpoint": str(checkpoint) if checkpoint is not None else None,
            "tasks": names, "limit": limit, "batch_size": lm.batch_size,
            "max_length": lm.max_length, "rolling_context": lm.rolling_context,
            "add_bos": lm.add_bos, "prefix_token_id": lm.prefix_token_id,
            "offline_data": str(offline_dir) if offline_dir else None,
            "bootstrap_iters": bootstrap_iters, "samples": samples,
            "seconds": round(time.time() - t0, 2), "versions": _versions()}
    table = markdown_table(results)
    if out is not None:
        out = Path(out)
        out.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(out, json_safe(results))
        stem = out.with_suffix("") if out.suffix == ".json" else out
        write_json_atomic(f"{stem}.meta.json", meta)
        settings = ", ".join(f"{k}={meta[k]}" for k in (
            "checkpoint", "limit", "batch_size", "max_length", "rolling_context", "offline_data"))
        write_text_atomic(f"{stem}.md", f"# Evaluation\n\n{settings}\n\n{table}")
    if wandb is None:
        wandb = bool(lm.config is not None and lm.config.wandb.enabled)
    if wandb:
        _log_wandb(results, meta, lm, table)
    return results


def _check_corpora(checkpoint, corpus_tasks: list[str]) -> None:
    from hldstudy.eval.perplexity import corpus_data_config

    base = None
    if rundir.is_run_dir(checkpoint):
        base = rundir.read_config(checkpoint).data
    for t in corpus_tasks:
        corpus_data_config(t, base)


def _corpus(lm, task, *, limit, workdir, progress):
    from hldstudy.eval.perplexity import corpus_perplexity

    return corpus_perplexity(lm, task, limit=limit, workdir=workdir, progress=progress)


def _run_lm_eval(lm, lm_tasks: list[str], *, offline_dir: Path | None, limit: int | None,
                 bootstrap_iters: int, progress: bool = True) -> tuple[dict, dict]:
    import logging

    import lm_eval
    from lm_eval.tasks import TaskManager

    if not progress:
        import datasets

        datasets.disable_progress_bars()
    if offline_dir is not None:
        os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
    # lm-eval bootstraps stderr in a forked multiprocessing pool; forking a process
    # running JAX threads can deadlock, so bootstrap in-process.
    os.environ.setdefault("DISABLE_MULTIPROC", "1")
    for name in ("lm_eval", "lm-eval"):
        logging.getLogger(name).setLevel(logging.ERROR)
    seed = 0
    if lm.config is not None and lm.config.data.source == "synthetic":
        seed = lm.config.data.synthetic_seed
    with tempfile.TemporaryDirectory(prefix="hldstudy-eval-") as tmp:
        tmp_dir = Path(tmp)
        needs_builtin = task_lib.prepare_task_dir(lm_tasks, tmp_dir, offline_dir=offline_dir,
                                                  limit=limit, synthetic_seed=seed)
        tm = TaskManager(include_path=str(tmp_dir), include_defaults=needs_builtin)
        res = lm_eval.simple_evaluate(
            model=lm, tasks=list(lm_tasks), task_manager=tm, limit=limit, num_fewshot=None,
            bootstrap_iters=bootstrap_iters, log_samples=False, batch_size=lm.batch_size,
            cache_requests=False)
    if res is None:
        raise InputError("lm-eval returned no results")
    results = {t: clean_metrics(res["results"].get(t, {})) for t in lm_tasks}
    samples = {t: int(v.get("effective", 0)) for t, v in res.get("n-samples", {}).items()}
    return results, samples


def _versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for pkg in ("hldstudy", "lm_eval", "jax", "flax", "datasets"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            pass
    return out
