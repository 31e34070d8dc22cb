"""The trainer side of a disaggregated teacher: `teacher.checkpoint=remote://h:p[,h:p...]`.

Design notes: `docs/teacher.md`, under this file's name.
"""

from __future__ import annotations

import json
import logging
import queue
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import jax
import numpy as np

from hldstudy import rundir, sharding, teacher_source
from hldstudy.config import Config, ModelConfig, config_from_dict
from hldstudy.data.tokenizer import mismatch as tokenizer_mismatch
from hldstudy.distill.base import Batch, Strategy, TeacherOutputs, make_strategy
from hldstudy.distill.methods import Stage
from hldstudy.errors import ConfigError, InputError
from hldstudy.fileio import read_jsonl, write_lines_atomic
from hldstudy.signals import Interrupted, StopSignals
from hldstudy.teacher import protocol as proto
from hldstudy.teacher.base import StageFeed, method_needs, stage_needs
from hldstudy.teacher.ring import PrefetchRing
from hldstudy.teacher_source import FIELD

log = logging.getLogger(__name__)
STEPS_LOG = "teacher_steps.log"


def parse_spec(spec: str) -> tuple[list[str], dict]:
    """`remote://h:p,h:p?fingerprint=abc` -> (["h:p", "h:p"], {"fingerprint": "abc"})."""
    source = teacher_source.parse(spec)
    if not source.remote:
        raise ConfigError(FIELD, f"{spec!r} is not a remote:// address")
    return list(source.addresses), dict(source.options)


class ReplicaDown(ConnectionError):
    pass


class ReplicaBusy(ReplicaDown):
    """The replica refused the call for now (RESOURCE_EXHAUSTED: all its slots are taken)."""


class StopRequested(Exception):
    """SIGTERM / SIGINT arrived while waiting for a replica."""

    def __init__(self, signum: int):
        self.signum = signum
        super().__init__(f"stopped by signal {signum}")


def stop_requested() -> int | None:
    """The signal the suite's stop flag (`hldstudy.signals.StopSignals`, e.g. the Trainer's)
    has recorded, if any: long waits check it, since the flag only records the signal."""
    for sig in (signal.SIGTERM, signal.SIGINT):
        owner = getattr(signal.getsignal(sig), "__self__", None)
        if isinstance(owner, StopSignals) and owner.signum is not None:
            return owner.signum
    return None


@dataclass(frozen=True)
class Security:
    """What every call carries: the shared secret (`teacher.token_file`) and, for TLS, the
    trusted root certificates (`teacher.tls_ca`)."""

    token: str | None = None
    root_certs: bytes | None = None

    @classmethod
    def from_config(cls, cfg: Config) -> Security:
        t = cfg.teacher
        token = proto.read_token(t.token_file, "teacher.token_file") \
            if getattr(t, "token_file", None) else None
        roots = proto.read_pem(t.tls_ca, "teacher.tls_ca", "certificate") \
            if getattr(t, "tls_ca", None) else None
        return cls(token, roots)

    @property
    def metadata(self) -> tuple:
        return proto.auth_metadata(self.token)

    def channel(self, address: str, options=()):
        import grpc

        options = proto.CHANNEL_OPTIONS + list(options)
        if self.root_certs is not None:
            return grpc.secure_channel(
                address, grpc.ssl_channel_credentials(root_certificates=self.root_certs), options)
        return grpc.insecure_channel(address, options)


NO_SECURITY = Security()


def _rpc_error(address: str, e) -> Exception:
    """A failed call as the trainer acts on it: a refused token or a refused request is the
    run's configuration (ConfigError, fatal); anything else means the replica is down."""
    import grpc

    code, details = e.code(), e.details()
    if code == grpc.StatusCode.UNAUTHENTICATED:
        return ConfigError("teacher.token_file", f"{address} refused the call: {details}",
                           "give the trainer the replica's --token-file secret")
    if code in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.INVALID_ARGUMENT):
        return ConfigError(FIELD, f"{address}: {details}")
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return ReplicaBusy(f"{address}: busy: {details}")
    return ReplicaDown(f"{address}: {code.name}: {details}")


class GrpcSession:
    """One bidirectional `Stream` call: requests are credits, answers are step frames
    (checked against `expect`, the tensors the handshake promised)."""

    def __init__(self, channel, open_spec: dict, on_result, on_error, *, metadata=(),
                 expect: list[dict] | None = None, address: str = ""):
        # Credits: the ring never has more than ring_size + 1 steps outstanding.
        self._q: queue.Queue = queue.Queue()
        self._q.put(proto.encode({"open": open_spec}))
        self._closed = False
        self._on_result, self._on_error = on_result, on_error
        self._expect, self._address = expect, address

        def requests():
            while True:
                item = self._q.get()
                if item is None:
                    return
                yield item

        self._call = channel.stream_stream(proto.method(proto.STREAM))(requests(),
                                                                       metadata=metadata)
        self._thread = threading.Thread(target=self._receive, daemon=True, name="teacher-recv")
        self._thread.start()

    def _receive(self):
        import grpc

        assembler = proto.StepAssembler(self._expect)
        try:
            for frame in self._call:
                header, payload = proto.decode(frame)
                done = assembler.add(header, payload)
                if done is not None:
                    self._on_result(*done)
            if not self._closed:
                self._on_error(ReplicaDown("the replica ended its stream"))
        except grpc.RpcError as e:
            if not self._closed:
                self._on_error(_rpc_error(self._address, e))
        except proto.ProtocolError as e:
            if not self._closed:
                self._call.cancel()
                self._on_error(ReplicaDown(f"{self._address} broke the protocol: {e}"))
        except Exception as e:  # noqa: BLE001
            if not self._closed:
                self._on_error(e)

    def request(self, step: int) -> None:
        self._q.put(proto.encode({"step": int(step)}))

    def close(self) -> None:
        self._closed = True
        self._q.put(None)
        self._call.cancel()


class GrpcLink:
    """One replica address: handshake (`Info`), head, stream sessions, stats."""

    def __init__(self, address: str, *, check=None, open_spec: dict | None = None,
                 timeout_s: float = 10.0, security: Security = NO_SECURITY,
                 expect: list[dict] | None = None):
        self.name = address
        self.address = address
        self.check = check  # info -> None, raises ConfigError on a mismatch
        self.open_spec = open_spec or {}
        self.timeout_s = timeout_s
        self.security = security
        self.expect = expect
        self._channel = None

    def _new_channel(self):
        if self._channel is not None:
            self._channel.close()
        self._channel = self.security.channel(self.address, [
            ("grpc.initial_reconnect_backoff_ms", 100), ("grpc.max_reconnect_backoff_ms", 500)])
        return self._channel

    def info(self) -> dict:
        import grpc

        channel = self._new_channel()
        try:
            reply = channel.unary_unary(proto.method(proto.INFO))(
                b"", timeout=self.timeout_s, metadata=self.security.metadata)
        except grpc.RpcError as e:
            raise _rpc_error(self.address, e) from None
        try:
            info = proto.decode(reply)[0]
        except proto.ProtocolError as e:
            raise ReplicaDown(f"{self.address}: {e}") from None
        for key in ("protocol", "fingerprint", "dtype", "model", "final", "layers",
                    "tokenizer", "data"):
            if key not in info:
                raise ReplicaDown(f"{self.address}: its Info has no {key!r}")
        return info

    def connect(self) -> None:
        info = self.info()
        if self.check is not None:
            self.check(self.address, info)

    def open(self, on_result, on_error) -> GrpcSession:
        if self._channel is None:
            self._new_channel()
        return GrpcSession(self._channel, self.open_spec, on_result, on_error,
                           metadata=self.security.metadata, expect=self.expect,
                           address=self.address)

    def head(self, shape, dtype: str, *, idle_s: float, stop=None) -> np.ndarray:
        """The head `[V, D]`, checked against `shape`/`dtype`. Each chunk must arrive within
        `idle_s` (no deadline for the whole transfer: a large head may take long); raises
        ReplicaDown on a failed, silent or malformed transfer, StopRequested when `stop()`
        reports a signal while waiting."""
        import grpc

        if self._channel is None:
            self._new_channel()
        call = self._channel.unary_stream(proto.method(proto.HEAD))(
            b"", metadata=self.security.metadata)
        inbox: queue.Queue = queue.Queue(maxsize=4)
        done = threading.Event()
        end = object()

        def pump():  # the blocking iteration, off the waiting thread
            try:
                for frame in call:
                    while not done.is_set():
                        try:
                            inbox.put(frame, timeout=0.1)
                            break
                        except queue.Full:
                            continue
                item = end
            except grpc.RpcError as e:
                item = e
            while not done.is_set():
                try:
                    inbox.put(item, timeout=0.1)
                    return
                except queue.Full:
                    continue

        threading.Thread(target=pump, daemon=True, name="teacher-head").start()
        assembler = proto.HeadAssembler(shape, dtype)
        last = time.monotonic()
        try:
            while True:
                try:
                    item = inbox.get(timeout=min(0.1, idle_s))
                except queue.Empty:
                    signum = stop() if stop is not None else None
                    if signum is not None:
                        raise StopRequested(signum) from None
                    if time.monotonic() - last > idle_s:
                        raise ReplicaDown(f"{self.address}: no chunk of the teacher's head for "
                                          f"{idle_s:g} s (teacher.timeout_s)") from None
                    continue
                if item is end:
                    raise ReplicaDown(f"{self.address}: the head ended early")
                if isinstance(item, grpc.RpcError):
                    raise _rpc_error(self.address, item)
                last = time.monotonic()
                try:
                    out = assembler.add(*proto.decode(item))
                except proto.ProtocolError as e:
                    raise ReplicaDown(f"{self.address} broke the protocol: {e}") from None
                if out is not None:
                    return out
        finally:
            done.set()
            call.cancel()

    def close(self) -> None:
        if self._channel is not None:
            self._channel.close()
            self._channel = None

    def stats(self) -> dict:
        import grpc

        channel = self.security.channel(self.address)
        try:
            return proto.decode(channel.unary_unary(proto.method(proto.STATS))(
                b"", timeout=self.timeout_s, metadata=self.security.metadata))[0]
        except grpc.RpcError as e:
            raise _rpc_error(self.address, e) from None
        finally:
            channel.close()


class RemoteFeeder:
    """One stage's `StageFeed`: the streamed hidden states of each step, over a ring."""

    def __init__(self, teacher: RemoteTeacher, final: bool, layers: tuple[int, ...], mesh,
                 embedding_VxD, last_stage: bool = True):
        self.teacher, self.final, self.layers, self.mesh = teacher, final, layers, mesh
        self.last_stage = last_stage
        self.embedding_VxD = embedding_VxD
        self.ring: PrefetchRing | None = None
        self.links: list[GrpcLink] = []
        self.workdir: Path | None = None
        self._log = None
        self.stall_s = 0.0
        self._stall_since_metrics = 0.0
        self.consumed: list[int] = []

    def begin(self, start: int, end: int, workdir: str | Path | None = None,
              data_cursor: dict | None = None) -> None:
        """Opens the streams for steps [start, end) (the loop calls it when a stage starts),
        handing each replica the data cursor of batch `start`: it never replays the stream."""
        self.close()
        t = self.teacher
        if workdir is not None:
            self.workdir = Path(workdir)
            t.check_run_record(self.workdir)
            path = self.workdir / STEPS_LOG
            # A resumed run retrains from `start`: keep each step once (a torn line is
            # reported and dropped), rewritten atomically.
            kept = [line for line, rec in read_jsonl(path) if rec.get("step", start) < start]
            write_lines_atomic(path, kept)
            self._log = open(path, "a")
        if self.final and self.embedding_VxD is None:
            try:  # the state is the checkpointed (or initial) one: a signal loses nothing
                emb_VxD = t.embedding(stop=stop_requested)
            except StopRequested as e:
                raise Interrupted(start, e.signum) from None
            self.embedding_VxD = t.place_embedding(emb_VxD, self.mesh)
        open_spec = {"final": self.final, "layers": list(self.layers), "dtype": t.dtype,
                     "fingerprint": t.fingerprint}
        if data_cursor is not None:
            open_spec["data"] = data_cursor
        if t.member is not None:
            open_spec.update(member=t.member, start=int(start), end=int(end),
                             last_stage=self.last_stage)
        links = [t.link(a, check=t.check_info, open_spec=open_spec,
                        expect=t.expected_tensors(self.final, self.layers))
                 for a in t.addresses]
        connected, why = [], []
        for link in links:
            try:
                link.connect()
                connected.append(True)
            except ConnectionError as e:
                connected.append(False)
                why.append(str(e))
        if not any(connected):
            raise ConfigError(FIELD, f"no teacher replica answers at {', '.join(t.addresses)} "
                              f"({'; '.join(why)})",
                              "start them with python -m hldstudy.teacher.serve")
        self.links = links
        self.ring = PrefetchRing(links, start=start, end=end, ring_size=t.ring_size,
                                 timeout_s=t.timeout_s, transform=self._place,
                                 connected=connected, rejoin_s=t.rejoin_s)

    def forward(self, t_in: dict, batch: Batch) -> TeacherOutputs:
        """Inside the student's step: the streamed states and the head as TeacherOutputs
        (the head is E^T in the teacher dtype, as `model.head_weight()` of the colocated
        teacher)."""
        return TeacherOutputs(final_hidden=t_in["final"], hidden=t_in["hidden"],
                              head_weight=t_in["embedding"].T if self.final else None)

    def _place(self, tensors: dict):
        """Host arrays -> device arrays sharded like the batch (runs on the receiver thread)."""

        def put(x_BxTxD):  # like the batch itself (each process keeps its devices' rows)
            if self.mesh is None:
                return jax.device_put(x_BxTxD)
            return sharding.put_batch({"x": x_BxTxD}, self.mesh)["x"]

        return {"final": put(tensors["final"]) if self.final else None,
                "hidden": {i: put(tensors[f"layer:{i}"]) for i in self.layers}}

    def inputs(self, step: int, batch: Batch) -> dict:
        """The step's streamed states: {"final", "hidden": {layer: [B, T, D]}, "embedding"}."""
        if self.ring is None:
            raise RuntimeError("RemoteFeeder.begin(start, end) was not called")
        got = self.ring.get(step)
        tokens = batch.get("tokens") if isinstance(batch, dict) else None
        if tokens is not None and getattr(tokens, "is_fully_addressable", True):
            digest = proto.batch_digest(np.asarray(tokens), np.asarray(batch["segment_ids"]))
            if digest != got.digest:
                raise ConfigError(
                    FIELD, f"replica {self.teacher.addresses[got.replica]} computed step {step} "
                    "on a different batch than the trainer's",
                    "start the replicas with the student's config (--config) and data")
        self.stall_s += got.stall_s
        self._stall_since_metrics += got.stall_s
        self.consumed.append(step)
        if self._log is not None:
            self._log.write(json.dumps({"step": step, "replica": got.replica,
                                        "stall_s": round(got.stall_s, 6)}) + "\n")
            self._log.flush()
        return {**got.payload, "embedding": self.embedding_VxD}

    def metrics(self) -> dict:
        """Stall since the last call (for the trainer's metrics record)."""
        out = {"teacher_stall_s": self._stall_since_metrics}
        self._stall_since_metrics = 0.0
        return out

    def close(self) -> None:
        if self.ring is not None:
            self.ring.close()
            self.ring = None
            for link in self.links:
                link.close()
        if self._log is not None:
            self._log.close()
            self._log = None


class RemoteTeacher:
    """A teacher served by replicas (`python -m hldstudy.teacher.serve`): implements the
    `Teacher` protocol over gRPC streams of hidden states."""

    rejoin_s = 0.5

    def __init__(self, cfg: Config, addresses: list[str], infos: dict[str, dict],
                 expected_fingerprint: str | None = None, security: Security | None = None,
                 member: str | None = None):
        self.cfg = cfg
        self.member = member
        self.security = security if security is not None else Security.from_config(cfg)
        self.addresses = addresses
        self.source = cfg.teacher.checkpoint
        self.dtype = cfg.teacher.dtype
        self.ring_size = cfg.teacher.ring_size
        self.timeout_s = cfg.teacher.timeout_s
        first = next(iter(infos.values()))
        self.reference = first
        self.fingerprint = first["fingerprint"]
        self.expected_fingerprint = expected_fingerprint
        self.model_cfg: ModelConfig = config_from_dict(first["model"], ModelConfig)
        self.tokenizer_info = first["tokenizer"]
        self._embedding = None
        self._feeders: list[RemoteFeeder] = []
        for addr, info in infos.items():
            self.check_info(addr, info)

    # ------------------------------------------------------------ handshake

    @classmethod
    def connect(cls, cfg: Config) -> RemoteTeacher:
        addresses, opts = parse_spec(cfg.teacher.checkpoint)
        security = Security.from_config(cfg)
        infos, down = {}, []
        for addr in addresses:
            link = GrpcLink(addr, timeout_s=min(cfg.teacher.timeout_s, 10.0), security=security)
            try:
                infos[addr] = link.info()
            except ReplicaDown as e:
                down.append(str(e))
            finally:
                link.close()
        if not infos:
            raise ConfigError(FIELD, f"no teacher replica answers at {', '.join(addresses)} "
                              f"({'; '.join(down)})",
                              "start them with python -m hldstudy.teacher.serve")
        if down:
            log.warning("teacher replicas are down (%s); they join when they answer",
                        "; ".join(down))
        teacher = cls(cfg, addresses, infos, opts.get("fingerprint"), security,
                      opts.get("member"))
        teacher._check_layers()
        return teacher

    def check_info(self, address: str, info: dict) -> None:
        """Raises ConfigError(teacher.checkpoint) when a replica serves something else."""
        cfg, ref = self.cfg, self.reference
        if info.get("protocol") != proto.PROTOCOL_VERSION:
            raise ConfigError(FIELD, f"{address} speaks protocol {info.get('protocol')}, "
                              f"this trainer {proto.PROTOCOL_VERSION}")
        if self.expected_fingerprint and not info["fingerprint"].startswith(
                self.expected_fingerprint):
            raise ConfigError(FIELD, f"{address} serves checkpoint {info['fingerprint']} "
                              f"({info['checkpoint']}), not {self.expected_fingerprint}",
                              "start the replica with the right --checkpoint")
        if info["fingerprint"] != ref["fingerprint"] or info["model"] != ref["model"]:
            raise ConfigError(FIELD, f"{address} serves checkpoint {info['fingerprint']} "
                              f"({info['checkpoint']}), other replicas serve {ref['fingerprint']} "
                              f"({ref['checkpoint']})", "every replica must serve one checkpoint")
        if info["dtype"] != cfg.teacher.dtype:
            raise ConfigError(FIELD, f"{address} computes in {info['dtype']}, the run asks for "
                              f"teacher.dtype={cfg.teacher.dtype}",
                              "restart the replica with --dtype or change teacher.dtype")
        if info["tokenizer"] != ref["tokenizer"]:
            raise ConfigError(FIELD, f"{address} uses tokenizer {info['tokenizer']}, other "
                              f"replicas {ref['tokenizer']}")
        data = info["data"]
        for key in ("seq_len", "batch_size", "seed"):
            mine = getattr(cfg.data, key)
            if data.get(key) != mine:
                raise ConfigError(FIELD, f"{address} serves data.{key}={data.get(key)}, the run "
                                  f"has data.{key}={mine}",
                                  "start the replica with the student's --config")
        mine = {k: v for k, v in data.items() if k != "stream_fingerprint"}
        expected = proto.data_identity(cfg.data, None)
        if mine != expected:
            diff = sorted(k for k in expected if expected[k] != mine.get(k))
            raise ConfigError(FIELD, f"{address} reproduces a different batch sequence "
                              f"(data.{', data.'.join(diff)} differ)",
                              "start the replica with the student's --config")
        if data.get("stream_fingerprint") != ref["data"].get("stream_fingerprint"):
            raise ConfigError(FIELD, f"{address} packs a different corpus than other replicas")
        if (info["final"], info["layers"]) != (ref["final"], ref["layers"]):
            raise ConfigError(FIELD, f"{address} serves layers "
                              f"{_fmt(info['final'], info['layers'])}, other replicas "
                              f"{_fmt(ref['final'], ref['layers'])}")
        self._check_cohort(address, info.get("cohort"), ref.get("cohort"))

    def _check_cohort(self, address: str, cohort, ref) -> None:
        if cohort != ref:
            raise ConfigError(FIELD, f"{address} serves the cohort {cohort}, other replicas "
                              f"{ref}", "start every replica with the same --cohort")
        if cohort is None:
            if self.member is not None:
                raise ConfigError(FIELD, f"?member={self.member} names a cohort member, but "
                                  f"{address} serves no cohort",
                                  "start the replicas with --cohort, or drop ?member=")
            return
        members = cohort.get("members") or []
        if self.member not in members:
            raise ConfigError(FIELD, f"{address} serves the cohort {', '.join(members)}; this "
                              f"run is {'no member' if self.member is None else repr(self.member)}",
                              "name the run's member: remote://host:port?member=ID")
        lag = cohort.get("lag_timeout_s")
        if isinstance(lag, (int, float)) and self.timeout_s <= lag:
            raise ConfigError("teacher.timeout_s", f"{self.timeout_s:g} s is not above the "
                              f"cohort's lag timeout ({lag:g} s at {address}): waiting for the "
                              "slowest member would look like a dead replica",
                              f"set teacher.timeout_s above {lag:g}")

    def _check_layers(self) -> None:
        needs = method_needs(make_strategy(self.cfg, self.cfg.model, self.model_cfg),
                             self.model_cfg)
        final, layers = needs.final, needs.layers
        ref = self.reference
        if (final and not ref["final"]) or not set(layers) <= set(ref["layers"]):
            raise ConfigError(FIELD, f"the replicas serve layers {_fmt(ref['final'], ref['layers'])}"
                              f", {self.cfg.distill.method} needs {_fmt(final, layers)}",
                              f"restart them with --layers {_fmt(final, layers)}")

    def check_tokenizer(self, student_tokenizer) -> None:
        tok = self.tokenizer_info
        differs = tokenizer_mismatch(student_tokenizer.vocab_size, student_tokenizer.fingerprint(),
                                     tok["vocab_size"], tok["fingerprint"])
        if differs:
            raise ConfigError(FIELD, f"the teacher replicas tokenize differently: {differs}",
                              "set data.tokenizer to the teacher's tokenizer file")

    def check_run_record(self, workdir: Path) -> None:
        """A resumed run must keep its teacher: records the fingerprint, refuses another."""
        path = workdir / "teacher_remote.json"
        if path.exists():
            try:
                old = json.loads(path.read_text())
            except ValueError:
                raise InputError(f"{path} is not readable JSON (damaged?); restore it or "
                                 "use a new --workdir") from None
            if old.get("fingerprint") != self.fingerprint:
                raise ConfigError(FIELD, f"{workdir} was trained with teacher "
                                  f"{old.get('fingerprint')} ({old.get('checkpoint')}), the "
                                  f"replicas serve {self.fingerprint}",
                                  "serve the original checkpoint or use a new --workdir")
            return
        rundir.write_json_atomic(path, {"fingerprint": self.fingerprint,
                                        "checkpoint": self.reference["checkpoint"],
                                        "model": self.reference["model"]})

    # --------------------------------------------------------------- stages

    def link(self, address: str, **kwargs) -> GrpcLink:
        """A link to one replica with this run's deadlines and credentials."""
        return GrpcLink(address, timeout_s=min(self.timeout_s, 10.0), security=self.security,
                        **kwargs)

    def expected_tensors(self, final: bool, layers) -> list[dict]:
        """What every step's first frame must announce: the handshake's `[B, T, D]` in
        teacher.dtype for each requested tensor (never the server's word for it)."""
        shape = [self.cfg.data.batch_size, self.cfg.data.seq_len, self.model_cfg.d_model]
        return proto.expected_tensors(proto.tensor_names(layers, final), shape, self.dtype)

    def embedding(self, stop=None) -> np.ndarray:
        """The teacher's head `[V, D]` (the tied embedding, or an untied head transposed) in
        the stream dtype (fetched once). A replica that fails, hangs (no chunk for
        teacher.timeout_s) or sends another layout is skipped for the next; when every replica is only busy (all its head slots taken, e.g. by the
        other runs of a sweep) the round is retried for up to teacher.timeout_s. `stop()`
        returning a signal ends the wait (StopRequested)."""
        if self._embedding is not None:
            return self._embedding
        shape = [self.model_cfg.vocab_size, self.model_cfg.d_model]
        deadline = time.monotonic() + self.timeout_s
        while True:
            why, busy = [], 0
            for addr in self.addresses:
                link = self.link(addr)
                try:
                    info = link.info()
                    self.check_info(addr, info)
                    self._embedding = link.head(shape, self.dtype, idle_s=self.timeout_s,
                                                stop=stop)
                    return self._embedding
                except ReplicaBusy as e:
                    busy += 1
                    why.append(str(e))
                except ConnectionError as e:
                    log.warning("teacher replica %s did not send the head (%s); trying the next",
                                addr, e)
                    why.append(str(e))
                finally:
                    link.close()
            if not busy or time.monotonic() > deadline:
                raise ConfigError(FIELD, "no replica sent the teacher's head "
                                  f"({'; '.join(why)})", "check the replicas' logs")
            for _ in range(10):  # 0.5 s, watching for a stop
                signum = stop() if stop is not None else None
                if signum is not None:
                    raise StopRequested(signum)
                time.sleep(0.05)

    @staticmethod
    def place_embedding(emb_VxD: np.ndarray, mesh):
        if mesh is None:
            return jax.device_put(emb_VxD)
        return jax.device_put(emb_VxD, sharding.tree_shardings(mesh, emb_VxD))

    def stage_feed(self, strategy: Strategy, stage: Stage, mesh) -> StageFeed:
        """The stage's feed; the head (stages that need it) is fetched when it begins."""
        needs = stage_needs(strategy, stage, self.model_cfg)
        self.close()
        stages = list(strategy.stages())
        feeder = RemoteFeeder(self, needs.final, needs.layers, mesh, None,
                              last_stage=not stages or stage == stages[-1])
        self._feeders.append(feeder)
        return feeder

    def close(self) -> None:
        for f in self._feeders:
            f.close()
        self._feeders = []

    def replica_stats(self) -> dict[str, dict]:
        out = {}
        for addr in self.addresses:
            try:
                out[addr] = GrpcLink(addr, timeout_s=5.0, security=self.security).stats()
            except Exception:  # noqa: BLE001
                out[addr] = None
        return out


def _fmt(final: bool, layers) -> str:
    return ",".join((["final"] if final else []) + [str(i) for i in sorted(layers)]) or "(none)"
