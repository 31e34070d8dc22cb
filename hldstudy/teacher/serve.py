"""python -m hldstudy.teacher.serve --checkpoint TEACHER --config STUDENT [--layers final,9] --port P

Design notes: `docs/teacher.md`, under this file's name.
"""

from __future__ import annotations

import argparse
import errno
import hmac
import ipaddress
import json
import logging
import math
import os
import queue
import re
import signal
import socket
import sys
import threading
import time
from concurrent import futures
from pathlib import Path

import numpy as np

from hldstudy import teacher_source
from hldstudy.cli_common import EXPERIMENTS, find_builtin, quiet_libraries
from hldstudy.config import apply_overrides, load_experiment, read_config
from hldstudy.distill.base import make_strategy
from hldstudy.errors import ConfigError, HLDError, user_errors
from hldstudy.fileio import write_text_atomic
from hldstudy.teacher import protocol as proto
from hldstudy.teacher.base import stage_needs
from hldstudy.teacher.fanout import CohortSpec, MemberGone, StepWindow, parse_cohort
from hldstudy.teacher.replica import (
    Replica,
    check_dtype,
    format_layers,
    serves_problem,
)

# The command's --help text.
HELP = """python -m hldstudy.teacher.serve --checkpoint TEACHER --config STUDENT [--layers final,9] --port P

One teacher replica of a disaggregated run: it loads the teacher, rebuilds
the student's deterministic batch sequence (the student's data config, seed
and step numbering: `batch_at(step)`), runs the teacher's forward exactly as
the colocated teacher does (`ColocatedTeacher.forward_fn`, same params, same
compute dtype; in micro-batches of `teacher.replica_batch` sequences, by default the
largest that fits the device: `hldstudy.teacher.microbatch`) and streams the
requested hidden states over gRPC, never logits. The trainer
(`teacher.checkpoint=remote://host:port,...`) decides which steps each replica
computes; start one process per replica.

  --checkpoint   teacher: hldstudy run dir, .gguf or HF dir (default: the
                 student config's teacher.checkpoint)
  --config       the student's experiment file, config.json or run directory
  --layers       layers served: "final" and/or block indices, e.g. final,9
                 (default: every layer the student's method needs)
  --dtype        compute = stream dtype: float32, bfloat16 or float16
                 (default: the config's teacher.dtype)
  --host         address to bind (default 127.0.0.1); anything beyond loopback
                 needs --token-file
  --port         1..65535, or 0 to pick a free port; the bound address is
                 printed. A busy port is refused (no port sharing).
  --token-file   shared secret every call must carry (the trainer's
                 teacher.token_file); compared in constant time
  --tls-cert, --tls-key
                 serve over TLS (PEM); the trainer trusts it via teacher.tls_ca
  --max-streams  concurrent streams (default 8); more are refused with
                 RESOURCE_EXHAUSTED, so Info and Head always find a thread
  --idle-timeout-s
                 a stream that asks for no step (or does not read what it
                 asked for) this long is closed (default 300); a trainer
                 reconnects by itself
  --cohort       fan-out: the trainer processes this replica serves, each with
                 the layers it needs, e.g. "kd-1=final;hldc-1=final,3". Each
                 step is computed once for the union of the layers and every
                 member gets its part; a trainer names itself with
                 teacher.checkpoint=remote://host:port?member=kd-1
                 (hldstudy.teacher.fanout)
  --window       steps held for the cohort (default 4): the fastest member
                 runs at most this far ahead of the slowest
  --lag-timeout-s
                 a member that holds the window (or has not connected) this
                 long while others wait is detached; it is served later by
                 recomputing its steps alone (default 20; below the trainers'
                 teacher.timeout_s)

  --address-file once serving, HOST:PORT is written there (atomically): the
                 address trainers dial (this machine's name when --host binds
                 every interface); how a sweep finds the replicas it started
  --parent-pid   stop (exit 3) when that process is gone: a sweep's replicas
                 never outlive it, even when it is killed with SIGKILL

SIGTERM / SIGINT stop the replica (exit 128+N); a temporary --workdir is
removed on exit.
"""

log = logging.getLogger("hldstudy.teacher.serve")


_HOSTNAME = re.compile(r"(?=.{1,253}$)[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
                       r"(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*")


def check_host(host: str) -> bool:
    """Whether `host` (an IP address or a resolvable name) is loopback only;
    ConfigError(--host) when it is neither an address nor a name."""
    fix = "e.g. 127.0.0.1 (this machine only), ::1, 0.0.0.0 (every interface) or a host name"
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    if re.fullmatch(r"[0-9.]+", host or ""):
        raise ConfigError("--host", f"{host!r} is not a valid IPv4 address", fix)
    if not _HOSTNAME.fullmatch(host or ""):
        raise ConfigError("--host", f"{host!r} is not an IP address or a host name", fix)
    try:
        addrs = {ai[4][0] for ai in socket.getaddrinfo(host, None)}
    except (socket.gaierror, UnicodeError):
        raise ConfigError("--host", f"{host!r} does not resolve to an address", fix) from None
    return all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addrs)


def check_port(port) -> int:
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise ConfigError("--port", f"{port!r} is not a TCP port",
                          "give 1..65535, or 0 to pick a free one")
    return port


def _bind_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _probe_port(host: str, port: int) -> None:
    """Refuses a busy port in one line before gRPC tries it (gRPC logs its own failure)."""
    if port == 0:
        return
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror:
        return
    family, _, _, _, sockaddr = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(sockaddr)
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise ConfigError("--port", f"{host}:{port} is already in use (another replica?)",
                                  "pick another --port, or 0 for a free one") from None
            raise ConfigError("--host", f"cannot bind {host}:{port}: {e.strerror}",
                              "give an address of this machine") from None


class _Inbox:
    """A stream's requests, read on a thread into a bounded queue (backpressure: a client
    that sends faster than steps are served waits)."""

    END = object()

    def __init__(self, request_iterator, context, maxsize: int):
        self._queue: queue.Queue = queue.Queue(maxsize=maxsize)
        self._done = threading.Event()
        self._context = context
        context.add_callback(self._done.set)
        threading.Thread(target=self._read, args=(request_iterator,), daemon=True,
                         name="teacher-credits").start()

    def _put(self, item) -> bool:
        while not self._done.is_set():
            try:
                self._queue.put(item, timeout=0.2)
                return True
            except queue.Full:
                continue
        return False

    def _read(self, request_iterator) -> None:
        try:
            for raw in request_iterator:
                if not self._put(raw):
                    return
        except Exception:  # noqa: BLE001 - the client went away
            pass
        self._put(self.END)

    def cancelled(self) -> bool:
        return self._done.is_set() or not self._context.is_active()

    def next(self, wait_s: float):
        """The next request; END when the stream is over; None after `wait_s` idle."""
        t0 = time.monotonic()
        while True:
            try:
                return self._queue.get(timeout=min(0.25, wait_s))
            except queue.Empty:
                if self.cancelled():
                    return self.END
                if time.monotonic() - t0 > wait_s:
                    return None


def _invalid(context, problem: str):
    import grpc

    context.abort(grpc.StatusCode.INVALID_ARGUMENT, problem)


def _decode(context, raw) -> dict:
    try:
        return proto.decode(raw)[0]
    except proto.ProtocolError as e:
        _invalid(context, str(e))


# Counters that say where something stands now, not how often it happened: a restarted
# replica's are its own (peaks: the larger of its runs').
_GAUGES = {"window", "held", "attached", "connected"}
_PEAKS = {"peak", "peak_bytes"}


def merge_counters(earlier: dict, now: dict) -> dict:
    """`now` with every count of `earlier` (a previous run's) added, nested dicts key by
    key; gauges are `now`'s, peaks the larger."""
    out = dict(now)
    for key, old in earlier.items():
        new = now.get(key)
        if isinstance(old, dict):
            out[key] = merge_counters(old, new if isinstance(new, dict) else {})
        elif isinstance(old, bool) or not isinstance(old, (int, float)) or key in _GAUGES:
            out.setdefault(key, old)
        elif key in _PEAKS:
            out[key] = max(old, new or 0)
        else:
            out[key] = old + (new or 0)
    return out


class TeacherServer:
    """The transport of a teacher replica (`hldstudy.teacher.replica.Replica`): a gRPC
    service with auth, bounded streams, deadlines and a cohort's step window. `start()`
    binds, `stop()` ends."""

    def __init__(self, cfg, checkpoint: str, *, layers: str | None = None,
                 dtype: str | None = None, step: int | None = None,
                 workdir: str | Path | None = None, cohort: str | CohortSpec | None = None,
                 window: int = 4, lag_s: float = 20.0):
        # The served layers are checked before anything is made (the replica's data cache),
        # each against the flag it came from.
        cohort = parse_cohort(cohort) if isinstance(cohort, str) else cohort
        if cohort is not None and layers:
            raise ConfigError("--layers", "a cohort replica serves the union of its members' "
                              "layers (--cohort)", "drop --layers")
        self.replica = Replica(cfg, checkpoint, layers=cohort.union if cohort else layers,
                               flag="--cohort" if cohort is not None else "--layers",
                               dtype=dtype, step=step, workdir=workdir)
        self._init_service()
        self._carry_counters(workdir)
        self.set_cohort(cohort, window, lag_s)

    def __getattr__(self, name: str):
        # What the replica knows (its model, data, served layers, fingerprint) is asked of it.
        if name.startswith("_") or name == "replica":
            raise AttributeError(name)
        return getattr(self.replica, name)

    def _init_service(self) -> None:
        self._stats_lock = threading.Lock()
        # forwards: teacher forwards run for streams (a cohort's shared ones included once)
        self.stats = {"steps": 0, "payload_bytes": 0, "frame_bytes": 0, "head_bytes": 0,
                      "streams": 0, "refused": 0, "closed_idle": 0, "forwards": 0}
        self.cohort: CohortSpec | None = None
        self.window: StepWindow | None = None
        self._server = None
        self.port = None
        self._token: bytes | None = None
        self._stopped = threading.Event()
        self._sending: dict[int, list] = {}  # id(context) -> [context, send started at]
        self._sending_lock = threading.Lock()

    def set_cohort(self, cohort: CohortSpec | None, window: int = 4,
                   lag_s: float = 20.0) -> None:
        """Serves `cohort` (None: every stream computes its own steps) through a window of
        `window` steps; every member's layers must be among the served ones."""
        if cohort is None:
            self.cohort, self.window = None, None
            return
        for member, (final, layers) in cohort.members.items():
            if (final and not self.final) or not set(layers) <= set(self.layers):
                raise ConfigError("--cohort", f"member {member} needs layers "
                                  f"{format_layers(final, layers)}, this replica serves "
                                  f"{format_layers(self.final, self.layers)}")
        final, layers = self.final, self.layers
        self.cohort = cohort
        self.window = StepWindow(cohort.members, window, lag_s,
                                 lambda step: self.compute(step, final, layers),
                                 nbytes=lambda out: sum(a.nbytes for _, a in out[1]))

    # ------------------------------------------------------------- the replica

    def info(self) -> dict:
        return {**self.replica.info(), **self._cohort_info()}

    def _cohort_info(self) -> dict:
        if self.cohort is None:
            return {}
        return {"cohort": {"members": sorted(self.cohort.members), "window": self.window.window,
                           "lag_timeout_s": self.window.lag_s}}

    def compute(self, step: int, final: bool, layers: tuple[int, ...]):
        return self.replica.compute(step, final, layers)

    def replayed_batches(self) -> int:
        """Batches read only to reach a requested one (0 when every stream brought its
        cursor)."""
        return int(self.replica.data.train.replayed)

    def seek(self, data_cursor: dict) -> None:
        self.replica.data.train.restore(data_cursor)

    def head(self) -> np.ndarray:
        return self.replica.head()

    # ------------------------------------------------------------- service

    MAX_HEADS = 2  # concurrent Head transfers
    CHUNK_BYTES = proto.CHUNK_BYTES
    MAX_CREDITS = 256  # requested, not yet computed steps per stream (more wait: backpressure)

    def _authorize(self, context) -> None:
        """Every call carries the shared secret when the replica has one (constant-time)."""
        if self._token is None:
            return
        got = next((v for k, v in (context.invocation_metadata() or ())
                    if k == proto.TOKEN_KEY), "")
        got = got.encode() if isinstance(got, str) else bytes(got)
        if not hmac.compare_digest(got, self._token):
            import grpc

            with self._stats_lock:
                self.stats["refused"] += 1
            context.abort(grpc.StatusCode.UNAUTHENTICATED,
                          "missing or wrong token (the trainer's teacher.token_file must hold "
                          "the replica's --token-file secret)")

    def _slot(self, sem: threading.Semaphore, context, what: str, limit: int):
        """Takes one of `limit` slots or refuses the call; returns its (idempotent) release."""
        import grpc

        if not sem.acquire(blocking=False):
            with self._stats_lock:
                self.stats["refused"] += 1
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                          f"this replica serves at most {limit} {what} at once; try another "
                          "replica or again later")
        lock, held = threading.Lock(), [True]

        def release():
            with lock:
                if held[0]:
                    held[0] = False
                    sem.release()

        context.add_callback(release)  # the call ended however it ended
        return release

    def _send(self, context, frame: bytes):
        """Yields one frame, watched: a send that does not complete (a client that stops
        reading) for idle_s cancels the call (`_watchdog`)."""
        key = id(context)
        with self._sending_lock:
            self._sending[key] = [context, time.monotonic()]
        try:
            yield frame
        finally:
            with self._sending_lock:
                self._sending.pop(key, None)

    def _watchdog(self) -> None:
        tick = max(0.05, min(1.0, self.idle_s / 4))
        while not self._stopped.wait(tick):
            now = time.monotonic()
            with self._sending_lock:
                stuck = [c for c, t0 in self._sending.values() if now - t0 > self.idle_s]
            for context in stuck:
                log.warning("closing a call whose client stopped reading for %g s", self.idle_s)
                with self._stats_lock:
                    self.stats["closed_idle"] += 1
                context.cancel()

    def _info(self, request: bytes, context) -> bytes:
        self._authorize(context)
        return proto.encode(self.info())

    def _stats(self, request: bytes, context) -> bytes:
        self._authorize(context)
        return proto.encode(self.counters())

    STATS_FILE = "replica_stats.json"

    def counters(self) -> dict:
        """This replica's counters, summed over every earlier run of a replica in the same
        work directory (a replica killed and restarted there keeps what it had counted:
        `STATS_FILE`, rewritten as each step is served); `incarnations` counts the runs."""
        with self._stats_lock:
            out = dict(self.stats)
        out["replayed_batches"] = self.replayed_batches()
        if self.window is not None:
            w = self.window.stats()
            out["forwards"] = w["forwards"]
            out["recomputed"] = w["recomputed"]
            out["cohort"] = w
        return merge_counters(getattr(self, "_carried", {}), {**out, "incarnations": 1})

    def _carry_counters(self, workdir: str | Path | None) -> None:
        """Reads the counters an earlier replica left in `workdir` (none: a fresh start)."""
        self._stats_path = None if workdir is None else Path(workdir) / self.STATS_FILE
        self._carried = {}
        if self._stats_path is not None and self._stats_path.exists():
            try:
                self._carried = json.loads(self._stats_path.read_text())
            except (OSError, ValueError):
                log.warning("%s is unreadable; counting from zero", self._stats_path)

    def _save_counters(self) -> None:
        if getattr(self, "_stats_path", None) is not None:
            write_text_atomic(self._stats_path, json.dumps(self.counters()) + "\n")

    def _head(self, request: bytes, context):
        self._authorize(context)
        release = self._slot(self._head_slots, context, "head transfers", self.MAX_HEADS)
        try:
            emb = np.ascontiguousarray(self.head())
            blob = memoryview(emb.reshape(-1).view(np.uint8))
            size = self.CHUNK_BYTES
            n = max(1, -(-len(blob) // size))
            for c in range(n):
                if not context.is_active():
                    return
                part = blob[c * size:(c + 1) * size]
                with self._stats_lock:
                    self.stats["head_bytes"] += len(part)
                yield from self._send(context, proto.encode(
                    {"chunk": c, "chunks": n, "shape": list(emb.shape), "dtype": str(emb.dtype),
                     "fingerprint": self.fingerprint}, part))
        finally:
            release()

    def check_open(self, spec: dict) -> str | None:
        """Why a stream request cannot be served (None if it can)."""
        problem = serves_problem(spec, self.fingerprint, self.checkpoint, self.dtype, self.final,
                                 self.layers)
        if problem:
            return problem
        want_final, want = bool(spec.get("final")), set(spec.get("layers", []))
        if self.cohort is not None:
            member = spec.get("member")
            ids = ", ".join(sorted(self.cohort.members))
            if member not in self.cohort.members:
                return (f"this replica serves the cohort {ids}; the trainer is "
                        f"{'no member' if member is None else repr(member)} (name it with "
                        "teacher.checkpoint=remote://...?member=ID)")
            if not self.cohort.covers(member, want_final, want):
                mf, ml = self.cohort.members[member]
                return (f"cohort member {member} was declared with layers "
                        f"{format_layers(mf, ml)}, its trainer wants "
                        f"{format_layers(want_final, want)}")
        return None

    def _stream(self, request_iterator, context):
        self._authorize(context)
        release = self._slot(self._stream_slots, context, "streams (--max-streams)",
                             self.max_streams)
        try:
            yield from self._serve_stream(request_iterator, context)
        finally:
            release()

    def _serve_stream(self, request_iterator, context):
        import grpc

        inbox = _Inbox(request_iterator, context, self.MAX_CREDITS)
        raw = self._next_request(inbox, context, self.open_s,
                                 f"no open request within {self.open_s:g} s; closed")
        if raw is _Inbox.END:
            return
        spec = _decode(context, raw).get("open")
        if not isinstance(spec, dict) or not isinstance(spec.get("layers", []), list) \
                or not all(proto.is_int(i) for i in spec.get("layers", [])) \
                or not isinstance(spec.get("final", False), bool):
            _invalid(context, "the first request must be {\"open\": {\"layers\": [int...], "
                     "\"final\": bool, ...}}")
        problem = self.check_open(spec)
        if problem:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, problem)
        if spec.get("data") is not None:
            try:  # the trainer's cursor of its first step: no step before it is replayed
                self.seek(spec["data"])
            except HLDError as e:
                context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        final, layers = bool(spec.get("final")), tuple(sorted(set(spec.get("layers", []))))
        with self._stats_lock:
            self.stats["streams"] += 1
        window, member, gen = self.window, spec.get("member"), 0
        if window is not None:
            start, stop_ = spec.get("start", 0), spec.get("end")
            if not proto.is_int(start) or start < 0 or not (
                    stop_ is None or (proto.is_int(stop_) and stop_ >= start)):
                _invalid(context, f"a cohort stream needs 0 <= start <= end, got {start!r}, "
                         f"{stop_!r}")
            gen = window.connect(member, start, math.inf if stop_ is None else stop_,
                                 bool(spec.get("last_stage", True)))
        try:
            yield from self._serve_steps(inbox, context, final, layers, member, gen)
        finally:
            if window is not None:
                window.disconnect(member, gen)

    def _next_request(self, inbox: _Inbox, context, wait_s: float, why: str):
        """The next request, `_Inbox.END` when the stream ended; closes an idle stream."""
        import grpc

        raw = inbox.next(wait_s)
        if raw is None:
            with self._stats_lock:
                self.stats["closed_idle"] += 1
            context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, why)
        return raw

    def _serve_steps(self, inbox: _Inbox, context, final: bool, layers: tuple, member, gen):
        """Answers each step request of an open stream with its frames."""
        idle = (f"no step requested for {self.idle_s:g} s; closed (--idle-timeout-s; "
                "a trainer reconnects by itself)")
        names = proto.tensor_names(layers, final)
        while True:
            raw = self._next_request(inbox, context, self.idle_s, idle)
            if raw is _Inbox.END:
                return
            step = _decode(context, raw).get("step")
            if not proto.is_int(step) or step < 0:
                _invalid(context, f"a step must be an integer >= 0, got {step!r}")
            try:
                if self.window is None:
                    digest, tensors = self.compute(step, final, layers)
                    with self._stats_lock:
                        self.stats["forwards"] += 1
                else:
                    (digest, union), _ = self.window.take(member, gen, step, inbox.cancelled)
                    union = dict(union)
                    tensors = [(n, union[n]) for n in names]
            except IndexError:
                _invalid(context, f"step {step} is beyond the end of the data this replica "
                         "serves")
            except MemberGone:
                return
            yield from self._frames(context, step, digest, tensors)

    def _frames(self, context, step: int, digest: str, tensors):
        """Sends one step's frames; the step is counted as its last frame is handed over (a
        client that has what it asked for may end the call before the generator resumes)."""
        total = sum(int(a.nbytes) for _, a in tensors)
        payload = frame_bytes = 0
        for frame, n in proto.step_frames(step, digest, tensors, self.CHUNK_BYTES):
            payload += n
            frame_bytes += len(frame)
            if payload == total:  # the last frame (an empty step has one empty frame)
                with self._stats_lock:
                    self.stats["steps"] += 1
                    self.stats["payload_bytes"] += payload
                    self.stats["frame_bytes"] += frame_bytes
                self._save_counters()
            yield from self._send(context, frame)

    def start(self, port: int = 0, host: str = "127.0.0.1", *, token: str | None = None,
              tls: tuple[bytes, bytes] | None = None, max_streams: int = 8,
              idle_s: float = 300.0, open_s: float = 10.0, workers: int | None = None) -> int:
        """Binds `host:port` (0: a free port) and serves; returns the port.

        token: the shared secret every call must carry (required beyond loopback);
        tls: (certificate chain PEM, private key PEM); max_streams: concurrent streams;
        idle_s: a stream with no request, or a send that does not move, this long is
        closed; open_s: the same for a stream's first (open) request.
        """
        import grpc

        check_port(port)
        loopback = check_host(host)
        if not loopback and not token:
            raise ConfigError("--token-file", f"--host {host} exposes the teacher's weights "
                              "and hidden states beyond this machine without a shared secret",
                              "pass --token-file FILE (the trainer's teacher.token_file), or "
                              "bind 127.0.0.1")
        if not loopback and not tls:
            log.warning("serving %s without TLS: the token and the hidden states cross the "
                        "network in clear (add --tls-cert/--tls-key)", host)
        if not (isinstance(max_streams, int) and max_streams >= 1):
            raise ConfigError("--max-streams", f"must be >= 1, got {max_streams!r}")
        for name, v in (("--idle-timeout-s", idle_s), ("open_s", open_s)):
            if not (isinstance(v, (int, float)) and 0 < v < float("inf")):
                raise ConfigError(name, f"must be a positive number of seconds, got {v!r}")
        self._token = token.encode() if token else None
        self.max_streams, self.idle_s, self.open_s = max_streams, float(idle_s), float(open_s)
        self._stream_slots = threading.Semaphore(max_streams)
        self._head_slots = threading.Semaphore(self.MAX_HEADS)
        # Long calls are capped by the slots, so a few threads stay for Info/Stats and
        # refusals; calls beyond maximum_concurrent_rpcs are refused, never queued forever.
        workers = workers or max_streams + self.MAX_HEADS + 4
        handlers = {
            proto.INFO: grpc.unary_unary_rpc_method_handler(self._info),
            proto.STATS: grpc.unary_unary_rpc_method_handler(self._stats),
            proto.HEAD: grpc.unary_stream_rpc_method_handler(self._head),
            proto.STREAM: grpc.stream_stream_rpc_method_handler(self._stream),
        }
        _probe_port(host, port)
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=workers),
                                   options=proto.SERVER_OPTIONS,
                                   maximum_concurrent_rpcs=4 * workers)
        self._server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(proto.SERVICE, handlers),))
        address = _bind_address(host, port)
        try:
            if tls:
                creds = grpc.ssl_server_credentials([(tls[1], tls[0])])
                self.port = self._server.add_secure_port(address, creds)
            else:
                self.port = self._server.add_insecure_port(address)
        except RuntimeError:
            self.port = 0
        if not self.port:
            raise ConfigError("--port", f"cannot bind {host}:{port} (in use, or not an "
                              "address of this machine)", "pick another --port, or 0")
        self._stopped.clear()
        threading.Thread(target=self._watchdog, daemon=True, name="teacher-watchdog").start()
        self._server.start()
        return self.port

    def warmup(self) -> None:
        """Compiles the forward of every layer set the student's stages ask for (and of the
        served set), so no first request runs into the trainer's teacher.timeout_s."""
        sets = {(self.final, self.layers)}
        try:
            strategy = make_strategy(self.cfg, self.cfg.model, self.model_cfg)
            for stage in strategy.stages():
                needs = stage_needs(strategy, stage, self.model_cfg)
                if (needs.final or needs.layers) and self.check_open(
                        {"final": needs.final, "layers": list(needs.layers)}) is None:
                    sets.add((needs.final, needs.layers))
        except Exception:  # noqa: BLE001 - a config the trainer will refuse anyway
            pass
        for final, layers in sorted(sets):
            self.compute(0, final, layers)

    def stop(self, grace: float | None = None) -> None:
        self._stopped.set()
        if self._server is not None:
            self._server.stop(grace).wait()

    def cleanup(self) -> None:
        """Removes the replica's temporary work directory (never one the user gave)."""
        if "replica" in self.__dict__:
            self.replica.cleanup()

    def wait(self, timeout: float | None = None) -> bool:
        """Blocks until the server stops (True) or `timeout` passes (False)."""
        return not self._server.wait_for_termination(timeout)


class SyntheticTeacherServer(TeacherServer):
    """Transport-only replica for benchmarks: serves fixed arrays of a given shape, no model.

    Same service and frames as a real replica (so the wire path is the same);
    `Info` describes the synthetic payload, which no trainer handshake accepts.
    """

    def __init__(self, shape: tuple[int, int, int], dtype: str = "bfloat16", n_layers: int = 1,
                 workdir: str | Path | None = None):
        self.dtype, self.checkpoint, self.fingerprint = dtype, "synthetic", "synthetic"
        self.final, self.layers = True, tuple(range(1, n_layers))
        rng = np.random.default_rng(0)
        self._array = rng.standard_normal(shape).astype(proto.np_dtype(dtype))
        self._lock = threading.Lock()
        self._init_service()
        self._carry_counters(workdir)

    def info(self) -> dict:
        return {"protocol": proto.PROTOCOL_VERSION, "fingerprint": self.fingerprint,
                "checkpoint": self.checkpoint, "dtype": self.dtype, "final": self.final,
                "layers": list(self.layers), "shape": list(self._array.shape),
                **self._cohort_info()}

    def replayed_batches(self) -> int:
        return 0  # no data: every step's arrays are the same

    def seek(self, data_cursor: dict) -> None:
        pass

    def compute(self, step: int, final: bool, layers: tuple[int, ...]):
        if step < 0:
            raise IndexError(step)
        tensors = ([("final", self._array)] if final else []) + \
            [(f"layer:{i}", self._array) for i in sorted(layers)]
        return f"synthetic{step}", tensors

    def head(self) -> np.ndarray:
        return self._array[0]


def load_student_config(spec: str, overrides: list[str]):
    path = Path(spec)
    if path.is_dir():
        cfg = read_config(path / "config.json")
    elif path.suffix == ".json":
        cfg = read_config(path)
    else:  # an experiment file, or a built-in one by name (as train and sweep accept)
        cfg = load_experiment(find_builtin(spec, EXPERIMENTS))
    return apply_overrides(cfg, overrides)


def dial_address(host: str, port: int) -> str:
    """The HOST:PORT a trainer dials: the bound host, or this machine's name when the
    replica binds every interface."""
    if host in ("0.0.0.0", "::", ""):
        host = socket.gethostname()
    return _bind_address(host, port)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's process: alive
        return True
    return True


def _raise_exit(signum, frame):
    """SIGTERM / SIGINT: unwind (the replica stops, its temporary directory goes), exit 128+N."""
    raise SystemExit(128 + signum)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m hldstudy.teacher.serve", description=HELP,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", default=None, help="teacher checkpoint (local path)")
    parser.add_argument("--step", type=int, default=None, help="checkpoint step of a run dir")
    parser.add_argument("--config", required=True,
                        help="the student's experiment file, config.json or run directory")
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        metavar="KEY=VALUE", help="override a field of the student config")
    parser.add_argument("--layers", default=None, help="served layers, e.g. final,9")
    parser.add_argument("--dtype", default=None,
                        help="compute/stream dtype: " + ", ".join(proto.STREAM_DTYPES))
    parser.add_argument("--port", type=int, default=0, help="1..65535, 0 = a free port")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--token-file", default=None,
                        help="shared secret every call must carry (needed beyond loopback)")
    parser.add_argument("--tls-cert", default=None, help="TLS certificate chain (PEM)")
    parser.add_argument("--tls-key", default=None, help="TLS private key (PEM)")
    parser.add_argument("--max-streams", type=int, default=8, help="concurrent streams")
    parser.add_argument("--idle-timeout-s", type=float, default=300.0,
                        help="close a stream idle this long")
    parser.add_argument("--cohort", default=None,
                        help='fan-out to trainer processes: "ID=LAYERS;ID=LAYERS..."')
    parser.add_argument("--window", type=int, default=4, help="steps held for the cohort")
    parser.add_argument("--lag-timeout-s", type=float, default=20.0,
                        help="detach a cohort member that holds the window this long")
    parser.add_argument("--workdir", default=None, help="data cache directory (default: temp)")
    parser.add_argument("--no-warmup", action="store_true", help="compile on the first request")
    parser.add_argument("--address-file", default=None,
                        help="write HOST:PORT here once serving")
    parser.add_argument("--parent-pid", type=int, default=None,
                        help="stop when this process is gone")
    parser.add_argument("--debug", action="store_true")
    return parser


def _checked_args(args, server_kwargs: dict) -> tuple[str | None, tuple | None, dict]:
    """(token, tls, server kwargs) from the command line, every flag checked before the
    teacher loads."""
    check_port(args.port)
    loopback = check_host(args.host)
    if args.dtype is not None:
        check_dtype(args.dtype)
    token = proto.read_token(args.token_file, "--token-file") if args.token_file \
        else None
    if not loopback and not token:
        raise ConfigError("--token-file", f"--host {args.host} exposes the teacher "
                          "beyond this machine without a shared secret",
                          "pass --token-file FILE (the trainer's teacher.token_file), "
                          "or bind 127.0.0.1")
    if bool(args.tls_cert) != bool(args.tls_key):
        raise ConfigError("--tls-cert" if not args.tls_cert else "--tls-key",
                          "TLS needs both --tls-cert and --tls-key")
    tls = (proto.read_pem(args.tls_cert, "--tls-cert", "certificate"),
           proto.read_pem(args.tls_key, "--tls-key", "private key")) \
        if args.tls_cert else None
    if args.max_streams < 1:
        raise ConfigError("--max-streams", f"must be >= 1, got {args.max_streams}")
    if not 0 < args.idle_timeout_s < float("inf"):
        raise ConfigError("--idle-timeout-s",
                          f"must be a positive number, got {args.idle_timeout_s}")
    cohort = parse_cohort(args.cohort) if args.cohort is not None else None
    if cohort is not None:
        if args.layers:
            raise ConfigError("--layers", "a cohort replica serves the union of its "
                              "members' layers (--cohort)", "drop --layers")
        if args.window < 1:
            raise ConfigError("--window", f"must be >= 1, got {args.window}")
        if not 0 < args.lag_timeout_s < float("inf"):
            raise ConfigError("--lag-timeout-s",
                              f"must be a positive number, got {args.lag_timeout_s}")
        if args.max_streams < len(cohort.members):
            raise ConfigError("--max-streams", f"{args.max_streams} streams cannot serve "
                              f"a cohort of {len(cohort.members)}",
                              f"pass --max-streams {2 * len(cohort.members)}")
        server_kwargs = {"cohort": cohort, "window": args.window,
                         "lag_s": args.lag_timeout_s, **server_kwargs}
    return token, tls, server_kwargs


def main(argv: list[str] | None = None, server_cls: type[TeacherServer] = TeacherServer,
         **server_kwargs) -> int:
    """The command line; `server_cls(cfg, checkpoint, ..., **server_kwargs)` is the replica
    (a subclass may change how it serves)."""
    args = _parser().parse_args(argv)
    quiet_libraries()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    server = None
    old = {sig: signal.signal(sig, _raise_exit) for sig in (signal.SIGTERM, signal.SIGINT)} \
        if threading.current_thread() is threading.main_thread() else {}
    try:
        with user_errors(args.debug, prog="hldstudy.teacher.serve"):
            token, tls, server_kwargs = _checked_args(args, server_kwargs)
            if args.port:
                _probe_port(args.host, args.port)
            cfg = load_student_config(args.config, args.overrides)
            checkpoint = args.checkpoint or cfg.teacher.checkpoint
            if not teacher_source.parse(checkpoint).local:
                raise ConfigError("--checkpoint", "no local teacher checkpoint given",
                                  "pass --checkpoint RUN_DIR (or a .gguf / HF directory)")
            server = server_cls(cfg, checkpoint, layers=args.layers, dtype=args.dtype,
                                step=args.step, workdir=args.workdir, **server_kwargs)
            if not args.no_warmup:
                server.warmup()
            port = server.start(args.port, args.host, token=token, tls=tls,
                                max_streams=args.max_streams, idle_s=args.idle_timeout_s)
        cohort_note = (f", cohort {','.join(sorted(server.cohort.members))} window "
                       f"{server.window.window}") if server.cohort is not None else ""
        micro = server.replica_batch(server.final, server.layers)
        batch = server.cfg.data.batch_size
        print(f"serving teacher {server.fingerprint} ({checkpoint}, {server.dtype}, layers "
              f"{format_layers(server.final, server.layers)}{cohort_note}, forward "
              f"{batch // micro} x {micro} sequences) on "
              f"{args.host}:{port}{' (TLS)' if tls else ''}", flush=True)
        if args.address_file:
            write_text_atomic(args.address_file, f"{dial_address(args.host, port)}\n")
        while not server.wait(0.5):
            if args.parent_pid is not None and not _alive(args.parent_pid):
                print(f"hldstudy.teacher.serve: its parent process {args.parent_pid} is gone; "
                      "stopping", file=sys.stderr, flush=True)
                return 3
        return 0
    finally:
        if server is not None:
            server.stop(0.5)
            server.cleanup()
        for sig, handler in old.items():
            signal.signal(sig, handler)


if __name__ == "__main__":
    sys.exit(main())
