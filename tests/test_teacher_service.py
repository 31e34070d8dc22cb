"""The teacher service hardened: ports, deadlines, caps, idle streams, token, TLS, frames.

Replicas here are transport-only (`SyntheticTeacherServer` and the test doubles in
tests/helpers/service_doubles.py, no model), in-process on 127.0.0.1; the command-line
checks call `serve.main` in-process (they fail before any model loads) and one test
starts it as a subprocess. Every test has a timeout that fails it on a hang.
"""

from __future__ import annotations

import json
import os
import queue
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import numpy as np
import pytest
from helpers.service_doubles import BoundedDataServer, SlowSendServer, WrongLayoutServer

from hldstudy.errors import ConfigError
from hldstudy.teacher import protocol as proto
from hldstudy.teacher import serve
from hldstudy.teacher.remote import (
    GrpcLink,
    ReplicaBusy,
    ReplicaDown,
    Security,
    StopRequested,
)
from hldstudy.teacher.serve import SyntheticTeacherServer

pytestmark = pytest.mark.timeout(90)

SHAPE = (2, 4, 8)  # [B, T, D] of the synthetic replica; its head is [T, D] = [4, 8]
HEAD = ([4, 8], "float32")
EXPECT = proto.expected_tensors(["final"], list(SHAPE), "float32")


@pytest.fixture
def servers():
    """Starts transport-only replicas on loopback; stops them all at the end."""
    started = []

    def start(cls=SyntheticTeacherServer, *, init=None, attrs=None, **kwargs):
        server = cls(SHAPE, "float32", **(init or {}))
        for k, v in (attrs or {}).items():
            setattr(server, k, v)
        kwargs.setdefault("port", 0)
        server.start(host="127.0.0.1", **kwargs)
        started.append(server)
        return server

    yield start
    for s in started:
        s.stop(0)


def _addr(server) -> str:
    return f"127.0.0.1:{server.port}"


def _call(server, name, token=None, timeout=5.0, security=None):
    channel = (security or Security()).channel(_addr(server))
    try:
        return proto.decode(channel.unary_unary(proto.method(name))(
            b"", timeout=timeout, metadata=proto.auth_metadata(token)))[0]
    finally:
        channel.close()


class RawStream:
    """A client-side Stream call driven by hand (what a legitimate trainer or an idle
    attacker sends)."""

    def __init__(self, server, token=None):
        self.channel = grpc.insecure_channel(_addr(server), proto.CHANNEL_OPTIONS)
        self.q: queue.Queue = queue.Queue()

        def requests():
            while True:
                item = self.q.get()
                if item is None:
                    return
                yield item

        self.call = self.channel.stream_stream(proto.method(proto.STREAM))(
            requests(), metadata=proto.auth_metadata(token))

    def send(self, header: dict):
        self.q.put(proto.encode(header))

    def open(self):
        self.send({"open": {"final": True, "layers": [], "dtype": "float32"}})
        return self

    def first_step(self, step: int = 0):
        self.send({"step": step})
        asm = proto.StepAssembler(EXPECT)
        for frame in self.call:
            out = asm.add(*proto.decode(frame))
            if out is not None:
                return out
        raise AssertionError("the stream ended without a step")

    def status(self, timeout: float = 10.0):
        """Waits for the call to end; its status code and details."""
        deadline = time.monotonic() + timeout
        while not self.call.done() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert self.call.done(), "the server never closed the stream"
        return self.call.code(), self.call.details()

    def close(self):
        self.q.put(None)
        self.call.cancel()
        self.channel.close()


# --------------------------------------------------------------------------- #
# Port, host, dtype, token, TLS flags (the command line, before any model loads)
# --------------------------------------------------------------------------- #


def _main_fails(argv, capsys) -> str:
    with pytest.raises(SystemExit) as exc:
        serve.main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


@pytest.mark.parametrize("argv, says", [
    (["--port", "99999"], "--port: 99999 is not a TCP port"),
    (["--port", "-1"], "--port: -1 is not a TCP port"),
    (["--dtype", "int8"], "--dtype: a replica computes in float32, bfloat16, float16, not 'int8'"),
    (["--host", "256.1.1.1"], "--host: '256.1.1.1' is not a valid IPv4 address"),
    (["--host", "bad host!"], "--host: 'bad host!' is not an IP address or a host name"),
    (["--host", "0.0.0.0"], "--token-file: --host 0.0.0.0 exposes the teacher beyond"),
    (["--tls-cert", "c.pem"], "--tls-key: TLS needs both --tls-cert and --tls-key"),
    (["--max-streams", "0"], "--max-streams: must be >= 1"),
    (["--idle-timeout-s", "nan"], "--idle-timeout-s: must be a positive number"),
])
def test_bad_service_flags_are_refused_in_one_line(argv, says, capsys, tmp_path):
    err = _main_fails(["--config", str(tmp_path / "none.py"), *argv], capsys)
    assert says in err


def test_bad_token_files_are_refused_in_one_line(capsys, tmp_path):
    cfg = str(tmp_path / "none.py")
    err = _main_fails(["--config", cfg, "--token-file", str(tmp_path / "missing")], capsys)
    assert "--token-file: cannot read the token file" in err
    (tmp_path / "empty").write_text("\n")
    err = _main_fails(["--config", cfg, "--token-file", str(tmp_path / "empty")], capsys)
    assert "--token-file: the token file" in err and "is empty" in err
    (tmp_path / "cert.pem").write_text("not a certificate")
    (tmp_path / "key.pem").write_text("not a key")
    err = _main_fails(["--config", cfg, "--tls-cert", str(tmp_path / "cert.pem"),
                       "--tls-key", str(tmp_path / "key.pem")], capsys)
    assert "--tls-cert:" in err and "is not a PEM certificate" in err


def test_busy_port_is_refused_and_not_shared(servers, capsys, tmp_path, monkeypatch):
    first = servers()
    with pytest.raises(ConfigError, match=r"--port: 127.0.0.1:\d+ is already in use"):
        SyntheticTeacherServer(SHAPE).start(first.port)
    err = _main_fails(["--config", str(tmp_path / "none.py"), "--port", str(first.port)], capsys)
    assert f"--port: 127.0.0.1:{first.port} is already in use (another replica?)" in err
    # gRPC's own bind fails too (so_reuseport off), should another process win the race.
    monkeypatch.setattr(serve, "_probe_port", lambda host, port: None)
    with pytest.raises(ConfigError, match="--port: cannot bind"):
        SyntheticTeacherServer(SHAPE).start(first.port)
    assert _call(first, proto.STATS)["streams"] == 0  # the first one still serves


def test_busy_port_from_the_command_line_exits_2_in_one_line(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        out = subprocess.run([sys.executable, "-m", "hldstudy.teacher.serve", "--config",
                              str(tmp_path / "none.py"), "--port", str(port)],
                             capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "already in use" in lines[0], out.stderr


def test_host_must_be_loopback_without_a_token():
    assert serve.check_host("127.0.0.1") and serve.check_host("::1")
    assert serve.check_host("localhost")
    assert not serve.check_host("0.0.0.0")
    with pytest.raises(ConfigError, match="--token-file: --host 0.0.0.0 exposes"):
        SyntheticTeacherServer(SHAPE).start(0, "0.0.0.0")


# --------------------------------------------------------------------------- #
# Token and TLS
# --------------------------------------------------------------------------- #


def test_every_call_needs_the_token(servers):
    server = servers(token="s3cret-token")
    for token in (None, "wrong", "s3cret-token-but-longer"):
        for name in (proto.INFO, proto.STATS):
            with pytest.raises(grpc.RpcError) as exc:
                _call(server, name, token)
            assert exc.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(ConfigError, match="teacher.token_file: .* refused the call"):
            GrpcLink(_addr(server), security=Security(token)).head(*HEAD, idle_s=5)
        stream = RawStream(server, token).open()
        code, details = stream.status()
        stream.close()
        assert code == grpc.StatusCode.UNAUTHENTICATED and "token" in details
    assert _call(server, proto.INFO, "s3cret-token")["fingerprint"] == "synthetic"
    head = GrpcLink(_addr(server), security=Security("s3cret-token")).head(*HEAD, idle_s=5)
    np.testing.assert_array_equal(head, server.head())
    stream = RawStream(server, "s3cret-token").open()
    assert stream.first_step(3)[0] == 3
    stream.close()
    assert _call(server, proto.STATS, "s3cret-token")["refused"] == 12


def _self_signed(tmp_path) -> tuple[Path, Path]:
    """A certificate for 127.0.0.1 / localhost, made with the openssl CLI (the `cryptography`
    package is not a dependency)."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed: no certificate to test TLS with")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    out = subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days",
                          "1", "-subj", "/CN=localhost", "-addext",
                          "subjectAltName=IP:127.0.0.1,DNS:localhost", "-keyout", str(key),
                          "-out", str(cert)], capture_output=True, text=True, timeout=60)
    if out.returncode != 0:
        pytest.skip(f"openssl cannot make a self-signed certificate: {out.stderr[-300:]}")
    return cert, key


def test_tls_with_a_self_signed_certificate(servers, tmp_path):
    cert, key = _self_signed(tmp_path)
    server = servers(tls=(cert.read_bytes(), key.read_bytes()), token="tok")
    secure = Security("tok", cert.read_bytes())
    assert _call(server, proto.STATS, "tok", security=secure)["streams"] == 0
    head = GrpcLink(_addr(server), security=secure).head(*HEAD, idle_s=5)
    np.testing.assert_array_equal(head, server.head())
    with pytest.raises(ReplicaDown, match="UNAVAILABLE"):  # plaintext to a TLS replica
        GrpcLink(_addr(server), security=Security("tok"), timeout_s=2).stats()
    (tmp_path / "other").mkdir()
    other_cert, _ = _self_signed(tmp_path / "other")
    with pytest.raises(ReplicaDown, match="UNAVAILABLE"):  # a root it does not chain to
        GrpcLink(_addr(server), security=Security("tok", other_cert.read_bytes()),
                 timeout_s=2).stats()


# --------------------------------------------------------------------------- #
# Deadlines: the head's idle deadline per chunk, a hung Head, a stop signal
# --------------------------------------------------------------------------- #


def test_slow_head_is_fine_and_hung_head_fails_within_its_idle_deadline(servers):
    # 8 chunks 0.15 s apart: 1.2 s in all, more than the 0.6 s idle deadline per chunk.
    slow = servers(SlowSendServer, init={"delay_s": 0.15, "chunk_bytes": 16})
    t0 = time.monotonic()
    head = GrpcLink(_addr(slow)).head(*HEAD, idle_s=0.6)
    assert time.monotonic() - t0 > 0.6
    np.testing.assert_array_equal(head, slow.head())
    hung = servers(SlowSendServer, init={"hang_after_frames": 2, "chunk_bytes": 16})
    t0 = time.monotonic()
    with pytest.raises(ReplicaDown, match="no chunk of the teacher's head for 0.5 s"):
        GrpcLink(_addr(hung)).head(*HEAD, idle_s=0.5)
    assert time.monotonic() - t0 < 5


def test_concurrent_heads_are_capped(servers):
    """Head transfers hold a slot each (MAX_HEADS): one more is refused as busy at once
    (the trainer retries busy replicas), not queued behind a thread."""
    slow = servers(SlowSendServer, init={"delay_s": 0.1, "chunk_bytes": 16},
                   attrs={"MAX_HEADS": 1})
    first = threading.Thread(target=GrpcLink(_addr(slow)).head, args=HEAD,
                             kwargs={"idle_s": 5})
    first.start()
    time.sleep(0.3)
    with pytest.raises(ReplicaBusy, match="at most 1 head transfers"):
        GrpcLink(_addr(slow)).head(*HEAD, idle_s=5)
    first.join(timeout=20)
    np.testing.assert_array_equal(GrpcLink(_addr(slow)).head(*HEAD, idle_s=5), slow.head())


def test_a_signal_ends_the_wait_for_a_hung_head(servers):
    from hldstudy.signals import StopSignals
    from hldstudy.teacher.remote import stop_requested

    hung = servers(SlowSendServer, init={"hang_after_frames": 0})
    timer = threading.Timer(0.3, os.kill, (os.getpid(), 15))
    t0 = time.monotonic()
    with StopSignals() as stop:
        timer.start()
        with pytest.raises(StopRequested):
            GrpcLink(_addr(hung)).head(*HEAD, idle_s=60, stop=stop_requested)
    timer.cancel()
    assert stop.signum == 15 and time.monotonic() - t0 < 5


# --------------------------------------------------------------------------- #
# Stream cap and idle streams
# --------------------------------------------------------------------------- #


def test_idle_streams_cannot_starve_the_replica(servers):
    """16 idle, unauthenticated streams used to take all 16 pool threads: now 2 hold the
    stream slots, the others are refused at once, Info still answers, and the idle ones are
    closed after the open timeout; then a legitimate trainer is served."""
    server = servers(max_streams=2, open_s=1.0, idle_s=1.0)
    idle = [RawStream(server) for _ in range(16)]
    try:
        time.sleep(0.3)
        t0 = time.monotonic()
        assert _call(server, proto.INFO, timeout=2)["fingerprint"] == "synthetic"
        assert time.monotonic() - t0 < 1
        refused = [s for s in idle if s.call.done()]
        assert len(refused) == 14
        assert {s.status()[0] for s in refused} == {grpc.StatusCode.RESOURCE_EXHAUSTED}
        assert "at most 2 streams" in refused[0].status()[1]
        legit = RawStream(server).open()  # refused while both slots are held: a clear status
        code, details = legit.status()
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "--max-streams" in details
        held = [s for s in idle if s not in refused]
        for s in held:
            code, details = s.status(timeout=5)
            assert code == grpc.StatusCode.DEADLINE_EXCEEDED and "no open request" in details
        legit = RawStream(server).open()
        assert legit.first_step(5)[0] == 5
        code, details = legit.status(timeout=5)  # asks for nothing more: closed when idle
        assert code == grpc.StatusCode.DEADLINE_EXCEEDED and "no step requested" in details
        assert _call(server, proto.STATS)["closed_idle"] == 3
    finally:
        for s in idle:
            s.close()


def test_a_client_that_stops_reading_is_closed(servers):
    """A stream asks for many steps and never reads them: once the transport's buffers are
    full its send stalls, and the watchdog closes it after the idle timeout."""
    server = servers(BoundedDataServer, init={"n_steps": 10_000}, max_streams=1, idle_s=1.0)
    server._array = np.zeros((64, 256, 256), np.float32)  # 16 MiB a step
    stuck = RawStream(server).open()
    for step in range(40):
        stuck.send({"step": step})
    deadline = time.monotonic() + 30
    while _call(server, proto.STATS)["closed_idle"] == 0 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _call(server, proto.STATS)["closed_idle"] == 1
    legit = RawStream(server).open()  # its slot is free again
    legit.send({"step": 7})
    assert proto.decode(next(iter(legit.call)))[0]["step"] == 7
    legit.close()
    with pytest.raises(grpc.RpcError) as exc:  # what it had buffered, then the cancellation
        for _ in stuck.call:
            pass
    stuck.close()
    assert exc.value.code() == grpc.StatusCode.CANCELLED


# --------------------------------------------------------------------------- #
# Requests the replica range-checks; frames the client checks
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("request_, says", [
    ({"step": -1}, "a step must be an integer >= 0, got -1"),
    ({"step": "3"}, "a step must be an integer >= 0, got '3'"),
    ({"step": True}, "a step must be an integer >= 0, got True"),
    ({"step": 1e300}, "a step must be an integer >= 0"),
    ({"step": 4}, "step 4 is beyond the end of the data"),
])
def test_requested_steps_are_range_checked(servers, request_, says):
    server = servers(BoundedDataServer, init={"n_steps": 4})
    stream = RawStream(server).open()
    stream.send(request_)
    code, details = stream.status()
    stream.close()
    assert code == grpc.StatusCode.INVALID_ARGUMENT and says in details


def test_malformed_open_requests_are_refused(servers):
    server = servers()
    for first in (b"\x00\x00", proto.encode({"step": 0}),
                  proto.encode({"open": {"layers": ["x"]}})):
        stream = RawStream(server)
        stream.q.put(first)
        code, _ = stream.status()
        stream.close()
        assert code == grpc.StatusCode.INVALID_ARGUMENT


def test_client_checks_every_frame_against_the_handshake(servers):
    wrong = servers(WrongLayoutServer)
    with pytest.raises(ReplicaDown, match="the handshake promised"):
        GrpcLink(_addr(wrong)).head(*HEAD, idle_s=5)  # float16 for float32
    errors: queue.Queue = queue.Queue()
    link = GrpcLink(_addr(wrong), open_spec={"final": True, "layers": [], "dtype": "float32"},
                    expect=EXPECT)
    session = link.open(lambda *a: errors.put(("result", a)), lambda e: errors.put(("error", e)))
    session.request(0)
    kind, err = errors.get(timeout=10)
    session.close()
    link.close()
    assert kind == "error" and isinstance(err, ReplicaDown)
    assert "broke the protocol" in str(err) and "[2, 4, 16]" in str(err)
    # The right layout passes, and nothing the header announces is allocated unchecked.
    asm = proto.StepAssembler(EXPECT)
    with pytest.raises(proto.ProtocolError):
        asm.add({"step": 0, "chunk": 0, "chunks": 1, "digest": "d",
                 "tensors": proto.expected_tensors(["final"], [1 << 40, 1 << 20, 8],
                                                   "float32")}, memoryview(b""))
    for bad in ({"step": 0, "chunk": 1, "chunks": 1}, {"step": 0, "chunk": 0, "chunks": 0},
                {"step": 0, "chunk": "0", "chunks": 1}):
        with pytest.raises(proto.ProtocolError):
            proto.StepAssembler(EXPECT).add(bad, memoryview(b""))
    for frame in (b"", b"\x00\x00\x00\xff{}", b"\x00\x00\x00\x02[]"):
        with pytest.raises(proto.ProtocolError):
            proto.decode(frame)


def test_a_restarted_replica_keeps_its_counters(tmp_path):
    """Counters live in the replica's work directory, rewritten as each step is served: a
    replica killed and started again there reports every step of both runs."""
    from hldstudy.teacher.serve import merge_counters

    def serve(steps):
        server = SyntheticTeacherServer(SHAPE, "float32", workdir=tmp_path)
        server.start(0)
        try:
            for step in steps:
                stream = RawStream(server).open()
                assert stream.first_step(step)[0] == step
                stream.close()
            return _call(server, proto.STATS)
        finally:
            server.stop(0)

    first = serve([0, 1, 2])
    assert first["steps"] == 3 and first["incarnations"] == 1
    # What a kill -9 leaves: the file of the last step served (nothing is written at stop).
    assert json.loads((tmp_path / "replica_stats.json").read_text())["steps"] == 3
    second = serve([3, 4])
    assert second["steps"] == 5 and second["incarnations"] == 2
    assert second["payload_bytes"] == 5 * first["payload_bytes"] // 3
    merged = merge_counters({"steps": 2, "peak": 7, "held": 1, "cohort": {"forwards": 3}},
                            {"steps": 1, "peak": 5, "held": 4, "cohort": {"forwards": 1}})
    assert merged == {"steps": 3, "peak": 7, "held": 4, "cohort": {"forwards": 4}}
