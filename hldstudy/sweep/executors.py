"""Executors: where the runs of a sweep execute.

Design notes: `docs/sweeps.md`, under this file's name.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path

from hldstudy.errors import InputError, exit_code_of
from hldstudy.signals import StopSignals, die_with_parent
from hldstudy.sweep.spec import Run, Sweep, run_status, steps_done
from hldstudy.wandb_online import wandb_online

log = logging.getLogger("hldstudy.sweep")

EXECUTORS = ("local", "slurm", "wandb")
INTERNAL = ".sweep"


@dataclass
class Outcome:
    done: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)
    interrupted: list[str] = field(default_factory=list)
    no_eval: list[str] = field(default_factory=list)
    # Runs found marked running by a process that is gone (resumed in this sweep).
    killed_earlier: list[str] = field(default_factory=list)
    # Exit code of each failed or interrupted run (as `python -m hldstudy.train` gives).
    exit_codes: dict[str, int] = field(default_factory=dict)
    signum: int | None = None
    teacher_loads: int = 0

    @property
    def exit_code(self) -> int:
        if self.signum is not None:
            return 128 + self.signum
        return 1 if self.failed else 0

    def as_dict(self) -> dict:
        return {"done": self.done, "skipped": self.skipped, "failed": self.failed,
                "interrupted": self.interrupted, "no_eval": self.no_eval,
                "killed_earlier": self.killed_earlier, "exit_codes": self.exit_codes,
                "signal": self.signum, "teacher_loads": self.teacher_loads}

    def absorb(self, other: Outcome) -> None:
        """Adds another part of the same sweep's outcome (`grid_exec.run_grid`'s data
        orders, one after the other); its signal, if any, becomes this one's."""
        for name in ("done", "skipped", "interrupted", "no_eval", "killed_earlier"):
            getattr(self, name).extend(getattr(other, name))
        self.failed.update(other.failed)
        self.exit_codes.update(other.exit_codes)
        self.teacher_loads += other.teacher_loads
        self.signum = other.signum

    def merge(self, res: dict) -> None:
        """Adds the bookkeeping of a worker's `as_dict()` (a SLURM job's result)."""
        self.failed.update(res.get("failed", {}))
        self.interrupted += res.get("interrupted", [])
        self.killed_earlier += res.get("killed_earlier", [])
        self.exit_codes.update(res.get("exit_codes", {}))


def worker_kwargs(sweep: Sweep, workdir: Path) -> dict:
    return {"workdir": str(workdir), "sweep_name": sweep.name, "eval_tasks": sweep.eval_tasks,
            "eval_limit": sweep.eval_limit, "eval_batch_size": sweep.eval_batch_size,
            "eval_offline_data": sweep.eval_offline_data}


# --------------------------------------------------------------------------- #
# Progress
# --------------------------------------------------------------------------- #


class Progress:
    """One overall display: a bar over the steps of every run (read from their metrics.jsonl)
    when stderr is a terminal and `enabled`, plus one line per run that ends."""

    def __init__(self, runs: list[Run], workdir: Path, enabled: bool = True):
        self.runs = {r.run_id: r for r in runs}
        self.workdir = workdir
        self.total = sum(r.steps for r in runs)
        self.finished: set[str] = set()
        self.running: set[str] = set()
        self.failed: set[str] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._bar = None
        self.enabled = enabled
        self.tty = enabled and sys.stderr.isatty()
        if self.tty:
            from tqdm.auto import tqdm

            self._bar = tqdm(total=self.total, unit="step", desc="sweep", dynamic_ncols=True)
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def __enter__(self):
        self._refresh()
        if self._bar is not None:
            self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        self._refresh()
        if self._bar is not None:
            self._bar.close()

    def _steps(self) -> int:
        n = 0
        for rid, r in self.runs.items():
            if rid in self.finished:
                n += r.steps
            else:
                n += min(r.steps, steps_done(self.workdir / rid))
        return n

    def _refresh(self) -> None:
        if self._bar is None:
            return
        with self._lock:
            self._bar.n = self._steps()
            self._bar.set_postfix_str(
                f"runs {len(self.finished)}/{len(self.runs)} done, {len(self.running)} running"
                + (f", {len(self.failed)} failed" if self.failed else ""), refresh=False)
            self._bar.refresh()

    def _poll(self) -> None:
        while not self._stop.wait(1.0):
            self._refresh()

    def event(self, kind: str, run_id: str, detail: str = "") -> None:
        with self._lock:
            if kind == "start":
                self.running.add(run_id)
            else:
                self.running.discard(run_id)
            if kind in ("done", "skipped"):
                self.finished.add(run_id)
            if kind == "failed":
                self.failed.add(run_id)
        if kind != "start":  # one line per finished / skipped / failed run, bar or not
            msg = f"[{len(self.finished)}/{len(self.runs)}] {run_id}: {kind}" + (
                f" ({detail})" if detail else "")
            if self._bar is not None:
                self._bar.write(msg, file=sys.stderr)
            else:
                print(msg, file=sys.stderr, flush=True)
        self._refresh()


def _detail(res: dict) -> str:
    parts = []
    if res.get("valid_ppl") is not None:
        parts.append(f"ppl {res['valid_ppl']:.3f}")
    for task, m in (res.get("eval") or {}).items():
        k = "acc" if "acc" in m else next((k for k in m if not k.endswith("_stderr")), None)
        if k is not None:
            parts.append(f"{task}/{k} {m[k]:.3g}")
    return ", ".join(parts)


# --------------------------------------------------------------------------- #
# Running a list of runs in one worker (this process, a subprocess, a SLURM job)
# --------------------------------------------------------------------------- #


class _Stop(StopSignals):
    """SIGINT / SIGTERM between runs: finish the current step of work, start nothing new.
    (During training the Trainer's own handler takes over and checkpoints.)"""


def run_many(runs: list[Run], kwargs: dict, report=None, stop: _Stop | None = None,
             worker=None) -> Outcome:
    """Runs `runs` one after another in this process with one Worker."""
    from hldstudy.sweep.worker import (
        EvalUnavailable,
        Worker,
        killed_earlier,
        record_failure,
        record_interrupted,
    )
    from hldstudy.train.loop import Interrupted

    worker = worker or Worker(**kwargs)
    out = Outcome()
    report = report or (lambda *a: None)
    workdir = Path(kwargs["workdir"])
    for run in runs:
        if stop is not None and stop.signum is not None:
            out.signum = stop.signum
            break
        if run_status(run, workdir / run.run_id, worker.eval_tasks) == "done":
            out.skipped.append(run.run_id)
            report("skipped", run.run_id, "already done")
            continue
        killed = killed_earlier(workdir / run.run_id)
        if killed is not None:
            out.killed_earlier.append(run.run_id)
            report("killed earlier", run.run_id,
                   f"marked running since {killed.get('started', '?')} by pid "
                   f"{killed.get('pid', '?')}, which is gone; resuming")
        report("start", run.run_id, "")
        try:
            res = worker.run(run)
        except Interrupted as e:
            record_interrupted(workdir / run.run_id, e)
            out.interrupted.append(run.run_id)
            out.exit_codes[run.run_id] = 128 + e.signum
            out.signum = e.signum
            report("interrupted", run.run_id, f"checkpoint at step {e.step}")
            break
        except EvalUnavailable as e:
            out.no_eval.append(run.run_id)
            out.done.append(run.run_id)
            report("done", run.run_id, f"trained; not evaluated: {e}")
            continue
        except Exception as e:  # noqa: BLE001 - one failed run must not stop the sweep
            msg = record_failure(workdir / run.run_id, e)
            out.failed[run.run_id] = msg
            out.exit_codes[run.run_id] = exit_code_of(e)
            report("failed", run.run_id, f"exit {exit_code_of(e)}: {msg}; see "
                   f"{workdir / run.run_id / 'error.txt'}")
            continue
        out.done.append(run.run_id)
        report("done", run.run_id, _detail(res))
    out.teacher_loads = worker.teacher_loads
    return out


# --------------------------------------------------------------------------- #
# local
# --------------------------------------------------------------------------- #


def spawned_worker(kwargs: dict, log_path: str):
    """In a spawned worker process: stdout/stderr to the worker's log, quiet libraries,
    and the process's `Worker` (teacher and data loaded once for all its runs)."""
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    sys.stdout = os.fdopen(1, "w", buffering=1)
    sys.stderr = os.fdopen(2, "w", buffering=1)
    from hldstudy.cli_common import quiet_libraries
    from hldstudy.sweep.worker import Worker

    die_with_parent()  # kill -9 of the sweep leaves no worker training on
    quiet_libraries()
    return Worker(**kwargs)


def _worker_main(index: int, kwargs: dict, tasks, events, log_path: str) -> None:
    """Entry point of a spawned local worker: take runs from `tasks` until None."""
    worker = spawned_worker(kwargs, log_path)

    def report(kind, run_id, detail):
        events.put((kind, run_id, detail))

    with _Stop() as stop:
        while stop.signum is None:
            run = tasks.get()
            if run is None:
                break
            out = run_many([run], kwargs, report, stop, worker=worker)
            if out.signum is not None:
                stop.signum = out.signum
    events.put(("exit", f"worker{index}", json.dumps({"teacher_loads": worker.teacher_loads,
                                                      "signal": stop.signum})))


def run_local(runs: list[Run], sweep: Sweep, workdir: Path, *, parallel: int = 1,
              progress: bool = True) -> Outcome:
    kwargs = worker_kwargs(sweep, workdir)
    pending = [r for r in runs]
    with Progress(runs, workdir, enabled=progress) as prog, _Stop() as stop:
        if parallel <= 1:
            out = run_many(pending, kwargs, prog.event, stop)
            if stop.signum is not None and out.signum is None:
                out.signum = stop.signum
            return out
        return _run_pool(pending, kwargs, parallel, prog, stop, workdir)


def _run_pool(runs, kwargs, parallel, prog: Progress, stop: _Stop, workdir: Path) -> Outcome:
    import multiprocessing as mp

    from hldstudy.sweep.worker import read_outcome

    ctx = mp.get_context("spawn")  # JAX is not fork-safe
    tasks, events = ctx.Queue(), ctx.Queue()
    for r in runs:
        tasks.put(r)
    n = max(1, min(parallel, len(runs)))
    for _ in range(n):
        tasks.put(None)
    logs = workdir / INTERNAL / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    procs = []
    for i in range(n):
        p = ctx.Process(target=_worker_main, name=f"hldstudy-sweep-{i}",
                        args=(i, kwargs, tasks, events, str(logs / f"worker{i}.log")))
        p.start()
        procs.append(p)
    out = Outcome()
    forwarded = False
    alive = n
    while alive:
        if stop.signum is not None and not forwarded:
            forwarded = True
            out.signum = stop.signum
            for p in procs:  # workers checkpoint and exit; queued runs stay pending
                if p.is_alive():
                    os.kill(p.pid, signal.SIGTERM)
        try:
            kind, rid, detail = events.get(timeout=0.5)
        except Exception:  # queue.Empty
            if not any(p.is_alive() for p in procs):
                break
            continue
        if kind == "exit":
            alive -= 1
            info = json.loads(detail)
            out.teacher_loads += info["teacher_loads"]
            if info["signal"] is not None and out.signum is None:
                out.signum = info["signal"]
            continue
        prog.event(kind, rid, detail)
        if kind == "done":
            out.done.append(rid)
            if "not evaluated" in detail:
                out.no_eval.append(rid)
        elif kind == "skipped":
            out.skipped.append(rid)
        elif kind == "killed earlier":
            out.killed_earlier.append(rid)
        elif kind in ("failed", "interrupted"):
            if kind == "failed":
                out.failed[rid] = detail
            else:
                out.interrupted.append(rid)
            code = (read_outcome(workdir / rid) or {}).get("exit_code")
            if isinstance(code, int):
                out.exit_codes[rid] = code
    for p in procs:
        p.join(timeout=120)
        if p.is_alive():
            p.terminate()
    for i, p in enumerate(procs):
        if p.exitcode not in (0, None) and out.signum is None:
            out.failed[f"worker{i}"] = (f"worker exited with code {p.exitcode}; "
                                        f"see {logs / f'worker{i}.log'}")
    return out


# --------------------------------------------------------------------------- #
# slurm (submitit)
# --------------------------------------------------------------------------- #


# A multi-task job's JAX coordinator listens on JAX_PORT_BASE + (job id mod 4096) on the
# job's first host (JAX's own SLURM rule), so concurrent jobs on one node do not collide.
JAX_PORT_BASE = 61440


def jax_distributed_env(job_env) -> dict[str, str]:
    """The JAX multi-process variables (`hldstudy.sharding`) of a submitit job of several
    tasks (`--slurm nodes=2,tasks_per_node=4`, say: one JAX process per task, every task
    running the same runs in step, process 0 writing their files): the coordinator on the
    job's first host, the task count and this task's global rank. {} for one task."""
    n = int(job_env.num_tasks)
    if n <= 1:
        return {}
    digits = "".join(ch for ch in str(job_env.raw_job_id) if ch.isdigit()) or "0"
    port = JAX_PORT_BASE + int(digits) % 4096
    return {"JAX_COORDINATOR_ADDRESS": f"{job_env.hostnames[0]}:{port}",
            "JAX_NUM_PROCESSES": str(n), "JAX_PROCESS_ID": str(int(job_env.global_rank))}


class SweepJob:
    """A submitit job: one worker running its share of the runs; requeued on preemption.
    A job of several tasks is one multi-process JAX job (`jax_distributed_env`)."""

    def __init__(self, kwargs: dict):
        self.kwargs = kwargs

    def __call__(self, runs: list[Run]) -> dict:
        import submitit

        from hldstudy.cli_common import quiet_libraries

        try:
            job_env = submitit.JobEnvironment()
        except RuntimeError:  # not inside a submitit job (called directly)
            job_env = None
        if job_env is not None:
            for key, value in jax_distributed_env(job_env).items():
                os.environ.setdefault(key, value)  # a launcher's own setting wins
        quiet_libraries()
        with _Stop() as stop:
            out = run_many(runs, self.kwargs, stop=stop)
        return out.as_dict()

    def checkpoint(self, runs: list[Run]):
        import submitit

        # The Trainer checkpoints on SIGTERM; a requeued job skips finished runs and
        # resumes the interrupted one from its checkpoint.
        return submitit.helpers.DelayedSubmission(SweepJob(self.kwargs), runs)


def run_slurm(runs: list[Run], sweep: Sweep, workdir: Path, *, parallel: int = 1,
              cluster: str | None = None, params: dict | None = None, wait: bool | None = None,
              progress: bool = True) -> Outcome:
    try:
        import submitit
    except ImportError as e:
        raise InputError("--executor slurm needs submitit (pip install submitit)") from e
    pending = [r for r in runs if run_status(r, workdir / r.run_id, sweep.eval_tasks) != "done"]
    out = Outcome(skipped=[r.run_id for r in runs if r not in pending])
    if not pending:
        return out
    folder = workdir / INTERNAL / "submitit"
    executor = submitit_executor(submitit, sweep, workdir, cluster, params)
    n = max(1, min(parallel, len(pending)))
    chunks = [pending[i::n] for i in range(n)]
    job_fn = SweepJob(worker_kwargs(sweep, workdir))
    jobs = [executor.submit(job_fn, chunk) for chunk in chunks]
    (workdir / INTERNAL).mkdir(parents=True, exist_ok=True)
    (workdir / INTERNAL / "jobs.json").write_text(json.dumps(
        [{"job_id": str(j.job_id), "runs": [r.run_id for r in c]}
         for j, c in zip(jobs, chunks, strict=True)], indent=2) + "\n")
    if wait is None:
        wait = executor.cluster in ("local", "debug")
    if not wait:
        print(f"submitted {len(jobs)} job(s) for {len(pending)} run(s) to {executor.cluster}: "
              + ", ".join(str(j.job_id) for j in jobs)
              + f" (logs: {folder}; rerun this command to resubmit unfinished runs)")
        return out
    with Progress(runs, workdir, enabled=progress) as prog:
        for rid in out.skipped:
            prog.event("skipped", rid, "already done")
        for job, chunk in zip(jobs, chunks, strict=True):
            fold_job_result(out, prog, job, chunk, job_outcome(job), sweep, workdir)
    return out


def submitit_executor(submitit, sweep: Sweep, workdir: Path, cluster, params: dict | None):
    """The sweep's submitit executor (its folder under the sweep's internal directory, a day's
    limit, SLURM's signal 120 s before it), `--slurm` parameters over those defaults; a
    parameter submitit rejects is one line naming --slurm."""
    executor = submitit.AutoExecutor(folder=workdir / INTERNAL / "submitit", cluster=cluster)
    defaults = {"name": f"hldstudy-{sweep.name}", "timeout_min": 24 * 60}
    if executor.cluster == "slurm":
        defaults["slurm_signal_delay_s"] = 120
    try:
        executor.update_parameters(**{**defaults, **(params or {})})
    except (ValueError, TypeError) as e:
        raise InputError(f"--slurm: {e}") from None
    return executor


def job_outcome(job):
    """A submitit job's result, or the exception it raised (submitit wraps the job's)."""
    try:
        return job.result()
    except Exception as e:  # noqa: BLE001 - reported per run by fold_job_result
        return e


def fold_job_result(out: Outcome, prog: Progress, job, runs: list[Run], res, sweep: Sweep,
                    workdir: Path) -> None:
    """One submitit job's outcome (a worker's result dict, or its exception) into the
    sweep's: a failed job fails each of its runs that is not done; the one place the SLURM
    paths (one job per chunk of runs, one per cohort) read a job's result."""
    if isinstance(res, Exception):
        for r in runs:
            if run_status(r, workdir / r.run_id, sweep.eval_tasks) != "done":
                out.failed[r.run_id] = f"job {job.job_id}: {str(res).splitlines()[-1][:200]}"
                prog.event("failed", r.run_id, out.failed[r.run_id])
        return
    for rid in res["done"]:
        out.done.append(rid)
        prog.event("done", rid, "")
    out.skipped += res["skipped"]
    out.merge(res)
    for rid in res.get("interrupted", ()):
        prog.event("interrupted", rid, "checkpointed; rerun to resume")
    if res.get("signal") is not None:
        out.signum = res["signal"]
    out.no_eval += res["no_eval"]
    out.teacher_loads += res["teacher_loads"]


# --------------------------------------------------------------------------- #
# wandb
# --------------------------------------------------------------------------- #


def wandb_sweep_config(sweep: Sweep, runs: list[Run], sweep_file: Path, workdir: Path,
                       overrides: list[str]) -> dict:
    """A W&B grid sweep over the run ids; each agent run executes exactly one grid run."""
    command = ["${env}", "${interpreter}", "-m", "hldstudy.sweep", str(Path(sweep_file).absolute()),
               "--workdir", str(Path(workdir).absolute())]
    for o in overrides:
        command += ["--set", o]
    command.append("${args}")
    return {
        "name": sweep.name,
        "description": f"hldstudy sweep {sweep.name}: {len(runs)} runs at "
                       f"{runs[0].config.budget.flops:.4g} FLOPs each",
        "program": str(Path(sweep_file).absolute()),
        "method": "grid",
        "metric": {"name": "valid_ppl", "goal": "minimize"},
        "parameters": {"run_id": {"values": [r.run_id for r in runs]}},
        "command": command,
    }


def write_wandb_config(cfg: dict, workdir: Path) -> Path:
    import yaml

    path = workdir / "wandb_sweep.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def run_wandb(runs: list[Run], sweep: Sweep, workdir: Path, *, sweep_file: Path,
              overrides: list[str], sweep_id: str | None = None, count: int | None = None,
              project: str | None = None, entity: str | None = None,
              parallel: int = 1) -> Outcome:
    cfg = wandb_sweep_config(sweep, runs, sweep_file, workdir, overrides)
    path = write_wandb_config(cfg, workdir)
    online, why = wandb_online()
    base = runs[0].config.wandb
    project = project or base.project
    entity = entity or base.entity
    if not online:
        print(f"wrote {path} (a W&B grid over the {len(runs)} run ids). No agent started: "
              f"{why}. With a W&B server: `wandb sweep --project {project} {path}`, then "
              f"`python -m hldstudy.sweep {sweep_file} --executor wandb --sweep-id "
              f"ENTITY/{project}/SWEEP_ID` (one teacher load per agent process) or "
              f"`wandb agent ENTITY/{project}/SWEEP_ID` (one process per run).")
        return Outcome()
    import wandb

    if sweep_id is None:
        sweep_id = wandb.sweep(cfg, project=project, entity=entity)
        print(f"created W&B sweep {sweep_id} ({path})")
    by_id = {r.run_id: r for r in runs}
    # --parallel N: N - 1 more agents as subprocesses (each loads the teacher once).
    import subprocess

    from hldstudy.sweep.worker import Worker

    extra = []
    for _ in range(max(0, parallel - 1)):
        cmd = [sys.executable, "-m", "hldstudy.sweep", str(sweep_file), "--executor", "wandb",
               "--sweep-id", sweep_id, "--workdir", str(workdir), "--no-progress"]
        for o in overrides:
            cmd += ["--set", o]
        if count is not None:
            cmd += ["--count", str(count)]
        extra.append(subprocess.Popen(cmd))

    worker = Worker(**worker_kwargs(sweep, workdir))
    out = Outcome()

    def agent_fn():
        with wandb.init() as wrun:
            rid = wrun.config["run_id"]
            if rid not in by_id:
                raise InputError(f"W&B asked for run {rid!r}, which this grid does not have")
            res = run_many([by_id[rid]], worker_kwargs(sweep, workdir), worker=worker)
            for k in ("done", "skipped", "no_eval"):
                getattr(out, k).extend(getattr(res, k))
            out.merge(res.as_dict())
            _replay_metrics(wrun, workdir / rid)

    try:
        wandb.agent(sweep_id, function=agent_fn, project=project, entity=entity, count=count)
    finally:
        for p in extra:
            p.wait()
            if p.returncode not in (0, None):
                out.failed[f"agent pid {p.pid}"] = f"exited with code {p.returncode}"
    out.teacher_loads = worker.teacher_loads
    return out


def _replay_metrics(wrun, run_dir: Path) -> None:
    """Logs the run's metrics.jsonl and results.json to the agent's W&B run."""
    mpath, rpath = run_dir / "metrics.jsonl", run_dir / "results.json"
    if mpath.exists():
        from hldstudy.fileio import read_records

        for rec in read_records(mpath):  # a torn line is reported and skipped
            step = rec.pop("step", None)
            rec = {k: v for k, v in rec.items() if isinstance(v, (int, float))}
            wrun.log(rec, step=step)
    if rpath.exists():
        res = json.loads(rpath.read_text())
        flat = {k: v for k, v in res.items() if isinstance(v, (int, float, str))}
        for task, m in (res.get("eval") or {}).items():
            for k, v in m.items():
                flat[f"eval/{task}/{k}"] = v
        wrun.summary.update(flat)
