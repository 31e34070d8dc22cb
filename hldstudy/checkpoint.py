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
import json
import logging
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace
from typing import Any, NamedTuple

import jax
import orbax.checkpoint as ocp

from hldstudy.errors import InputError, RuntimeFault, warn

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


def _root_reason(exc: BaseException) -> str:
    """`_reason` of the innermost cause (tensorstore's own words: which file, which byte
    range), not of the wrappers around it."""
    while exc.__cause__ is not None:
        exc = exc.__cause__
    return _reason(exc)


_OS_ERROR_CODE = re.compile(r"os_error_code='(\d+)'")


def _errno_of(exc: BaseException) -> int | None:
    """The OS error behind `exc`: an OSError in its chain, or the code tensorstore writes
    into its messages (`[os_error_code='28']`)."""
    while exc is not None:
        if isinstance(exc, OSError) and exc.errno:
            return exc.errno
        m = _OS_ERROR_CODE.search(str(exc))
        if m:
            return int(m.group(1))
        exc = exc.__cause__ or exc.__context__
    return None


def _save_reason(exc: BaseException, directory: Path) -> str:
    """One clause: the OS's words for the failure (and the space left, for a full disk)."""
    code = _errno_of(exc)
    if code is None:
        return _reason(exc)
    why = os.strerror(code)
    if code in (errno.ENOSPC, errno.EDQUOT):
        try:
            free = shutil.disk_usage(directory).free
            why += f" ({free / 2**20:.1f} MiB free there)"
        except OSError:
            pass
    return why


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


ORBAX_BOOKKEEPING = "_CHECKPOINT_METADATA"


TMP_SUFFIX = ".orbax-checkpoint-tmp"  # a step directory Orbax has not finished writing


class _OrbaxNoiseFilter(logging.Filter):
    """Orbax's own reports of what hldstudy reports in one line: its two-line error for an
    unreadable `_CHECKPOINT_METADATA` (`Checkpointer.check_bookkeeping`), and each of its
    writer threads' traceback of a failed save (`Checkpointer.save`)."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not (message.startswith("Failed to json parse Metadata file")
                    or "_SignalingThread.run() raised an exception" in message)


class Checkpointer:
    def __init__(self, directory: str | Path, keep: int):
        self.directory = Path(directory).absolute()
        self.check_bookkeeping()
        self.remove_unfinished()
        self.manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True,
                                                 enable_async_checkpointing=False),
        )

    def check_bookkeeping(self) -> None:
        """Says which step directories hold an unreadable `_CHECKPOINT_METADATA` (Orbax's
        record of save times, not part of the state: the step is still restored, from its
        state and meta items)."""
        absl_log = logging.getLogger("absl")
        if not any(isinstance(f, _OrbaxNoiseFilter) for f in absl_log.filters):
            absl_log.addFilter(_OrbaxNoiseFilter())
        asyncio_log = logging.getLogger("asyncio")  # a failed save's abandoned writes
        if not any(isinstance(f, _AbandonedReadLogFilter) for f in asyncio_log.filters):
            asyncio_log.addFilter(_AbandonedReadLogFilter())
        if not self.directory.is_dir():
            return
        for path in sorted(self.directory.glob(f"*/{ORBAX_BOOKKEEPING}")):
            try:
                json.loads(path.read_text())
            except (OSError, ValueError) as e:
                warn(f"checkpoint {path.parent}: Orbax's {ORBAX_BOOKKEEPING} is unreadable "
                     f"({_reason(e)}); it records only save times, so the step is restored "
                     "from its state and metadata without it", "hldstudy.train")

    def remove_unfinished(self) -> None:
        """Removes the step directories a save left unfinished (a crash, a full disk): never
        restored, they would only hold the space a new save needs. Process 0 removes."""
        if jax.process_index() != 0 or not self.directory.is_dir():
            return
        for path in sorted(self.directory.glob(f"*{TMP_SUFFIX}")):
            shutil.rmtree(path, ignore_errors=True)
            warn(f"removed {path}, a checkpoint whose save did not finish", "hldstudy.train")

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
        install_teardown_filter()  # a failing write reports from tensorstore's threads at once
        try:
            self.manager.save(step, args=ocp.args.Composite(
                state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)))
            if wait:
                self.manager.wait_until_finished()
        except Exception as e:  # noqa: BLE001 - any failed write is the same fault for the user
            install_teardown_filter()  # the writer threads' callbacks into a closed loop
            fix = _SAVE_FIXES.get(_errno_of(e), "check the disk and its permissions")
            for path in self.directory.glob(f"{step}{TMP_SUFFIX}*"):
                shutil.rmtree(path, ignore_errors=True)  # the half-written step
            previous = [s for s in self.steps() if s != step]
            kept = (f"step {previous[0]} is the last checkpoint saved" if previous
                    else "no checkpoint was saved")
            raise RuntimeFault(f"could not save the checkpoint of step {step} in "
                               f"{self.directory}: {_save_reason(e, self.directory)} ({fix}; "
                               f"{kept})") from e

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
        install_teardown_filter()
        restored = self.manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract_state), meta=ocp.args.JsonRestore()))
        return restored.state, restored.meta

    def restore_meta(self, step: int) -> dict:
        install_teardown_filter()
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


def _reads_damaged(exc: BaseException) -> bool:
    """A restore failure that says the files are damaged or missing (as opposed to a
    checkpoint of another model's shapes)."""
    text = f"{type(exc).__name__}: {exc}"
    shape_words = ("shape", "Shape", "dtype", "Requested shape", "not compatible")
    damage_words = ("OUT_OF_RANGE", "DATA_LOSS", "NOT_FOUND", "Error reading", "Error opening",
                    "was not found in the checkpoint", "No such file", "corrupt", "Corrupt",
                    "Encountered error while reading", "Invalid", "decod")
    if isinstance(exc, FileNotFoundError) or any(w in text for w in damage_words):
        return True
    return not any(w in text for w in shape_words)


class Restored(NamedTuple):
    """What `restore_partial` read: the state, its step, and the newer steps it skipped
    ({step: why})."""

    state: Any
    step: int
    skipped: dict[int, str]


def restore_partial(directory: str | Path, target, step: int | None = None,
                    prog: str = "hldstudy") -> Restored:
    """The part of a saved train state that `target` (a pytree of ShapeDtypeStructs, e.g.
    `{"params": {"student": ...}}`) names, from the given step, or from the newest step
    that restores; nothing else (no optimizer state) is read.

    The one restore path of every reader (eval, the served teacher, compress, the
    colocated teacher): a newest step whose files are damaged gets one warning naming it,
    and the previous step is restored instead (nothing is moved: a reader does not own
    the run directory). When no step restores, one `InputError` names each step and
    blames config.json only when the steps are intact but of another model's shapes."""
    directory = Path(directory).absolute()
    if not directory.is_dir():
        raise InputError(f"{directory.parent} has no {directory.name}/ (train it first)")
    install_teardown_filter()
    manager = ocp.CheckpointManager(directory)
    failures: dict[int, BaseException] = {}
    try:
        steps = sorted(manager.all_steps(), reverse=True) if step is None else [step]
        if not steps:
            raise InputError(f"{directory} holds no complete checkpoint")
        for candidate in steps:
            try:
                restored = manager.restore(candidate, args=ocp.args.Composite(
                    state=ocp.args.PyTreeRestore(
                        item=target,
                        restore_args=ocp.checkpoint_utils.construct_restore_args(target),
                        partial_restore=True)))
            except Exception as e:  # noqa: BLE001 - every failed read is reported below
                failures[candidate] = e
                if not _reads_damaged(e):
                    break  # another model's shapes: every older step is the same model
                continue
            for bad in failures:
                warn(f"checkpoint {directory / str(bad)} cannot be restored "
                     f"({_root_reason(failures[bad])}); using step {candidate} instead", prog)
            return Restored(restored.state, candidate,
                            {s: _root_reason(e) for s, e in failures.items()})
    finally:
        manager.close()
    listed = "; ".join(f"step {s}: {_root_reason(e)}" for s, e in failures.items())
    if not all(_reads_damaged(e) for e in failures.values()):
        raise InputError(f"{directory} cannot be restored into the model its config.json "
                         f"describes ({listed}); check that config.json belongs to this "
                         "checkpoint")
    raise InputError(f"no checkpoint in {directory} can be restored, its files are damaged "
                     f"or missing ({listed}); retrain, or copy the run back from a backup")


def _is_teardown_noise(unraisable) -> bool:
    """The abandoned reads of a restore that failed (the failure itself is reported by
    the caller): a read completing after Orbax closed its asyncio event loop
    (tensorstore's callback finds the loop closed), or a read coroutine of Orbax's
    collected with its own error never retrieved. They can arrive on tensorstore's
    threads before the failure reaches the caller, so the filter does not wait for it."""
    obj = getattr(unraisable, "object", None)
    code = getattr(obj, "cr_code", None)
    if code is not None and "orbax" in code.co_filename:
        return True
    if unraisable.exc_type is not RuntimeError or \
            str(unraisable.exc_value) != "Event loop is closed":
        return False
    tb = unraisable.exc_traceback
    while tb is not None:
        if tb.tb_frame.f_code.co_name == "call_soon_threadsafe":
            return True
        tb = tb.tb_next
    return False


class _AbandonedReadLogFilter(logging.Filter):
    """The same abandoned reads reported through the other channel: a failed read task of
    Orbax's that is garbage-collected with its error never retrieved makes asyncio log
    "Task exception was never retrieved" with the task's traceback (the logging path,
    not sys.unraisablehook, so the hook alone lets it through when the task is collected
    late); a failed save's writes (a full disk) log "_GatheringFuture exception was never
    retrieved" so. Only records naming Orbax are dropped: the save's failure is reported
    in one line (`Checkpointer.save`)."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not (message.startswith(("Task exception was never retrieved",
                                        "_GatheringFuture exception was never retrieved"))
                    and "orbax" in message)


def install_teardown_filter() -> None:
    """Keeps the teardown tracebacks of a failed restore ("RuntimeError: Event loop is
    closed", "Exception ignored in: <coroutine ...>", printed through sys.unraisablehook,
    and asyncio's logged "Task exception was never retrieved"; tens to hundreds of lines)
    off the terminal; every other unraisable exception and log record is printed as
    before. Installed before each restore; idempotent."""
    asyncio_log = logging.getLogger("asyncio")
    if not any(isinstance(f, _AbandonedReadLogFilter) for f in asyncio_log.filters):
        asyncio_log.addFilter(_AbandonedReadLogFilter())
    previous = sys.unraisablehook
    if getattr(previous, "_hldstudy_filter", False):
        return

    def hook(unraisable):
        if not _is_teardown_noise(unraisable):
            previous(unraisable)

    hook._hldstudy_filter = True
    sys.unraisablehook = hook
    previous_except = sys.excepthook

    def except_hook(exc_type, exc_value, tb):  # the same, printed through PyErr_Print
        noise = SimpleNamespace(exc_type=exc_type, exc_value=exc_value, exc_traceback=tb,
                                object=None)
        if not _is_teardown_noise(noise):
            previous_except(exc_type, exc_value, tb)

    sys.excepthook = except_hook
