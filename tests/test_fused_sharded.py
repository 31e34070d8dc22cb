"""The fused KD loss partitioned over the batch (jax.shard_map) under a mesh.

conftest gives 4 CPU devices. Under `jax.set_mesh` with batch axes of more than one
device, each device computes only its own rows' loss: the value and the gradients
(hidden states, head) equal the single-device ones, and the compiled program gathers
no hidden states (only the FSDP-sharded head, once). The Mosaic loss, which XLA
cannot partition by itself, lowers for TPU over an abstract 2x2 mesh.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from hldstudy.losses import fused

B, T, D_S, D_T, V = 8, 16, 32, 48, 300  # V not a multiple of any block


def _inputs(seed=0):
    ks = jax.random.split(jax.random.key(seed), 6)
    h_s = jax.random.normal(ks[0], (B, T, D_S), jnp.float32)
    h_t = jax.random.normal(ks[1], (B, T, D_T), jnp.float32)
    w_s = jax.random.normal(ks[2], (D_S, V), jnp.float32) / np.sqrt(D_S)
    w_t = jax.random.normal(ks[3], (D_T, V), jnp.float32) / np.sqrt(D_T)
    labels = jax.random.randint(ks[4], (B, T), 0, V)
    mask = jax.random.bernoulli(ks[5], 0.8, (B, T)).at[0].set(False)  # one shard's row all masked
    return h_s, w_s, h_t, w_t, labels, mask


def _loss_and_grads(backend, **kw):
    def f(h_s, w_s, h_t, w_t, labels, mask):
        loss, m = fused.fused_kd_loss(h_s, w_s, h_t, w_t, labels, mask, temperature=2.0,
                                      alpha=0.3, backend=backend, **kw)
        return loss, m

    return jax.jit(jax.value_and_grad(f, argnums=(0, 1), has_aux=True))


def _mesh(shape, axis_type=jax.sharding.AxisType.Auto):
    # Auto axes, as the trainer's mesh (sharding.make_mesh) has.
    return jax.make_mesh(shape, ("data", "fsdp"), devices=jax.devices()[:4],
                         axis_types=(axis_type,) * 2)


def _placed(mesh, args):
    h_s, w_s, h_t, w_t, labels, mask = args
    rows = NamedSharding(mesh, P(("data", "fsdp")))
    head = NamedSharding(mesh, P("fsdp"))  # FSDP shards the head's d_model axis
    return (jax.device_put(h_s, rows), jax.device_put(w_s, head), jax.device_put(h_t, rows),
            jax.device_put(w_t, head), jax.device_put(labels, rows), jax.device_put(mask, rows))


def _close(a, b, rtol=1e-6):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert np.max(np.abs(a - b)) <= rtol * max(np.max(np.abs(b)), 1e-30), np.max(np.abs(a - b))


# (backend, kwargs, mesh): interpret mode is slow, so the Triton kernels run on one mesh.
CASES = [("xla", {}, (2, 2)), ("xla", {}, (4, 1)),
         ("xla", {"vocab_block": 128, "row_block": 8}, (2, 2)),
         ("xla", {"vocab_block": 128, "row_block": 8}, (4, 1)),
         ("pallas_triton", {"interpret": True, "row_block": 16, "vocab_block": 64}, (2, 2))]


@pytest.mark.parametrize("backend,kw,mesh_shape", CASES,
                         ids=["xla-2x2", "xla-4x1", "xla-chunked-2x2", "xla-chunked-4x1",
                              "triton-interpret-2x2"])
def test_sharded_loss_and_grads_equal_single_device(backend, kw, mesh_shape):
    args = _inputs()
    step = _loss_and_grads(backend, **kw)
    (loss1, m1), (dh1, dw1) = step(*args)
    mesh = _mesh(mesh_shape)
    with jax.set_mesh(mesh):
        placed = _placed(mesh, args)
        (loss4, m4), (dh4, dw4) = step(*placed)
        text = step.lower(*placed).as_text()
    assert "shard_map" in text or "sdy.manual_computation" in text
    _close(loss4, loss1)
    _close(m4["nll"], m1["nll"])
    _close(m4["kl"], m1["kl"])
    _close(dh4, dh1)
    _close(dw4, dw1)


def _all_gather_shapes(compiled_text: str) -> list[str]:
    return re.findall(r"=\s*(\S+)\s+all-gather\(", compiled_text)


def test_compiled_sharded_loss_gathers_only_the_head():
    args = _inputs()
    step = _loss_and_grads("xla")
    mesh = _mesh((2, 2))
    with jax.set_mesh(mesh):
        placed = _placed(mesh, args)
        compiled = step.lower(*placed).compile()
    gathers = _all_gather_shapes(compiled.as_text())
    # At most the two heads (student, teacher) are gathered; never a [rows, d] hidden state
    # or the labels / mask.
    assert len(gathers) <= 2, gathers
    for shape in gathers:
        assert re.search(rf"\[{D_S},{V}\]|\[{D_T},{V}\]", shape), gathers
    # Each device keeps its own quarter of the rows: the hidden-state gradient comes out
    # sharded like the hidden states.
    assert compiled.output_shardings[1][0].spec[0] == ("data", "fsdp")


def test_without_a_mesh_the_loss_runs_whole():
    args = _inputs()
    text = _loss_and_grads("xla").lower(*args).as_text()
    assert "manual_computation" not in text and "shard_map" not in text


def test_sharded_mosaic_loss_lowers_for_tpu_over_an_abstract_2x2_mesh():
    device = jax.sharding.AbstractDevice(device_kind="TPU v5 lite", num_cores=1, platform="tpu")
    mesh = jax.sharding.AbstractMesh((2, 2), ("data", "fsdp"), abstract_device=device)
    h_s, w_s, h_t, w_t, labels, mask = _inputs()
    specs = [jax.ShapeDtypeStruct((B * 64, D_S * 4), jnp.bfloat16),
             jax.ShapeDtypeStruct((D_S * 4, 1024), jnp.bfloat16),
             jax.ShapeDtypeStruct((B * 64, D_T * 4), jnp.bfloat16),
             jax.ShapeDtypeStruct((D_T * 4, 1024), jnp.bfloat16),
             jax.ShapeDtypeStruct((B * 64,), jnp.int32),
             jax.ShapeDtypeStruct((B * 64,), jnp.bool_)]
    step = _loss_and_grads("pallas_mosaic", row_block=128, vocab_block=256)
    with jax.sharding.use_abstract_mesh(mesh):
        text = step.trace(*specs).lower(lowering_platforms=("tpu",)).as_text()
    assert "tpu_custom_call" in text
    assert "manual_computation" in text or "shard_map" in text
    # The kernels run per shard: their operands carry a quarter of the rows.
    assert re.search(rf"tensor<{B * 64 // 4}x{D_S * 4}xbf16>", text)


@pytest.mark.slow
def test_kd_training_on_a_2x2_mesh_matches_one_device(tmp_path, teacher_dir, tokenizer_path):
    """The trainer traces its step under its mesh (jax.set_mesh), so the fused loss runs
    per batch shard there too; the losses match one device's."""
    import dataclasses

    from helpers.runs import losses, student_config

    from hldstudy.train.loop import Trainer

    cfg = student_config("kd", teacher_dir, steps=4, tokenizer=tokenizer_path, loss_impl="fused")
    Trainer(cfg, tmp_path / "one", devices=jax.devices()[:1]).run()
    sharded = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, mesh_data=2,
                                                                 mesh_fsdp=2))
    Trainer(sharded, tmp_path / "four", devices=jax.devices()[:4]).run()
    one, four = losses(tmp_path / "one"), losses(tmp_path / "four")
    np.testing.assert_allclose([four[s] for s in sorted(four)], [one[s] for s in sorted(one)],
                               rtol=2e-5)
