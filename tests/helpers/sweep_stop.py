"""A sweep whose runs stop at chosen steps, exactly as a SIGTERM there would stop them."""

from __future__ import annotations

import contextlib

from hldstudy.sweep.worker import Worker


@contextlib.contextmanager
def runs_stopped_at(stops: dict[str, int]):
    """Within the block, a sweep worker of this process trains run `run_id` only up to step
    `stops[run_id]`, then checkpoints and raises `Interrupted` (the Trainer's own
    stop-at-step, as a SIGTERM at that step). The local executor with --parallel 1 and
    submitit's debug executor run their workers in this process."""
    original = Worker.run

    def run(self, run, *, stop_at_step=None):
        return original(self, run, stop_at_step=stops.get(run.run_id, stop_at_step))

    Worker.run = run
    try:
        yield
    finally:
        Worker.run = original
