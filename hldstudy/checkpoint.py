"""Orbax checkpoints: train state + JSON metadata (data position, RNG, stage, FLOPs).

Orbax writes to a temporary directory and renames it when complete, so a
crash mid-save leaves the previous checkpoint intact; `max_to_keep` keeps
the last k. Saves are synchronous (the trainer waits for each anyway): a save
that fails raises here, in the caller's thread, as a one-line `RuntimeFault`,
and leaves no background thread waiting forever at interpreter exit (Orbax's
async saver does, when its directory cannot be made). A damaged step can be
moved aside (`quarantine`) so that resuming falls back to the previous one.
Below both the trainer (which saves and resumes) and the model loader (which
reads a run's student parameters); it knows no model.
"""

from __future__ import annotations

import errno
import os
import tempfile
from pathlib import Path

import jax
import orbax.checkpoint as ocp

from hldstudy.errors import InputError, RuntimeFault

DAMAGED_DIR = "checkpoints.damaged"

_SAVE_FIXES = {
    errno.ENOSPC: "free disk space, or point --workdir at a larger disk",
    errno.EDQUOT: "free disk space (the quota is full), or point --workdir elsewhere",
    errno.EACCES: "make it writable, or use another --workdir",
    errno.EPERM: "make it writable, or use another --workdir",
    errno.EROFS: "the file system is read-only: use another --workdir",
    errno.ENOTDIR: "a file is in the way of a directory there: move it aside",
    errno.EEXIST: "a file is in the way there: move it aside",
}


def _reason(exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.strerror:
        where = f": {exc.filename}" if exc.filename else ""
        return f"{exc.strerror}{where}"
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:200]}" if text else type(exc).__name__


def _errno_of(exc: BaseException) -> int | None:
    while exc is not None:
        if isinstance(exc, OSError) and exc.errno:
            return exc.errno
        exc = exc.__cause__ or exc.__context__
    return None


def check_writable(directory: str | Path, what: str = "checkpoint directory") -> Path:
    """Makes `directory` if needed and writes (then removes) a probe file in it; an
    `InputError` naming the directory when that fails. Run before training, so an
    unwritable checkpoint directory costs no work."""
    directory = Path(directory).absolute()
    if os.path.lexists(directory) and not directory.is_dir():
        raise InputError(f"the {what} {directory} is a file, not a directory "
                         "(move the file aside, or use another --workdir)")
    try:
        directory.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".write-probe-", dir=directory)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        fix = _SAVE_FIXES.get(e.errno, "make it writable, or use another --workdir")
        raise InputError(f"the {what} {directory} is not writable: {e.strerror} ({fix})") from None
    return directory


class Checkpointer:
    def __init__(self, directory: str | Path, keep: int):
        self.directory = Path(directory).absolute()
        self.manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True,
                                                 enable_async_checkpointing=False),
        )

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def steps(self) -> list[int]:
        """The saved steps, newest first."""
        return sorted(self.manager.all_steps(), reverse=True)

    def step_dir(self, step: int) -> Path:
        return self.directory / str(step)

    def save(self, step: int, state, meta: dict, *, wait: bool = True) -> None:
        """Saves step `step` (a step already saved is kept). A save that fails (a full
        disk, no permission, a file in the way) raises a one-line `RuntimeFault`; the
        checkpoints saved before are untouched."""
        if step in self.manager.all_steps():
            return
        try:
            self.manager.save(step, args=ocp.args.Composite(
                state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)))
            if wait:
                self.manager.wait_until_finished()
        except Exception as e:  # noqa: BLE001 - any failed write is the same fault for the user
            fix = _SAVE_FIXES.get(_errno_of(e), "check the disk and its permissions")
            previous = [s for s in self.steps() if s != step]
            kept = (f"step {previous[0]} is the last checkpoint saved" if previous
                    else "no checkpoint was saved")
            raise RuntimeFault(f"could not save the checkpoint of step {step} in "
                               f"{self.directory}: {_reason(e)} ({fix}; {kept})") from e

    def quarantine(self, step: int) -> Path:
        """Moves the damaged step directory to <workdir>/checkpoints.damaged/<step> (kept for
        inspection, out of Orbax's way) and forgets it; returns where it went."""
        src = self.step_dir(step)
        dest_root = self.directory.parent / DAMAGED_DIR
        dest_root.mkdir(parents=True, exist_ok=True)
        dest, n = dest_root / str(step), 1
        while os.path.lexists(dest):
            dest, n = dest_root / f"{step}.{n}", n + 1
        if os.path.lexists(src):
            os.replace(src, dest)
        self.manager.reload()
        return dest

    def restore(self, step: int, abstract_state):
        """Restores into the shardings/dtypes of `abstract_state` (ShapeDtypeStructs)."""
        restored = self.manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract_state), meta=ocp.args.JsonRestore()))
        return restored.state, restored.meta

    def restore_meta(self, step: int) -> dict:
        return self.manager.restore(step, args=ocp.args.Composite(
            meta=ocp.args.JsonRestore())).meta

    def close(self) -> None:
        try:
            self.manager.wait_until_finished()
        finally:
            self.manager.close()


def abstract_like(tree, shardings):
    return jax.tree_util.tree_map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)


def restore_partial(directory: str | Path, target, step: int | None = None):
    """The part of a saved train state that `target` (a pytree of ShapeDtypeStructs, e.g.
    `{"params": {"student": ...}}`) names, from the latest (or given) step; nothing else
    (no optimizer state) is read."""
    directory = Path(directory).absolute()
    if not directory.is_dir():
        raise InputError(f"{directory.parent} has no {directory.name}/ (train it first)")
    manager = ocp.CheckpointManager(directory)
    try:
        step = manager.latest_step() if step is None else step
        if step is None:
            raise InputError(f"{directory} holds no complete checkpoint")
        try:
            restored = manager.restore(step, args=ocp.args.Composite(
                state=ocp.args.PyTreeRestore(
                    item=target, restore_args=ocp.checkpoint_utils.construct_restore_args(target),
                    partial_restore=True)))
        except (ValueError, KeyError, TypeError, FileNotFoundError) as e:
            # Another model's shapes (config.json edited, or a checkpoint copied in), or a
            # damaged step: say which step directory, not orbax's traceback.
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise InputError(f"{directory / str(step)} cannot be restored into the model its "
                             f"config.json describes ({first[:200]}); check that config.json "
                             "belongs to this checkpoint") from e
    finally:
        manager.close()
    return restored.state
