"""Compression: 2:4 masks, Wanda, SparseGPT, FP8, recovery with masks held, export, CLI."""

from __future__ import annotations

import numpy as np
import pytest

from hldstudy.compress import fp8, sparse

# --------------------------------------------------------------------------- #
# Pure math
# --------------------------------------------------------------------------- #


def _correlated_inputs(rng, n, d):
    """Tokens with correlated channels and a few large ones (like LM activations)."""
    mix = rng.normal(size=(d, d)) / np.sqrt(d)
    x = rng.normal(size=(n, d)) @ (np.eye(d) + 2.0 * mix)
    x[:, : max(1, d // 16)] *= 6.0
    return x


def test_nm_mask_keeps_two_largest_of_every_four():
    rng = np.random.default_rng(0)
    s = rng.normal(size=(16, 5))
    mask = sparse.nm_mask(np.abs(s))
    assert mask.shape == s.shape
    groups = mask.reshape(4, 4, 5)
    assert (groups.sum(axis=1) == 2).all()
    a = np.abs(s).reshape(4, 4, 5)
    kept_min = np.where(groups, a, np.inf).min(axis=1)
    dropped_max = np.where(~groups, a, -np.inf).max(axis=1)
    assert (kept_min >= dropped_max).all()
    assert sparse.is_nm_sparse(s * mask)
    assert not sparse.is_nm_sparse(s)


def test_wanda_scores_weight_inputs_by_channel_norm():
    w = np.ones((8, 3))
    x_norm = np.array([1, 5, 2, 3, 9, 1, 1, 4.0])
    mask = sparse.nm_mask(sparse.wanda_scores(w, x_norm))
    # channels 1, 3 of the first group; 4, 7 of the second, in every column
    assert mask[:, 0].tolist() == [False, True, False, True, True, False, False, True]


def test_groupable_error_names_the_dimension():
    from hldstudy.errors import ConfigError

    with pytest.raises(ConfigError, match="not divisible by 4"):
        sparse.nm_mask(np.ones((6, 2)))


def _sparsegpt_direct_f64(w, h, percdamp, n=2, m=4):
    """SparseGPT's update, written directly in float64: rows (inputs) in order; at
    each row q the inverse Hessian of the rows not yet visited, inv(H[q:, q:]), is
    computed afresh (no Cholesky, no blocks, no lazy updates); the mask of a group is
    chosen at its first row by w^2 / [H_F^-1]_jj; the OBS update is
    W[q:] -= ((w_q - w'_q) / [H_F^-1]_qq) * [H_F^-1]_{q,:}."""
    w = np.array(w, np.float64)
    h = np.array(h, np.float64)
    h = h + percdamp * np.mean(np.diag(h)) * np.eye(len(h))
    n_in = w.shape[0]
    hinv_rows = [np.linalg.inv(h[q:, q:])[0] for q in range(n_in)]  # row q of H_F^-1, F = q..
    d = np.array([r[0] for r in hinv_rows])
    keep = np.ones_like(w, dtype=bool)
    for q in range(n_in):
        if q % m == 0:
            err = w[q:q + m] ** 2 / d[q:q + m, None]
            order = np.argsort(err, axis=0, kind="stable")
            for j in range(w.shape[1]):
                keep[q + order[: m - n, j], j] = False
        new = np.where(keep[q], w[q], 0.0)
        e = (w[q] - new) / d[q]
        w[q:] -= np.outer(hinv_rows[q], e)
        w[q] = new
    return w, keep


@pytest.mark.parametrize("blocksize", [8, 128])
def test_sparsegpt_matches_direct_float64_and_beats_magnitude(blocksize):
    rng = np.random.default_rng(1)
    n_in, n_out = 32, 24
    x = _correlated_inputs(rng, 512, n_in)
    w = rng.normal(size=(n_in, n_out)) / np.sqrt(n_in)
    h = sparse.hessian(x)
    w_sg, mask = sparse.sparsegpt_prune(w, h, blocksize=blocksize, percdamp=0.01)
    w_sg = np.asarray(w_sg)
    assert sparse.is_nm_sparse(w_sg)
    assert (w_sg[~np.asarray(mask)] == 0).all()
    w_ref, keep_ref = _sparsegpt_direct_f64(w, h, 0.01)
    assert (np.asarray(mask) == keep_ref).all()
    err_sg = sparse.reconstruction_error(w, w_sg, x)
    err_ref = sparse.reconstruction_error(w, w_ref, x)
    assert abs(err_sg - err_ref) <= 1e-4 * err_ref
    w_mag = w * sparse.nm_mask(sparse.magnitude_scores(w))
    err_mag = sparse.reconstruction_error(w, w_mag, x)
    assert err_sg < err_mag


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("granularity", ["channel", "tensor"])
def test_fp8_round_trip_within_format_bound_per_channel(fmt, granularity):
    rng = np.random.default_rng(2)
    w = rng.normal(size=(64, 12)) * np.logspace(-3, 1, 12)[None, :]
    w[::4] = 0.0  # zeros survive
    w[1, 3] = 1e-9  # a subnormal after scaling
    q, scale = fp8.quantize_fp8(w, fmt, granularity)
    assert q.dtype == fp8.FORMATS[fmt].dtype
    assert np.asarray(scale).shape == ((12,) if granularity == "channel" else ())
    back = np.asarray(fp8.dequantize_fp8(q, scale), np.float64)
    err = np.abs(back - w.astype(np.float32))
    bound = fp8.error_bound(w.astype(np.float32), np.broadcast_to(scale, (12,))[None, :], fmt)
    assert (err <= bound).all()
    assert (back[::4] == 0).all()
    # normal range: relative error at most half an ulp, 2^-(m+1)
    f = fp8.FORMATS[fmt]
    normal = np.abs(w) >= np.broadcast_to(scale, (12,))[None, :] * 2.0 ** f.min_normal_exp
    rel = err[normal] / np.abs(w[normal])
    assert rel.max() <= 2.0 ** -(f.mantissa_bits + 1) + 1e-6
    # per-channel scales use the format's full range in every column
    if granularity == "channel":
        amax_q = np.abs(np.asarray(q, np.float32)).max(axis=0)
        assert np.allclose(amax_q, f.fmax)


def test_fp8_dot_real_and_simulated_paths_agree():
    import jax.numpy as jnp

    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.normal(size=(5, 32)), jnp.float32)
    w = rng.normal(size=(32, 8)) / 6
    q, s = fp8.quantize_fp8(w)
    sim = fp8.fp8_dot(x, q, s, real=False)
    np.testing.assert_allclose(sim, np.asarray(x) @ np.asarray(fp8.dequantize_fp8(q, s)),
                               rtol=1e-5, atol=1e-6)
    real = fp8.fp8_dot(x, q, s, real=True)  # XLA emulates FP8 on CPU
    ref = np.asarray(x, np.float64) @ w
    # W8A8 error: a few percent of the output scale
    assert np.abs(np.asarray(real) - ref).max() <= 0.1 * np.abs(ref).max()
    import jax

    if jax.devices()[0].platform == "cpu":
        assert not fp8.backend_has_fp8_matmul()  # CPU: no FP8 units, simulated by default
