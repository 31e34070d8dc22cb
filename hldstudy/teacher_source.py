"""What `teacher.checkpoint` names, parsed in one place: nothing, a local checkpoint (an
hldstudy run directory, a GGUF file, a Hugging Face directory) or served replicas
(`remote://host:port[,host:port...][?option=value&...]`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from urllib.parse import parse_qs

from hldstudy.errors import ConfigError

FIELD = "teacher.checkpoint"
SCHEME = "remote://"
# Where a run's teacher runs: inside the student's step (a local checkpoint), or on
# replicas that stream its outputs into the step (remote://).
LAYOUTS = ("colocated", "disaggregated")


def is_remote(spec: str | None) -> bool:
    """Whether `teacher.checkpoint` names replicas rather than a local path."""
    return bool(spec) and str(spec).startswith(SCHEME)


def layout_of(spec: str | None) -> str:
    """The layout (LAYOUTS) a `teacher.checkpoint` gives a run."""
    return "disaggregated" if is_remote(spec) else "colocated"


@dataclass(frozen=True)
class TeacherSource:
    """A parsed `teacher.checkpoint`: `local` (a path to load), `remote` (replica
    addresses and the options after `?`) or neither (no teacher)."""

    spec: str | None
    addresses: tuple[str, ...] = ()
    options: dict = field(default_factory=dict)

    @property
    def remote(self) -> bool:
        return is_remote(self.spec)

    @property
    def local(self) -> str | None:
        """The local checkpoint's path, or None (no teacher, or a remote one)."""
        return None if not self.spec or self.remote else self.spec


def parse(spec: str | None) -> TeacherSource:
    """ConfigError(teacher.checkpoint) for a remote address without a host:port list or
    with a port outside 1..65535."""
    if not is_remote(spec):
        return TeacherSource(spec or None)
    rest, _, query = spec[len(SCHEME):].partition("?")
    addrs = tuple(a.strip() for a in rest.split(",") if a.strip())
    if not addrs or any(":" not in a for a in addrs):
        raise ConfigError(FIELD, f"{spec!r} has no host:port list",
                          "write remote://host:port[,host:port...]")
    for addr in addrs:
        port = addr.rpartition(":")[2]
        if not (port.isdigit() and 1 <= int(port) <= 65535):
            raise ConfigError(FIELD, f"{addr!r}: port {port!r} is not 1..65535",
                              "write remote://host:port[,host:port...] with the ports the "
                              "replicas printed")
    return TeacherSource(spec, addrs, {k: v[-1] for k, v in parse_qs(query).items()})
