"""Attention kernels behind `model.attention`: dense, chunked (flash-style), cuDNN.

Design notes: `docs/model.md`, under this file's name.
"""

from __future__ import annotations

import dataclasses
import functools
import logging

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as splash_mask

from hldstudy.chips import traced_target
from hldstudy.config import ATTENTIONS
from hldstudy.errors import ConfigError
from hldstudy.mesh_axes import axes_size, shard_mapped, traced_batch_axes
from hldstudy.numerics import softcap as softcap_fn

IMPLEMENTATIONS = ATTENTIONS  # the values model.attention may take

_NEG_INF = -2.3819763e38  # finite "minus infinity": keeps fully-masked rows NaN-free
# Running-max start of the online softmax: far below any real logit but far above
# _NEG_INF, so masked entries get weight exp(_NEG_INF - m) == 0 even in a row whose
# every key so far was masked (starting at _NEG_INF would give them weight 1).
_M_INIT = -1e30
# Row log-sum-exp stored for a row with no visible key: p = exp(s - lse) == 0.
_LSE_EMPTY = 3.0e38

# CPU defaults (benchmarks/attention.py): blocks of 256 keep XLA's matmuls large
# enough that per-block loop overhead stays small, and band edges cost at most
# one partly masked block per query block.
DEFAULT_BLOCK_Q = 256
DEFAULT_BLOCK_K = 256
# `auto` on CPU/TPU: from this length on, chunked is both leaner and faster on
# CPU (benchmarks/results/attention.md: fwd+bwd 0.55x dense's time at T = 512,
# 0.36x at 1024, 0.19x at 4096); shorter rows are one or two blocks, nothing to
# skip, and dense's T x T is small.
AUTO_CHUNKED_MIN_T = 512
_CUDNN_DTYPES = ("bfloat16", "float16")
# Splash attention's blocks: a multiple of 128 lanes; the largest of SPLASH_BLOCKS that
# divides T is used for the forward and both backward kernels.
SPLASH_MIN_BLOCK = 128
SPLASH_BLOCKS = (512, 256, 128)

log = logging.getLogger("hldstudy.model")


# --------------------------------------------------------------------------- #
# Masks
# --------------------------------------------------------------------------- #


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True)
class BranchSegments:
    """Segment ids read as bit sets: a key is visible to a later query when their sets
    intersect (0: visible to none). Continuations scored after one shared context: the
    context carries every branch's bit, each branch its own, so a branch sees the context
    and itself, never another branch (`hldstudy.eval.adapter`'s shared contexts). Index
    distance stands for position distance in the window: rows no longer than the window.
    Dense and chunked paths only (`attend` takes chunked for cuDNN / splash)."""

    bits_BxT: jax.Array

    def tree_flatten(self):
        return (self.bits_BxT,), None

    @classmethod
    def tree_unflatten(cls, _, children):
        return cls(*children)


def _same_segment(seg_q_BxQ, seg_k_BxK, branches: bool):
    """[B, Q, K] bool: keys in the query's document (its branch or their shared context)."""
    if branches:
        return (seg_q_BxQ[:, :, None] & seg_k_BxK[:, None, :]) != 0
    return seg_q_BxQ[:, :, None] == seg_k_BxK[:, None, :]


def attention_mask(segment_ids_BxT, window: int | None) -> jax.Array:
    """[B, T, S] bool: causal, within one packed document (or branch, `BranchSegments`),
    and inside the window.

    A local layer with window W lets query t see keys s with t - W < s <= t
    (W keys including itself), as Gemma 3 does.
    """
    branches = isinstance(segment_ids_BxT, BranchSegments)
    seg = segment_ids_BxT.bits_BxT if branches else segment_ids_BxT
    seq_len = seg.shape[1]
    q_idx = jnp.arange(seq_len)[:, None]
    k_idx = jnp.arange(seq_len)[None, :]
    allowed_TxS = k_idx <= q_idx
    if window is not None:
        allowed_TxS &= (q_idx - k_idx) < window
    return allowed_TxS[None] & _same_segment(seg, seg, branches)


# --------------------------------------------------------------------------- #
# Dense (reference)
# --------------------------------------------------------------------------- #


def dense_attention(q_BxTxNxH, k_BxSxKxH, v_BxSxKxH, segment_ids_BxT=None, *,
                    window: int | None = None, softcap: float | None = None):
    """Masked T x T attention; the numerics every other path is tested against."""
    b, t, n, h = q_BxTxNxH.shape
    n_kv = k_BxSxKxH.shape[2]
    dt = q_BxTxNxH.dtype
    if segment_ids_BxT is None:
        segment_ids_BxT = jnp.ones((b, t), jnp.int32)
    mask_BxTxS = attention_mask(segment_ids_BxT, window)
    q_BxTxKxGxH = q_BxTxNxH.reshape(b, t, n_kv, n // n_kv, h)
    logits_BxKxGxTxS = jnp.einsum("btkgh,bskh->bkgts", q_BxTxKxGxH, k_BxSxKxH,
                                  preferred_element_type=jnp.float32)
    logits_BxKxGxTxS = softcap_fn(logits_BxKxGxTxS, softcap)
    logits_BxKxGxTxS = jnp.where(mask_BxTxS[:, None, None], logits_BxKxGxTxS, _NEG_INF)
    probs = jax.nn.softmax(logits_BxKxGxTxS, axis=-1).astype(dt)
    out_BxTxKxGxH = jnp.einsum("bkgts,bskh->btkgh", probs, v_BxSxKxH)
    return out_BxTxKxGxH.reshape(b, t, n, h)


# --------------------------------------------------------------------------- #
# Chunked (flash-style, pure JAX)
# --------------------------------------------------------------------------- #


@dataclasses.dataclass(frozen=True)
class _Blocks:
    """Static description of one chunked attention call (hashable: custom_vjp arg)."""

    window: int | None
    softcap: float | None
    block_q: int
    block_k: int
    n_q_blocks: int
    n_k_blocks: int
    branches: bool = False  # segment ids are BranchSegments bit sets


def _key_block_range(i, s: _Blocks):
    """[lo, hi) key blocks that intersect query block i's causal/window band."""
    q_first = i * s.block_q
    q_last = q_first + s.block_q - 1
    hi = jnp.minimum(s.n_k_blocks, q_last // s.block_k + 1)
    if s.window is None:
        return jnp.int32(0), hi
    lo = jnp.maximum(0, (q_first - s.window + 1) // s.block_k)
    return lo, hi


def _query_block_range(j, s: _Blocks):
    """[lo, hi) query blocks whose band intersects key block j."""
    k_first = j * s.block_k
    k_last = k_first + s.block_k - 1
    lo = k_first // s.block_q
    if s.window is None:
        return lo, jnp.int32(s.n_q_blocks)
    hi = jnp.minimum(s.n_q_blocks, (k_last + s.window - 1) // s.block_q + 1)
    return lo, hi


def _spec(seq_len: int, window: int | None, softcap: float | None, block_q: int,
          block_k: int) -> _Blocks:
    """Blocks clipped to T (a short sequence is one block), counts rounded up (padding)."""
    bq, bk = min(block_q, seq_len), min(block_k, seq_len)
    return _Blocks(window=window, softcap=softcap, block_q=bq, block_k=bk,
                   n_q_blocks=-(-seq_len // bq), n_k_blocks=-(-seq_len // bk))


def evaluated_blocks(seq_len: int, window: int | None, block_q: int = DEFAULT_BLOCK_Q,
                     block_k: int = DEFAULT_BLOCK_K) -> dict:
    """(query block, key block) pairs the chunked kernel computes, forward and backward.

    Returns {"forward": set, "backward": set, "block_q", "block_k"} (block sizes
    after clipping to T). For FLOP accounting (each pair is block_q x block_k
    logits) and for tests that the band is exact.
    """
    s = _spec(seq_len, window, None, block_q, block_k)
    fwd, bwd = set(), set()
    for i in range(s.n_q_blocks):
        lo, hi = _key_block_range(i, s)
        fwd.update((i, j) for j in range(int(lo), int(hi)))
    for j in range(s.n_k_blocks):
        lo, hi = _query_block_range(j, s)
        bwd.update((i, j) for i in range(int(lo), int(hi)))
    return {"forward": fwd, "backward": bwd, "block_q": s.block_q, "block_k": s.block_k}


def _block_logits(q_i, k_j, seg_q, seg_k, i, j, s: _Blocks):
    """Masked (and soft-capped) float32 logits of query block i x key block j.

    q_i [B, K, G, bq, H], k_j [B, K, bk, H], seg_q [B, bq] | None, seg_k [B, bk] | None.
    Returns (logits [B, K, G, bq, bk], tanh or None): the tanh is reused by the
    soft-cap's backward.
    """
    raw = jnp.einsum("bkgqh,bkch->bkgqc", q_i, k_j, preferred_element_type=jnp.float32)
    tanh = None
    if s.softcap is not None:  # numerics.softcap, spelled out to keep tanh for the backward
        tanh = jnp.tanh(raw / s.softcap)
        raw = tanh * s.softcap
    q_pos = i * s.block_q + jnp.arange(s.block_q)
    k_pos = j * s.block_k + jnp.arange(s.block_k)
    allowed_QxC = k_pos[None, :] <= q_pos[:, None]
    if s.window is not None:
        allowed_QxC &= (q_pos[:, None] - k_pos[None, :]) < s.window
    allowed = allowed_QxC[None, None, None]
    if seg_q is not None:
        allowed = allowed & _same_segment(seg_q, seg_k, s.branches)[:, None, None]
    return jnp.where(allowed, raw, _NEG_INF), tanh


def _slice(x, start, size, axis):
    return lax.dynamic_slice_in_dim(x, start, size, axis=axis)


def _chunked_forward(s: _Blocks, q, k, v, seg):
    """q [B, K, G, Tq, H], k/v [B, K, Tk, H] (padded). Returns out (q layout), lse [B, K, G, Tq]."""
    b, n_kv, g, _, h = q.shape
    stat_shape = (b, n_kv, g, s.block_q)

    def q_block(i):
        q_i = _slice(q, i * s.block_q, s.block_q, 3)
        seg_q = None if seg is None else _slice(seg, i * s.block_q, s.block_q, 1)

        def k_step(j, carry):
            m, denom, acc = carry
            k_j = _slice(k, j * s.block_k, s.block_k, 2)
            v_j = _slice(v, j * s.block_k, s.block_k, 2)
            seg_k = None if seg is None else _slice(seg, j * s.block_k, s.block_k, 1)
            logits, _ = _block_logits(q_i, k_j, seg_q, seg_k, i, j, s)
            m_new = jnp.maximum(m, logits.max(axis=-1))
            p = jnp.exp(logits - m_new[..., None])
            rescale = jnp.exp(m - m_new)
            denom = denom * rescale + p.sum(axis=-1)
            pv = jnp.einsum("bkgqc,bkch->bkgqh", p.astype(v.dtype), v_j,
                            preferred_element_type=jnp.float32)
            return m_new, denom, acc * rescale[..., None] + pv

        lo, hi = _key_block_range(i, s)
        init = (jnp.full(stat_shape, _M_INIT, jnp.float32), jnp.zeros(stat_shape, jnp.float32),
                jnp.zeros((*stat_shape, h), jnp.float32))
        m, denom, acc = lax.fori_loop(lo, hi, k_step, init)
        seen = denom > 0
        safe_denom = jnp.where(seen, denom, 1.0)
        out = (acc / safe_denom[..., None]).astype(q.dtype)
        lse = jnp.where(seen, m + jnp.log(safe_denom), _LSE_EMPTY)
        return out, lse

    # [nq, B, K, G, bq, ...] -> [B, K, G, nq * bq, ...]
    out_blocks, lse_blocks = lax.map(q_block, jnp.arange(s.n_q_blocks))
    out = jnp.moveaxis(out_blocks, 0, 3).reshape(q.shape)
    lse = jnp.moveaxis(lse_blocks, 0, 3).reshape(q.shape[:-1])
    return out, lse


def _chunked_backward(s: _Blocks, q, k, v, seg, out, lse, d_out):
    """Flash backward: key blocks outer (dK, dV in registers), query blocks inner.

    dQ is carried whole (O(T H)) and updated block by block; each block's
    probabilities are rebuilt from the saved row log-sum-exp.
    """
    b, n_kv, g, tq, h = q.shape
    # D_i = sum_h dO * O: the softmax-Jacobian row term, once per row.
    delta = jnp.sum(d_out.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)

    def k_block(dq, j):
        k_j = _slice(k, j * s.block_k, s.block_k, 2)
        v_j = _slice(v, j * s.block_k, s.block_k, 2)
        seg_k = None if seg is None else _slice(seg, j * s.block_k, s.block_k, 1)

        def q_step(i, carry):
            dq, dk_j, dv_j = carry
            start = i * s.block_q
            q_i = _slice(q, start, s.block_q, 3)
            do_i = _slice(d_out, start, s.block_q, 3)
            lse_i = _slice(lse, start, s.block_q, 3)
            delta_i = _slice(delta, start, s.block_q, 3)
            seg_q = None if seg is None else _slice(seg, start, s.block_q, 1)
            logits, tanh = _block_logits(q_i, k_j, seg_q, seg_k, i, j, s)
            p = jnp.exp(logits - lse_i[..., None])  # masked entries: exactly 0
            dv_j = dv_j + jnp.einsum("bkgqc,bkgqh->bkch", p.astype(d_out.dtype), do_i,
                                     preferred_element_type=jnp.float32)
            dp = jnp.einsum("bkgqh,bkch->bkgqc", do_i, v_j, preferred_element_type=jnp.float32)
            ds = p * (dp - delta_i[..., None])
            if tanh is not None:  # d(c tanh(x / c))/dx = 1 - tanh^2
                ds = ds * (1.0 - tanh * tanh)
            ds = ds.astype(q.dtype)
            dq_i = jnp.einsum("bkgqc,bkch->bkgqh", ds, k_j, preferred_element_type=jnp.float32)
            dq = lax.dynamic_update_slice_in_dim(dq, _slice(dq, start, s.block_q, 3) + dq_i,
                                                 start, axis=3)
            dk_j = dk_j + jnp.einsum("bkgqc,bkgqh->bkch", ds, q_i,
                                     preferred_element_type=jnp.float32)
            return dq, dk_j, dv_j

        lo, hi = _query_block_range(j, s)
        zeros_kv = jnp.zeros((b, n_kv, s.block_k, h), jnp.float32)
        dq, dk_j, dv_j = lax.fori_loop(lo, hi, q_step, (dq, zeros_kv, zeros_kv))
        return dq, (dk_j, dv_j)

    dq, (dk_blocks, dv_blocks) = lax.scan(k_block, jnp.zeros(q.shape, jnp.float32),
                                          jnp.arange(s.n_k_blocks))
    dk = jnp.moveaxis(dk_blocks, 0, 2).reshape(k.shape)
    dv = jnp.moveaxis(dv_blocks, 0, 2).reshape(v.shape)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _chunked_core(s: _Blocks, q, k, v, seg):
    return _chunked_forward(s, q, k, v, seg)[0]


def _chunked_core_fwd(s, q, k, v, seg):
    out, lse = _chunked_forward(s, q, k, v, seg)
    return out, (q, k, v, seg, out, lse)


def _chunked_core_bwd(s, residuals, d_out):
    q, k, v, seg, out, lse = residuals
    dq, dk, dv = _chunked_backward(s, q, k, v, seg, out, lse, d_out)
    return dq, dk, dv, None


_chunked_core.defvjp(_chunked_core_fwd, _chunked_core_bwd)


def _pad_axis(x, axis: int, size: int, value=0):
    extra = size - x.shape[axis]
    if extra == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, extra)
    return jnp.pad(x, widths, constant_values=value)


def chunked_attention(q_BxTxNxH, k_BxSxKxH, v_BxSxKxH, segment_ids_BxT=None, *,
                      window: int | None = None, softcap: float | None = None,
                      block_q: int = DEFAULT_BLOCK_Q, block_k: int = DEFAULT_BLOCK_K):
    """Blockwise online-softmax attention; equals `dense_attention` (values and gradients).

    T need not divide the block sizes: q is padded to a multiple of block_q and
    k/v to a multiple of block_k. Padded keys sit after every real query, so
    causality already hides them; padded query rows are dropped.
    """
    if block_q <= 0 or block_k <= 0:
        raise ValueError(f"block sizes must be positive, got {block_q}, {block_k}")
    b, t, n, h = q_BxTxNxH.shape
    n_kv = k_BxSxKxH.shape[2]
    if k_BxSxKxH.shape[1] != t:
        raise ValueError("chunked attention is self-attention: q and k need the same length")
    spec = _spec(t, window, softcap, block_q, block_k)
    bq, bk, nq, nk = spec.block_q, spec.block_k, spec.n_q_blocks, spec.n_k_blocks
    q = q_BxTxNxH.reshape(b, t, n_kv, n // n_kv, h).transpose(0, 2, 3, 1, 4)
    q = _pad_axis(q, 3, nq * bq)
    k = _pad_axis(k_BxSxKxH.transpose(0, 2, 1, 3), 2, nk * bk)
    v = _pad_axis(v_BxSxKxH.transpose(0, 2, 1, 3), 2, nk * bk)
    seg = None
    if isinstance(segment_ids_BxT, BranchSegments):  # padding: bit set 0, visible to none
        spec = dataclasses.replace(spec, branches=True)
        seg = _pad_axis(segment_ids_BxT.bits_BxT.astype(jnp.int32), 1,
                        max(nq * bq, nk * bk), value=0)
    elif segment_ids_BxT is not None:
        # One padded length serves both q and k slices; -1 is never a real document.
        seg = _pad_axis(segment_ids_BxT.astype(jnp.int32), 1, max(nq * bq, nk * bk), value=-1)
    out = _chunked_core(spec, q, k, v, seg)[:, :, :, :t]  # [B, K, G, T, H]
    return out.transpose(0, 3, 1, 2, 4).reshape(b, t, n, h)


# --------------------------------------------------------------------------- #
# cuDNN
# --------------------------------------------------------------------------- #


def cudnn_attention(q_BxTxNxH, k_BxSxKxH, v_BxSxKxH, segment_ids_BxT=None, *,
                    window: int | None = None, softcap: float | None = None):
    """cuDNN flash attention via `jax.nn.dot_product_attention` (GPU, bf16/fp16)."""
    if softcap is not None:
        raise ConfigError("model.attention", "cudnn has no attention-logit soft-cap",
                          "use model.attention=chunked (or auto) with attn_softcap")
    mask = None
    if segment_ids_BxT is not None:
        mask = (segment_ids_BxT[:, :, None] == segment_ids_BxT[:, None, :])[:, None]
    return jax.nn.dot_product_attention(
        q_BxTxNxH, k_BxSxKxH, v_BxSxKxH, mask=mask, scale=1.0, is_causal=True,
        local_window_size=None if window is None else (window - 1, 0),
        implementation="cudnn")


# --------------------------------------------------------------------------- #
# Splash (TPU)
# --------------------------------------------------------------------------- #


@functools.lru_cache(maxsize=64)
def _splash_kernel(seq_len: int, n_heads: int, window: int | None, softcap: float | None,
                   interpret: bool):
    """The splash kernel for one layer shape (mask metadata is built once, in numpy)."""
    shape = (seq_len, seq_len)
    if window is None:
        mask = splash_mask.CausalMask(shape)
    else:  # query t sees t - W < s <= t: W - 1 keys to the left, none to the right
        mask = splash_mask.LocalMask(shape, window_size=(window - 1, 0), offset=0)
    block = next(b for b in SPLASH_BLOCKS if seq_len % b == 0)
    sizes = splash.BlockSizes(block_q=block, block_kv=block, block_kv_compute=block,
                              block_q_dkv=block, block_kv_dkv=block, block_kv_dkv_compute=block,
                              block_q_dq=block, block_kv_dq=block)
    return splash.make_splash_mha_single_device(
        splash_mask.MultiHeadMask([mask] * n_heads), block_sizes=sizes,
        attn_logits_soft_cap=softcap, interpret=interpret)


def splash_attention(q_BxTxNxH, k_BxSxKxH, v_BxSxKxH, segment_ids_BxT=None, *,
                     window: int | None = None, softcap: float | None = None,
                     interpret: bool = False):
    """Splash attention (TPU Mosaic kernels); equals `dense_attention`.

    interpret: run the kernels in Pallas interpret mode (CPU tests).
    """
    t, n = q_BxTxNxH.shape[1], q_BxTxNxH.shape[2]
    why = _splash_unfit(t)
    if why:
        raise ConfigError("model.attention", why, "use model.attention=chunked or auto")
    kernel = _splash_kernel(t, n, window, softcap, interpret)

    def per_shard(q_BxTxNxH, k_BxSxKxH, v_BxSxKxH, seg_BxT=None):
        q = q_BxTxNxH.transpose(0, 2, 1, 3)  # [B, N, T, H]: heads major, as splash takes them
        k = k_BxSxKxH.transpose(0, 2, 1, 3)
        v = v_BxSxKxH.transpose(0, 2, 1, 3)
        if seg_BxT is None:
            out = jax.vmap(kernel)(q, k, v)
        else:
            out = jax.vmap(lambda q, k, v, s: kernel(q, k, v, splash.SegmentIds(q=s, kv=s)))(
                q, k, v, seg_BxT)
        return out.transpose(0, 2, 1, 3).astype(q_BxTxNxH.dtype)

    seg = None if segment_ids_BxT is None else segment_ids_BxT.astype(jnp.int32)
    mesh, axes = traced_batch_axes()
    size = axes_size(mesh, axes)
    if size <= 1:
        return per_shard(q_BxTxNxH, k_BxSxKxH, v_BxSxKxH, seg)
    if q_BxTxNxH.shape[0] % size:
        raise ConfigError("model.attention", f"splash runs per batch shard, and "
                          f"{q_BxTxNxH.shape[0]} sequences do not split over the {size} "
                          f"devices of mesh axes {axes}",
                          "use model.attention=chunked, or a batch the devices divide")
    # Mosaic kernels are not partitioned by XLA: each device runs splash on its own
    # sequences (attention never mixes sequences: no communication).
    rows = jax.sharding.PartitionSpec(axes)
    args = (q_BxTxNxH, k_BxSxKxH, v_BxSxKxH) + (() if seg is None else (seg,))
    return shard_mapped(per_shard, mesh, (rows,) * len(args), rows, *args)


# --------------------------------------------------------------------------- #
# Choosing a path
# --------------------------------------------------------------------------- #


def _splash_unfit(seq_len: int) -> str | None:
    """Why splash cannot take this layer (None: it can), backend aside."""
    if seq_len % SPLASH_MIN_BLOCK:
        return f"splash needs T a multiple of {SPLASH_MIN_BLOCK}, got {seq_len}"
    return None



def _cudnn_unfit(dtype: str, softcap: float | None, head_dim: int) -> str | None:
    """Why cuDNN cannot run this layer (None: it can), backend aside."""
    if dtype not in _CUDNN_DTYPES:
        return f"cudnn needs model.dtype in {_CUDNN_DTYPES}, got {dtype!r}"
    if softcap is not None:
        return "cudnn has no attention-logit soft-cap (model.attn_softcap is set)"
    if head_dim % 8 or head_dim > 256:
        return f"cudnn needs head_dim <= 256 and a multiple of 8, got {head_dim}"
    return None


def check_implementation(name: str, *, dtype: str, softcap: float | None, head_dim: int,
                         backend: str | None = None) -> None:
    """Raises ConfigError if `model.attention=name` cannot run on this backend.

    backend None: the backend being traced for (`chips.traced_target`). `splash` is
    checked only against a given backend (`resolve_implementation`, at trace time): a
    model built on a CPU host may be traced for a TPU target (`hldstudy.aot`).
    """
    if name not in IMPLEMENTATIONS:
        raise ConfigError("model.attention", f"{name!r} is not one of {', '.join(IMPLEMENTATIONS)}")
    if name == "splash" and backend is not None and backend != "tpu":
        raise ConfigError("model.attention", f"splash needs a TPU, this backend is {backend}",
                          "use model.attention=chunked (any backend) or auto")
    if name != "cudnn":
        return
    backend = backend or traced_target()[0]
    if backend != "gpu":
        raise ConfigError("model.attention", f"cudnn needs an NVIDIA GPU, this backend is {backend}",
                          "use model.attention=chunked (any backend) or auto")
    why = _cudnn_unfit(dtype, softcap, head_dim)
    if why:
        raise ConfigError("model.attention", why,
                          "use model.attention=chunked (any backend) or auto")


def resolve_implementation(name: str, *, dtype: str, softcap: float | None, head_dim: int,
                           seq_len: int, backend: str | None = None) -> str:
    """The concrete path (`dense`, `chunked`, `cudnn` or `splash`) for one attention call.

    backend: "tpu", "gpu", "cpu" (what jax.default_backend() says on such a machine);
    None: the backend being traced for (`chips.traced_target`).
    """
    backend = backend or traced_target()[0]
    check_implementation(name, dtype=dtype, softcap=softcap, head_dim=head_dim, backend=backend)
    if name != "auto":
        return name
    if backend == "tpu":
        why = _splash_unfit(seq_len)
        if why is None:
            return "splash"
        _notice_once(f"model.attention=auto: {why}; using chunked")
        return "chunked"
    if backend == "gpu":
        return "chunked" if _cudnn_unfit(dtype, softcap, head_dim) else "cudnn"
    return "chunked" if seq_len >= AUTO_CHUNKED_MIN_T else "dense"


@functools.lru_cache(maxsize=32)
def _notice_once(message: str) -> None:
    log.warning(message)


def attend(q_BxTxNxH, k_BxSxKxH, v_BxSxKxH, segment_ids_BxT=None, *, implementation: str,
           window: int | None = None, softcap: float | None = None,
           block_q: int | None = None, block_k: int | None = None):
    """Self-attention of pre-scaled, RoPE'd q over k/v by `implementation` (see module doc).

    Block sizes default to the module's DEFAULT_BLOCK_Q / DEFAULT_BLOCK_K, read
    at call time.
    """
    block_q = DEFAULT_BLOCK_Q if block_q is None else block_q
    block_k = DEFAULT_BLOCK_K if block_k is None else block_k
    impl = resolve_implementation(implementation, dtype=jnp.dtype(q_BxTxNxH.dtype).name,
                                  softcap=softcap, head_dim=q_BxTxNxH.shape[-1],
                                  seq_len=q_BxTxNxH.shape[1])
    if isinstance(segment_ids_BxT, BranchSegments) and impl not in ("dense", "chunked"):
        impl = "chunked"  # the kernels know equal segment ids only
    kw = dict(window=window, softcap=softcap)
    if impl == "dense":
        return dense_attention(q_BxTxNxH, k_BxSxKxH, v_BxSxKxH, segment_ids_BxT, **kw)
    if impl == "cudnn":
        return cudnn_attention(q_BxTxNxH, k_BxSxKxH, v_BxSxKxH, segment_ids_BxT, **kw)
    if impl == "splash":
        return splash_attention(q_BxTxNxH, k_BxSxKxH, v_BxSxKxH, segment_ids_BxT, **kw)
    return chunked_attention(q_BxTxNxH, k_BxSxKxH, v_BxSxKxH, segment_ids_BxT,
                             block_q=block_q, block_k=block_k, **kw)
