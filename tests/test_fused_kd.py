"""Fused KD loss == materialized reference (loss and student gradients)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hldstudy.losses import fused_kd_loss, materialized_kd_loss


def make_inputs(seed, T, d_s, d_t, V, p_valid=0.7, dtype=jnp.float32, batch=None):
    k = jax.random.split(jax.random.PRNGKey(seed), 6)
    lead = (T,) if batch is None else (batch, T)
    h_s = jax.random.normal(k[0], (*lead, d_s)).astype(dtype)
    w_s = (jax.random.normal(k[1], (d_s, V)) * 0.4).astype(dtype)
    h_t = jax.random.normal(k[2], (*lead, d_t)).astype(dtype)
    w_t = (jax.random.normal(k[3], (d_t, V)) * 0.4).astype(dtype)
    labels = jax.random.randint(k[4], lead, 0, V)
    mask = jax.random.bernoulli(k[5], p_valid, lead)
    return h_s, w_s, h_t, w_t, labels, mask


def loss_and_grads(fn, inputs, **kw):
    h_s, w_s, h_t, w_t, labels, mask = inputs

    def scalar(hs, ws):
        return fn(hs, ws, h_t, w_t, labels, mask, **kw)[0]

    return jax.jit(jax.value_and_grad(scalar, argnums=(0, 1)))(h_s, w_s)


def assert_close(actual, expected, rtol):
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    scale = max(np.max(np.abs(expected)), 1e-30)
    assert np.max(np.abs(actual - expected)) / scale <= rtol, np.max(np.abs(actual - expected)) / scale


def check_matches(inputs, rtol=1e-5, **kw):
    fused_kw = {k: kw.pop(k) for k in ("row_block", "vocab_block", "backend") if k in kw}
    ref_loss, (ref_dh, ref_dw) = loss_and_grads(materialized_kd_loss, inputs, **kw)
    loss, (dh, dw) = loss_and_grads(fused_kd_loss, inputs, backend="xla", **fused_kw, **kw)
    assert_close(loss, ref_loss, rtol)
    assert_close(dh, ref_dh, rtol)
    assert_close(dw, ref_dw, rtol)


@pytest.mark.parametrize("divergence", ["forward_kl", "reverse_kl"])
@pytest.mark.parametrize("softcap", [None, 3.0])
@pytest.mark.parametrize("vocab_block", [None, 16])  # single-chunk and multi-chunk schedules
def test_matches_materialized(divergence, softcap, vocab_block):
    # 37 rows / 101 columns divide neither row_block=8 nor vocab_block=16.
    inputs = make_inputs(0, 37, 16, 24, 101)
    check_matches(
        inputs, divergence=divergence, softcap=softcap, temperature=2.0, alpha=0.3,
        row_block=8, vocab_block=vocab_block,
    )


def test_metrics_match():
    inputs = make_inputs(1, 20, 8, 8, 50)
    kw = dict(temperature=1.5, alpha=0.4, divergence="reverse_kl")
    _, ref = materialized_kd_loss(*inputs, **kw)
    _, got = fused_kd_loss(*inputs, row_block=8, vocab_block=16, **kw)
    assert_close(got["nll"], ref["nll"], 1e-5)
    assert_close(got["kl"], ref["kl"], 1e-5)


def test_batched_inputs_and_no_mask():
    h_s, w_s, h_t, w_t, labels, _ = make_inputs(2, 9, 8, 8, 40, batch=3)
    ref, _ = materialized_kd_loss(h_s, w_s, h_t, w_t, labels, None)
    got, _ = fused_kd_loss(h_s, w_s, h_t, w_t, labels, None, row_block=4, vocab_block=16)
    assert_close(got, ref, 1e-5)


def test_masked_tokens_do_not_matter():
    h_s, w_s, h_t, w_t, labels, mask = make_inputs(3, 16, 8, 8, 30)
    mask = mask.at[0].set(False)
    loss1, _ = fused_kd_loss(h_s, w_s, h_t, w_t, labels, mask, row_block=8, vocab_block=8)
    h_s2 = h_s.at[0].set(1e3)
    labels2 = labels.at[0].set(-1)
    loss2, _ = fused_kd_loss(h_s2, w_s, h_t, w_t, labels2, mask, row_block=8, vocab_block=8)
    assert np.isfinite(loss2)
    assert_close(loss2, loss1, 1e-6)


def test_teacher_gets_no_gradient():
    h_s, w_s, h_t, w_t, labels, mask = make_inputs(4, 12, 8, 8, 30)
    g_ht, g_wt = jax.grad(
        lambda ht, wt: fused_kd_loss(h_s, w_s, ht, wt, labels, mask, row_block=4, vocab_block=8)[0],
        argnums=(0, 1),
    )(h_t, w_t)
    assert not np.any(g_ht) and not np.any(g_wt)


def test_inside_bigger_grad_and_jit():
    """Used like the trainer: h_s from a module, w_s = embedding.T, plus other terms."""
    h_s, w_s, h_t, w_t, labels, mask = make_inputs(5, 24, 8, 8, 33)
    x = jax.random.normal(jax.random.PRNGKey(9), (24, 6))
    proj = jax.random.normal(jax.random.PRNGKey(10), (6, 8))
    emb = w_s.T

    def total(fn, params):
        p, e = params
        hs = jnp.tanh(x @ p)
        loss, _ = fn(hs, e.T, h_t, w_t, labels, mask, temperature=2.0, alpha=0.5,
                     row_block=8, vocab_block=16)
        return loss + 0.1 * jnp.sum(p**2)

    ref = jax.jit(jax.grad(lambda ps: total(materialized_kd_loss, ps)))((proj, emb))
    got = jax.jit(jax.grad(lambda ps: total(fused_kd_loss, ps)))((proj, emb))
    for a, b in zip(got, ref, strict=True):
        assert_close(a, b, 1e-5)


def test_cotangent_scaling():
    inputs = make_inputs(6, 10, 8, 8, 20)
    h_s, w_s, h_t, w_t, labels, mask = inputs
    for vb in (None, 8):
        g1 = jax.grad(lambda hs, vb=vb: fused_kd_loss(hs, w_s, h_t, w_t, labels, mask, vocab_block=vb)[0])(h_s)
        g3 = jax.grad(lambda hs, vb=vb: 3.0 * fused_kd_loss(hs, w_s, h_t, w_t, labels, mask, vocab_block=vb)[0])(h_s)
        assert_close(g3, 3.0 * g1, 1e-6)


def test_bf16_inputs():
    inputs = make_inputs(7, 19, 16, 16, 70, dtype=jnp.bfloat16)
    ref_loss, (ref_dh, ref_dw) = loss_and_grads(materialized_kd_loss, inputs, temperature=2.0)
    for vb in (None, 32):
        loss, (dh, dw) = loss_and_grads(fused_kd_loss, inputs, temperature=2.0, row_block=8, vocab_block=vb)
        assert dh.dtype == jnp.bfloat16 and dw.dtype == jnp.bfloat16
        assert loss.dtype == jnp.float32
        assert_close(loss, ref_loss, 1e-5)  # float32 accumulation on both sides
        assert_close(dh, ref_dh, 2e-2)  # bf16 rounding of the gradients
        assert_close(dw, ref_dw, 2e-2)


def test_errors():
    inputs = make_inputs(8, 4, 4, 4, 8)
    with pytest.raises(ValueError, match="divergence"):
        fused_kd_loss(*inputs, divergence="jsd")
    with pytest.raises(ValueError, match="alpha"):
        fused_kd_loss(*inputs, alpha=1.5)
    with pytest.raises(ValueError, match="temperature"):
        fused_kd_loss(*inputs, temperature=0.0)
    with pytest.raises(ValueError, match="backend"):
        fused_kd_loss(*inputs, backend="cuda")


@settings(max_examples=5, deadline=None)
@given(
    T=st.integers(1, 40),
    V=st.integers(2, 70),
    row_block=st.sampled_from([1, 4, 16, 64]),
    vocab_block=st.sampled_from([1, 7, 16, 1024]),
    temperature=st.sampled_from([0.5, 1.0, 2.0, 4.0]),
    alpha=st.floats(0.0, 1.0),
    divergence=st.sampled_from(["forward_kl", "reverse_kl"]),
    softcap=st.sampled_from([None, 2.0]),
)
def test_property_matches_materialized(T, V, row_block, vocab_block, temperature, alpha, divergence, softcap):
    inputs = make_inputs(T * 100 + V, T, 8, 12, V, p_valid=0.8)
    check_matches(
        inputs, rtol=2e-5, temperature=temperature, alpha=alpha, divergence=divergence,
        softcap=softcap, row_block=row_block, vocab_block=vocab_block,
    )


def test_never_materializes_logits():
    """XLA's own memory analysis: the chunked schedule's scratch is far below one [T, V] array."""
    T, d, V = 256, 16, 8192
    h_s, w_s, h_t, w_t, labels, mask = make_inputs(11, T, d, d, V)

    def temp_bytes(**kw):
        f = jax.jit(jax.value_and_grad(
            lambda hs, ws: fused_kd_loss(hs, ws, h_t, w_t, labels, mask, backend="xla", **kw)[0],
            argnums=(0, 1)))
        return f.lower(h_s, w_s).compile().memory_analysis().temp_size_in_bytes

    one_logits_array = T * V * 4
    assert temp_bytes(row_block=32, vocab_block=512) < one_logits_array / 4
    # Single-chunk schedule: O(row_block x V) plus the saved dW (d x V).
    assert temp_bytes(row_block=16) < one_logits_array / 2


def test_auto_backend_is_xla_on_cpu():
    from hldstudy.losses.fused import resolve_backend

    assert jax.default_backend() != "cpu" or resolve_backend("auto") == "xla"
