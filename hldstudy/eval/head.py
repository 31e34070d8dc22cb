"""Target log-probabilities from final hidden states: the LM head fused with the
log-softmax over vocabulary chunks, never building rows x vocab beyond a bound.

`target_logprobs(h, w, targets)` returns, per row of `h` [N, D], log p(target) and
whether the target is the argmax, computing the logits `h @ w` (soft-capped like
the model's head) one vocabulary chunk at a time with an online log-sum-exp, the
way the fused KD loss does (chunk layout and per-row reductions from
`hldstudy.losses.kd_chunks`). Rows are also processed in blocks, so the largest
float32 temporary is `row_block x vocab_block` whatever N is: a scorer gathers the
few positions whose log-probabilities are needed first and pays the head only
there, and a corpus scorer passes every position without a [N, V] block.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from hldstudy.losses.kd_chunks import chunk_columns, chunk_layout, row_max, row_sum
from hldstudy.numerics import softcap

# 8192 columns x 1024 rows float32 = 32 MB per chunk of logits (CPU caches and
# Gemma's 262k vocabulary in 32 steps); both are clamped to the problem's size.
VOCAB_BLOCK = 8192
ROW_BLOCK = 1024
# Up to this many logits (rows x vocab; 128 MB float32) the head is one matmul and one
# log-softmax: a scorer's few gathered rows (lm-eval's continuations) then read the
# weight once, where the chunked loop slices it (and, tied to the embedding, its
# transpose) chunk by chunk: 1.5-3x slower on the CPU at 16-64 rows of Gemma's head.
DIRECT_LOGITS = 1 << 25


def _block_logprobs(h_RxD, w_DxV, targets_R, cap: float | None, vocab_block: int):
    rows = h_RxD.shape[0]
    vocab = w_DxV.shape[1]
    width, n_chunks = chunk_layout(vocab, vocab_block)
    t_Rx1 = targets_R[:, None]

    def step(j, carry):
        m, s, z_y, best, best_idx = carry
        start, valid_1xC, cols_1xC = chunk_columns(j, width, vocab)
        w_DxC = jax.lax.dynamic_slice_in_dim(w_DxV, start, width, axis=1)
        z = jnp.einsum("rd,dc->rc", h_RxD, w_DxC, preferred_element_type=jnp.float32)
        # A clamped last chunk overlaps the one before: its repeated columns are -inf.
        z = jnp.where(valid_1xC, softcap(z, cap), -jnp.inf)
        m_new = jnp.maximum(m, row_max(z))
        s = s * jnp.exp(m - m_new) + row_sum(jnp.exp(z - m_new))
        z_y = z_y + row_sum(jnp.where((cols_1xC == t_Rx1) & valid_1xC, z, 0.0))
        c_max = row_max(z)
        c_idx = start + jnp.argmax(z, axis=-1, keepdims=True).astype(jnp.int32)
        # Strictly greater: ties keep the earlier column, as jnp.argmax over the row does.
        better = c_max > best
        return (m_new, s, z_y, jnp.where(better, c_max, best), jnp.where(better, c_idx, best_idx))

    neg_inf = jnp.full((rows, 1), -jnp.inf, jnp.float32)
    zero = jnp.zeros((rows, 1), jnp.float32)
    init = (neg_inf, zero, zero, neg_inf, jnp.zeros((rows, 1), jnp.int32))
    m, s, z_y, _, best_idx = jax.lax.fori_loop(0, n_chunks, step, init)
    return (z_y - (m + jnp.log(s)))[:, 0], (best_idx == t_Rx1)[:, 0]


def _direct_logprobs(h_NxD, w, targets_N, cap: float | None, vocab_major: bool):
    spec = "nd,vd->nv" if vocab_major else "nd,dv->nv"
    z_NxV = softcap(jnp.einsum(spec, h_NxD, w, preferred_element_type=jnp.float32), cap)
    z_y = jnp.take_along_axis(z_NxV, targets_N[:, None], axis=1)[:, 0]
    return z_y - jax.nn.logsumexp(z_NxV, axis=-1), jnp.argmax(z_NxV, axis=-1) == targets_N


def target_logprobs(h_NxD: jax.Array, w: jax.Array, targets_N: jax.Array, *,
                    cap: float | None = None, vocab_block: int = VOCAB_BLOCK,
                    row_block: int = ROW_BLOCK, direct_logits: int = DIRECT_LOGITS,
                    vocab_major: bool = False) -> tuple[jax.Array, jax.Array]:
    """(log p(targets) float32 [N], targets == argmax bool [N]) of logits
    softcap(h @ w, cap): in one piece up to `direct_logits` logits, else built one
    [row_block, vocab_block] chunk at a time. `w` is [D, V], or [V, D] with
    `vocab_major` (a tied embedding as it is stored: the one-piece head then reads it
    without a transposed copy)."""
    n, d = h_NxD.shape
    w = w.astype(h_NxD.dtype)
    targets_N = targets_N.astype(jnp.int32)
    if n * w.shape[0 if vocab_major else 1] <= direct_logits:
        return _direct_logprobs(h_NxD, w, targets_N, cap, vocab_major)
    w_DxV = w.T if vocab_major else w
    r = max(1, min(n, row_block))
    if r == n:
        return _block_logprobs(h_NxD, w_DxV, targets_N, cap, vocab_block)
    n_pad = -n % r
    h_BxRxD = jnp.pad(h_NxD, ((0, n_pad), (0, 0))).reshape(-1, r, d)
    t_BxR = jnp.pad(targets_N, (0, n_pad)).reshape(-1, r)
    logp, greedy = jax.lax.map(
        lambda a: _block_logprobs(a[0], w_DxV, a[1], cap, vocab_block), (h_BxRxD, t_BxR))
    return logp.reshape(-1)[:n], greedy.reshape(-1)[:n]
