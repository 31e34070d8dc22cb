"""An owner file: one job at a time may hold a directory (no jax).

Design notes: `docs/infrastructure.md`, under this file's name.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from hldstudy.errors import InputError, warn


class LockHeld(InputError):
    """The directory is owned by another job (exit code 2)."""


@dataclass(frozen=True)
class Owner:
    host: str
    pid: int
    started: str
    boot_id: str
    proc_start: str
    token: str

    def describe(self) -> str:
        return f"pid {self.pid} on host {self.host}, started {self.started}"


def _read_first(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


def _proc_start(pid: int) -> str:
    """The process's start time in clock ticks since boot (Linux), "" elsewhere: tells a
    live owner from a later process that reuses its pid."""
    stat = _read_first(f"/proc/{pid}/stat")
    if not stat:
        return ""
    # Field 22; the command name (field 2) may hold spaces, so count from its ")".
    fields = stat.rsplit(")", 1)[-1].split()
    return fields[19] if len(fields) > 19 else ""


def this_owner() -> Owner:
    return Owner(host=socket.gethostname(), pid=os.getpid(),
                 started=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                 boot_id=_read_first("/proc/sys/kernel/random/boot_id"),
                 proc_start=_proc_start(os.getpid()), token=uuid.uuid4().hex)


def read_owner(path: Path) -> Owner | None:
    """The record in the lock file; None when it is missing, empty or unreadable."""
    try:
        raw = json.loads(Path(path).read_text())
        return Owner(host=str(raw["host"]), pid=int(raw["pid"]), started=str(raw["started"]),
                     boot_id=str(raw.get("boot_id", "")),
                     proc_start=str(raw.get("proc_start", "")), token=str(raw["token"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def is_stale(owner: Owner) -> bool:
    """The owner ran on this host and is no longer running (see module doc)."""
    if owner.host != socket.gethostname():
        return False
    here_boot = _read_first("/proc/sys/kernel/random/boot_id")
    if owner.boot_id and here_boot and owner.boot_id != here_boot:
        return True
    try:
        os.kill(owner.pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # alive, another user's
        return False
    start = _proc_start(owner.pid)
    return bool(owner.proc_start and start and start != owner.proc_start)


def _create(path: Path, owner: Owner) -> bool:
    """Creates the lock file holding `owner`; False when it already exists."""
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return False
    os.close(fd)
    tmp = path.with_name(f".{path.name}.{owner.token}.tmp")
    try:
        with open(tmp, "w") as f:
            json.dump(owner.__dict__, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)  # the whole record appears at once
    except BaseException:
        tmp.unlink(missing_ok=True)
        path.unlink(missing_ok=True)
        raise
    return True


def _take_over(path: Path, stale: Owner) -> bool:
    """Moves the stale lock aside; True when it was still `stale` (then it is gone)."""
    aside = path.with_name(f".{path.name}.stale-{uuid.uuid4().hex}")
    try:
        os.rename(path, aside)
    except FileNotFoundError:
        return False  # another contender moved it first
    moved = read_owner(aside)
    if moved is not None and moved.token == stale.token:
        aside.unlink(missing_ok=True)
        return True
    # Not the stale record any more (a contender had already taken over): put it back.
    with contextlib.suppress(FileExistsError):
        os.link(aside, path)
    aside.unlink(missing_ok=True)
    return False


def acquire(path: str | Path, what: str, prog: str = "hldstudy") -> Owner:
    """Takes the lock file `path` (its directory must exist); `LockHeld` naming the owner
    and `what` when another live job holds it."""
    path = Path(path)
    me = this_owner()
    for _ in range(5):
        if _create(path, me):
            return me
        owner = read_owner(path)
        if owner is None:
            if not os.path.lexists(path):
                continue
            # Empty: being filled right now, or its creator died within that instant.
            time.sleep(0.2)
            owner = read_owner(path)
            if owner is None and os.path.lexists(path):
                raise LockHeld(f"{what} is locked by {path}, which names no owner "
                               f"(remove {path} if no job is using {what})")
            continue
        if not is_stale(owner):
            remote = owner.host != socket.gethostname()
            fix = (f"if that job is gone, remove {path}" if remote
                   else "wait for it to finish, stop it, or use another directory")
            raise LockHeld(f"{what} is in use by another job: {owner.describe()} ({fix})")
        if _take_over(path, owner):
            warn(f"took over the lock of {what} from {owner.describe()}, which is no "
                 "longer running", prog)
    raise LockHeld(f"{what}: could not take {path} (other jobs keep taking it)")


def release(path: str | Path, owner: Owner) -> None:
    """Removes the lock file if it is still `owner`'s (never another job's)."""
    path = Path(path)
    held = read_owner(path)
    if held is not None and held.token == owner.token:
        path.unlink(missing_ok=True)


@contextlib.contextmanager
def held(path: str | Path, what: str, prog: str = "hldstudy"):
    """`acquire` on entry, `release` on every exit (return, exception, Ctrl-C)."""
    owner = acquire(path, what, prog)
    try:
        yield owner
    finally:
        release(path, owner)
