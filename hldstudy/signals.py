"""SIGTERM / SIGINT as a flag: long-running work checks it at safe points
(after a train step, between runs) instead of dying mid-write."""

from __future__ import annotations

import signal


class StopSignals:
    """Context manager that records SIGTERM / SIGINT in `signum` instead of raising.

    Scopes nest (a sweep around a trainer around a teacher's wait): the innermost holds
    the handlers. A signal it caught is never dropped when its scope ends: it is passed
    on to the handler of the scope around it (so a trainer that caught SIGTERM at its
    last step, or while it evaluated, lets the sweep stop before it starts new work),
    unless that is the interpreter's default, which the caught signal would have
    killed: then the scope's owner has acted on it (checkpointed, exited)."""

    def __init__(self):
        self.signum = None
        self._old = {}

    def __enter__(self):
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                self._old[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not in the main thread: leave the handlers alone
                pass
        return self

    def _handle(self, signum, frame):
        self.signum = signum

    def __exit__(self, *exc):
        for sig, old in self._old.items():
            signal.signal(sig, old)
        outer = self._old.get(self.signum)
        if self.signum is not None and callable(outer) \
                and outer is not signal.default_int_handler:
            outer(self.signum, None)


class Interrupted(Exception):
    """Raised (after a checkpoint is saved) when SIGTERM / SIGINT stops training; the
    trainer, the remote teacher's waits and the sweep all raise or catch this one."""

    def __init__(self, step: int, signum: int):
        self.step, self.signum = step, signum
        super().__init__(f"interrupted at step {step}; checkpoint saved, rerun to resume")


def die_with_parent() -> None:
    """In a worker process: SIGKILL when the process that started it dies (Linux
    prctl PR_SET_PDEATHSIG), so that kill -9 of a command leaves no worker behind.
    Elsewhere a no-op."""
    import ctypes
    import os

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() == 1:  # the parent died before the request took effect
        os._exit(1)
