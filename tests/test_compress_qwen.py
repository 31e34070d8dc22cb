"""Compression of Qwen3.5 students: the layout knows gated attention, Gated DeltaNet,
SwiGLU and the mixture of experts (per-expert 2:4 and FP8, the router kept dense)."""

from __future__ import annotations

import numpy as np
import optax
import pytest
from flax import nnx
from test_compress import _adamw_steps, _logits, _random_batches

from hldstudy.compress import export, fp8, prune, sparse
from hldstudy.compress.layout import Target, targets
from hldstudy.compress.pipeline import quantize_model, weight_bytes
from hldstudy.model import Transformer, preset


def _names(model):
    return {(t.module, t.name) for t in targets(model)}


def test_layout_lists_every_qwen_linear_and_keeps_gates_dense():
    dense = Transformer(preset("tiny-qwen"), rngs=nnx.Rngs(0))
    assert _names(dense) == {("mixer", n) for n in ("q", "q_gate", "k", "v", "o", "in_qkv",
                                                    "in_z", "out")} | \
        {("mlp", n) for n in ("gate", "up", "down")}
    moe = Transformer(preset("tiny-qwen-moe"), rngs=nnx.Rngs(0))
    tg = targets(moe)
    assert {n for m, n in _names(moe) if m == "mlp"} == {"gate", "up", "down", "shared_gate",
                                                         "shared_up", "shared_down"}
    # one target per expert of every stacked weight; router and shared_expert_gate dense
    assert sum(t.name == "gate" for t in tg) == 4 * moe.cfg.n_experts
    assert all(t.name not in ("router", "shared_expert_gate", "in_a", "in_b") for t in tg)
    t = Target.from_key("blocks.1.mlp.down.5")
    assert (t.layer, t.module, t.name, t.expert) == (1, "mlp", "down", 5)
    assert t.get2d(moe).shape == (moe.cfg.d_expert, moe.cfg.d_model)


# Each method and each model stays in the default suite; the other two pairs are slow.
@pytest.mark.parametrize("method,name", [
    ("sparsegpt", "tiny-qwen"), ("wanda", "tiny-qwen-moe"),
    pytest.param("wanda", "tiny-qwen", marks=pytest.mark.slow),
    pytest.param("sparsegpt", "tiny-qwen-moe", marks=pytest.mark.slow)])
def test_prune_qwen_students_to_2_4(name, method):
    model = Transformer(preset(name), rngs=nnx.Rngs(1))
    dense = nnx.clone(model)
    batches = _random_batches(2, seed=2)
    masks = prune.prune_model(model, method, batches, progress=False)
    tg = targets(model)
    assert sorted(masks) == sorted(t.key for t in tg)
    for t in tg:
        w = np.asarray(t.get2d(model))
        assert sparse.is_nm_sparse(w), t.key
        assert (w[~masks[t.key]] == 0).all() and masks[t.key].mean() == 0.5
    untouched = ["embedding", "lm_head"] + [f"blocks.{i}.mixer.conv" for i in range(3)]
    if model.cfg.n_experts:
        untouched += [f"blocks.{i}.mlp.{n}" for i in range(4)
                      for n in ("router", "shared_expert_gate")]
    items, ref = export._param_items(model), export._param_items(dense)
    for key in untouched:
        assert np.array_equal(np.asarray(items[key]), np.asarray(ref[key])), key
    assert np.isfinite(_logits(model, batches[0]["tokens"])).all()


def test_sparsegpt_beats_magnitude_on_the_qwen_moe_student():
    batches = _random_batches(2, seed=3)
    dense = Transformer(preset("tiny-qwen-moe"), rngs=nnx.Rngs(3))
    ref = _logits(dense, batches[0]["tokens"])
    errs = {}
    for method in ("magnitude", "sparsegpt"):
        m = nnx.clone(dense)
        prune.prune_model(m, method, batches, progress=False)
        errs[method] = float(np.mean((_logits(m, batches[0]["tokens"]) - ref) ** 2))
    assert errs["sparsegpt"] < errs["magnitude"]


@pytest.mark.parametrize("granularity", ["channel", "tensor"])
def test_qwen_moe_fp8_export_reloads_identical_logits(tmp_path, granularity):
    model = Transformer(preset("tiny-qwen-moe"), rngs=nnx.Rngs(4))
    masks = prune.prune_model(model, "magnitude", progress=False)
    names = tuple(sorted({t.name for t in targets(model)}))
    quantized = quantize_model(model, names, "e4m3", granularity)
    tokens = _random_batches(1)[0]["tokens"]
    ref = _logits(model, tokens)
    path = export.save_safetensors(model, tmp_path / "m.safetensors", quantized=quantized,
                                   sparse_keys=tuple(masks), fp8_format="e4m3",
                                   granularity=granularity)
    tensors, _ = export.read_safetensors(path)
    e, d, f = 8, 96, 64
    assert tensors["blocks.0.mlp.gate"].dtype == fp8.FORMATS["e4m3"].dtype
    assert tensors["blocks.0.mlp.gate"].shape == (e, d, f)
    assert tensors["blocks.0.mlp.gate.scale"].shape == ((e, f) if granularity == "channel"
                                                        else (e,))
    assert tensors["blocks.0.mlp.router"].dtype == np.float32
    back, _ = export.load_safetensors(path)
    assert np.array_equal(_logits(back, tokens), ref)
    for t in targets(back):
        assert (np.asarray(t.get2d(back))[~masks[t.key]] == 0).all()
    b = weight_bytes(model, sparse_keys=tuple(masks), quantized=quantized)
    assert b["weight_bytes_packed"] < b["weight_bytes"]


def test_hold_masks_on_stacked_experts():
    from hldstudy.compress.recover import hold_masks

    model = Transformer(preset("tiny-qwen-moe"), rngs=nnx.Rngs(5))
    masks = prune.prune_model(model, "magnitude", progress=False)
    _, state = nnx.split(model, nnx.Param)
    out = _adamw_steps(hold_masks(optax.adam(1e-2), masks, ("e4m3", "channel")),
                       {"student": state, "aux": None})
    moved = nnx.merge(nnx.split(model, nnx.Param)[0], out["student"])
    for t in targets(moved):
        w = np.asarray(t.get2d(moved))
        assert (w[~masks[t.key]] == 0).all(), t.key
        np.testing.assert_allclose(w, np.asarray(fp8.fake_quant(w)), rtol=1e-6, atol=1e-9)
