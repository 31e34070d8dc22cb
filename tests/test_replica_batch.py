"""A teacher replica's forward in micro-batches (`teacher.replica_batch`).

The forward of the whole batch and the same forward looped over n micro-batches inside
one jit serve the same tensors (tiny teacher, float32, CPU); `auto` picks the largest
divisor of the batch whose forward the planner says fits the device; `hldstudy.aot`
compiles the replica with that pick and a micro-batched replica compiles to a smaller
working set for the same arguments and outputs.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from hldstudy.config import load_experiment, validate
from hldstudy.errors import ConfigError
from hldstudy.model import preset
from hldstudy.model.transformer import Transformer
from hldstudy.teacher.colocated import teacher_forward_fn
from hldstudy.teacher.microbatch import (
    device_memory,
    forward_bytes,
    micro_batched,
    pick_replica_batch,
    replica_forward_memory,
)

GiB = 2**30


def _tiny_forward(layers=(1,), head=True):
    model = Transformer(preset("tiny-teacher"), rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model, nnx.Param)
    fwd = teacher_forward_fn(graphdef, layers, head)

    def run(params, batch):  # what Replica._forward jits
        out = fwd(params, batch)
        return out.final_hidden, out.hidden

    return run, params, model.cfg


def _batch(b, t, vocab):
    rng = np.random.default_rng(0)
    tokens = rng.integers(1, vocab, size=(b, t), dtype=np.int32)
    # two documents per row, so segment ids and positions differ across rows
    cut = rng.integers(1, t, size=(b, 1))
    col = np.arange(t)[None, :]
    seg = np.where(col < cut, 1, 2).astype(np.int32)
    pos = np.where(col < cut, col, col - cut).astype(np.int32)
    return {"tokens": jnp.asarray(tokens), "positions": jnp.asarray(pos),
            "segment_ids": jnp.asarray(seg)}


@pytest.mark.parametrize("n", [1, 2, 4])
def test_micro_batched_forward_serves_the_whole_batchs_tensors(n):
    run, params, cfg = _tiny_forward(layers=(1,), head=True)
    batch = _batch(8, 32, cfg.vocab_size)
    whole_final, whole_hidden = jax.jit(run)(params, batch)
    final, hidden = jax.jit(micro_batched(run, n))(params, batch)
    assert final.shape == whole_final.shape == (8, 32, cfg.d_model)
    assert set(hidden) == set(whole_hidden) and 1 in hidden
    # Bitwise on the CPU: each micro-batch's rows go through the same kernels.
    np.testing.assert_array_equal(np.asarray(final), np.asarray(whole_final))
    for k in hidden:
        np.testing.assert_array_equal(np.asarray(hidden[k]), np.asarray(whole_hidden[k]))


def test_micro_batched_refuses_a_batch_it_cannot_split():
    run, params, cfg = _tiny_forward()
    with pytest.raises(ConfigError, match="teacher.replica_batch"):
        jax.jit(micro_batched(run, 3))(params, _batch(8, 16, cfg.vocab_size))


def test_the_field_is_validated_naming_it():
    cfg = load_experiment("experiments/tiny_distill.py")
    assert cfg.teacher.replica_batch == 0
    bad = dataclasses.replace(cfg, teacher=dataclasses.replace(cfg.teacher, replica_batch=3))
    with pytest.raises(ConfigError, match="teacher.replica_batch.*does not divide"):
        validate(bad, check_paths=False, need_teacher=False)
    neg = dataclasses.replace(cfg, teacher=dataclasses.replace(cfg.teacher, replica_batch=-1))
    with pytest.raises(ConfigError, match="teacher.replica_batch"):
        validate(neg, check_paths=False, need_teacher=False)
    ok = dataclasses.replace(cfg, teacher=dataclasses.replace(
        cfg.teacher, replica_batch=cfg.data.batch_size // 2))
    validate(ok, check_paths=False, need_teacher=False)


def test_a_cpu_replica_plans_against_no_limit_and_runs_the_whole_batch():
    assert device_memory(jax.devices("cpu")[0]) is None
    big = preset("paper-teacher-3.4b")
    kw = dict(layers=(), head=True, dtype="float32", backend="cpu")
    assert pick_replica_batch(0, big, 256, 2048, memory_bytes=None, **kw) == 256
    assert pick_replica_batch(32, big, 256, 2048, memory_bytes=None, **kw) == 32
    with pytest.raises(ConfigError, match="teacher.replica_batch"):
        pick_replica_batch(48, big, 256, 2048, memory_bytes=None, **kw)


def test_auto_picks_the_largest_divisor_whose_forward_fits():
    big = preset("paper-teacher-3.4b")
    kw = dict(layers=(), head=True, dtype="float32", backend="gpu")
    sizes = {b: forward_bytes(big, 256, b, 2048, **kw) for b in (256, 128, 64, 32)}
    # the working set shrinks with the micro-batch; params, inputs and outputs do not
    assert sizes[256] > sizes[128] > sizes[64] > sizes[32]
    between = (sizes[64] + sizes[128]) / 2  # a device where 64 fits and 128 does not
    assert pick_replica_batch(0, big, 256, 2048, memory_bytes=int(between), **kw) == 64
    assert pick_replica_batch(0, big, 256, 2048, memory_bytes=int(sizes[256]) + 1, **kw) == 256
    # nothing fits (a device smaller than the params): one sequence, the compiler says
    # by how much
    assert pick_replica_batch(0, big, 256, 2048, memory_bytes=GiB, **kw) == 1


@pytest.mark.parametrize("chip,compiler,dtype,compiled_pick", [
    ("h100", "gpu", "float32", 128), ("h100", "gpu", "bfloat16", 256),
    ("v5e", "tpu", "bfloat16", 16)])
def test_auto_picks_by_the_targets_compiler_row(chip, compiler, dtype, compiled_pick):
    """The 3.4B teacher's replica, 256 x 2048: auto's pick by the target compiler's row of
    hldstudy.plan.compilers is the largest micro-batch the target's compiler fits
    (tests/test_plan.py's REPLICA_COMPILES: on an H100 float32 256 needs 90.29 GiB, 128
    56.77; bfloat16 256 61.16; on a v5e bfloat16 32 needs 17.50, 16 13.58). By the CPU
    row the float32 H100 pick was the whole batch (61.8 GiB by the planner)."""
    from hldstudy import chips

    big = preset("paper-teacher-3.4b")
    memory = chips.CHIPS[chip].device_memory_bytes
    kw = dict(layers=(), head=True, dtype=dtype, memory_bytes=memory)
    assert pick_replica_batch(0, big, 256, 2048, backend=compiler, **kw) == compiled_pick
    if (chip, dtype) == ("h100", "float32"):
        assert pick_replica_batch(0, big, 256, 2048, backend="cpu", **kw) == 256


def test_the_compiler_has_the_last_word_on_the_pick():
    """`compiler_checked` over real CPU compiles: a device one byte short of the whole
    batch's compiled program gets the next divisor whose program fits."""
    from hldstudy.plan import xla_memory
    from hldstudy.teacher.microbatch import compiled_fits, compiler_checked, divisors_from

    run, params, cfg = _tiny_forward()
    batch = _batch(8, 32, cfg.vocab_size)
    compiled = {m: jax.jit(micro_batched(run, 8 // m)).lower(params, batch).compile()
                for m in (8, 4)}
    totals = {m: xla_memory(c)["total_bytes"] for m, c in compiled.items()}
    assert totals[4] < totals[8]
    limit = int(totals[8]) - 1
    seen = []

    def compile_micro(m):
        seen.append(m)
        return jax.jit(micro_batched(run, 8 // m)).lower(params, batch).compile()

    micro, c = compiler_checked(divisors_from(8, 8), compile_micro,
                                lambda c: compiled_fits(c, limit))
    assert (micro, seen) == (4, [8, 4]) and xla_memory(c)["total_bytes"] == totals[4]
    # what fits nowhere comes back as the last (smallest) one, for the compiler to report
    assert compiler_checked([8, 4], compile_micro, lambda c: False)[0] == 4


def test_aot_compiles_the_replica_in_its_micro_batches():
    """The replica's forward compiled as the server runs it: a named micro-batch is in
    the step's label; the arguments (params + the whole batch) are the same, the
    working set is smaller."""
    from hldstudy.aot.compile import Choices, compile_teacher_forward

    cfg, teacher = load_experiment("experiments/tiny_distill.py"), preset("tiny-teacher")
    b = cfg.data.batch_size
    whole = compile_teacher_forward(cfg, teacher, "kd", jax.devices())
    assert whole.name == f"teacher forward (one replica, 1 x {b} sequences)"  # CPU: auto = all
    cfg2 = dataclasses.replace(cfg, teacher=dataclasses.replace(cfg.teacher, replica_batch=b // 4))
    micro = compile_teacher_forward(cfg2, teacher, "kd", jax.devices())
    assert micro.name == f"teacher forward (one replica, 4 x {b // 4} sequences)"
    assert micro.memory["argument_bytes"] == whole.memory["argument_bytes"]
    assert micro.memory["output_bytes"] == whole.memory["output_bytes"]
    assert micro.memory["temp_bytes"] < whole.memory["temp_bytes"]
    # XLA's cost analysis counts the micro-batch loop once: the table says so
    from hldstudy.aot.report import flops_note

    assert (whole.loop_trips, micro.loop_trips) == (1, 4)
    assert "micro-batches in a loop (counted once: XLA / model is about 1/4)" in flops_note(
        cfg2, Choices("dense", "dense", "xla", "vmap", ()), [whole, micro])
    assert "micro-batches" not in flops_note(cfg, Choices("dense", "dense", "xla", "vmap", ()),
                                             [whole])
    # the planner's figures for the micro-batch compiled, by this host's compiler's row
    for step, m in ((whole, b), (micro, b // 4)):
        assert step.planner == replica_forward_memory(
            teacher, b, m, cfg.data.seq_len, layers=(), head=True, dtype=cfg.teacher.dtype,
            backend="cpu")
    assert micro.planner["temp_bytes"] < whole.planner["temp_bytes"]
    # aot's row of the replica stands the planner beside the compiled figures
    from hldstudy.aot.report import largest_terms, step_rows
    from hldstudy.aot.targets import parse_target

    choices = Choices("dense", "dense", "xla", "vmap", ())
    (row,) = step_rows(cfg2, teacher, parse_target("h100:8"), choices, [micro], 8, 1)
    assert row["planner"] == micro.planner
    assert row["planner_over_compiled"] == micro.planner["total_bytes"] / \
        micro.memory["total_bytes"]
    assert row["planner_fits"] and row["fits"]
    # and a replica that does not fit is told its own forward's largest buffers
    terms = largest_terms(cfg2, teacher, row, 8, choices, None)
    assert terms.split(", ")[0].startswith(max(
        [("teacher params and batch", micro.planner["argument_bytes"]),
         ("served hidden states", micro.planner["output_bytes"]),
         ("one micro-batch's working set", micro.planner["temp_bytes"])],
        key=lambda kv: kv[1])[0])


def _with_replica_batch(cfg, rb):
    return dataclasses.replace(cfg, teacher=dataclasses.replace(cfg.teacher, replica_batch=rb))


def test_a_replica_serves_the_same_step_in_micro_batches(teacher_dir, tokenizer_path, tmp_path):
    """`TeacherServer.compute` with teacher.replica_batch = half the batch sends what the
    whole-batch forward (auto on the CPU) sends, bitwise."""
    from helpers.runs import student_config

    from hldstudy.teacher.serve import TeacherServer

    cfg = student_config("kd", teacher_dir, tokenizer=tokenizer_path)
    b = cfg.data.batch_size
    sent = {}
    for rb in (0, b // 2):
        server = TeacherServer(_with_replica_batch(cfg, rb), str(teacher_dir), layers="final,3",
                               workdir=tmp_path / f"w{rb}")
        assert server.replica_batch(server.final, server.layers) == (rb or b)
        sent[rb] = server.compute(2, server.final, server.layers)
        server.cleanup()
    (d0, t0), (d1, t1) = sent[0], sent[b // 2]
    assert d0 == d1 and [n for n, _ in t0] == [n for n, _ in t1] == ["final", "layer:3"]
    for (_, a), (_, c) in zip(t0, t1, strict=True):
        assert a.shape[0] == b
        np.testing.assert_array_equal(a, c)


@pytest.mark.timeout(300)
def test_the_replicas_start_up_line_names_its_micro_batches(teacher_dir, tokenizer_path,
                                                            tmp_path):
    import signal
    import subprocess
    import sys

    from helpers.runs import student_config

    from hldstudy.config import save_config

    cfg = student_config("kd", teacher_dir, tokenizer=tokenizer_path)
    b = cfg.data.batch_size
    save_config(cfg, tmp_path / "student.json")
    proc = subprocess.Popen([sys.executable, "-m", "hldstudy.teacher.serve", "--config",
                             str(tmp_path / "student.json"), "--set",
                             f"teacher.replica_batch={b // 2}", "--no-warmup", "--port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert f"forward 2 x {b // 2} sequences" in line, line or proc.stderr.read()[-2000:]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 128 + signal.SIGTERM
    finally:
        proc.kill()


def test_a_replica_steps_down_to_the_micro_batch_its_compiler_fits(teacher_dir, tokenizer_path,
                                                                  tmp_path, monkeypatch):
    """Where the device's memory is known, the replica compiles its pick ahead and steps
    down a divisor while the compiled program (`memory_analysis()`) does not fit. The CPU
    reports no memory: the test gives this one the compiled whole-batch forward's total
    less one byte (the compiles and their figures are real)."""
    from helpers.runs import student_config

    from hldstudy.plan import xla_memory
    from hldstudy.teacher import replica
    from hldstudy.teacher.microbatch import forward_bytes

    cfg = student_config("kd", teacher_dir, tokenizer=tokenizer_path)
    b = cfg.data.batch_size
    monkeypatch.setattr(replica, "device_memory", lambda device: 2**50)  # everything fits
    whole = replica.Replica(cfg, str(teacher_dir), layers="final,3", workdir=tmp_path / "a")
    fwd, micro = whole._forward(whole.final, whole.layers)
    assert micro == b
    total = xla_memory(fwd)["total_bytes"]
    limit = int(total) - 1
    planned = forward_bytes(whole.model_cfg, b, b, cfg.data.seq_len, layers=whole.layers,
                            head=whole.final, dtype=whole.dtype, backend="cpu")
    monkeypatch.setattr(replica, "device_memory", lambda device: limit)
    small = replica.Replica(cfg, str(teacher_dir), layers="final,3", workdir=tmp_path / "b")
    fwd2, micro2 = small._forward(small.final, small.layers)
    assert micro2 < b and b % micro2 == 0
    assert xla_memory(fwd2)["total_bytes"] <= limit
    got, want = (s.compute(1, s.final, s.layers) for s in (small, whole))
    for (n1, a), (n2, c) in zip(got[1], want[1], strict=True):
        assert n1 == n2
        np.testing.assert_array_equal(a, c)
    print(f"whole batch compiled {total:.0f} B, planner {planned:.0f} B; limit {limit} -> "
          f"{b // micro2} x {micro2}")
    whole.cleanup()
    small.cleanup()


def test_a_gpu_replica_over_devices_holds_its_weights_twice_when_it_loops(monkeypatch):
    """XLA GPU copies a sharded replica's weights into its micro-batch loop (the 35B-A3B over
    8 H100s: a 7.7 GiB "while" value beside 7.95 GiB of weights per device): the planner adds
    each device's weight share on GPU where there is a loop (micro-batch < batch) and the
    replica spans devices; nothing on one micro-batch, on one device, for libtpu or XLA CPU."""
    import hldstudy.teacher.microbatch as mb
    from hldstudy.plan.compilers import COMPILERS

    t = preset("qwen3.5-35b-a3b", attention="chunked")

    def temp(backend, micro, shards=8):
        return replica_forward_memory(t, 256, micro, 4096, layers=(), head=True,
                                      dtype="bfloat16", backend=backend, shards=shards)

    with_copy = {(b, m, n): temp(b, m, n) for b in ("gpu", "tpu", "cpu")
                 for m in (128, 256) for n in (1, 8)}
    monkeypatch.setattr(mb, "peak_habits", lambda name: dataclasses.replace(
        COMPILERS[name], sharded_loop_weight_copy=0.0))
    for (backend, micro, shards), got in with_copy.items():
        extra = got["temp_bytes"] - temp(backend, micro, shards)["temp_bytes"]
        copies = backend == "gpu" and micro < 256 and shards > 1
        assert extra == pytest.approx(got["argument_bytes"] if copies else 0.0)
