"""Training and evaluating the runs of a sweep inside one worker process.

Design notes: `docs/sweeps.md`, under this file's name.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
import traceback
from pathlib import Path

from hldstudy.distill import methods
from hldstudy.errors import EXIT_OK, InputError, exit_code_of
from hldstudy.fileio import write_text_atomic
from hldstudy.rundir import job_owns, write_json_atomic
from hldstudy.runlock import LockHeld
from hldstudy.sweep.spec import Run, run_status

log = logging.getLogger("hldstudy.sweep")

CACHE_DIR = ".sweep/data"
OUTCOME_FILE = "outcome.json"
COUNT_KEYS = ("tokens", "samples", "n", "items", "docs")


class EvalUnavailable(RuntimeError):
    pass


class Worker:
    def __init__(self, workdir: str | Path, *, sweep_name: str = "", eval_tasks=(),
                 eval_limit=None, eval_batch_size: int = 8, eval_offline_data=None,
                 grid_teacher: dict | None = None):
        self.workdir = Path(workdir)
        # The sweep's replica set ({"spec": "remote://h:p,...", "token_file"}), serving
        # every cohort of the grid (`hldstudy.sweep.gridteach`); None: each loads its own.
        self.grid_teacher = grid_teacher
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

    def teacher_for(self, cfg, tokenizer, member: str | None = None):
        """The run's teacher, loaded once per worker; with the sweep's replica set and a
        cohort `member` id, that member's stream of the replicas (the run's config keeps
        its local checkpoint: the replicas serve that teacher)."""
        if not methods.get(cfg.distill.method).needs_teacher:
            return None
        if self.grid_teacher is not None and member is not None:
            import dataclasses

            cfg = dataclasses.replace(cfg, teacher=dataclasses.replace(
                cfg.teacher, checkpoint=f"{self.grid_teacher['spec']}?member={member}",
                token_file=self.grid_teacher.get("token_file")))
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
            return _read_json(run_dir / "results.json")
        with job_owns(run_dir, "hldstudy.sweep"):  # run.lock before anything is written
            (run_dir / "error.txt").unlink(missing_ok=True)
            mark_running(run_dir)
            t0 = time.time()
            if status != "trained":
                from hldstudy.train.loop import Trainer

                data = self.data_for(run.config)
                teacher = self.teacher_for(run.config, data.tokenizer if data else None)
                trainer = Trainer(run.config, run_dir, teacher=teacher, data=data)
                planned = {p.stage.name: p.steps for p in trainer.plans}
                if planned != run.stage_steps:
                    log.warning("%s: the trainer plans %s steps, the sweep expected %s (the "
                                "teacher's real config differs from the one used for counting?)",
                                run.run_id, planned, run.stage_steps)
                trainer.run(stop_at_step=stop_at_step)
            return self.complete(run, run_dir, t0)

    def complete(self, run: Run, run_dir: Path, t0: float) -> dict:
        """After training (solo or in a cohort): identity fields, evaluation, outcome."""
        results = _read_json(run_dir / "results.json")
        results["train_seconds"] = results.get("train_seconds") or round(time.time() - t0, 1)
        results.update(self._identity(run, run_dir))
        write_json_atomic(run_dir / "results.json", results)
        if self.eval_tasks and not all(t in (results.get("eval") or {}) for t in self.eval_tasks):
            t1 = time.time()
            results["eval"] = {**(results.get("eval") or {}), **self.evaluate(run_dir)}
            results["eval_seconds"] = round(time.time() - t1, 1)
            write_json_atomic(run_dir / "results.json", results)
        record_outcome(run_dir, "done", EXIT_OK)
        return results

    def _identity(self, run: Run, run_dir: Path) -> dict:
        from hldstudy.analysis.runs import config_hash

        cfg = _read_json(run_dir / "config.json")
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


def _read_json(path: Path) -> dict:
    """A run file's JSON object; an InputError naming the file when it is not one."""
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise InputError(f"{path} is missing") from None
    except (OSError, ValueError) as e:
        raise InputError(f"{path} is unreadable ({e}); rerun the run, or remove the file") \
            from None
    if not isinstance(data, dict):
        raise InputError(f"{path} holds {type(data).__name__}, not a JSON object")
    return data


def record_failure(run_dir: Path, exc: BaseException) -> str:
    """Writes run_dir/error.txt (the traceback) and the outcome (failed, with the exit code
    the train CLI would give); returns a one-line summary. A run refused because another
    job owns its directory gets nothing written there: the files are that job's."""
    line = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
    if isinstance(exc, LockHeld):
        return line
    run_dir.mkdir(parents=True, exist_ok=True)
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    write_text_atomic(run_dir / "error.txt", text)
    record_outcome(run_dir, "failed", exit_code_of(exc), error=line)
    return line


def record_interrupted(run_dir: Path, exc) -> None:
    """A run stopped by a signal (`Interrupted`, checkpoint saved): 128 + N."""
    record_outcome(run_dir, "interrupted", exit_code_of(exc), step=getattr(exc, "step", None))


def mark_running(run_dir: Path) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    write_json_atomic(run_dir / OUTCOME_FILE, {
        "status": "running", "pid": os.getpid(), "host": socket.gethostname(),
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")})


def record_outcome(run_dir: Path, status: str, exit_code: int, **extra) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    write_json_atomic(run_dir / OUTCOME_FILE, {
        "status": status, "exit_code": int(exit_code),
        "ended": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        **{k: v for k, v in extra.items() if v is not None}})


def read_outcome(run_dir: Path) -> dict | None:
    """The run's outcome.json, or None (missing or unreadable)."""
    try:
        rec = json.loads((Path(run_dir) / OUTCOME_FILE).read_text())
    except (OSError, ValueError):
        return None
    return rec if isinstance(rec, dict) else None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OSError):
        return True
    return True


def killed_earlier(run_dir: Path) -> dict | None:
    """The outcome of a run left marked `running` by a process that is gone (kill -9,
    OOM killer, a lost node): it was interrupted without a word. None otherwise (no
    record, a recorded end, or its process is alive on this host)."""
    rec = read_outcome(run_dir)
    if rec is None or rec.get("status") != "running":
        return None
    pid = rec.get("pid")
    if rec.get("host") == socket.gethostname() and isinstance(pid, int) \
            and pid != os.getpid() and _alive(pid):
        return None
    return rec
