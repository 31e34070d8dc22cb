"""Fan-out: one teacher replica serves a cohort of trainer processes, one forward per step.

- `StepWindow` alone (threads, no gRPC, no JAX): one forward per step for the whole
  cohort, backpressure (the slowest member sets the pace), laggards detached after
  the lag timeout and served by recomputation, rejoin after a crash, stage
  boundaries, errors and cancellation.
- The service in-process (`SyntheticTeacherServer`, no model) through the trainer's
  own client path (`GrpcLink` + `PrefetchRing`): three members, each gets only its
  tensors, the replica's forward count is the number of steps.
- End to end (slow): one real replica subprocess with `--cohort`, three trainer
  processes (kd, kd with another learning rate, hldc) on loopback; the replica
  runs one forward per step and every member's losses equal its colocated run
  bitwise (float32 on CPU).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from hldstudy.errors import ConfigError
from hldstudy.teacher.fanout import MemberGone, StepWindow, parse_cohort

pytestmark = pytest.mark.timeout(120)


class Counting:
    """compute(step) for the window: records the steps it computed."""

    def __init__(self, fail_from: int | None = None, delay: float = 0.0):
        self.steps: list[int] = []
        self.fail_from, self.delay = fail_from, delay
        self.lock = threading.Lock()

    def __call__(self, step):
        if self.fail_from is not None and step >= self.fail_from:
            raise IndexError(step)
        time.sleep(self.delay)
        with self.lock:
            self.steps.append(step)
        return ("digest", {"step": step})


def _in_thread(fn, *args):
    out = {}

    def run():
        try:
            out["value"] = fn(*args)
        except BaseException as e:  # noqa: BLE001 - handed to the test
            out["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, out


def test_cohort_specs_parse_and_bad_ones_are_refused():
    spec = parse_cohort("kd-1=final; hldc.2=final,9,3 ;x=4")
    assert spec.members == {"kd-1": (True, ()), "hldc.2": (True, (3, 9)), "x": (False, (4,))}
    assert spec.union == (True, (3, 4, 9))
    assert spec.covers("hldc.2", True, [9]) and not spec.covers("kd-1", True, [9])
    for bad, says in [("", "no member"), ("a", "not ID=LAYERS"), ("a=final;a=3", "twice"),
                      ("a=fin", "neither 'final'"), ("a=", "needs no teacher layer"),
                      ("a b=final", "not ID=LAYERS")]:
        with pytest.raises(ConfigError, match=f"--cohort: .*{re.escape(says)}"):
            parse_cohort(bad)


def test_one_forward_per_step_and_the_slowest_member_sets_the_pace():
    n, window = 20, 2
    taken = {"a": 0, "b": 0, "c": 0}
    lead = []  # at each forward: the computed step minus the slowest member's progress
    compute = Counting()

    def counted(step):
        lead.append(step - min(taken.values()))
        return compute(step)

    w = StepWindow(taken, window, lag_s=30, compute=counted, tick_s=0.005)
    gens = {m: w.connect(m, 0, n) for m in taken}
    got = {m: [] for m in taken}

    def member(m, pause):
        for s in range(n):
            (digest, payload), shared = w.take(m, gens[m], s)
            got[m].append((payload["step"], shared))
            taken[m] = s + 1
            time.sleep(pause)

    threads = [threading.Thread(target=member, args=(m, p))
               for m, p in (("a", 0.0), ("b", 0.002), ("c", 0.01))]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    elapsed = time.perf_counter() - t0
    stats = w.stats()
    assert sorted(compute.steps) == list(range(n))  # each step computed once, not 3x
    assert stats["forwards"] == n and stats["recomputed"] == 0 and stats["detached"] == 0
    assert all(got[m] == [(s, True) for s in range(n)] for m in taken)
    assert stats["peak"] <= window
    assert max(lead) <= window  # the fastest never ran more than the window ahead
    assert elapsed >= n * 0.01 * 0.9  # ... so everyone went at the slowest member's pace


def test_a_laggard_is_detached_after_the_lag_timeout_and_recomputed_alone():
    compute = Counting()
    w = StepWindow(["a", "b", "c"], 2, lag_s=0.3, compute=compute, tick_s=0.005)
    g = {m: w.connect(m, 0) for m in "abc"}
    assert w.take("a", g["a"], 0) == (("digest", {"step": 0}), True)
    w.take("a", g["a"], 1)
    t, out = _in_thread(w.take, "a", g["a"], 2)  # the window {0, 1} is full: a waits
    for s in (0, 1):
        assert w.take("b", g["b"], s)[1] is True  # b reads them from the window
    time.sleep(0.1)
    assert t.is_alive() and w.held() == [0, 1]  # c (slow) still holds them
    t0 = time.perf_counter()
    t.join(5)
    assert not t.is_alive() and 0.1 < time.perf_counter() - t0 < 2
    assert out["value"][1] is True
    stats = w.stats()
    assert stats["detached"] == 1 and not stats["members"]["c"]["attached"]
    assert stats["members"]["a"]["attached"] and stats["members"]["b"]["attached"]
    # c comes back: the steps behind the window are computed for it alone, then it is
    # served from the window (and attached) again.
    assert w.take("c", g["c"], 0) == (("digest", {"step": 0}), False)
    assert w.take("c", g["c"], 1)[1] is False
    assert w.take("c", g["c"], 2)[1] is True
    stats = w.stats()
    assert stats["members"]["c"] == {"attached": True, "connected": True, "taken": 3,
                                     "shared": 1, "recomputed": 2, "detached": 1}
    assert stats["forwards"] == 5 and stats["recomputed"] == 2
    assert compute.steps == [0, 1, 2, 0, 1]


def test_a_member_that_never_connects_holds_the_window_until_the_join_deadline(caplog):
    w = StepWindow(["a", "late"], 1, lag_s=0.2, compute=Counting(), tick_s=0.005)
    g = w.connect("a", 0)
    w.take("a", g, 0)
    t0 = time.perf_counter()
    assert w.take("a", g, 1)[1] is True  # waits for "late" up to the deadline, then goes on
    assert 0.15 < time.perf_counter() - t0 < 3
    assert "late" in caplog.text and "has not connected" in caplog.text


def test_a_crashed_member_rejoins_from_its_checkpoint_and_catches_up():
    compute = Counting()
    w = StepWindow(["a", "b"], 2, lag_s=0.2, compute=compute, tick_s=0.005)
    ga, gb = w.connect("a", 0), w.connect("b", 0)
    for s in (0, 1):
        w.take("a", ga, s)
        w.take("b", gb, s)
    w.disconnect("b", gb)  # killed mid-run: it still holds its place for lag_s
    w.take("a", ga, 2)
    w.take("a", ga, 3)
    assert w.held() == [2, 3]
    assert w.take("a", ga, 4)[1] is True  # after lag_s b is detached and a goes on
    assert w.stats()["members"]["b"]["attached"] is False
    gb = w.connect("b", 1)  # resumed from its checkpoint at step 1
    # 1..4 (a passed them, the window no longer holds them) are computed for b alone;
    # 5, which nobody has passed, enters the window: b is attached again, a reads it.
    assert [w.take("b", gb, s)[1] for s in (1, 2, 3, 4, 5)] == [False] * 4 + [True]
    assert w.take("a", ga, 5)[1] is True
    stats = w.stats()
    assert stats["forwards"] == 6 + 4 and stats["recomputed"] == 4  # 0..5 once, 1..4 for b
    assert stats["members"]["b"]["attached"] is True


def test_stage_boundaries_and_finished_members():
    compute = Counting()
    # a's first stage ends at 3: its stream closes, its next stage's steps stay held.
    w = StepWindow(["a", "b"], 2, lag_s=30, compute=compute, tick_s=0.005)
    ga, gb = w.connect("a", 0, 3, last_stage=False), w.connect("b", 0)
    for s in range(3):
        w.take("a", ga, s)
        w.take("b", gb, s)
    for s in (3, 4):  # a's stage-1 stream is still open (the trainer compiles stage 2)
        w.take("b", gb, s)
    assert w.held() == [3, 4]  # a (between its stages) still needs them
    w.disconnect("a", ga)
    assert w.held() == [3, 4]
    ga = w.connect("a", 3, 6, last_stage=True)
    t, out = _in_thread(w.take, "b", gb, 5)
    assert [w.take("a", ga, s)[1] for s in (3, 4, 5)] == [True, True, True]
    t.join(5)
    assert out["value"][1] is True
    assert sorted(compute.steps) == list(range(6)) and w.stats()["recomputed"] == 0
    # A member that took its last step holds nothing: the others never wait for it.
    w2 = StepWindow(["a", "b"], 1, lag_s=30, compute=Counting(), tick_s=0.005)
    ga, gb = w2.connect("a", 0, 2), w2.connect("b", 0)
    w2.take("a", ga, 0)
    w2.take("b", gb, 0)
    w2.take("a", ga, 1)
    w2.disconnect("a", ga)
    t0 = time.perf_counter()
    for s in range(1, 10):
        w2.take("b", gb, s)
    assert time.perf_counter() - t0 < 5 and w2.stats()["detached"] == 0


def test_a_reissued_step_inside_the_window_is_computed_alone_never_waited_for():
    compute = Counting()
    w = StepWindow(["a", "b"], 2, lag_s=30, compute=compute, tick_s=0.005)
    ga, _ = w.connect("a", 0), w.connect("b", 0)
    w.take("a", ga, 0)
    w.take("a", ga, 2)  # interleaved replicas: this one owns the even steps
    assert w.held() == [0, 2]
    t0 = time.perf_counter()
    assert w.take("a", ga, 1)[1] is False  # a failed replica's step, reissued here
    assert time.perf_counter() - t0 < 1 and w.held() == [0, 2]


def test_errors_free_the_slot_and_a_closed_stream_stops_waiting():
    w = StepWindow(["a", "b"], 1, lag_s=30, compute=Counting(fail_from=3), tick_s=0.005)
    ga, gb = w.connect("a", 0), w.connect("b", 0)
    with pytest.raises(IndexError):
        w.take("a", ga, 3)  # beyond the data: the asker gets the error
    w.take("a", ga, 0)
    gone = threading.Event()
    t, out = _in_thread(w.take, "a", ga, 1, gone.is_set)  # full (b holds 0): waits
    time.sleep(0.05)
    gone.set()
    t.join(5)
    assert isinstance(out.get("error"), MemberGone)
    assert w.take("b", gb, 0)[1] is True
    with pytest.raises(ConfigError, match="--window"):
        StepWindow(["a"], 0, 1.0, Counting())
    with pytest.raises(ConfigError, match="--lag-timeout-s"):
        StepWindow(["a"], 1, math.inf, Counting())


@pytest.mark.parametrize("argv, says", [
    (["--cohort", "a=final", "--layers", "final"], "--layers: a cohort replica serves the union"),
    (["--cohort", "a=final;b=final", "--max-streams", "1"], "--max-streams: 1 streams cannot"),
    (["--cohort", "a=final", "--window", "0"], "--window: must be >= 1"),
    (["--cohort", "a=final", "--lag-timeout-s", "inf"], "--lag-timeout-s: must be a positive"),
    (["--cohort", "a=final;a=3"], "--cohort: member 'a' is declared twice"),
])
def test_bad_cohort_flags_are_refused_in_one_line(argv, says, capsys, tmp_path):
    from hldstudy.teacher import serve

    with pytest.raises(SystemExit) as exc:
        serve.main(["--config", str(tmp_path / "none.py"), *argv])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and says in err, err


def test_the_trainer_handshake_checks_its_membership():
    from hldstudy.teacher.remote import RemoteTeacher

    def teacher(member, timeout_s=30.0):
        t = object.__new__(RemoteTeacher)  # only what the cohort check reads
        t.member, t.timeout_s = member, timeout_s
        return t

    cohort = {"members": ["a", "b"], "window": 4, "lag_timeout_s": 20.0}
    teacher("a")._check_cohort("h:1", cohort, cohort)
    teacher(None)._check_cohort("h:1", None, None)
    for t, info, ref, says in [
            (teacher(None), cohort, cohort, "this run is no member"),
            (teacher("z"), cohort, cohort, "this run is 'z'"),
            (teacher("a"), None, None, "serves no cohort"),
            (teacher("a"), cohort, {**cohort, "window": 2}, "other replicas"),
            (teacher("a", timeout_s=20.0), cohort, cohort, "teacher.timeout_s: 20 s is not above")]:
        with pytest.raises(ConfigError, match=re.escape(says)):
            t._check_cohort("h:1", info, ref)


def test_the_planner_has_the_window_memory():
    from hldstudy.commands.plan import format_markdown
    from hldstudy.plan import PlanInputs, fanout_window_bytes, plan, plan_model

    assert fanout_window_bytes(4, 1000, 2, 2560, 2) == 4 * 1000 * 2 * 2560 * 2
    p = PlanInputs(teacher=plan_model("gemma3-4b"), student=plan_model("gemma3-270m"),
                   tokens_per_step=8192, devices=8, link_gbps=100, hidden_layers=1)
    r = plan(p)
    assert r["disaggregated"]["fanout_window_bytes"] == 0
    assert "fan-out window" not in format_markdown(r)
    r = plan(dataclasses.replace(p, fanout_window=3, fanout_union_layers=3))
    d_t = r["models"]["teacher"]["d_model"]
    assert r["disaggregated"]["fanout_window_bytes"] == 3 * 8192 * 3 * d_t * 2  # bf16 stream
    assert "| fan-out window (3 steps, host, per replica) |" in format_markdown(r)
    with pytest.raises(ConfigError, match="--fanout-window"):
        plan(dataclasses.replace(p, fanout_window=-1))


# --------------------------------------------------------------------------- #
# The service in-process (no model): the trainer's client path, three members
# --------------------------------------------------------------------------- #

SHAPE = (2, 4, 8)


def test_a_synthetic_cohort_replica_serves_each_member_its_part_once():
    from hldstudy.plan import fanout_window_bytes
    from hldstudy.teacher import protocol as proto
    from hldstudy.teacher.remote import GrpcLink, ReplicaDown, Security
    from hldstudy.teacher.ring import PrefetchRing
    from hldstudy.teacher.serve import SyntheticTeacherServer

    server = SyntheticTeacherServer(SHAPE, "float32", n_layers=3)  # final, layers 1 and 2
    server.set_cohort(parse_cohort("a=final;b=final,2;c=1"), window=2, lag_s=20)
    server.start(host="127.0.0.1", port=0)
    address = f"127.0.0.1:{server.port}"
    n = 12
    wants = {"a": (True, []), "b": (True, [2]), "c": (False, [1])}
    got: dict = {}

    def member(m):
        final, layers = wants[m]
        link = GrpcLink(address, open_spec={"final": final, "layers": layers, "member": m,
                                            "start": 0, "end": n, "last_stage": True},
                        expect=proto.expected_tensors(proto.tensor_names(layers, final),
                                                      list(SHAPE), "float32"))
        ring = PrefetchRing([link], start=0, end=n, ring_size=3, timeout_s=30)
        try:
            got[m] = [sorted(ring.get(s).payload) for s in range(n)]
        finally:
            ring.close()
            link.close()

    try:
        threads = [threading.Thread(target=member, args=(m,)) for m in wants]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        deadline = time.time() + 10
        while (stats := GrpcLink(address).stats())["steps"] < 3 * n and time.time() < deadline:
            time.sleep(0.02)  # a step is counted once its last frame has left
        assert got == {"a": [["final"]] * n, "b": [["final", "layer:2"]] * n,
                       "c": [["layer:1"]] * n}
        assert stats["forwards"] == n and stats["recomputed"] == 0  # not 3 x n
        assert stats["steps"] == 3 * n  # each member got every step once
        # The planner's window memory is what the replica holds when the window is full.
        peak = stats["cohort"]["peak"]
        assert 1 <= peak <= 2
        per_step = fanout_window_bytes(1, SHAPE[0] * SHAPE[1], 3, SHAPE[2], 4)
        assert stats["cohort"]["peak_bytes"] == peak * per_step
        assert fanout_window_bytes(2, SHAPE[0] * SHAPE[1], 3, SHAPE[2], 4) == 2 * per_step
        channel = Security().channel(address)
        info = proto.decode(channel.unary_unary(proto.method(proto.INFO))(b"", timeout=5))[0]
        channel.close()
        assert info["cohort"] == {"members": ["a", "b", "c"], "window": 2, "lag_timeout_s": 20.0}
        # Not a member, or a member asking for layers it was not declared with: refused.
        for spec, says in [({"final": True, "layers": []}, "no member"),
                           ({"final": True, "layers": [], "member": "z"}, "'z'"),
                           ({"final": True, "layers": [1], "member": "a"}, "declared with")]:
            errors = []
            session = GrpcLink(address, open_spec=spec).open(lambda *a: None, errors.append)
            session.request(0)
            deadline = time.time() + 10
            while not errors and time.time() < deadline:
                time.sleep(0.01)
            session.close()
            assert errors and not isinstance(errors[0], ReplicaDown) and says in str(errors[0])
    finally:
        server.stop(0)


def test_a_cohort_fails_over_to_the_other_replica():
    """Two cohort replicas own interleaved steps; one stops mid-run: every member still
    gets every step once, in order, from the survivor; a reissued step costs at most one
    extra forward."""
    from hldstudy.teacher import protocol as proto
    from hldstudy.teacher.remote import GrpcLink
    from hldstudy.teacher.ring import PrefetchRing
    from hldstudy.teacher.serve import SyntheticTeacherServer

    servers = []
    for _ in range(2):
        server = SyntheticTeacherServer(SHAPE, "float32", n_layers=2)
        server.set_cohort(parse_cohort("a=final;b=final,1"), window=3, lag_s=20)
        server.start(host="127.0.0.1", port=0)
        servers.append(server)
    addresses = [f"127.0.0.1:{s.port}" for s in servers]
    n, half = 20, 8
    wants = {"a": (True, []), "b": (True, [1])}
    got, reassigned, rings = {m: [] for m in wants}, {}, {}
    at_half = threading.Barrier(3)
    go_on = threading.Event()

    def member(m):
        final, layers = wants[m]
        links = [GrpcLink(addr, open_spec={"final": final, "layers": layers, "member": m,
                                           "start": 0, "end": n, "last_stage": True},
                          expect=proto.expected_tensors(proto.tensor_names(layers, final),
                                                        list(SHAPE), "float32"))
                 for addr in addresses]
        ring = rings[m] = PrefetchRing(links, start=0, end=n, ring_size=2, timeout_s=10,
                                       rejoin_s=60)
        try:
            for s in range(n):
                if s == half:
                    at_half.wait(30)
                    go_on.wait(30)
                d = ring.get(s)
                got[m].append((s, sorted(d.payload)))
            reassigned[m] = ring.status()["reassigned"]
        finally:
            ring.close()
            for link in links:
                link.close()

    threads = [threading.Thread(target=member, args=(m,)) for m in wants]
    try:
        for t in threads:
            t.start()
        at_half.wait(30)
        before = GrpcLink(addresses[1]).stats()["forwards"]
        servers[1].stop(0)  # replica 1 goes away with its outstanding steps
        go_on.set()
        for t in threads:
            t.join(60)
        survivor = GrpcLink(addresses[0]).stats()
    finally:
        for server in servers:
            server.stop(0)
    assert got == {"a": [(s, ["final"]) for s in range(n)],
                   "b": [(s, ["final", "layer:1"]) for s in range(n)]}
    assert before > 0  # replica 1 had its share before it went
    # The survivor computes each step at most once for the window; what it computes for
    # one member alone (reissued steps, a member detached while the other replica went
    # away: timing-dependent) is counted apart, as `recomputed`.
    assert survivor["forwards"] - survivor["recomputed"] <= n
    assert before <= n
    assert survivor["steps"] >= 2 * (n - half - 3)  # the survivor served the rest to both


# --------------------------------------------------------------------------- #
# End to end: one replica subprocess, three trainer processes, two methods
# --------------------------------------------------------------------------- #

MEMBER_SCRIPT = """
import sys, jax
from hldstudy.config import read_config
from hldstudy.train.loop import Interrupted, Trainer
stop = int(sys.argv[3]) if len(sys.argv) > 3 else None
try:
    Trainer(read_config(sys.argv[1]), sys.argv[2], devices=jax.devices()[:1]).run(stop)
except Interrupted:
    sys.exit(143)
"""


def _configs(teacher_dir, tokenizer, steps=5, checkpoint_every=4,
             names=("kd-a", "kd-b", "hldc-c")):
    """The three members' colocated configs, distilled from the session's tiny teacher."""
    from helpers.runs import student_config

    def student(name, method, lr, **distill):
        return student_config(method, teacher_dir, name=name, steps=steps, tokenizer=tokenizer,
                              train={"lr": lr, "checkpoint_every": checkpoint_every,
                                     "eval_batches": 1},
                              teacher_fields={"timeout_s": 120.0}, **distill)

    every = {"kd-a": student("kd-a", "kd", 3e-3), "kd-b": student("kd-b", "kd", 1e-3),
             "hldc-c": student("hldc-c", "hldc", 3e-3),
             "hldf-d": student("hldf-d", "hldf", 3e-3, hldf_stage1_share=0.4)}
    return {k: every[k] for k in names}


class CohortReplica:
    """`python -m hldstudy.teacher.serve --cohort ...` in a subprocess."""

    def __init__(self, root, cfg, cohort, *args):
        from hldstudy.config import save_config

        save_config(cfg, root / "replica.json")
        self.log = root / "replica.log"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "hldstudy.teacher.serve", "--config", str(root / "replica.json"),
             "--workdir", str(root / "replica"), "--cohort", cohort, *args, "--port", "0"],
            stdout=subprocess.PIPE, stderr=open(self.log, "w"), text=True)
        self.address = None

    def ready(self, says=""):
        line = self.proc.stdout.readline()
        m = re.search(re.escape(says) + r".* on \S+:(\d+)$", line.strip())
        assert m, f"{line!r}\n{self.log.read_text()[-3000:]}"
        self.address = f"127.0.0.1:{m.group(1)}"

    def stats(self):
        from hldstudy.teacher.remote import GrpcLink

        return GrpcLink(self.address).stats()

    def kill(self):
        self.proc.kill()
        self.proc.wait()


def _member(root, name, cfg, address, stop=None):
    """A trainer process of cohort member `name` (it stops at `stop` as on SIGTERM)."""
    from hldstudy.config import save_config

    remote = dataclasses.replace(cfg, teacher=dataclasses.replace(
        cfg.teacher, checkpoint=f"remote://{address}?member={name}"))
    save_config(remote, root / f"{name}.json")
    return subprocess.Popen(
        [sys.executable, "-c", MEMBER_SCRIPT, str(root / f"{name}.json"), str(root / name / "remote"),
         *([str(stop)] if stop is not None else [])], env=dict(os.environ),
        stdout=subprocess.DEVNULL, stderr=open(root / f"{name}.log", "a"))


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_three_trainer_processes_share_one_forward_per_step(
        tmp_path, teacher_dir, tokenizer_path):
    import jax
    from helpers.runs import losses, teacher_steps

    from hldstudy.train.loop import Trainer

    members = _configs(teacher_dir, tokenizer_path)
    # hldc aligns with teacher layer 3: the replica computes final + layer 3 once per step
    replica = CohortReplica(tmp_path, members["kd-a"], "kd-a=final;kd-b=final;hldc-c=final,3",
                            "--window", "3", "--lag-timeout-s", "60")
    procs = []
    try:
        for name, cfg in members.items():  # the colocated references, while the replica starts
            Trainer(cfg, tmp_path / name / "colocated", devices=jax.devices()[:1]).run()
        replica.ready("cohort hldc-c,kd-a,kd-b window 3, forward")
        procs = [_member(tmp_path, name, cfg, replica.address) for name, cfg in members.items()]
        for name, p in zip(members, procs, strict=True):
            assert p.wait(600) == 0, (tmp_path / f"{name}.log").read_text()[-3000:]
        stats = replica.stats()
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        replica.kill()
    assert stats["forwards"] == 5 and stats["recomputed"] == 0  # 5 steps, not 3 x 5
    assert stats["steps"] == 15
    for name in members:
        col, rem = losses(tmp_path / name / "colocated"), losses(tmp_path / name / "remote")
        assert sorted(rem) == [1, 2, 3, 4, 5]
        assert rem == col, name  # float32 on CPU: the same bits
        assert teacher_steps(tmp_path / name / "remote") == [0, 1, 2, 3, 4]
    assert losses(tmp_path / "kd-a" / "remote") != losses(tmp_path / "kd-b" / "remote")
    assert np.isfinite(list(losses(tmp_path / "hldc-c" / "remote").values())).all()


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_member_that_stops_mid_run_rejoins_and_is_recomputed_alone(
        tmp_path, teacher_dir, tokenizer_path):
    """kd-b stops at step 3 (as on SIGTERM or a crash: its stream ends before its last
    step); kd-a goes on once the lag timeout detaches kd-b; kd-b resumes from its
    checkpoint and the steps kd-a has passed are computed for it alone."""
    import jax
    from helpers.runs import losses, teacher_steps

    from hldstudy.train.loop import Trainer

    n = 8
    members = _configs(teacher_dir, tokenizer_path, steps=n, checkpoint_every=2,
                       names=("kd-a", "kd-b"))
    replica = CohortReplica(tmp_path, members["kd-a"], "kd-a=final;kd-b=final",
                            "--window", "2", "--lag-timeout-s", "3")
    procs = []
    try:
        for name, cfg in members.items():
            Trainer(cfg, tmp_path / name / "colocated", devices=jax.devices()[:1]).run()
        replica.ready()
        procs = [_member(tmp_path, "kd-a", members["kd-a"], replica.address),
                 _member(tmp_path, "kd-b", members["kd-b"], replica.address, stop=3)]
        assert procs[1].wait(600) == 143, (tmp_path / "kd-b.log").read_text()[-3000:]
        procs.append(_member(tmp_path, "kd-b", members["kd-b"], replica.address))
        for name, p in zip(("kd-a", "kd-b", "kd-b"), procs, strict=True):
            assert p.wait(600) in (0, 143), (tmp_path / f"{name}.log").read_text()[-3000:]
        assert procs[0].returncode == 0 and procs[2].returncode == 0
        stats = replica.stats()
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        replica.kill()
    (tmp_path / "replica_stats.json").write_text(json.dumps(stats))  # for a failure's reader
    assert stats["recomputed"] >= 1 and stats["forwards"] == n + stats["recomputed"]
    assert stats["cohort"]["members"]["kd-b"]["detached"] >= 1
    assert stats["cohort"]["members"]["kd-b"]["recomputed"] == stats["recomputed"]
    for name in members:
        assert losses(tmp_path / name / "remote") == losses(tmp_path / name / "colocated")
        assert teacher_steps(tmp_path / name / "remote") == list(range(n))  # each step once


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_an_hldf_member_crosses_its_stage_boundary_without_extra_forwards(
        tmp_path, teacher_dir, tokenizer_path):
    """hldf streams layer 3 in stage 1 and the final state in stage 2 (two streams); the
    union is computed once per step, and its layer 3 is the colocated stage 1's, bitwise."""
    import jax
    from helpers.runs import losses, teacher_steps

    from hldstudy.train.loop import Trainer

    members = _configs(teacher_dir, tokenizer_path, names=("kd-a", "hldf-d"))
    replica = CohortReplica(tmp_path, members["kd-a"], "kd-a=final;hldf-d=final,3",
                            "--window", "2", "--lag-timeout-s", "60")
    procs = []
    try:
        for name, cfg in members.items():
            Trainer(cfg, tmp_path / name / "colocated", devices=jax.devices()[:1]).run()
        replica.ready()
        procs = [_member(tmp_path, name, cfg, replica.address) for name, cfg in members.items()]
        for name, p in zip(members, procs, strict=True):
            assert p.wait(600) == 0, (tmp_path / f"{name}.log").read_text()[-3000:]
        stats = replica.stats()
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        replica.kill()
    assert stats["forwards"] == 5 and stats["recomputed"] == 0
    assert stats["streams"] == 3  # kd-a's, and one per hldf stage
    for name in members:
        assert losses(tmp_path / name / "remote") == losses(tmp_path / name / "colocated")
        assert teacher_steps(tmp_path / name / "remote") == [0, 1, 2, 3, 4]
