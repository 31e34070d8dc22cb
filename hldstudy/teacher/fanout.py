"""Fan-out: one teacher replica serves a cohort of trainer processes, one forward per step.

Design notes: `docs/teacher.md`, under this file's name.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hldstudy.errors import ConfigError

log = logging.getLogger(__name__)

_ID_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-")


@dataclass(frozen=True)
class CohortSpec:
    """The declared members: id -> (final hidden state needed, block layers needed)."""

    members: dict[str, tuple[bool, tuple[int, ...]]]

    @property
    def union(self) -> tuple[bool, tuple[int, ...]]:
        final = any(f for f, _ in self.members.values())
        layers = sorted({i for _, ls in self.members.values() for i in ls})
        return final, tuple(layers)

    def covers(self, member: str, final: bool, layers) -> bool:
        mf, ml = self.members[member]
        return (mf or not final) and set(layers) <= set(ml)


def parse_cohort(text: str, field_name: str = "--cohort") -> CohortSpec:
    """`"a=final;b=final,3"` -> CohortSpec; ConfigError(field_name) on anything else."""
    fix = "write ID=LAYERS;ID=LAYERS..., e.g. kd-1=final;hldc-1=final,9"
    members: dict[str, tuple[bool, tuple[int, ...]]] = {}
    for part in (p.strip() for p in (text or "").split(";") if p.strip()):
        ident, eq, spec = part.partition("=")
        ident = ident.strip()
        if not eq or not ident or not set(ident) <= _ID_CHARS or len(ident) > 64:
            raise ConfigError(field_name, f"{part!r} is not ID=LAYERS (ids: letters, digits, "
                              "'.', '_', '-')", fix)
        if ident in members:
            raise ConfigError(field_name, f"member {ident!r} is declared twice", fix)
        final, layers = False, []
        for tok in (t.strip() for t in spec.split(",") if t.strip()):
            if tok == "final":
                final = True
                continue
            try:
                layers.append(int(tok))
            except ValueError:
                raise ConfigError(field_name, f"member {ident!r}: {tok!r} is neither 'final' "
                                  "nor a layer index", fix) from None
        if not final and not layers:
            raise ConfigError(field_name, f"member {ident!r} needs no teacher layer", fix)
        members[ident] = (final, tuple(sorted(set(layers))))
    if not members:
        raise ConfigError(field_name, "the cohort declares no member", fix)
    return CohortSpec(members)


class MemberGone(Exception):
    """The asking stream ended while it waited (the trainer went away)."""


@dataclass
class _Member:
    attached: bool = True
    connected: bool = False
    gen: int = 0
    start: float = -math.inf  # unknown until it connects: holds every step
    end: float = math.inf
    last_stage: bool = True
    current: int | None = None  # the step it is taking
    next: int | None = None  # one past the last step it took
    taken: int = 0
    shared: int = 0
    recomputed: int = 0
    detached: int = 0
    why: str = ""

    def floor(self) -> float:
        if self.current is not None:
            return self.current
        if self.next is not None:
            return max(self.next, self.start)
        return self.start

    def holds(self, step: int) -> bool:
        # Before its last stage a member also holds the steps past the stage's end: its
        # next stage's stream (opened after this one closes) will ask for them.
        end = self.end if self.last_stage else math.inf
        return self.attached and self.floor() <= step < end


class StepWindow:
    """The shared, bounded window of computed steps of one replica (see the module doc).

    `compute(step)` runs one teacher forward for the union of the cohort's layers
    (it may raise, e.g. IndexError beyond the data: the asker gets the error).
    """

    def __init__(self, members, window: int, lag_s: float, compute: Callable[[int], Any], *,
                 clock: Callable[[], float] = time.monotonic, tick_s: float = 0.05,
                 nbytes: Callable[[Any], int] | None = None):
        if not (isinstance(window, int) and window >= 1):
            raise ConfigError("--window", f"must be an integer >= 1, got {window!r}",
                              "steps held for the cohort; 2..ring size + 2 is plenty")
        if not (isinstance(lag_s, (int, float)) and 0 < lag_s < math.inf):
            raise ConfigError("--lag-timeout-s", f"must be a positive number, got {lag_s!r}")
        self.window, self.lag_s, self._compute = window, float(lag_s), compute
        self._clock, self._tick = clock, tick_s
        self._nbytes = nbytes or (lambda payload: 0)
        self._members = {m: _Member() for m in members}
        if not self._members:
            raise ConfigError("--cohort", "the cohort declares no member")
        self._cv = threading.Condition()
        self._cache: dict[int, Any] = {}
        self._computing: set[int] = set()
        self.forwards = 0
        self.recomputed = 0
        self.detached = 0
        self.peak = 0
        self.peak_bytes = 0

    # ------------------------------------------------------------ streams

    def connect(self, member: str, start: int = 0, end: float = math.inf,
                last_stage: bool = True) -> int:
        """A member's stream opens for steps [start, end); returns its generation."""
        with self._cv:
            m = self._members[member]
            m.gen += 1
            m.connected, m.current = True, None
            m.start, m.end, m.last_stage = start, end, last_stage
            m.next = None  # its floor is its start until it takes a step
            self._evict()
            self._cv.notify_all()
            return m.gen

    def disconnect(self, member: str, gen: int) -> None:
        """The member's stream ended (however it ended)."""
        with self._cv:
            m = self._members[member]
            if m.gen != gen:
                return  # a newer stream of the member replaced this one
            m.connected, m.current = False, None
            if m.next is not None and m.next >= m.end and not m.last_stage:
                m.start, m.end = m.end, math.inf  # its next stage continues from here
            self._evict()
            self._cv.notify_all()

    # -------------------------------------------------------------- steps

    def take(self, member: str, gen: int, step: int,
             cancelled: Callable[[], bool] = lambda: False) -> tuple[Any, bool]:
        """The union payload of `step` for `member`: (payload, shared). Waits while the
        window is full (backpressure); raises MemberGone when `cancelled()` turns true."""
        with self._cv:
            m = self._members[member]
            m.current = step
            t0 = self._clock()
            try:
                while True:
                    if step in self._cache:
                        if not m.attached:
                            log.warning("cohort member %s is back in the window at step %d",
                                        member, step)
                        m.attached = True
                        payload, shared = self._cache[step], True
                        break
                    if step in self._computing:
                        self._wait(cancelled)
                        continue
                    passed = [k for k, o in self._members.items()
                              if k != member and o.attached and o.floor() > step]
                    if passed or (self._cache and step < max(self._cache)):
                        if passed and (not self._cache or step < min(self._cache)):
                            self._detach(m, member, f"asked for step {step}, which "
                                         f"{', '.join(sorted(passed))} already passed")
                        payload, shared = self._run(step, alone=True), False
                        break
                    self._evict()
                    if len(self._cache) + len(self._computing) < self.window:
                        m.attached = True
                        payload, shared = self._run(step, alone=False), True
                        break
                    if self._clock() - t0 > self.lag_s:
                        self._detach_laggards(member)
                        t0 = self._clock()
                        continue
                    self._wait(cancelled)
                m.taken += 1
                m.shared += shared
                m.recomputed += not shared
                m.next = step + 1
                return payload, shared
            finally:
                if m.gen == gen:
                    m.current = None
                self._evict()
                self._cv.notify_all()

    def _wait(self, cancelled) -> None:
        if cancelled():
            raise MemberGone()
        self._cv.wait(self._tick)

    def _run(self, step: int, *, alone: bool):
        """One forward, outside the lock; into the window unless `alone`."""
        if not alone:
            self._computing.add(step)
        self._cv.release()
        try:
            payload = self._compute(step)
        finally:
            self._cv.acquire()
            self._computing.discard(step)
            self._cv.notify_all()
        self.forwards += 1
        if alone:
            self.recomputed += 1
        else:
            self._cache[step] = payload
            self.peak = max(self.peak, len(self._cache))
            self.peak_bytes = max(self.peak_bytes,
                                  sum(self._nbytes(p) for p in self._cache.values()))
        return payload

    def _evict(self) -> None:
        for s in sorted(self._cache):
            if not any(m.holds(s) for m in self._members.values()):
                del self._cache[s]

    def _detach(self, m: _Member, member: str, why: str) -> None:
        if m.attached:
            m.attached = False
            m.detached += 1
            m.why = why
            self.detached += 1
            log.warning("cohort member %s detached from the window: %s (its steps behind the "
                        "window are recomputed for it alone)", member, why)

    def _detach_laggards(self, waiter: str) -> None:
        oldest = min(self._cache)
        for name, m in self._members.items():
            if name != waiter and m.holds(oldest):
                state = "has not connected" if m.gen == 0 else (
                    "is disconnected" if not m.connected else "is slow")
                self._detach(m, name, f"held step {oldest} for more than {self.lag_s:g} s "
                             f"(--lag-timeout-s); it {state}")
        self._evict()

    # -------------------------------------------------------------- stats

    def stats(self) -> dict:
        with self._cv:
            return {"window": self.window, "held": len(self._cache), "peak": self.peak,
                    "peak_bytes": self.peak_bytes,
                    "forwards": self.forwards, "recomputed": self.recomputed,
                    "detached": self.detached,
                    "members": {k: {"attached": m.attached, "connected": m.connected,
                                    "taken": m.taken, "shared": m.shared,
                                    "recomputed": m.recomputed, "detached": m.detached}
                                for k, m in self._members.items()}}

    def held(self) -> list[int]:
        with self._cv:
            return sorted(self._cache)
