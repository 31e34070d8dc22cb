"""Running a sweep's runs as cohorts (`python -m hldstudy.sweep SWEEP --cohort K`).

Design notes: `docs/sweeps.md`, under this file's name.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
import time
from pathlib import Path

from hldstudy.errors import RuntimeFault, exit_code_of
from hldstudy.rundir import job_owns, read_results
from hldstudy.sweep.cohorts import group
from hldstudy.sweep.executors import INTERNAL, Outcome, _Stop, spawned_worker, worker_kwargs
from hldstudy.sweep.spec import Run, run_status


def cohort_id(members: list[Run]) -> str:
    """Stable id of a cohort: its method and a hash of its members' run ids."""
    digest = hashlib.sha1("\n".join(r.run_id for r in members).encode()).hexdigest()[:10]
    return f"{members[0].method}-{digest}"


def cohort_ids(runs: list[Run], k: int) -> dict[str, str]:
    """run_id -> cohort id for every run (`--dry-run --json`)."""
    return {r.run_id: cohort_id(c) for c in group(runs, k) for r in c}


def to_train(members: list[Run], workdir: Path, eval_tasks) -> list[Run]:
    """The members a cohort still trains: neither done, nor trained (waiting only for their
    evaluation), nor diverged."""
    from hldstudy.train.cohort import DIVERGED

    return [r for r in members
            if run_status(r, workdir / r.run_id, eval_tasks) not in ("done", "trained")
            and (read_results(workdir / r.run_id) or {}).get("status") != DIVERGED]


def run_cohort(worker, members: list[Run], workdir: Path, report, out: Outcome) -> None:
    """Trains (or resumes) one cohort and completes its members; fills `out`."""
    from hldstudy.sweep.worker import (
        EvalUnavailable,
        killed_earlier,
        mark_running,
        record_failure,
        record_interrupted,
    )
    from hldstudy.train.cohort import DIVERGED, CohortTrainer
    from hldstudy.train.loop import Interrupted

    todo = []
    for run in members:
        run_dir = workdir / run.run_id
        if run_status(run, run_dir, worker.eval_tasks) == "done":
            out.skipped.append(run.run_id)
            report("skipped", run.run_id, "already done")
            continue
        if killed_earlier(run_dir) is not None:
            out.killed_earlier.append(run.run_id)
            report("killed earlier", run.run_id, "its process is gone; resuming")
        todo.append(run)
    # Every member's run.lock before anything is written there (training, then the
    # completion: evaluation and results), released on every exit path.
    with contextlib.ExitStack() as owned:
        for r in todo:
            owned.enter_context(job_owns(workdir / r.run_id, "hldstudy.sweep"))
        cid = cohort_id(members)
        train = to_train(todo, workdir, worker.eval_tasks)
        t0 = time.time()
        failed: dict[str, BaseException] = {}
        for r in train:
            (workdir / r.run_id / "error.txt").unlink(missing_ok=True)
            mark_running(workdir / r.run_id)
            report("start", r.run_id, f"cohort {cid} ({len(train)} members)")
        try:
            if train:
                data = worker.data_for(train[0].config)
                teacher = worker.teacher_for(train[0].config, data.tokenizer if data else None,
                                             member=cid)
                CohortTrainer([r.config for r in train], [workdir / r.run_id for r in train],
                              teacher=teacher, data=data).run()
        except Interrupted as e:
            for r in train:
                record_interrupted(workdir / r.run_id, e)
                out.interrupted.append(r.run_id)
                out.exit_codes[r.run_id] = 128 + e.signum
                report("interrupted", r.run_id, f"checkpoint at step {e.step}")
            out.signum = e.signum
            return
        except Exception as e:  # noqa: BLE001 - a failed cohort fails its members, not the sweep
            failed = {r.run_id: e for r in train}
        for run in todo:
            run_dir = workdir / run.run_id
            try:
                if run.run_id in failed:
                    raise failed[run.run_id]
                results = json.loads((run_dir / "results.json").read_text())
                if results.get("status") == DIVERGED:
                    raise RuntimeFault(results.get("error", "diverged"))
                res = worker.complete(run, run_dir, t0)
            except EvalUnavailable as e:
                out.no_eval.append(run.run_id)
                out.done.append(run.run_id)
                report("done", run.run_id, f"trained; not evaluated: {e}")
                continue
            except Exception as e:  # noqa: BLE001
                msg = record_failure(run_dir, e)
                out.failed[run.run_id] = msg
                out.exit_codes[run.run_id] = exit_code_of(e)
                report("failed", run.run_id, f"exit {exit_code_of(e)}: {msg}")
                continue
            out.done.append(run.run_id)
            report("done", run.run_id, f"valid_nll {res.get('valid_nll', float('nan')):.4f}")


def _run_cohorts_here(cohorts, kwargs, report, stop, worker=None) -> Outcome:
    from hldstudy.sweep.worker import Worker

    worker = worker or Worker(**kwargs)
    out = Outcome()
    for members in cohorts:
        if stop is not None and stop.signum is not None:
            out.signum = stop.signum
            break
        run_cohort(worker, members, Path(kwargs["workdir"]), report, out)
        if out.signum is not None:
            break
    out.teacher_loads = worker.teacher_loads
    return out


def _cohort_worker(index: int, kwargs: dict, tasks, results, log_path: str) -> None:
    worker = spawned_worker(kwargs, log_path)
    total = Outcome()
    with _Stop() as stop:
        while stop.signum is None:
            members = tasks.get()
            if members is None:
                break
            out = _run_cohorts_here([members], kwargs, lambda *a: None, stop, worker)
            for f in ("done", "skipped", "interrupted", "no_eval", "killed_earlier"):
                getattr(total, f).extend(getattr(out, f))
            total.failed.update(out.failed)
            total.exit_codes.update(out.exit_codes)
            if out.signum is not None:
                stop.signum = out.signum
    total.signum = stop.signum
    total.teacher_loads = worker.teacher_loads
    results.put(total.as_dict())


def run_local_cohorts(runs: list[Run], sweep, workdir: Path, *, k: int, parallel: int = 1,
                      progress: bool = True, grid_teacher: dict | None = None,
                      cohorts: list[list[Run]] | None = None) -> Outcome:
    """The local executor with cohorts of at most `k` (`parallel` processes; `cohorts`:
    that grouping, in that order, instead of `group(runs, k)`). `grid_teacher`: the
    sweep's replica set every cohort streams its teacher from (`hldstudy.sweep.grid_exec`)."""
    from hldstudy.sweep.executors import Progress

    kwargs = {**worker_kwargs(sweep, workdir), "grid_teacher": grid_teacher}
    cohorts = cohorts if cohorts is not None else group(runs, k)
    with Progress(runs, workdir, enabled=progress) as prog, _Stop() as stop:
        if parallel <= 1 or len(cohorts) <= 1:
            out = _run_cohorts_here(cohorts, kwargs, prog.event, stop)
            if stop.signum is not None and out.signum is None:
                out.signum = stop.signum
            return out
        import multiprocessing as mp

        ctx = mp.get_context("spawn")  # JAX is not fork-safe
        tasks, results = ctx.Queue(), ctx.Queue()
        for c in cohorts:
            tasks.put(c)
        n = min(parallel, len(cohorts))
        for _ in range(n):
            tasks.put(None)
        logs = workdir / INTERNAL / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        procs = [ctx.Process(target=_cohort_worker, name=f"hldstudy-cohort-{i}",
                             args=(i, kwargs, tasks, results, str(logs / f"cohort{i}.log")))
                 for i in range(n)]
        for p in procs:
            p.start()
        out, got, forwarded = Outcome(), 0, False
        while got < n:
            if stop.signum is not None and not forwarded:
                forwarded = True
                for p in procs:
                    if p.is_alive():
                        os.kill(p.pid, signal.SIGTERM)
            try:
                res = results.get(timeout=0.5)
            except Exception:  # queue.Empty
                if not any(p.is_alive() for p in procs):
                    break
                continue
            got += 1
            for f in ("done", "skipped", "interrupted", "no_eval", "killed_earlier"):
                getattr(out, f).extend(res.get(f, []))
            out.failed.update(res.get("failed", {}))
            out.exit_codes.update(res.get("exit_codes", {}))
            out.teacher_loads += res.get("teacher_loads", 0)
            if res.get("signal") is not None and out.signum is None:
                out.signum = res["signal"]
        for p in procs:
            p.join(timeout=120)
        for i, p in enumerate(procs):
            if p.exitcode not in (0, None) and out.signum is None:
                out.failed[f"cohort worker{i}"] = f"exited with code {p.exitcode}"
        if stop.signum is not None:  # the sweep's own signal, not the one it forwarded
            out.signum = stop.signum
        return out
