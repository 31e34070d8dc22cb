"""`python tests/helpers/train_faults.py MODE ARGS...`: `python -m hldstudy.train ARGS...` with
one fault injected (test doubles live here, never as flags in the trainer):

- ``file_in_way``: after the trainer checked its checkpoint directory, the directory is
  replaced by a file, so the first save meets "Not a directory" (what root cannot
  write through either, unlike permission bits);
- ``enospc``: every checkpoint save fails as a full disk does (OSError ENOSPC).
"""

from __future__ import annotations

import errno
import shutil
import sys


def install(mode: str) -> None:
    from hldstudy.train import loop

    if mode == "file_in_way":
        original = loop.Trainer.run

        def run(self, *args, **kwargs):
            ck = self.workdir / "checkpoints"
            shutil.rmtree(ck)
            ck.write_text("a file where the checkpoint directory must be\n")
            return original(self, *args, **kwargs)

        loop.Trainer.run = run
    elif mode == "enospc":
        import orbax.checkpoint as ocp

        def save(self, step, *args, **kwargs):
            raise OSError(errno.ENOSPC, "No space left on device",
                          str(self.directory / f"{step}.orbax-checkpoint-tmp"))

        ocp.CheckpointManager.save = save
    else:
        raise SystemExit(f"unknown fault {mode!r}")


if __name__ == "__main__":
    install(sys.argv[1])
    from hldstudy.train.__main__ import main

    sys.exit(main(sys.argv[2:]))
