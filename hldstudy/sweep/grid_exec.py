"""A sweep whose cohorts share one teacher replica set (`--cohort K --teacher-replicas N`).

`run_grid` groups the runs into cohorts (`hldstudy.sweep.cohorts.group`), declares
every cohort that still trains as a member of the replicas' fan-out cohort
(`gridteach.grid_members`), starts the replicas (`gridteach.ReplicaSet`), trains
every such cohort at once, each in its own process (local) or submitit job (slurm),
streaming from the replicas, and stops the replicas however the sweep ends. The
cohorts must train together: a member that has not connected holds the replicas'
window until the lag timeout, after which its steps are recomputed for it alone.
So `--parallel` is raised to the number of cohorts that train.
"""

from __future__ import annotations

import signal
import sys
from pathlib import Path

from hldstudy.cli_common import quiet_libraries
from hldstudy.errors import ConfigError, InputError
from hldstudy.fileio import write_json_atomic
from hldstudy.model.loading import teacher_model_config
from hldstudy.signals import Interrupted
from hldstudy.sweep.cohort_exec import (
    _run_cohorts_here,
    cohort_id,
    run_local_cohorts,
    to_train,
)
from hldstudy.sweep.cohorts import group
from hldstudy.sweep.executors import (
    INTERNAL,
    Outcome,
    Progress,
    _Stop,
    fold_job_result,
    job_outcome,
    submitit_executor,
    worker_kwargs,
)
from hldstudy.sweep.gridteach import ReplicaOptions, ReplicaSet, check_grid, grid_members
from hldstudy.sweep.replica_launch import LocalLauncher, SlurmLauncher
from hldstudy.sweep.spec import Run, run_status

PROG = "python -m hldstudy.sweep"


class _Raise:
    """While the replicas start: SIGTERM / SIGINT raise `Interrupted` (the ReplicaSet
    stops what it started); the previous handlers come back after."""

    def __enter__(self):
        self._old = {}
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                self._old[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread
                pass
        return self

    @staticmethod
    def _handle(signum, frame):
        raise Interrupted(0, signum)

    def __exit__(self, *exc):
        for sig, old in self._old.items():
            signal.signal(sig, old)


def data_streams(runs: list[Run]) -> list[list[Run]]:
    """The runs grouped by the data they read (one replica set streams one `batch_at(step)`
    sequence): one group per data order when the sweep's seeds set it
    (`Sweep.seeds_vary_data_order`), in grid order."""
    out: dict[str, list[Run]] = {}
    for r in runs:
        out.setdefault(repr(r.config.data), []).append(r)
    return list(out.values())


def run_grid(runs: list[Run], sweep, workdir: Path, **kwargs) -> Outcome:
    """One replica set per data order, in turn (a sweep whose seeds set the data order has
    one per seed; the replicas' economy holds within each: every configuration of that
    seed streams from it); a stop signal ends the sweep before the next one starts."""
    streams = data_streams(runs)
    if len(streams) == 1:
        return _serve_grid(runs, sweep, workdir, **kwargs)
    total = Outcome()
    for i, part in enumerate(streams, 1):
        print(f"{PROG}: data order {i} of {len(streams)} ({len(part)} runs)", file=sys.stderr)
        total.absorb(_serve_grid(part, sweep, workdir, **kwargs))
        if total.signum is not None:
            break
    return total


def _serve_grid(runs: list[Run], sweep, workdir: Path, *, k: int, options: ReplicaOptions,
                executor: str = "local", parallel: int = 1, progress: bool = True,
                cluster: str | None = None, params: dict | None = None,
                teacher_params: dict | None = None) -> Outcome:
    workdir = Path(workdir)
    check_grid(runs, options)
    cohorts = group(runs, k)
    eval_tasks = sweep.eval_tasks
    training = [c for c in cohorts if to_train(c, workdir, eval_tasks)]
    # The cohorts that train first, so every one of them has a process from the start.
    ordered = training + [c for c in cohorts if c not in training]
    lead = runs[0].config
    teacher = teacher_model_config(lead.teacher.checkpoint, sweep.teacher_preset)
    if teacher is None:
        raise ConfigError("teacher.checkpoint", f"cannot read the teacher's shape from "
                          f"{lead.teacher.checkpoint}", "give a trained teacher's run directory "
                          "(or a .gguf / HF directory)")
    members = grid_members(training, teacher)
    if not members:  # nothing left to distill: no replica to start
        return _train(ordered, runs, sweep, workdir, k, None, executor, parallel, progress,
                      cluster, params)
    taught = next(c[0] for c in training if c[0].method in {m.method for m in members})
    if executor == "slurm":
        launcher = SlurmLauncher(workdir / INTERNAL / "submitit-teacher", cluster,
                                 teacher_params or {}, f"hldstudy-{sweep.name}")
    else:
        launcher = LocalLauncher()
    print(f"{PROG}: starting {options.replicas} teacher replica(s) for {len(members)} "
          f"cohort(s) ({', '.join(sorted({m.method for m in members}))})", file=sys.stderr)
    replicas = ReplicaSet(members, taught.config, workdir, options, launcher)
    try:
        with _Raise():
            replicas.__enter__()
    except Interrupted as e:
        return Outcome(signum=e.signum)
    try:
        grid = {"spec": replicas.spec, "token_file": replicas.token_file}
        out = _train(ordered, runs, sweep, workdir, k, grid, executor,
                     max(parallel, len(training)), progress, cluster, params)
    finally:
        replicas.__exit__(None, None, None)
    print(f"{PROG}: {replicas.summary()}", file=sys.stderr)
    return out


def _train(cohorts, runs, sweep, workdir, k, grid, executor, parallel, progress, cluster,
           params) -> Outcome:
    if executor == "slurm":
        return run_slurm_cohorts(cohorts, runs, sweep, workdir, grid_teacher=grid,
                                 cluster=cluster, params=params, progress=progress)
    return run_local_cohorts(runs, sweep, workdir, k=k, parallel=parallel, progress=progress,
                             grid_teacher=grid, cohorts=cohorts)


class CohortJob:
    """A submitit job training one cohort (`run_cohort`) with the sweep's replica set."""

    def __init__(self, kwargs: dict):
        self.kwargs = kwargs

    def __call__(self, members: list[Run]) -> dict:
        quiet_libraries()
        with _Stop() as stop:
            out = _run_cohorts_here([members], self.kwargs, lambda *a: None, stop)
        return out.as_dict()

    def checkpoint(self, members: list[Run]):
        import submitit

        return submitit.helpers.DelayedSubmission(CohortJob(self.kwargs), members)


def run_slurm_cohorts(cohorts: list[list[Run]], runs: list[Run], sweep, workdir: Path, *,
                      grid_teacher: dict | None, cluster: str | None = None,
                      params: dict | None = None, progress: bool = True) -> Outcome:
    """One submitit job per cohort that is not done, all submitted at once, waited for
    (the replicas live as long as the sweep does); SIGINT / SIGTERM cancel the jobs (each
    checkpoints on its SIGTERM) before the replicas stop."""
    try:
        import submitit
    except ImportError as e:
        raise InputError("--executor slurm needs submitit (pip install submitit)") from e
    pending = [c for c in cohorts
               if any(run_status(r, workdir / r.run_id, sweep.eval_tasks) != "done" for r in c)]
    out = Outcome(skipped=[r.run_id for c in cohorts if c not in pending for r in c])
    if not pending:
        return out
    executor = submitit_executor(submitit, sweep, workdir, cluster, params)
    job_fn = CohortJob({**worker_kwargs(sweep, workdir), "grid_teacher": grid_teacher})
    jobs = [executor.submit(job_fn, c) for c in pending]
    write_json_atomic(workdir / INTERNAL / "jobs.json", [
        {"job_id": str(j.job_id), "cohort": cohort_id(c), "runs": [r.run_id for r in c]}
        for j, c in zip(jobs, pending, strict=True)])
    with Progress(runs, workdir, enabled=progress) as prog:
        for rid in out.skipped:
            prog.event("skipped", rid, "already done")
        try:
            with _Raise():
                results = [(job, c, job_outcome(job)) for job, c in zip(jobs, pending, strict=True)]
        except Interrupted as e:
            for job in jobs:
                job.cancel(check=False)
            out.signum = e.signum
            for job in jobs:
                job_outcome(job)  # each job checkpoints on its SIGTERM before it ends
            return out
        for job, c, res in results:
            fold_job_result(out, prog, job, c, res, sweep, workdir)
    return out
