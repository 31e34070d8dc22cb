"""SIGTERM / SIGINT as a flag: long-running work checks it at safe points
(after a train step, between runs) instead of dying mid-write."""

from __future__ import annotations

import signal


class StopSignals:
    """Context manager that records SIGTERM / SIGINT in `signum` instead of raising."""

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


class Interrupted(Exception):
    """Raised (after a checkpoint is saved) when SIGTERM / SIGINT stops training; the
    trainer, the remote teacher's waits and the sweep all raise or catch this one."""

    def __init__(self, step: int, signum: int):
        self.step, self.signum = step, signum
        super().__init__(f"interrupted at step {step}; checkpoint saved, rerun to resume")
