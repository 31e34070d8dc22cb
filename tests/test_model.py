"""Model behaviour pinned against closed forms and invariances."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from hldstudy.model import Transformer, count_module_params, count_params, preset
from hldstudy.model.layers import RMSNorm, apply_rope, attention_mask


@pytest.fixture(scope="module")
def tiny():
    return Transformer(preset("tiny"), rngs=nnx.Rngs(0))


def test_param_count_closed_form_matches_module(tiny):
    assert count_params(tiny.cfg)["total"] == count_module_params(tiny)


def test_gemma3_270m_param_count():
    counts = count_params(preset("gemma3-270m"))
    assert counts["total"] == 268_098_176  # 170M embedding + 100M transformer (Gemma 3 270M)
    assert counts["embedding"] == 262144 * 640


def test_paper_student_sizes():
    assert abs(count_params(preset("paper-123m"))["total"] / 1e6 - 121.3) < 1.0
    assert abs(count_params(preset("paper-735m"))["total"] / 1e6 - 735.5) < 1.5


def test_rmsnorm_closed_form():
    norm = RMSNorm(4, 1e-6)
    norm.scale[...] = jnp.array([0.0, 1.0, -0.5, 2.0])
    x = jnp.array([[1.0, 2.0, 3.0, 4.0]])
    ref = x / np.sqrt(np.mean(np.square(x)) + 1e-6) * (1 + np.array([0.0, 1.0, -0.5, 2.0]))
    np.testing.assert_allclose(norm(x), ref, rtol=1e-6)


def test_rope_is_relative():
    """q.k after RoPE depends only on the position difference."""
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.normal(size=(1, 1, 1, 16)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(1, 1, 1, 16)), jnp.float32)

    def score(pq, pk):
        rq = apply_rope(q, jnp.array([[pq]]), 10_000.0)
        rk = apply_rope(k, jnp.array([[pk]]), 10_000.0)
        return float(jnp.sum(rq * rk))

    assert score(5, 2) == pytest.approx(score(13, 10), rel=1e-5)
    assert score(0, 0) == pytest.approx(float(jnp.sum(q * k)), rel=1e-5)


def test_logits_are_causal(tiny):
    rng = np.random.default_rng(1)
    tokens = jnp.asarray(rng.integers(0, 512, (2, 40)), jnp.int32)
    changed = tokens.at[:, 25:].set((tokens[:, 25:] + 7) % 512)
    a, b = tiny(tokens).logits, tiny(changed).logits
    np.testing.assert_array_equal(a[:, :25], b[:, :25])
    assert not np.allclose(a[:, 25:], b[:, 25:])


def test_local_layers_ignore_tokens_beyond_window():
    cfg = dataclasses.replace(preset("tiny"), sliding_window=8, global_every=10**6)  # all local
    assert not any(cfg.is_global_layer(i) for i in range(cfg.n_layers))
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(2)
    tokens = jnp.asarray(rng.integers(0, 512, (1, 60)), jnp.int32)
    changed = tokens.at[:, :10].set((tokens[:, :10] + 3) % 512)
    # Receptive field of the last position through 4 local layers of window 8: 4 * 7 = 28 back.
    out_a = model(tokens, hidden_layers=(1,))
    out_b = model(changed, hidden_layers=(1,))
    np.testing.assert_array_equal(out_a.logits[:, 10 + 28:], out_b.logits[:, 10 + 28:])
    # After one local layer, position t sees only t-7..t.
    np.testing.assert_array_equal(out_a.hidden[1][:, 17:], out_b.hidden[1][:, 17:])
    assert not np.allclose(out_a.hidden[1][:, 16], out_b.hidden[1][:, 16])


def test_global_layer_sees_whole_context(tiny):
    rng = np.random.default_rng(3)
    tokens = jnp.asarray(rng.integers(0, 512, (1, 100)), jnp.int32)
    changed = tokens.at[:, 0].set((tokens[:, 0] + 1) % 512)
    assert not np.allclose(tiny(tokens).logits[:, -1], tiny(changed).logits[:, -1])


def test_packed_documents_do_not_attend_to_each_other(tiny):
    rng = np.random.default_rng(4)
    doc_a = rng.integers(0, 512, 12)
    doc_b = rng.integers(0, 512, 20)
    tokens = jnp.asarray(np.concatenate([doc_a, doc_b])[None], jnp.int32)
    segments = jnp.asarray([[1] * 12 + [2] * 20], jnp.int32)
    positions = jnp.asarray([list(range(12)) + list(range(20))], jnp.int32)
    packed = tiny(tokens, positions, segments).logits
    alone_b = tiny(jnp.asarray(doc_b[None], jnp.int32)).logits
    np.testing.assert_allclose(packed[:, 12:], alone_b, atol=2e-5, rtol=2e-5)
    alone_a = tiny(jnp.asarray(doc_a[None], jnp.int32)).logits
    np.testing.assert_allclose(packed[:, :12], alone_a, atol=2e-5, rtol=2e-5)


def test_attention_mask_window_semantics():
    mask = attention_mask(jnp.ones((1, 6), jnp.int32), window=3)[0]
    expected = np.array([[int(0 <= t - s < 3) for s in range(6)] for t in range(6)], bool)
    np.testing.assert_array_equal(mask, expected)


def test_hidden_states_without_logits(tiny):
    tokens = jnp.zeros((1, 8), jnp.int32)
    full = tiny(tokens, hidden_layers=(0, 2, 4))
    lean = tiny(tokens, hidden_layers=(2,), return_logits=False)
    assert lean.logits is None
    np.testing.assert_array_equal(lean.hidden[2], full.hidden[2])
    np.testing.assert_allclose(full.logits, full.final_hidden @ tiny.head_weight(), rtol=1e-5,
                               atol=1e-5)
    partial = tiny(tokens, hidden_layers=(2,), max_layer=2)
    assert partial.final_hidden is None
    np.testing.assert_array_equal(partial.hidden[2], full.hidden[2])


def test_final_softcap_bounds_logits():
    cfg = dataclasses.replace(preset("tiny"), final_softcap=2.0, attn_softcap=5.0)
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    logits = model(jnp.arange(16, dtype=jnp.int32)[None]).logits
    assert float(jnp.max(jnp.abs(logits))) < 2.0


def test_bf16_compute_close_to_float32(tiny):
    cfg16 = dataclasses.replace(tiny.cfg, dtype="bfloat16")
    graphdef, params = nnx.split(tiny, nnx.Param)
    model16 = nnx.merge(nnx.split(Transformer(cfg16, rngs=nnx.Rngs(0)), nnx.Param)[0], params)
    tokens = jnp.arange(32, dtype=jnp.int32)[None]
    p32 = jax.nn.softmax(tiny(tokens).logits)
    p16 = jax.nn.softmax(model16(tokens).logits)
    assert float(jnp.max(jnp.abs(p32 - p16))) < 0.05


def test_remat_gives_same_gradients():
    cfg = preset("tiny")
    tokens = jnp.arange(16, dtype=jnp.int32)[None]

    def grads(remat):
        model = Transformer(dataclasses.replace(cfg, remat=remat), rngs=nnx.Rngs(0))
        return nnx.grad(lambda m: jnp.mean(m(tokens).logits ** 2))(model)

    a, b = grads(False), grads(True)
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b), strict=True):
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6)
