"""Training and evaluating the runs of a sweep inside one worker process.

A `Worker` keeps what runs can share for as long as the process lives: the
teacher (loaded once per worker process, not once per run) and the prepared
data (tokenizer + packed rows) per data config. `Worker.run(run, dir)` trains
or resumes the run (`hldstudy.train.loop.Trainer`), evaluates it
(`hldstudy.eval.evaluate`), and completes its results.json with `run_id`,
`config_hash`, `sweep` and `eval`.
"""

from __future__ import annotations

import json
import logging
import os
import time
import traceback
from pathlib import Path

from hldstudy.distill import methods
from hldstudy.rundir import write_json_atomic
from hldstudy.sweep.spec import Run, run_status

log = logging.getLogger("hldstudy.sweep")

CACHE_DIR = ".sweep/data"
COUNT_KEYS = ("tokens", "samples", "n", "items", "docs")


class EvalUnavailable(RuntimeError):
    pass


class Worker:
    def __init__(self, workdir: str | Path, *, sweep_name: str = "", eval_tasks=(),
                 eval_limit=None, eval_batch_size: int = 8, eval_offline_data=None):
        self.workdir = Path(workdir)
        self.sweep_name = sweep_name
        self.eval_tasks = tuple(eval_tasks)
        self.eval_limit = eval_limit
        self.eval_batch_size = eval_batch_size
        self.eval_offline_data = eval_offline_data
        self._teachers: dict = {}
        self._data: dict = {}
        self.teacher_loads = 0  # observable: how many times this worker loaded a teacher

    # -- shared state --------------------------------------------------- #

    def data_for(self, cfg):
        """Prepared data shared by every run with the same data config (needs data.tokenizer
        set; otherwise the Trainer prepares it in the run directory)."""
        if not cfg.data.tokenizer:
            return None
        if cfg.data not in self._data:
            from hldstudy.data import prepare_data

            self._data[cfg.data] = prepare_data(cfg.data, self.workdir / CACHE_DIR)
        return self._data[cfg.data]

    def teacher_for(self, cfg, tokenizer):
        if not methods.get(cfg.distill.method).needs_teacher:
            return None
        key = (cfg.teacher.checkpoint, cfg.teacher.dtype)
        if key not in self._teachers:
            from hldstudy.teacher import load_teacher

            self._teachers[key] = load_teacher(cfg, tokenizer)
            self.teacher_loads += 1
        teacher = self._teachers[key]
        if tokenizer is not None:
            teacher.check_tokenizer(tokenizer)
        return teacher

    # -- one run ---------------------------------------------------------- #

    def run(self, run: Run, *, stop_at_step: int | None = None) -> dict:
        """Trains (or resumes) and evaluates one run; returns its results.json.

        Raises `hldstudy.train.loop.Interrupted` when a signal stops training (a
        checkpoint is saved first)."""
        run_dir = self.workdir / run.run_id
        status = run_status(run, run_dir, self.eval_tasks)
        if status == "done":
            return json.loads((run_dir / "results.json").read_text())
        (run_dir / "error.txt").unlink(missing_ok=True)
        t0 = time.time()
        if status != "trained":
            from hldstudy.train.loop import Trainer

            data = self.data_for(run.config)
            teacher = self.teacher_for(run.config, data.tokenizer if data else None)
            trainer = Trainer(run.config, run_dir, teacher=teacher, data=data)
            planned = {p.stage.name: p.steps for p in trainer.plans}
            if planned != run.stage_steps:
                log.warning("%s: the trainer plans %s steps, the sweep expected %s (the teacher's "
                            "real config differs from the one used for counting?)",
                            run.run_id, planned, run.stage_steps)
            trainer.run(stop_at_step=stop_at_step)
        results = json.loads((run_dir / "results.json").read_text())
        results["train_seconds"] = results.get("train_seconds") or round(time.time() - t0, 1)
        results.update(self._identity(run, run_dir))
        write_json_atomic(run_dir / "results.json", results)
        if self.eval_tasks and not all(t in (results.get("eval") or {}) for t in self.eval_tasks):
            t1 = time.time()
            results["eval"] = {**(results.get("eval") or {}), **self.evaluate(run_dir)}
            results["eval_seconds"] = round(time.time() - t1, 1)
            write_json_atomic(run_dir / "results.json", results)
        return results

    def _identity(self, run: Run, run_dir: Path) -> dict:
        from hldstudy.analysis.runs import config_hash

        cfg = json.loads((run_dir / "config.json").read_text())
        return {"run_id": run.run_id, "sweep": self.sweep_name, "params": run.params,
                "config_hash": config_hash(cfg)}

    def evaluate(self, run_dir: Path) -> dict:
        try:
            from hldstudy.eval import evaluate
        except ImportError as e:
            raise EvalUnavailable(f"hldstudy.eval is not available ({e}); "
                                  "train-only: rerun the sweep once it is installed, "
                                  "or drop eval_tasks") from e
        import inspect

        kwargs = {"limit": self.eval_limit, "batch_size": self.eval_batch_size,
                  "offline_data": self.eval_offline_data,
                  "out": str(run_dir / "eval" / "results.json")}
        if "progress" in inspect.signature(evaluate).parameters:
            kwargs["progress"] = False
        import contextlib

        os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
        (run_dir / "eval").mkdir(parents=True, exist_ok=True)
        # lm-eval / datasets print progress bars and notes; keep them out of the sweep's display.
        with open(run_dir / "eval" / "log.txt", "a") as logf, \
                contextlib.redirect_stdout(logf), contextlib.redirect_stderr(logf):
            metrics = evaluate(str(run_dir), list(self.eval_tasks), **kwargs)
        # Counts (tokens, items) are not scores; the analysis would compare them as metrics.
        return {task: {k: float(v) for k, v in m.items()
                       if isinstance(v, (int, float)) and k not in COUNT_KEYS}
                for task, m in metrics.items()}


def record_failure(run_dir: Path, exc: BaseException) -> str:
    """Writes run_dir/error.txt (the traceback); returns a one-line summary."""
    run_dir.mkdir(parents=True, exist_ok=True)
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    (run_dir / "error.txt").write_text(text)
    return f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
