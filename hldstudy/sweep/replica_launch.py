"""Where a teacher replica of the sweep's replica set runs (`hldstudy.sweep.gridteach`).

A launcher starts one replica (`python -m hldstudy.teacher.serve ARGV`) and returns a
handle with `name`, `log_path`, `exit_code()` (None while it runs) and `stop(grace_s)`:

- `LocalLauncher`: a subprocess of the sweep in its own session (a Ctrl-C meant for the
  sweep reaches the trainers, which checkpoint; the sweep stops the replicas after), told
  the sweep's pid (`--parent-pid`) so it never outlives it; restartable on its port.
- `SlurmLauncher`: a submitit job with its own resources, binding every interface behind
  the sweep's token; not restartable (it may land on another node).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from hldstudy.errors import InputError
from hldstudy.teacher.serve import main as serve_main


class LocalReplica:
    """A replica as a subprocess of the sweep, in its own session (a Ctrl-C meant for the
    sweep reaches the trainers, which checkpoint; the sweep stops the replicas after)."""

    def __init__(self, argv: list[str], log_path: Path):
        self.log_path = log_path
        with open(log_path, "a") as logf:
            self.proc = subprocess.Popen([sys.executable, "-m", "hldstudy.teacher.serve", *argv],
                                         stdout=logf, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True)
        self.name = f"pid {self.proc.pid}"

    def exit_code(self) -> int | None:
        return self.proc.poll()

    def stop(self, grace_s: float) -> None:
        if self.proc.poll() is not None:
            return
        try:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        except ProcessLookupError:
            pass


class LocalLauncher:
    restartable = True
    bind_host = "127.0.0.1"

    def launch(self, index: int, argv: list[str], log_path: Path) -> LocalReplica:
        return LocalReplica([*argv, "--parent-pid", str(os.getpid())], log_path)


class ReplicaJob:
    """A submitit job running one replica (`python -m hldstudy.teacher.serve ARGV`)."""

    def __init__(self, argv: list[str]):
        self.argv = list(argv)

    def __call__(self) -> int:
        try:
            return serve_main(self.argv)
        except SystemExit as e:  # user_errors: a bad replica exits 2 / 3 with its one line
            return e.code if isinstance(e.code, int) else 1


class SlurmReplica:
    def __init__(self, job, log_path: Path):
        self.job, self.log_path = job, log_path
        self.name = f"job {job.job_id}"

    def exit_code(self) -> int | None:
        if not self.job.done():
            return None
        try:
            code = self.job.result()
        except Exception:  # noqa: BLE001 - submitit wraps the job's failure
            return 1
        return code if isinstance(code, int) else 0

    def stop(self, grace_s: float) -> None:
        if self.job.done():
            return
        self.job.cancel(check=False)  # SIGTERM-then-SIGKILL is SLURM's (KillWait)
        deadline = time.monotonic() + grace_s
        while not self.job.done() and time.monotonic() < deadline:
            time.sleep(0.2)


class SlurmLauncher:
    """Replicas as submitit jobs beside the students', with their own resources
    (`--teacher-slurm KEY=VALUE`); they bind every interface behind a shared token."""

    restartable = False
    bind_host = "0.0.0.0"

    def __init__(self, folder: Path, cluster: str | None, params: dict, name: str):
        try:
            import submitit
        except ImportError as e:
            raise InputError("--executor slurm needs submitit (pip install submitit)") from e
        self.executor = submitit.AutoExecutor(folder=folder, cluster=cluster)
        defaults = {"name": f"{name}-teacher", "timeout_min": 24 * 60}
        try:
            self.executor.update_parameters(**{**defaults, **params})
        except (ValueError, TypeError) as e:
            raise InputError(f"--teacher-slurm: {e}") from None

    def launch(self, index: int, argv: list[str], log_path: Path) -> SlurmReplica:
        job = self.executor.submit(ReplicaJob(argv))
        return SlurmReplica(job, Path(job.paths.stderr))  # submitit's log of the job
