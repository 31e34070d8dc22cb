"""A Qwen3.5-MoE teacher served by one replica to a cohort of two members.

Issue 19's must-show: a KD run with a tiny Qwen3.5-MoE teacher served by a replica to 2
cohort members has per-step losses equal to the colocated runs (within 1e-6 relative; on
CPU in float32 they are the same bits), and the replica computes each teacher step once
(its counters: `forwards` = steps, `recomputed` = 0, `steps` = 2 x steps sent).

- Default suite: the replica in-process with `--cohort a=final;b=final`, two members
  reading through the trainer's own client path (`GrpcLink` + `PrefetchRing`): every
  step's final hidden state is the colocated forward's, bitwise, each computed once; the
  head it serves is the untied `lm_head` (not the embedding a Gemma replica sends).
- Slow: the same replica serving two KD trainers (different learning rates), each against
  its colocated run.
"""

from __future__ import annotations

import threading
import time

import jax
import numpy as np
import pytest
from helpers.qwen_pair import export_teacher, student_config
from helpers.runs import losses, teacher_steps

pytestmark = pytest.mark.timeout(900)

MEMBERS = ("a", "b")


@pytest.fixture(scope="module")
def moe_teacher(tmp_path_factory):
    return export_teacher("moe", tmp_path_factory.mktemp("qwen-moe") / "teacher")


def _replica(cfg, teacher, workdir, lag_s=600.0):  # generous: compiles under load
    from hldstudy.teacher.serve import TeacherServer

    server = TeacherServer(cfg, str(teacher), workdir=workdir,
                           cohort=";".join(f"{m}=final" for m in MEMBERS), window=2, lag_s=lag_s)
    server.start(host="127.0.0.1", port=0)
    return server


def _stats_when_sent(address, n_sent, timeout_s=30.0):
    """The replica's counters once `n_sent` step streams have left (a step is counted
    after its last frame)."""
    from hldstudy.teacher.remote import GrpcLink

    deadline = time.time() + timeout_s
    while (stats := GrpcLink(address).stats())["steps"] < n_sent and time.time() < deadline:
        time.sleep(0.05)
    return stats


def test_a_cohort_replica_serves_the_moe_teacher_once_per_step(tmp_path, moe_teacher):
    from hldstudy.model.loading import load_model
    from hldstudy.teacher import protocol as proto
    from hldstudy.teacher.colocated import ColocatedTeacher
    from hldstudy.teacher.remote import GrpcLink
    from hldstudy.teacher.ring import PrefetchRing

    n = 3
    cfg = student_config("kd", moe_teacher)
    server = _replica(cfg, moe_teacher, tmp_path / "replica")
    address = f"127.0.0.1:{server.port}"
    shape = [cfg.data.batch_size, cfg.data.seq_len, server.model_cfg.d_model]
    got: dict = {}

    def member(name):
        link = GrpcLink(address, open_spec={"final": True, "layers": [], "member": name,
                                            "start": 0, "end": n, "last_stage": True},
                        expect=proto.expected_tensors(["final"], shape, "float32"))
        ring = PrefetchRing([link], start=0, end=n, ring_size=2, timeout_s=600)
        try:
            got[name] = [ring.get(s).payload["final"] for s in range(n)]
        finally:
            ring.close()
            link.close()

    try:
        threads = [threading.Thread(target=member, args=(m,)) for m in MEMBERS]
        for t in threads:
            t.start()
        for t in threads:
            t.join(600)
        stats = _stats_when_sent(address, len(MEMBERS) * n)
        head = GrpcLink(address).head([server.model_cfg.vocab_size, server.model_cfg.d_model],
                                      "float32", idle_s=60)
    finally:
        server.stop(0)
    assert sorted(got) == list(MEMBERS)
    assert stats["forwards"] == n and stats["recomputed"] == 0  # not 2 x n
    assert stats["steps"] == len(MEMBERS) * n
    # The colocated teacher's forward on the same batches: the same bits.
    loaded = load_model(moe_teacher)
    assert loaded.model.cfg.n_experts == 8 and not loaded.model.cfg.tie_embeddings
    colocated = ColocatedTeacher(loaded.model, loaded.tokenizer)
    forward = jax.jit(colocated.forward_fn((), True))
    for step in range(n):
        batch = server.data.train.batch_at(step)
        inputs = {k: batch[k] for k in ("tokens", "positions", "segment_ids")}
        want = np.asarray(forward(colocated.params, inputs).final_hidden)
        for m in MEMBERS:
            np.testing.assert_array_equal(got[m][step], want)
    # The head a remote student rebuilds logits with is the untied lm_head ([V, D] on the
    # wire), not the embedding.
    np.testing.assert_array_equal(head, np.asarray(loaded.model.head_weight()).T)
    assert not np.array_equal(head, np.asarray(loaded.model.embedding[...]))


def _train_in_thread(cfg, workdir, out, key):
    from hldstudy.train.loop import Trainer

    def run():
        try:
            out[key] = Trainer(cfg, workdir, devices=jax.devices()[:1]).run()
        except BaseException as e:  # noqa: BLE001 - handed to the test
            out[key] = e

    t = threading.Thread(target=run, name=f"member-{key}")
    t.start()
    return t


@pytest.mark.slow
def test_kd_members_of_a_served_moe_teacher_equal_their_colocated_runs(tmp_path, moe_teacher):
    import dataclasses

    from hldstudy.train.loop import Trainer

    n = 4
    cfgs = {"a": student_config("kd", moe_teacher, name="a", steps=n,
                                teacher_fields={"timeout_s": 900.0}),
            "b": student_config("kd", moe_teacher, name="b", steps=n, temperature=2.0,
                                train={"lr": 1e-3}, teacher_fields={"timeout_s": 900.0})}
    for name, cfg in cfgs.items():
        Trainer(cfg, tmp_path / name / "colocated", devices=jax.devices()[:1]).run()
    server = _replica(cfgs["a"], moe_teacher, tmp_path / "replica")
    address = f"127.0.0.1:{server.port}"
    out: dict = {}
    try:
        threads = [_train_in_thread(dataclasses.replace(cfg, teacher=dataclasses.replace(
            cfg.teacher, checkpoint=f"remote://{address}?member={name}")),
            tmp_path / name / "remote", out, name) for name, cfg in cfgs.items()]
        for t in threads:
            t.join(800)
        stats = _stats_when_sent(address, len(cfgs) * n)
    finally:
        server.stop(0)
    for name in cfgs:
        assert isinstance(out.get(name), dict) and out[name]["status"] == "done", out.get(name)
    assert stats["forwards"] == n and stats["recomputed"] == 0  # each step once, not 2 x n
    assert stats["steps"] == len(cfgs) * n
    for name in cfgs:
        col, rem = losses(tmp_path / name / "colocated"), losses(tmp_path / name / "remote")
        assert sorted(rem) == list(range(1, n + 1))
        np.testing.assert_allclose([rem[s] for s in sorted(rem)], [col[s] for s in sorted(col)],
                                   rtol=1e-6, atol=0)
        assert teacher_steps(tmp_path / name / "remote") == list(range(n))
    assert losses(tmp_path / "a" / "remote") != losses(tmp_path / "b" / "remote")


@pytest.mark.slow  # the default tier compiles the sharded replica (tests/test_aot.py)
def test_a_replica_over_several_devices_serves_the_one_device_forward(tmp_path, moe_teacher):
    """teacher.replica_devices=0: the replica's weights and every micro-batch split over
    all of its host's devices (here the 4 CPU devices; two interleaved micro-batches of
    4 sequences). What it serves is the colocated forward's, to float32 rounding."""
    from hldstudy.model.loading import load_model
    from hldstudy.teacher.colocated import ColocatedTeacher
    from hldstudy.teacher.replica import Replica

    cfg = student_config("kd", moe_teacher,
                         teacher_fields={"replica_devices": 0, "replica_batch": 4})
    assert cfg.data.batch_size == 8 and len(jax.devices()) == 4
    replica = Replica(cfg, str(moe_teacher), workdir=tmp_path / "replica")
    try:
        assert len(replica.devices) == 4 and replica.replica_batch(True, ()) == 4
        spread = {leaf.sharding.spec for leaf in jax.tree_util.tree_leaves(replica.params)}
        assert any(any(axis is not None for axis in spec) for spec in spread)  # weights split
        loaded = load_model(moe_teacher)
        colocated = ColocatedTeacher(loaded.model, loaded.tokenizer)
        forward = jax.jit(colocated.forward_fn((), True))
        for step in range(2):
            _, tensors = replica.compute(step, True, ())
            (name, served), = tensors
            batch = replica.data.train.batch_at(step)
            inputs = {k: batch[k] for k in ("tokens", "positions", "segment_ids")}
            want = np.asarray(forward(colocated.params, inputs).final_hidden)
            assert name == "final" and served.shape == want.shape
            # Sharded contractions sum in another order: float32 rounding, through the
            # DeltaNet's recurrence (relative 1e-6 in norm; a routing flip would be ~1e-1).
            rel = np.linalg.norm(served - want) / np.linalg.norm(want)
            assert rel <= 1e-5, rel
    finally:
        replica.cleanup()
