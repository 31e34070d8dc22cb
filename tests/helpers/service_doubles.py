"""Transport-only test doubles of a teacher replica (no model: `SyntheticTeacherServer`).

- `SlowSendServer`: every frame it sends waits `delay_s` first (a slow link), and after
  `hang_after_frames` frames it stops sending (a replica hung mid-transfer) until stopped.
- `BoundedDataServer`: data that ends after `n_steps` steps (`compute` raises IndexError
  beyond, as a finite `batch_at` does).
- `WrongLayoutServer`: announces `[B, T, D]` of another width than its Info (a confused or
  hostile replica).
"""

from __future__ import annotations

import time

import numpy as np

from hldstudy.teacher.serve import SyntheticTeacherServer


class SlowSendServer(SyntheticTeacherServer):
    def __init__(self, *args, delay_s: float = 0.0, hang_after_frames: int | None = None,
                 chunk_bytes: int | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.delay_s, self.hang_after_frames = delay_s, hang_after_frames
        if chunk_bytes:
            self.CHUNK_BYTES = chunk_bytes
        self.frames_sent = 0

    def _send(self, context, frame):
        if self.hang_after_frames is not None and self.frames_sent >= self.hang_after_frames:
            while not self._stopped.is_set() and context.is_active():
                time.sleep(0.02)  # hung, but it ends when the test stops the server
            return
        time.sleep(self.delay_s)
        self.frames_sent += 1
        yield from super()._send(context, frame)


class BoundedDataServer(SyntheticTeacherServer):
    def __init__(self, *args, n_steps: int = 4, **kwargs):
        super().__init__(*args, **kwargs)
        self.n_steps = n_steps

    def compute(self, step, final, layers):
        if step >= self.n_steps:
            raise IndexError(step)
        return super().compute(step, final, layers)


class WrongLayoutServer(SyntheticTeacherServer):
    def compute(self, step, final, layers):
        digest, tensors = super().compute(step, final, layers)
        return digest, [(n, np.concatenate([a, a], axis=-1)) for n, a in tensors]

    def head(self):
        return self._array[0].astype(np.float16)
