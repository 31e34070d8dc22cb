"""Disaggregated teacher: gRPC replicas, the prefetch ring, faults, equality with colocated.

The ring tests drive `PrefetchRing` with in-process fake replicas (no JAX).
The end-to-end tests start real replicas (`python -m hldstudy.teacher.serve`
subprocesses on loopback) for the session's tiny teacher (tests/conftest.py),
and compare a remote run with the colocated one bitwise (float32 on CPU).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from helpers.runs import VOCAB, data_config, losses, student_config, teacher_steps

from hldstudy.config import DistillConfig, save_config
from hldstudy.errors import ConfigError
from hldstudy.model import preset
from hldstudy.teacher import protocol as proto
from hldstudy.teacher.remote import RemoteTeacher, parse_spec
from hldstudy.teacher.ring import PrefetchRing, TeacherUnavailable

# --------------------------------------------------------------------------- #
# Fake replicas for the ring
# --------------------------------------------------------------------------- #


class FakeLink:
    """A replica in-process: answers requested steps in order on a worker thread."""

    def __init__(self, name, *, fail_after=None, hang_after=None, delay=0.0, up=True):
        self.name, self.fail_after, self.hang_after, self.delay = name, fail_after, hang_after, delay
        self.up = up
        self.requests: list[int] = []
        self.answered: list[int] = []
        self.max_outstanding = 0
        self.lock = threading.Lock()
        self.sessions = []

    def connect(self):
        if not self.up:
            raise ConnectionError(f"{self.name} is down")

    def open(self, on_result, on_error):
        s = FakeSession(self, on_result, on_error)
        self.sessions.append(s)
        return s


class FakeSession:
    def __init__(self, link, on_result, on_error):
        import queue

        self.link, self.on_result, self.on_error = link, on_result, on_error
        self.q = queue.Queue()
        self.closed = False
        threading.Thread(target=self._work, daemon=True).start()

    def request(self, step):
        with self.link.lock:
            self.link.requests.append(step)
            out = len(self.link.requests) - len(self.link.answered)
            self.link.max_outstanding = max(self.link.max_outstanding, out)
        self.q.put(step)

    def _work(self):
        link = self.link
        while True:
            step = self.q.get()
            if step is None or self.closed:
                return
            if link.fail_after is not None and len(link.answered) >= link.fail_after:
                link.up = False
                self.on_error(ConnectionError("killed"))
                return
            if link.hang_after is not None and len(link.answered) >= link.hang_after:
                while not self.closed:
                    time.sleep(0.01)
                return
            time.sleep(link.delay)
            with link.lock:
                link.answered.append(step)
            self.on_result(step, f"d{step}", {"step": step, "by": link.name})

    def close(self):
        self.closed = True
        self.q.put(None)


def _drain(ring, start, end, pause=0.0):
    got = []
    for s in range(start, end):
        d = ring.get(s)
        assert d.payload["step"] == s
        got.append((s, d.payload["by"]))
        time.sleep(pause)
    return got


def test_ring_interleaves_steps_and_bounds_prefetch():
    links = [FakeLink("a"), FakeLink("b")]
    ring = PrefetchRing(links, start=10, end=30, ring_size=3, timeout_s=5)
    try:
        got = _drain(ring, 10, 30, pause=0.002)
    finally:
        ring.close()
    assert [by for _, by in got] == ["a", "b"] * 10  # replica r owns steps start+r, start+r+n, ...
    assert sorted(links[0].requests + links[1].requests) == list(range(10, 30))
    assert max(link.max_outstanding for link in links) <= 3  # backpressure: never past the ring


def test_ring_of_size_zero_is_synchronous():
    link = FakeLink("a")
    ring = PrefetchRing([link], start=0, end=5, ring_size=0, timeout_s=5)
    try:
        time.sleep(0.05)
        assert link.requests == []  # nothing asked before the trainer wants it
        ring.get(0)
        time.sleep(0.05)
        assert link.requests == [0]
        _drain(ring, 1, 5)
    finally:
        ring.close()
    assert link.max_outstanding == 1


def test_dead_replica_steps_are_reassigned_and_it_rejoins():
    a, b = FakeLink("a", delay=0.002), FakeLink("b", fail_after=2, delay=0.002)
    ring = PrefetchRing([a, b], start=0, end=60, ring_size=4, timeout_s=5, rejoin_s=0.05)
    try:
        got = _drain(ring, 0, 20)
        assert ring.status()["live"] == [True, False]
        b.fail_after, b.up = None, True  # restarted: the next handshake succeeds
        deadline = time.time() + 5
        while not ring.status()["live"][1] and time.time() < deadline:
            time.sleep(0.01)
        got += _drain(ring, 20, 60)
        status = ring.status()
    finally:
        ring.close()
    assert [s for s, _ in got] == list(range(60))  # every step once, in order
    assert status["live"] == [True, True] and status["failures"] == [0, 1]
    assert status["reassigned"] >= 1
    assert any(by == "b" for s, by in got if s >= 24)  # took its share again after rejoining


def test_stalled_replica_times_out_and_late_answers_are_dropped():
    a, b = FakeLink("a"), FakeLink("b", hang_after=1)
    ring = PrefetchRing([a, b], start=0, end=12, ring_size=2, timeout_s=0.2, rejoin_s=60)
    try:
        t0 = time.perf_counter()
        got = _drain(ring, 0, 12)
        elapsed = time.perf_counter() - t0
    finally:
        ring.close()
    assert [s for s, _ in got] == list(range(12))
    assert [by for s, by in got if s >= 3] == ["a"] * 9
    assert 0.2 <= elapsed < 3
    assert ring.stall_s >= 0.2  # the trainer waited out the timeout once


def test_no_replica_left_raises_after_the_timeout():
    ring = PrefetchRing([FakeLink("a", fail_after=0)], start=0, end=3, ring_size=1,
                        timeout_s=0.2, rejoin_s=0.05)
    try:
        with pytest.raises(TeacherUnavailable, match="teacher.timeout_s"):
            ring.get(0)
    finally:
        ring.close()


def test_out_of_order_consumption_is_refused():
    ring = PrefetchRing([FakeLink("a")], start=0, end=3, ring_size=1, timeout_s=1)
    try:
        ring.get(0)
        with pytest.raises(RuntimeError, match="consumed once"):
            ring.get(0)
    finally:
        ring.close()


def test_frames_roundtrip_in_chunks():
    import jax.numpy as jnp

    a = np.arange(3 * 5 * 7, dtype=np.float32).reshape(3, 5, 7)
    b = np.asarray(jnp.linspace(-3, 3, 2 * 5 * 7).reshape(2, 5, 7).astype(jnp.bfloat16))
    frames = list(proto.step_frames(9, "dd", [("final", a), ("layer:2", b)], chunk_bytes=64))
    assert len(frames) > 3 and sum(n for _, n in frames) == a.nbytes + b.nbytes
    asm = proto.StepAssembler()
    outs = [asm.add(*proto.decode(f)) for f, _ in frames]
    assert all(o is None for o in outs[:-1])
    step, digest, tensors = outs[-1]
    assert step == 9 and digest == "dd"
    np.testing.assert_array_equal(tensors["final"], a)
    assert tensors["layer:2"].dtype == b.dtype and (tensors["layer:2"] == b).all()


def test_remote_spec_parsing():
    assert parse_spec("remote://h:1,127.0.0.1:2?fingerprint=ab") == (
        ["h:1", "127.0.0.1:2"], {"fingerprint": "ab"})
    with pytest.raises(ConfigError, match="teacher.checkpoint"):
        parse_spec("remote://")


# --------------------------------------------------------------------------- #
# End to end: real replicas on loopback
# --------------------------------------------------------------------------- #


def _student(method, checkpoint, tokenizer, steps=5, **teacher):
    """These tests' student: 5 steps, one validation batch; `teacher` sets teacher fields."""
    return student_config(method, checkpoint, steps=steps, tokenizer=tokenizer,
                          train={"eval_batches": 1}, teacher_fields=teacher)


class Replica:
    """`python -m hldstudy.teacher.serve` in a subprocess."""

    def __init__(self, config, workdir, *args, port=0):
        self.args = [sys.executable, "-m", "hldstudy.teacher.serve", "--config", str(config),
                     "--workdir", str(workdir), *map(str, args)]
        self.log = Path(workdir).with_suffix(".log")
        self.port = port
        self.proc = None

    def start(self):
        Path(self.log).parent.mkdir(parents=True, exist_ok=True)
        err = open(self.log, "a")
        self.proc = subprocess.Popen(self.args + ["--port", str(self.port)],
                                     stdout=subprocess.PIPE, stderr=err, text=True)
        return self

    def ready(self):
        line = self.proc.stdout.readline()
        m = re.search(r"on \S+:(\d+)$", line.strip())
        if not m:
            self.proc.kill()
            raise RuntimeError(f"replica failed to start: {line!r}\n{self.log.read_text()[-3000:]}")
        self.port = int(m.group(1))
        return self

    @property
    def address(self):
        return f"127.0.0.1:{self.port}"

    def kill(self):
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()

    def stats(self):
        from hldstudy.teacher.remote import GrpcLink

        return GrpcLink(self.address).stats()


@pytest.fixture(scope="module")
def env(tmp_path_factory, teacher_dir, tokenizer_path):
    """The session's tiny teacher, the student config and two replicas serving it."""
    root = tmp_path_factory.mktemp("disagg")
    tok = tokenizer_path
    config = root / "student.json"
    save_config(_student("kd", str(teacher_dir), tok), config)
    # hldc aligns the student's middle layer with the teacher's layer 3.
    replicas = [Replica(config, root / f"replica{i}", "--layers", "final,3").start()
                for i in range(2)]
    try:  # not waited for here: they start while the colocated reference trains
        yield {"root": root, "teacher": str(teacher_dir), "tokenizer": tok, "config": config,
               "replicas": replicas}
    finally:
        for r in replicas:
            r.kill()


def _ready(env):
    for r in env["replicas"]:
        if not r.port:
            r.ready()


def _remote(env, replicas=None):
    _ready(env)
    return "remote://" + ",".join(r.address for r in (replicas or env["replicas"]))


_runs: dict = {}


def _run_pair(env, method):
    """(colocated losses, remote losses, remote workdir, bytes the replicas sent)."""
    from hldstudy.train.loop import Trainer

    if method in _runs:
        return _runs[method]
    root = env["root"] / method
    col = _student(method, env["teacher"], env["tokenizer"])
    Trainer(col, root / "colocated", devices=jax.devices()[:1]).run()
    _ready(env)
    before = [r.stats()["payload_bytes"] for r in env["replicas"]]
    rem = dataclasses.replace(col, teacher=dataclasses.replace(col.teacher,
                                                               checkpoint=_remote(env)))
    Trainer(rem, root / "remote", devices=jax.devices()[:1]).run()
    sent = sum(r.stats()["payload_bytes"] - b for r, b in zip(env["replicas"], before, strict=True))
    _runs[method] = (losses(root / "colocated"), losses(root / "remote"), root / "remote", sent)
    return _runs[method]


@pytest.mark.parametrize("method", ["kd", pytest.param("hldc", marks=pytest.mark.slow)])
def test_remote_teacher_matches_colocated_bitwise(env, method):
    col, rem, workdir, _ = _run_pair(env, method)
    assert sorted(rem) == [1, 2, 3, 4, 5]
    assert rem == col  # float32 on CPU: the same bits
    assert teacher_steps(workdir) == [0, 1, 2, 3, 4]
    records = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    assert all("teacher_stall_s" in r for r in records if "loss" in r)


@pytest.mark.slow
def test_remote_hldf_switches_streams_at_the_stage_boundary(env):
    """Stage 1 streams only teacher layer 3, stage 2 only the final hidden state."""
    from hldstudy.train.loop import Trainer

    col = _student("hldf", env["teacher"], env["tokenizer"])
    col = dataclasses.replace(col, distill=DistillConfig(method="hldf", hldf_stage1_share=0.4))
    rem = dataclasses.replace(col, teacher=dataclasses.replace(col.teacher,
                                                               checkpoint=_remote(env)))
    root = env["root"] / "hldf"
    Trainer(col, root / "colocated", devices=jax.devices()[:1]).run()
    Trainer(rem, root / "remote", devices=jax.devices()[:1]).run()
    assert losses(root / "remote") == losses(root / "colocated")
    assert teacher_steps(root / "remote") == [0, 1, 2, 3, 4]


@pytest.mark.parametrize("method", ["kd", pytest.param("hldc", marks=pytest.mark.slow)])
def test_planner_network_bytes_equal_bytes_sent(env, method):
    from hldstudy.plan import PlanInputs, PlanModel, network_bytes_per_step, plan

    _, _, _, sent = _run_pair(env, method)
    tmodel = preset("tiny-teacher", vocab_size=VOCAB)
    cfg = _student(method, env["teacher"], env["tokenizer"])
    extra = 1 if method == "hldc" else 0  # streamed: final hidden (+ the aligned layer)
    tokens = cfg.data.batch_size * cfg.data.seq_len
    planned = plan(PlanInputs(
        teacher=PlanModel.from_model_config(tmodel, "teacher"),
        student=PlanModel.from_model_config(cfg.model, "student"), tokens_per_step=tokens,
        devices=1, link_gbps=100, seq_len=cfg.data.seq_len, hidden_layers=extra,
        stream_dtype="float32"))["network_bytes_per_step"]
    assert planned == network_bytes_per_step(tokens, 1 + extra, tmodel.d_model, VOCAB, 4)
    assert sent == cfg.train.steps * planned["hidden"]  # tensor payload the replicas sent


def test_handshake_refuses_mismatches(env, tmp_path):
    tok = env["tokenizer"]
    remote = _remote(env)

    def connect(cfg):
        return RemoteTeacher.connect(cfg)

    connect(_student("kd", remote, tok))  # the matching config is accepted
    with pytest.raises(ConfigError, match=r"teacher.checkpoint: .*data.seq_len=64.*seq_len=32"):
        connect(dataclasses.replace(_student("kd", remote, tok),
                                    data=data_config(tok, seq_len=32)))
    with pytest.raises(ConfigError, match=r"teacher.checkpoint: .*computes in float32"):
        connect(_student("kd", remote, tok, dtype="bfloat16"))
    with pytest.raises(ConfigError, match=r"teacher.checkpoint: .*serve layers final,3.*needs"):
        connect(dataclasses.replace(_student("hldc", remote, tok), distill=DistillConfig(
            method="hldc", layer_pairs="2:5")))
    with pytest.raises(ConfigError, match=r"teacher.checkpoint: .*not 0000"):
        connect(_student("kd", remote + "?fingerprint=0000", tok))
    from hldstudy.data.synthetic import generate_documents
    from hldstudy.data.tokenizer import train_tokenizer

    other = train_tokenizer(generate_documents(300, seed=7)[::-1], VOCAB, tmp_path / "other")
    with pytest.raises(ConfigError, match=r"teacher.checkpoint: the teacher replicas tokenize differently: .* both have \d+ pieces but different ones"):
        connect(_student("kd", remote, tok)).check_tokenizer(other)


def test_replicas_serving_different_checkpoints_are_refused(env):
    from hldstudy.teacher.serve import TeacherServer, load_student_config

    cfg = load_student_config(str(env["config"]), [])
    older = TeacherServer(cfg, env["teacher"], step=4, layers="final,3",
                          workdir=env["root"] / "older")
    port = older.start(0)
    try:
        with pytest.raises(ConfigError, match=r"teacher.checkpoint: .* serves checkpoint"):
            RemoteTeacher.connect(_student(
                "kd", _remote(env) + f",127.0.0.1:{port}", env["tokenizer"]))
    finally:
        older.stop(0)


def test_killed_replica_mid_run(env):
    """SIGKILL one replica after step 1: its steps move to the other, every step trains once,
    and the losses still equal the colocated run's."""
    from hldstudy.teacher import remote as remote_mod
    from hldstudy.train.loop import Trainer

    col, _, _, _ = _run_pair(env, "kd")
    b = env["replicas"][1]
    workdir = env["root"] / "killed"
    # ring_size=1: step 3 (b's) is requested only after b is dead.
    cfg = _student("kd", _remote(env), env["tokenizer"], ring_size=1, timeout_s=5.0)
    original = remote_mod.RemoteFeeder.inputs

    def feed(self, step, batch):
        out = original(self, step, batch)
        if step == 1:
            b.kill()
        return out

    remote_mod.RemoteFeeder.inputs = feed
    try:
        Trainer(cfg, workdir, devices=jax.devices()[:1]).run()
    finally:
        remote_mod.RemoteFeeder.inputs = original
    assert b.proc.poll() is not None
    assert losses(workdir) == col
    log = [json.loads(line) for line in (workdir / "teacher_steps.log").read_text().splitlines()]
    assert [r["step"] for r in log] == [0, 1, 2, 3, 4]
    assert [r["replica"] for r in log] == [0, 1, 0, 0, 0]  # b's step 3 went to a


@pytest.mark.slow
def test_replica_that_dies_mid_stream(env):
    """A replica that exits when asked for its second step (a test double of the server,
    tests/helpers/faulty_server.py): its steps move to the other replica, every step trains
    once, and the losses still equal the colocated run's."""
    from hldstudy.train.loop import Trainer

    col, _, _, _ = _run_pair(env, "kd")
    _ready(env)
    a = env["replicas"][0]
    faulty = Replica(env["config"], env["root"] / "faulty", "--layers", "final,3",
                     "--exit-after-steps", 1)
    faulty.args[1:3] = [str(Path(__file__).parent / "helpers" / "faulty_server.py")]
    faulty.start().ready()
    try:
        workdir = env["root"] / "faulty_run"
        cfg = _student("kd", _remote(env, [a, faulty]), env["tokenizer"], ring_size=1,
                       timeout_s=5.0)
        Trainer(cfg, workdir, devices=jax.devices()[:1]).run()
        assert faulty.proc.wait(timeout=30) == 3
    finally:
        faulty.kill()
    assert losses(workdir) == col
    log = [json.loads(line) for line in (workdir / "teacher_steps.log").read_text().splitlines()]
    assert [r["step"] for r in log] == [0, 1, 2, 3, 4]
    assert [r["replica"] for r in log] == [0, 1, 0, 0, 0]  # its step 3 went to the other


@pytest.mark.slow
def test_restarted_replica_rejoins_a_live_stream(env):
    from hldstudy.distill.base import make_strategy

    _ready(env)
    b = env["replicas"][1]
    b.kill()
    restarted = Replica(env["config"], env["root"] / "replica1b", "--layers", "final,3",
                        port=b.port).start()
    cfg = _student("kd", _remote(env), env["tokenizer"], timeout_s=5.0)
    teacher = RemoteTeacher.connect(cfg)  # b is still starting: a alone answers
    teacher.rejoin_s = 0.1
    strategy = make_strategy(cfg, cfg.model, teacher.model_cfg)
    feeder = teacher.stage_feed(strategy, strategy.stages()[0], None)
    feeder.begin(0, 10_000)
    served, deadline = [], time.time() + 120
    try:
        while time.time() < deadline and 1 not in served[-4:]:
            served.append(feeder.ring.get(len(served)).replica)
            time.sleep(0.05)
    finally:
        feeder.close()
        env["replicas"][1] = restarted.ready()
    assert served.index(1) > 1  # down when the stream started: a served its step 1
    assert served[-2:] == [0, 1]  # back in the interleave


def test_resumed_run_restarts_the_stream_at_its_checkpoint(env):
    from hldstudy.train.loop import Interrupted, Trainer

    col, _, _, _ = _run_pair(env, "kd")
    workdir = env["root"] / "resumed"
    cfg = _student("kd", _remote(env), env["tokenizer"])
    with pytest.raises(Interrupted):
        Trainer(cfg, workdir, devices=jax.devices()[:1]).run(stop_at_step=3)
    Trainer(cfg, workdir, devices=jax.devices()[:1]).run()
    assert losses(workdir) == col
    assert teacher_steps(workdir) == [0, 1, 2, 3, 4]


_BF16_SCRIPT = """
import dataclasses, json, sys
import jax
sys.path.insert(0, {tests!r})
from helpers.runs import losses
from test_disagg import _student
from hldstudy.train.loop import Trainer
col = _student("hldc", {teacher!r}, {tok!r}, dtype="bfloat16")
rem = dataclasses.replace(col, teacher=dataclasses.replace(col.teacher, checkpoint={remote!r}))
Trainer(col, {root!r} + "/col", devices=jax.devices()[:1]).run()
Trainer(rem, {root!r} + "/rem", devices=jax.devices()[:1]).run()
print(json.dumps([losses({root!r} + "/col"), losses({root!r} + "/rem")]))
"""


@pytest.mark.slow
def test_bfloat16_stream_matches_colocated_without_excess_precision(env, tmp_path):
    """bf16: the colocated step may keep fused bf16 intermediates in f32 (XLA's
    excess precision); with it off on both sides the streamed bf16 states give the same bits."""
    flags = os.environ.get("XLA_FLAGS", "") + " --xla_allow_excess_precision=false"
    environ = {**os.environ, "XLA_FLAGS": flags.strip()}
    replicas = []
    for i in range(2):
        r = Replica(env["config"], tmp_path / f"bf16_{i}", "--layers", "final,3",
                    "--dtype", "bfloat16")
        r.proc = subprocess.Popen(r.args + ["--port", "0"], stdout=subprocess.PIPE,
                                  stderr=open(r.log, "a"), text=True, env=environ)
        replicas.append(r)
    try:
        for r in replicas:
            r.ready()
        script = _BF16_SCRIPT.format(tests=str(Path(__file__).parent), teacher=env["teacher"],
                                     tok=env["tokenizer"], root=str(tmp_path),
                                     remote="remote://" + ",".join(r.address for r in replicas))
        out = subprocess.run([sys.executable, "-c", script], env=environ, capture_output=True,
                             text=True, timeout=600)
        assert out.returncode == 0, out.stderr[-3000:]
        col, rem = json.loads(out.stdout.strip().splitlines()[-1])
        assert col == rem and len(col) == 5
    finally:
        for r in replicas:
            r.kill()


# --------------------------------------------------------------------------- #
# The hardened service end to end (tests/test_teacher_service.py: the transport alone)
# --------------------------------------------------------------------------- #


@pytest.mark.timeout(300)
def test_hung_head_replica_is_skipped_and_a_signal_stops_the_wait(env):
    """A replica hung in `Head` (test double: tests/helpers/faulty_server.py) no longer blocks
    the trainer: after teacher.timeout_s without a chunk the next replica sends the head; with
    no other replica, SIGTERM ends the wait as the trainer's stop (Interrupted, signal 15)."""
    from helpers.faulty_server import FaultyTeacherServer

    from hldstudy.distill.base import make_strategy
    from hldstudy.signals import StopSignals
    from hldstudy.teacher.serve import TeacherServer, load_student_config
    from hldstudy.train.loop import Interrupted

    _ready(env)
    cfg = load_student_config(str(env["config"]), [])
    hung = FaultyTeacherServer(cfg, env["teacher"], layers="final,3",
                               workdir=env["root"] / "hung", hang_in_head=True)
    port = hung.start(0)
    try:
        good = env["replicas"][0].address
        teacher = RemoteTeacher.connect(_student(
            "kd", f"remote://127.0.0.1:{port},{good}", env["tokenizer"], timeout_s=1.0))
        t0 = time.monotonic()
        emb = teacher.embedding()
        assert 1.0 <= time.monotonic() - t0 < 15
        np.testing.assert_array_equal(emb, TeacherServer.head(hung))

        alone = _student("kd", f"remote://127.0.0.1:{port}", env["tokenizer"], timeout_s=120.0)
        teacher = RemoteTeacher.connect(alone)
        strategy = make_strategy(alone, alone.model, teacher.model_cfg)
        feed = teacher.stage_feed(strategy, strategy.stages()[0], None)
        timer = threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGTERM))
        t0 = time.monotonic()
        with StopSignals():
            timer.start()
            with pytest.raises(Interrupted) as exc:
                feed.begin(0, 5)
        timer.cancel()
        assert exc.value.signum == signal.SIGTERM and time.monotonic() - t0 < 15
        feed.close()
    finally:
        hung.stop(0)


def test_busy_replica_head_is_retried(env):
    """Every replica busy (its head slots taken, e.g. by the other runs of a sweep): the
    trainer retries within teacher.timeout_s instead of failing the run."""
    from hldstudy.teacher.serve import TeacherServer, load_student_config

    server = TeacherServer(load_student_config(str(env["config"]), []), env["teacher"],
                           layers="final,3", workdir=env["root"] / "busy")
    server.MAX_HEADS = 1
    port = server.start(0)
    try:
        server._head_slots.acquire()  # another run is fetching the head
        threading.Timer(1.0, server._head_slots.release).start()
        teacher = RemoteTeacher.connect(_student("kd", f"remote://127.0.0.1:{port}",
                                                 env["tokenizer"], timeout_s=20.0))
        t0 = time.monotonic()
        emb = teacher.embedding()
        assert 0.5 < time.monotonic() - t0 < 15 and server.stats["refused"] >= 1
        np.testing.assert_array_equal(emb, server.head())
    finally:
        server.stop(0)


def _self_signed(tmp_path):
    import shutil

    if shutil.which("openssl") is None:
        return None
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    out = subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days",
                          "1", "-subj", "/CN=localhost", "-addext",
                          "subjectAltName=IP:127.0.0.1,DNS:localhost", "-keyout", str(key),
                          "-out", str(cert)], capture_output=True, timeout=60)
    return (cert, key) if out.returncode == 0 else None


@pytest.mark.timeout(600)
def test_token_and_tls_replica_trains_bitwise_equal(env, tmp_path):
    """A replica with a shared secret (and TLS when openssl can make a certificate): the
    trainer with teacher.token_file (and teacher.tls_ca) trains the same bits as colocated;
    a trainer without the token is refused in one line naming teacher.token_file."""
    from hldstudy.teacher.serve import TeacherServer, load_student_config
    from hldstudy.train.loop import Trainer

    col, _, _, _ = _run_pair(env, "kd")
    token = tmp_path / "token"
    token.write_text("0123456789abcdef-secret\n")
    pem = _self_signed(tmp_path)
    server = TeacherServer(load_student_config(str(env["config"]), []), env["teacher"],
                           layers="final,3", workdir=env["root"] / "secured")
    port = server.start(0, token=token.read_text().strip(),
                        tls=(pem[0].read_bytes(), pem[1].read_bytes()) if pem else None)
    try:
        extra = {"token_file": str(token), "tls_ca": str(pem[0]) if pem else None}
        cfg = _student("kd", f"remote://127.0.0.1:{port}", env["tokenizer"], **extra)
        Trainer(cfg, tmp_path / "run", devices=jax.devices()[:1]).run()
        assert losses(tmp_path / "run") == col
        assert server.stats["steps"] == 5 and server.stats["refused"] == 0
        without = dataclasses.replace(cfg, teacher=dataclasses.replace(cfg.teacher,
                                                                       token_file=None))
        with pytest.raises(ConfigError, match=r"teacher.token_file: .* refused the call"):
            RemoteTeacher.connect(without)
        wrong = tmp_path / "wrong"
        wrong.write_text("not-the-secret")
        with pytest.raises(ConfigError, match=r"teacher.token_file: .* refused the call"):
            RemoteTeacher.connect(dataclasses.replace(cfg, teacher=dataclasses.replace(
                cfg.teacher, token_file=str(wrong))))
        assert server.stats["refused"] >= 1
    finally:
        server.stop(0)


def test_info_has_no_paths_and_the_temporary_workdir_goes(env):
    from hldstudy.teacher.serve import TeacherServer, load_student_config

    server = TeacherServer(load_student_config(str(env["config"]), []), env["teacher"],
                           layers="final,3")
    info = json.dumps(server.info())
    assert "pid" not in json.loads(info) and str(env["root"]) not in info
    assert json.loads(info)["checkpoint"] == "teacher"
    workdir = server.workdir
    assert workdir.is_dir() and any(workdir.iterdir())
    server.cleanup()
    assert not workdir.exists()


@pytest.mark.timeout(300)
def test_sigterm_stops_a_replica_and_removes_its_temporary_workdir(env, tmp_path):
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    proc = subprocess.Popen([sys.executable, "-m", "hldstudy.teacher.serve", "--config",
                             str(env["config"]), "--layers", "final,3", "--no-warmup",
                             "--port", "0"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, "TMPDIR": str(tmp)})
    try:
        line = proc.stdout.readline()
        assert "serving teacher" in line, proc.stderr.read()[-2000:] if not line else line
        assert [p.name.startswith("hldstudy-teacher-") for p in tmp.iterdir()] == [True]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 128 + signal.SIGTERM
    finally:
        proc.kill()
    assert not any(p.name.startswith("hldstudy-teacher-") for p in tmp.iterdir())


@pytest.mark.timeout(300)
def test_corrupted_teacher_run_is_refused_in_one_line(env, tmp_path):
    import shutil

    bad = tmp_path / "teacher"
    shutil.copytree(env["teacher"], bad)
    for f in (bad / "checkpoints").rglob("*"):  # every array file of every step truncated
        if f.is_file() and f.stat().st_size > 256 and f.suffix not in (".json",):
            f.write_bytes(f.read_bytes()[:64])
    out = subprocess.run([sys.executable, "-m", "hldstudy.teacher.serve", "--config",
                          str(env["config"]), "--checkpoint", str(bad), "--port", "0"],
                         capture_output=True, text=True, timeout=240)
    assert out.returncode == 2, out.stderr[-3000:]
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in out.stderr, out.stderr[-3000:]
    assert str(bad) in lines[0] or "teacher" in lines[0]
