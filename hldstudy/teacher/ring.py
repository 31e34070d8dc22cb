"""The trainer-side prefetch ring of a disaggregated teacher.

Design notes: `docs/teacher.md`, under this file's name.
"""

from __future__ import annotations

import heapq
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from hldstudy.errors import HLDError

log = logging.getLogger(__name__)


class TeacherUnavailable(HLDError, RuntimeError):
    """No teacher replica answered for longer than teacher.timeout_s."""


class Session(Protocol):
    def request(self, step: int) -> None: ...

    def close(self) -> None: ...


class Link(Protocol):
    name: str

    def connect(self) -> None:
        """Handshake (raises when the replica is down or serves something else)."""

    def open(self, on_result: Callable[[int, str, Any], None],
             on_error: Callable[[BaseException], None]) -> Session: ...


@dataclass
class _Replica:
    link: Any
    live: bool = False
    gen: int = 0
    session: Any = None
    pending: set = field(default_factory=set)
    last_progress: float = 0.0
    next_rejoin: float = 0.0
    steps_served: int = 0
    failures: int = 0
    refused: str = ""
    # Whether its current stream has answered a step: a replica that rejoins (its handshake
    # answers) and then never answers is no proof that the teacher is there.
    answered: bool = False


@dataclass
class Delivered:
    step: int
    payload: Any
    replica: int
    digest: str
    stall_s: float


class PrefetchRing:
    def __init__(self, links: list, *, start: int, end: int, ring_size: int, timeout_s: float,
                 transform: Callable[[Any], Any] | None = None, rejoin_s: float = 0.5,
                 connected: list[bool] | None = None):
        if not links:
            raise ValueError("a ring needs at least one replica")
        self.start, self.end = start, end
        self.ring_size = max(0, int(ring_size))
        self.timeout_s = float(timeout_s)
        self.rejoin_s = rejoin_s
        self._transform = transform or (lambda x: x)
        self._cv = threading.Condition()
        self._reps = [_Replica(link) for link in links]
        self._next_issue = start
        self._horizon = min(end, start + self.ring_size)
        self._requeue: list[int] = []
        self._ready: dict[int, tuple] = {}
        self._expected = start
        self._closed = False
        self._fatal: BaseException | None = None
        self._last_answer = time.monotonic()
        self.stall_s = 0.0
        self.dropped = 0
        self.reassigned = 0
        connected = connected if connected is not None else [True] * len(links)
        with self._cv:
            for i, ok in enumerate(connected):
                if ok:
                    self._open(i)
            self._pump()
        self._threads = [threading.Thread(target=self._watch, name="ring-watch", daemon=True),
                         threading.Thread(target=self._rejoin, name="ring-rejoin", daemon=True)]
        for t in self._threads:
            t.start()

    # ---------------------------------------------------------------- state

    def _live(self) -> list[int]:
        return [i for i, r in enumerate(self._reps) if r.live]

    def _open(self, i: int) -> None:
        rep = self._reps[i]
        rep.gen += 1
        gen = rep.gen
        rep.pending = set()
        rep.live = True
        rep.answered = False
        rep.last_progress = time.monotonic()
        try:
            rep.session = rep.link.open(
                lambda step, digest, payload: self._on_result(i, gen, step, digest, payload),
                lambda exc: self._on_error(i, gen, exc))
        except Exception as exc:  # noqa: BLE001 - a replica that cannot open is down
            rep.session = None
            self._fail(i, gen, exc)

    def _owner(self, step: int) -> int | None:
        live = self._live()
        if not live:
            return None
        preferred = step % len(self._reps)
        return preferred if self._reps[preferred].live else live[step % len(live)]

    def _assign(self, step: int) -> bool:
        i = self._owner(step)
        if i is None:
            return False
        rep = self._reps[i]
        if not rep.pending:
            rep.last_progress = time.monotonic()
        rep.pending.add(step)
        try:
            rep.session.request(step)
        except Exception as exc:  # noqa: BLE001
            self._fail(i, rep.gen, exc)
        return True

    def _pump(self) -> None:
        """Issues requeued steps, then new ones up to the horizon (holding the lock)."""
        if self._closed:
            return
        while self._requeue and self._live():
            step = heapq.heappop(self._requeue)
            if not self._assign(step):
                heapq.heappush(self._requeue, step)
                break
        while self._next_issue < self._horizon and self._live():
            if not self._assign(self._next_issue):
                break
            self._next_issue += 1

    def _fail(self, i: int, gen: int, exc: BaseException | str) -> None:
        rep = self._reps[i]
        if rep.gen != gen or not rep.live:
            return
        rep.live = False
        rep.failures += 1
        rep.next_rejoin = time.monotonic() + self.rejoin_s
        lost = sorted(rep.pending)
        rep.pending = set()
        _close_session(rep)
        log.warning("teacher replica %s dropped (%s); reassigning steps %s",
                    getattr(rep.link, "name", i), exc, lost)
        for step in lost:
            heapq.heappush(self._requeue, step)
        self.reassigned += len(lost)
        if isinstance(exc, HLDError):
            self._fatal = exc
        self._pump()
        self._cv.notify_all()

    # ------------------------------------------------------------ callbacks

    def _on_result(self, i: int, gen: int, step: int, digest: str, payload: Any) -> None:
        try:
            payload = self._transform(payload)
        except Exception as exc:  # noqa: BLE001
            self._on_error(i, gen, exc)
            return
        with self._cv:
            rep = self._reps[i]
            if rep.gen != gen or not rep.live or step not in rep.pending:
                self.dropped += 1  # a late answer of a stream already given up on
                return
            rep.pending.discard(step)
            rep.answered = True
            self._last_answer = rep.last_progress = time.monotonic()
            rep.steps_served += 1
            self._ready[step] = (payload, i, digest)
            self._cv.notify_all()

    def _on_error(self, i: int, gen: int, exc: BaseException) -> None:
        with self._cv:
            self._fail(i, gen, exc)

    # -------------------------------------------------------------- threads

    def _watch(self) -> None:
        tick = max(0.005, min(0.05, self.timeout_s / 10))
        while True:
            with self._cv:
                if self._closed:
                    return
                now = time.monotonic()
                for i, rep in enumerate(self._reps):
                    if rep.live and rep.pending and now - rep.last_progress > self.timeout_s:
                        self._fail(i, rep.gen, f"no answer for {self.timeout_s:g} s")
                self._cv.wait(tick)

    def _rejoin(self) -> None:
        while True:
            with self._cv:
                if self._closed:
                    return
                now = time.monotonic()
                due = [i for i, r in enumerate(self._reps) if not r.live and now >= r.next_rejoin]
                if not due:
                    self._cv.wait(self.rejoin_s / 2)
                    continue
            for i in due:
                rep = self._reps[i]
                try:
                    rep.link.connect()
                except HLDError as exc:  # back, but serving something else: keep it out
                    if str(exc) != rep.refused:
                        log.warning("teacher replica %s refused on rejoin: %s",
                                    getattr(rep.link, "name", i), exc)
                    rep.refused = str(exc)
                    ok = False
                except Exception:  # noqa: BLE001 - still down
                    ok = False
                else:
                    ok = True
                with self._cv:
                    if self._closed:
                        return
                    if not ok:
                        rep.next_rejoin = time.monotonic() + self.rejoin_s
                        continue
                    log.warning("teacher replica %s rejoined", getattr(rep.link, "name", i))
                    self._open(i)
                    self._pump()
                    self._cv.notify_all()

    # -------------------------------------------------------------- trainer

    def get(self, step: int) -> Delivered:
        """The teacher outputs of `step` (the next one in order); blocks while its slot is empty."""
        with self._cv:
            if self._closed:
                raise RuntimeError("the prefetch ring is closed")
            if step != self._expected:
                raise RuntimeError(f"the trainer asked for step {step}, the ring serves "
                                   f"{self._expected} next (each step is consumed once, in order)")
            if not self.start <= step < self.end:
                raise RuntimeError(f"step {step} is outside the stream [{self.start}, {self.end})")
            self._horizon = min(self.end, max(self._horizon, step + 1 + self.ring_size))
            self._pump()
            t0 = time.perf_counter()
            waiting_since = time.monotonic()
            while step not in self._ready:
                if self._fatal is not None:
                    raise self._fatal
                # Given up after teacher.timeout_s without an answer while no replica whose
                # stream has answered is live: replicas that are down, and replicas that
                # rejoin and then hang, count alike (the second kind once kept a run
                # waiting, timeout after timeout, for minutes).
                now = time.monotonic()
                quiet = now - max(self._last_answer, waiting_since)
                if quiet > self.timeout_s and \
                        not any(self._reps[i].answered for i in self._live()):
                    names = ", ".join(str(getattr(r.link, "name", i))
                                      for i, r in enumerate(self._reps))
                    raise TeacherUnavailable(
                        f"teacher.checkpoint: no teacher replica ({names}) answered for "
                        f"{self.timeout_s:g} s (teacher.timeout_s); start them and resume")
                self._cv.wait(0.05)
            stall = time.perf_counter() - t0
            self.stall_s += stall
            payload, replica, digest = self._ready.pop(step)
            self._expected += 1
            self._pump()
            return Delivered(step, payload, replica, digest, stall)

    def status(self) -> dict:
        with self._cv:
            return {"live": [r.live for r in self._reps],
                    "served": [r.steps_served for r in self._reps],
                    "failures": [r.failures for r in self._reps],
                    "reassigned": self.reassigned, "dropped": self.dropped,
                    "stall_s": self.stall_s, "buffered": len(self._ready)}

    def close(self) -> None:
        with self._cv:
            if self._closed:
                return
            self._closed = True
            for rep in self._reps:
                _close_session(rep)
                rep.live = False
            self._ready.clear()
            self._cv.notify_all()


def _close_session(rep) -> None:
    """Closes a replica's stream if it has one; a broken stream may fail to close."""
    if rep.session is not None:
        try:
            rep.session.close()
        except Exception:  # noqa: BLE001
            pass
    rep.session = None
