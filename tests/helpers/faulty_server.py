"""A teacher replica that fails on purpose, for tests of the trainer's fault handling.

    python tests/helpers/faulty_server.py [--exit-after-steps N] [--hang-after-steps N]
        [--delay-s S] [--hang-in-head] <the arguments of python -m hldstudy.teacher.serve>

--exit-after-steps N   serves N steps, then dies (exit 3) when asked for one more
--hang-after-steps N   serves N steps, then never answers again
--delay-s S            sleeps S seconds after computing each step (a slow teacher)
--hang-in-head         never sends the head (`Head` hangs until the replica stops)
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time

from hldstudy.teacher.serve import TeacherServer, main

log = logging.getLogger("faulty_server")


class FaultyTeacherServer(TeacherServer):
    def __init__(self, *args, exit_after_steps: int = 0, hang_after_steps: int = 0,
                 delay_s: float = 0.0, hang_in_head: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        self.exit_after_steps, self.hang_after_steps = exit_after_steps, hang_after_steps
        self.delay_s, self.hang_in_head = delay_s, hang_in_head
        self.serving = False

    def start(self, *args, **kwargs) -> int:
        port = super().start(*args, **kwargs)
        self.serving = True  # warm-up computes before this are not served steps
        return port

    def head(self):
        if self.hang_in_head:
            log.warning("hanging on purpose in Head")
            while not self._stopped.wait(0.05):  # ends when the replica stops
                pass
            raise RuntimeError("stopped")
        return super().head()

    def compute(self, step, final, layers):
        if self.serving:
            with self._stats_lock:
                done = self.stats["steps"]
            if self.exit_after_steps and done >= self.exit_after_steps:
                log.warning("exiting on purpose after %d steps, before step %d", done, step)
                os._exit(3)
            if self.hang_after_steps and done >= self.hang_after_steps:
                log.warning("hanging on purpose after %d steps, at step %d", done, step)
                while True:
                    time.sleep(1.0)
        out = super().compute(step, final, layers)
        if self.delay_s:
            time.sleep(self.delay_s)
        return out


if __name__ == "__main__":
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--exit-after-steps", type=int, default=0)
    parser.add_argument("--hang-after-steps", type=int, default=0)
    parser.add_argument("--delay-s", type=float, default=0.0)
    parser.add_argument("--hang-in-head", action="store_true")
    faults, rest = parser.parse_known_args()
    sys.exit(main(rest, FaultyTeacherServer, exit_after_steps=faults.exit_after_steps,
                  hang_after_steps=faults.hang_after_steps, delay_s=faults.delay_s,
                  hang_in_head=faults.hang_in_head))
