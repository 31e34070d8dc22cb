"""N:M (2:4) pruning math on one matrix: masks, scores, SparseGPT. Pure functions.

Design notes: `docs/compression.md`, under this file's name.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from hldstudy.errors import ConfigError


def check_groupable(n_in: int, m: int = 4, name: str = "matrix") -> None:
    if n_in % m:
        raise ConfigError("compress.prune",
                          f"2:4 groups run along the input dimension and {name} has input "
                          f"dimension {n_in}, not divisible by {m}",
                          "prune only models whose d_model, n_heads*head_dim and d_ff are "
                          "multiples of 4")


def nm_mask(scores, n: int = 2, m: int = 4) -> np.ndarray:
    """Bool mask [in, out]: in every group of m consecutive rows of a column, the n
    highest scores are kept (ties: the earlier row wins)."""
    s = np.asarray(scores)
    n_in, n_out = s.shape
    check_groupable(n_in, m)
    g = s.reshape(n_in // m, m, n_out)
    # Stable descending order inside each group: sort (-score) stably.
    order = np.argsort(-g, axis=1, kind="stable")
    keep = np.zeros_like(g, dtype=bool)
    np.put_along_axis(keep, order[:, :n, :], True, axis=1)
    return keep.reshape(n_in, n_out)


def is_nm_sparse(w, n: int = 2, m: int = 4) -> bool:
    """True when every group of m consecutive input weights holds at most n non-zeros."""
    w = np.asarray(w)
    if w.shape[0] % m:
        return False
    nz = (w.reshape(w.shape[0] // m, m, -1) != 0).sum(axis=1)
    return bool((nz <= n).all())


def magnitude_scores(w) -> np.ndarray:
    return np.abs(np.asarray(w, np.float64))


def wanda_scores(w, x_norm) -> np.ndarray:
    """|W_ij| * ||X[:, i]||_2; `x_norm [in]` is the input channel's L2 norm over tokens."""
    return np.abs(np.asarray(w, np.float64)) * np.asarray(x_norm, np.float64)[:, None]


def hessian(x, weights=None) -> np.ndarray:
    """H = 2 X^T X / n over tokens (rows of x [n, in]); `weights` [n] masks tokens."""
    x = np.asarray(x, np.float64)
    if weights is not None:
        x = x[np.asarray(weights) > 0]
    return 2.0 * x.T @ x / max(x.shape[0], 1)


def damped_inverse_cholesky(h, percdamp: float = 0.01):
    """(U, dead): U the upper Cholesky factor of (H + damp I)^-1; dead rows had H_ii = 0
    (an input that is always zero: its weights are pruned freely)."""
    h = jnp.asarray(h, jnp.float32)
    dead = jnp.diag(h) == 0
    h = h + jnp.diag(dead.astype(h.dtype))
    damp = percdamp * jnp.mean(jnp.diag(h))
    h = h + damp * jnp.eye(h.shape[0], dtype=h.dtype)
    lower = jnp.linalg.cholesky(h)
    eye = jnp.eye(h.shape[0], dtype=h.dtype)
    linv = jax.scipy.linalg.solve_triangular(lower, eye, lower=True)
    hinv = linv.T @ linv  # (L L^T)^-1
    # Upper factor U with U^T U = H^-1: U = chol(H^-1)^T.
    upper = jnp.linalg.cholesky(hinv).T
    return upper, dead


@functools.partial(jax.jit, static_argnames=("n", "m"))
def _sparsegpt_block(w1, u1, n: int, m: int):
    """One block of rows. w1 [B, out] (rows = inputs), u1 [B, B] upper triangular.

    Returns (q1 pruned rows, err1 [B, out] scaled errors, mask1 [B, out])."""
    b = w1.shape[0]
    diag = jnp.diag(u1)

    def body(i, carry):
        w1, q1, err1, mask1 = carry
        # Choose the group's mask at its first row, from the rows as updated so far.
        def choose(mask1):
            grp = jax.lax.dynamic_slice_in_dim(w1, i, m, axis=0)  # [m, out]
            d = jax.lax.dynamic_slice_in_dim(diag, i, m)
            err = grp ** 2 / (d[:, None] ** 2)
            # rank of each row among the m (ascending error, earlier row first on ties)
            less = (err[None, :, :] < err[:, None, :]) | (
                (err[None, :, :] == err[:, None, :])
                & (jnp.arange(m)[None, :, None] < jnp.arange(m)[:, None, None]))
            rank = jnp.sum(less, axis=1)  # [m, out]: how many rows are "smaller"
            prune = rank < (m - n)
            return jax.lax.dynamic_update_slice_in_dim(mask1, ~prune, i, axis=0)

        mask1 = jax.lax.cond(i % m == 0, choose, lambda x: x, mask1)
        w = w1[i]
        keep = mask1[i]
        q = jnp.where(keep, w, 0.0)
        e = (w - q) / diag[i]
        # rows < i of u1[i] are zero (upper triangular): only later rows move.
        w1 = w1 - u1[i][:, None] * e[None, :]
        w1 = w1.at[i].set(q)
        q1 = q1.at[i].set(q)
        err1 = err1.at[i].set(e)
        return w1, q1, err1, mask1

    init = (w1, jnp.zeros_like(w1), jnp.zeros_like(w1), jnp.ones(w1.shape, bool))
    _, q1, err1, mask1 = jax.lax.fori_loop(0, b, body, init)
    return q1, err1, mask1


def sparsegpt_prune(w, h, *, n: int = 2, m: int = 4, blocksize: int = 128,
                    percdamp: float = 0.01):
    """SparseGPT N:M on one matrix. w [in, out], h [in, in] (= 2 X^T X / n).

    Returns (w_pruned [in, out] float32, mask [in, out] bool). Every group of m
    input rows of every column keeps at most n non-zeros; the kept weights carry
    the OBS compensation of the pruned ones."""
    w = jnp.asarray(w, jnp.float32)
    check_groupable(w.shape[0], m)
    if blocksize % m:
        raise ConfigError("compress.blocksize", f"{blocksize} is not a multiple of {m}")
    return _sparsegpt(w, jnp.asarray(h, jnp.float32), jnp.float32(percdamp), n=n, m=m,
                      blocksize=blocksize)


@functools.partial(jax.jit, static_argnames=("n", "m", "blocksize"))
def _sparsegpt(w, h, percdamp, *, n: int, m: int, blocksize: int):
    """One compiled program per matrix shape: blocks unrolled, lazy updates in between."""
    n_in = w.shape[0]
    upper, dead = damped_inverse_cholesky(h, percdamp)
    w = jnp.where(dead[:, None], 0.0, w)
    outs, masks = [], []
    for i1 in range(0, n_in, blocksize):
        i2 = min(i1 + blocksize, n_in)
        q1, err1, mask1 = _sparsegpt_block(w[i1:i2], upper[i1:i2, i1:i2], n, m)
        outs.append(q1)
        masks.append(mask1)
        if i2 < n_in:  # lazy update of every later row, once per block
            w = w.at[i2:].add(-(upper[i1:i2, i2:].T @ err1))
    return jnp.concatenate(outs, 0), jnp.concatenate(masks, 0)


def reconstruction_error(w, w_new, x) -> float:
    """||X W - X W'||_F / ||X W||_F (relative layer output error on inputs x [n, in])."""
    x = np.asarray(x, np.float64)
    a = x @ np.asarray(w, np.float64)
    b = x @ np.asarray(w_new, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(a), 1e-30))
