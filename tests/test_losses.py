"""Closed forms for NLL, KD divergences, the materialized KD loss and hidden alignment."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.test_util import check_grads

from hldstudy.losses import (
    Regressor,
    forward_kl_per_token,
    hidden_alignment_loss,
    jsd_per_token,
    materialized_kd_loss,
    nll_from_logits,
    normalized_mse,
    reverse_kl_per_token,
)

P_T = np.array([[0.5, 0.25, 0.25], [0.7, 0.2, 0.1]])
P_S = np.array([[1 / 3, 1 / 3, 1 / 3], [0.1, 0.6, 0.3]])


def kl_np(p, q):
    return np.sum(p * np.log(p / q), axis=-1)


def tempered(p, tau):
    q = p ** (1.0 / tau)
    return q / q.sum(-1, keepdims=True)


def identity_head_loss(z_s, z_t, labels, mask=None, **kw):
    """Runs materialized_kd_loss with h = logits and W = I, so z = h."""
    eye = jnp.eye(z_s.shape[-1])
    return materialized_kd_loss(jnp.asarray(z_s), eye, jnp.asarray(z_t), eye, labels, mask, **kw)


def test_nll_closed_form():
    logits = jnp.log(jnp.asarray(P_S))
    labels = jnp.array([1, 2])
    got = nll_from_logits(logits, labels, jnp.array([True, True]))
    np.testing.assert_allclose(got, -(np.log(1 / 3) + np.log(0.3)) / 2, rtol=1e-6)
    got_masked = nll_from_logits(logits, labels, jnp.array([False, True]))
    np.testing.assert_allclose(got_masked, -np.log(0.3), rtol=1e-6)


@pytest.mark.parametrize("tau", [1.0, 2.0, 0.5])
def test_forward_and_reverse_kl_closed_form(tau):
    z_t, z_s = np.log(P_T), np.log(P_S)
    pt, ps = tempered(P_T, tau), tempered(P_S, tau)
    np.testing.assert_allclose(forward_kl_per_token(z_s, z_t, tau), kl_np(pt, ps), rtol=1e-5)
    np.testing.assert_allclose(reverse_kl_per_token(z_s, z_t, tau), kl_np(ps, pt), rtol=1e-5)


def test_kl_invariant_to_logit_shift_and_zero_when_equal():
    z = jnp.log(jnp.asarray(P_T))
    np.testing.assert_allclose(forward_kl_per_token(z + 7.0, z, 2.0), 0.0, atol=1e-6)


@pytest.mark.parametrize("divergence", ["forward_kl", "reverse_kl"])
@pytest.mark.parametrize("tau", [1.0, 3.0])
def test_objective_alpha_and_tau_squared_scaling(divergence, tau):
    z_t, z_s = np.log(P_T), np.log(P_S)
    labels = jnp.array([0, 1])
    pt, ps = tempered(P_T, tau), tempered(P_S, tau)
    kl = kl_np(pt, ps) if divergence == "forward_kl" else kl_np(ps, pt)
    nll = -np.log(P_S[[0, 1], [0, 1]])
    for alpha in (0.0, 0.25, 1.0):
        loss, metrics = identity_head_loss(
            z_s, z_t, labels, temperature=tau, alpha=alpha, divergence=divergence
        )
        expected = alpha * nll.mean() + (1 - alpha) * tau**2 * kl.mean()
        np.testing.assert_allclose(loss, expected, rtol=1e-5)
        np.testing.assert_allclose(metrics["kl"], kl.mean(), rtol=1e-5)
        np.testing.assert_allclose(metrics["nll"], nll.mean(), rtol=1e-5)


def test_jsd_endpoints_symmetry_and_closed_form():
    z_t, z_s = jnp.log(jnp.asarray(P_T)), jnp.log(jnp.asarray(P_S))
    for beta in (0.0, 1.0):
        np.testing.assert_allclose(jsd_per_token(z_s, z_t, 1.0, beta), 0.0, atol=1e-7)
    # Near the ends JSD/beta -> KL(p_t || p_s) and JSD/(1-beta) -> KL(p_s || p_t).
    eps = 1e-3
    np.testing.assert_allclose(jsd_per_token(z_s, z_t, 1.0, eps) / eps, kl_np(P_T, P_S), rtol=2e-2)
    np.testing.assert_allclose(
        jsd_per_token(z_s, z_t, 1.0, 1 - eps) / eps, kl_np(P_S, P_T), rtol=2e-2
    )
    sym = jsd_per_token(z_s, z_t, 1.0, 0.5)
    np.testing.assert_allclose(sym, jsd_per_token(z_t, z_s, 1.0, 0.5), rtol=1e-6)
    m = 0.5 * (P_T + P_S)
    np.testing.assert_allclose(sym, 0.5 * kl_np(P_T, m) + 0.5 * kl_np(P_S, m), rtol=1e-5)
    # beta <-> 1 - beta swaps the roles of teacher and student.
    np.testing.assert_allclose(
        jsd_per_token(z_s, z_t, 1.0, 0.2), jsd_per_token(z_t, z_s, 1.0, 0.8), rtol=1e-5
    )


def test_materialized_jsd_runs():
    z_t, z_s = np.log(P_T), np.log(P_S)
    loss, metrics = identity_head_loss(z_s, z_t, jnp.array([0, 1]), divergence="jsd", jsd_beta=0.5, alpha=0.0)
    m = 0.5 * (P_T + P_S)
    np.testing.assert_allclose(metrics["kl"], np.mean(0.5 * kl_np(P_T, m) + 0.5 * kl_np(P_S, m)), rtol=1e-5)


def test_mask_excludes_tokens():
    k = jax.random.split(jax.random.PRNGKey(0), 4)
    z_s = jax.random.normal(k[0], (6, 11))
    z_t = jax.random.normal(k[1], (6, 11))
    labels = jax.random.randint(k[2], (6,), 0, 11)
    mask = jnp.array([1, 1, 0, 1, 0, 1], bool)
    loss, _ = identity_head_loss(z_s, z_t, labels, mask, temperature=2.0)
    # Garbage (huge logits, out-of-range label) in masked rows changes nothing.
    z_s2 = z_s.at[2].set(1e4).at[4].set(-1e4)
    labels2 = labels.at[4].set(10_000)
    loss2, _ = identity_head_loss(z_s2, z_t, labels2, mask, temperature=2.0)
    np.testing.assert_allclose(loss2, loss, rtol=1e-6)
    # Equal to the loss on the valid rows only.
    keep = np.asarray(mask)
    loss3, _ = identity_head_loss(z_s[keep], z_t[keep], labels[keep], None, temperature=2.0)
    np.testing.assert_allclose(loss3, loss, rtol=1e-6)


def test_batched_leading_dims():
    k = jax.random.split(jax.random.PRNGKey(1), 5)
    h_s = jax.random.normal(k[0], (2, 5, 4))
    h_t = jax.random.normal(k[1], (2, 5, 3))
    w_s, w_t = jax.random.normal(k[2], (4, 9)), jax.random.normal(k[3], (3, 9))
    labels = jax.random.randint(k[4], (2, 5), 0, 9)
    flat, _ = materialized_kd_loss(h_s.reshape(10, 4), w_s, h_t.reshape(10, 3), w_t, labels.reshape(10))
    batched, _ = materialized_kd_loss(h_s, w_s, h_t, w_t, labels)
    np.testing.assert_allclose(batched, flat, rtol=1e-6)


def test_gradients_finite_differences_and_no_teacher_grad():
    jax.config.update("jax_enable_x64", True)
    try:
        k = jax.random.split(jax.random.PRNGKey(2), 6)
        h_s = jax.random.normal(k[0], (5, 3), jnp.float64)
        w_s = jax.random.normal(k[1], (3, 7), jnp.float64)
        h_t = jax.random.normal(k[2], (5, 4), jnp.float64)
        w_t = jax.random.normal(k[3], (4, 7), jnp.float64)
        labels = jax.random.randint(k[4], (5,), 0, 7)
        mask = jnp.array([1, 0, 1, 1, 1], bool)
        for divergence in ("forward_kl", "reverse_kl", "jsd"):
            f = lambda hs, ws, divergence=divergence: materialized_kd_loss(
                hs, ws, h_t, w_t, labels, mask, temperature=1.7, alpha=0.3,
                divergence=divergence, softcap=2.5, jsd_beta=0.3,
            )[0]
            check_grads(f, (h_s, w_s), order=1, modes=("rev",), atol=1e-6, rtol=1e-6)
        g_teacher = jax.grad(
            lambda ht, wt: materialized_kd_loss(h_s, w_s, ht, wt, labels, mask)[0], argnums=(0, 1)
        )(h_t, w_t)
        assert not np.any(g_teacher[0]) and not np.any(g_teacher[1])
        check_grads(
            lambda p, t: normalized_mse(p, t, mask), (h_t, h_t * 0.5 + 1), order=1,
            modes=("rev",), atol=1e-6, rtol=1e-6,
        )
    finally:
        jax.config.update("jax_enable_x64", False)


def test_softcap_applied_to_both_sides():
    z = jnp.array([[10.0, -3.0, 0.5]])
    capped = 2.0 * jnp.tanh(z / 2.0)
    loss_cap, _ = identity_head_loss(z, z * 0.5, jnp.array([0]), softcap=2.0, temperature=1.5)
    loss_pre, _ = identity_head_loss(capped, 2.0 * jnp.tanh(z * 0.5 / 2.0), jnp.array([0]), temperature=1.5)
    np.testing.assert_allclose(loss_cap, loss_pre, rtol=1e-6)


@pytest.mark.parametrize(
    "kw, name",
    [
        (dict(alpha=-0.1), "alpha"),
        (dict(alpha=1.01), "alpha"),
        (dict(temperature=0.0), "temperature"),
        (dict(temperature=-1.0), "temperature"),
        (dict(divergence="kl"), "divergence"),
    ],
)
def test_argument_errors(kw, name):
    z = jnp.zeros((2, 3))
    with pytest.raises(ValueError, match=name):
        identity_head_loss(z, z, jnp.array([0, 1]), **kw)


def test_normalized_mse_closed_form_scale_invariance_and_mask():
    pred = jnp.array([[1.0, 2.0], [0.0, 0.0], [5.0, 5.0]])
    target = jnp.array([[1.0, 0.0], [3.0, 4.0], [9.0, 9.0]])
    mask = jnp.array([True, True, False])
    expected = (0 + 4 + 9 + 16) / (1 + 9 + 16)
    np.testing.assert_allclose(normalized_mse(pred, target, mask), expected, rtol=1e-6)
    np.testing.assert_allclose(normalized_mse(37.0 * pred, 37.0 * target, mask), expected, rtol=1e-6)
    np.testing.assert_allclose(normalized_mse(target, target), 0.0, atol=0)
    np.testing.assert_allclose(normalized_mse(jnp.zeros_like(target), target), 1.0, rtol=1e-6)


def test_regressor_and_hidden_alignment_loss():
    rngs = nnx.Rngs(0)
    regs = [Regressor(4, 6, rngs=rngs), Regressor(4, 6, rngs=rngs)]
    assert regs[0].kernel[...].dtype == jnp.float32 and regs[0].bias[...].shape == (6,)
    h = jax.random.normal(jax.random.PRNGKey(3), (2, 5, 4), jnp.bfloat16)
    out = regs[0](h)
    assert out.shape == (2, 5, 6) and out.dtype == jnp.float32
    # Init keeps the output scale near the input's (LeCun normal, zero bias).
    big = jax.random.normal(jax.random.PRNGKey(4), (4096, 4))
    assert 0.3 < float(jnp.std(regs[0](big))) < 3.0
    t1, t2 = jax.random.normal(jax.random.PRNGKey(5), (2, 2, 5, 6))
    mask = jnp.ones((2, 5), bool)
    loss = hidden_alignment_loss([h, h], [t1, t2], regs, mask)
    expected = (normalized_mse(regs[0](h), t1, mask) + normalized_mse(regs[1](h), t2, mask)) / 2
    np.testing.assert_allclose(loss, expected, rtol=1e-6)

    # Gradient flows to the regressor, not to the teacher.
    graphdef, params = nnx.split(regs[0])

    def f(params, t):
        reg = nnx.merge(graphdef, params)
        return hidden_alignment_loss([h], [t], [reg], mask)

    g_params, g_t = jax.grad(f, argnums=(0, 1))(params, t1)
    assert np.any(jax.tree.leaves(g_params)[0]) and not np.any(g_t)
    with pytest.raises(ValueError, match="regressors"):
        hidden_alignment_loss([h], [t1, t2], regs, mask)
