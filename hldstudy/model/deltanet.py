"""Gated DeltaNet (Qwen3.5's linear-attention layer) in two equal forms.

Design notes: `docs/model.md`, under this file's name.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from hldstudy.config import ModelConfig
from hldstudy.model.layers import _init_normal

__all__ = ["GatedDeltaNet", "GatedRMSNorm", "causal_depthwise_conv", "delta_rule_chunked",
           "delta_rule_recurrent", "l2_normalize", "unit_lower_inverse"]


def l2_normalize(x: jax.Array, eps: float = 1e-6) -> jax.Array:
    """x * rsqrt(sum x^2 + eps) over the last axis (the FLA / transformers convention)."""
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def _starts(segment_ids_BxT: jax.Array | None, b: int, t: int) -> jax.Array:
    """[B, T] bool: True where a new document starts (position 0 always)."""
    first = jnp.ones((b, 1), bool)
    if segment_ids_BxT is None:
        return jnp.concatenate([first, jnp.zeros((b, t - 1), bool)], axis=1)
    return jnp.concatenate([first, segment_ids_BxT[:, 1:] != segment_ids_BxT[:, :-1]], axis=1)


def causal_depthwise_conv(x_BxTxC: jax.Array, w_CxK: jax.Array,
                          segment_ids_BxT: jax.Array | None = None) -> jax.Array:
    """out[t, c] = sum_k w[c, k] x[t - (K-1) + k, c], reading only the same document
    (PyTorch's Conv1d(groups=C, padding=K-1) cut to T, as transformers runs it)."""
    b, t, _ = x_BxTxC.shape
    ksize = w_CxK.shape[1]
    out = jnp.zeros(x_BxTxC.shape, jnp.result_type(x_BxTxC, w_CxK))
    for k in range(ksize):
        shift = ksize - 1 - k
        if shift >= t:
            continue
        xs = jnp.pad(x_BxTxC, ((0, 0), (shift, 0), (0, 0)))[:, :t]
        if segment_ids_BxT is not None and shift:
            seg_s = jnp.pad(segment_ids_BxT, ((0, 0), (shift, 0)), constant_values=-1)[:, :t]
            xs = jnp.where((seg_s == segment_ids_BxT)[..., None], xs, 0)
        out = out + xs * w_CxK[:, k]
    return out


def delta_rule_recurrent(q, k, v, g, beta, segment_ids_BxT=None):
    """Token-by-token gated delta rule; returns o [B, T, H, V] float32."""
    b, t, h, dk = q.shape
    dv = v.shape[-1]
    f32 = jnp.float32
    q, k, v, g, beta = (x.astype(f32) for x in (q, k, v, g, beta))
    reset = _starts(segment_ids_BxT, b, t)

    def step(state_BxHxKxV, xs):
        q_t, k_t, v_t, g_t, beta_t, reset_t = xs
        state = jnp.where(reset_t[:, None, None, None], 0.0, state_BxHxKxV)
        state = state * jnp.exp(g_t)[..., None, None]
        kv_mem = jnp.einsum("bhk,bhkv->bhv", k_t, state)
        delta = (v_t - kv_mem) * beta_t[..., None]
        state = state + k_t[..., :, None] * delta[..., None, :]
        return state, jnp.einsum("bhk,bhkv->bhv", q_t, state)

    xs = tuple(jnp.moveaxis(x, 1, 0) for x in (q, k, v, g, beta, reset))
    _, out_TxBxHxV = jax.lax.scan(step, jnp.zeros((b, h, dk, dv), f32), xs)
    return jnp.moveaxis(out_TxBxHxV, 0, 1)


def unit_lower_inverse(m: jax.Array) -> jax.Array:
    """Inverse of unit-lower-triangular matrices `m [..., C, C]` from matmuls only.

    Recursive block inversion, bottom up: [[A, 0], [B, D]]^-1 = [[A^-1, 0],
    [-D^-1 B A^-1, D^-1]], starting from 1 x 1 blocks (= 1) and doubling log2(C) times
    (C padded to a power of two with identity). Used instead of
    `lax.linalg.triangular_solve` because jaxlib 0.10's CPU LAPACK kernel for batched
    solves parks an XLA worker thread until its batch items, queued on the same pool, are
    done: when as many solves run at once as the pool has threads (two independent ones
    on a 2-core machine, e.g. a DeltaNet student's backward), the step deadlocks.
    """
    c = m.shape[-1]
    size = 1 << max(0, (c - 1).bit_length())
    batch = m.shape[:-2]
    if size != c:  # identity padding: the top-left C x C block of the inverse is unchanged
        pad = ((0, 0),) * len(batch) + ((0, size - c), (0, size - c))
        m = jnp.pad(m, pad) + jnp.eye(size, dtype=m.dtype).at[:c, :c].set(0.0)
    inv = jnp.ones(batch + (size, 1, 1), m.dtype)  # [..., blocks, s, s]: inverses of 1 x 1
    s = 1
    while s < size:
        nb = size // (2 * s)
        blocks = jnp.moveaxis(jnp.diagonal(m.reshape(batch + (nb, 2 * s, nb, 2 * s)),
                                           axis1=-4, axis2=-2), -1, -3)  # [..., nb, 2s, 2s]
        a_inv, d_inv = inv[..., 0::2, :, :], inv[..., 1::2, :, :]
        lower = -(d_inv @ blocks[..., s:, :s] @ a_inv)
        inv = jnp.concatenate([jnp.concatenate([a_inv, jnp.zeros_like(a_inv)], axis=-1),
                               jnp.concatenate([lower, d_inv], axis=-1)], axis=-2)
        s *= 2
    return inv[..., 0, :c, :c]


def delta_rule_chunked(q, k, v, g, beta, segment_ids_BxT=None, *, chunk: int = 64):
    """Chunked (parallel) gated delta rule; equal to `delta_rule_recurrent`.

    Inside a chunk the delta updates form a unit-lower-triangular system
    (I + L) U = beta V with L_ij = beta_i k_i.k_j exp(G_i - G_j) (j < i, G the in-chunk
    cumulative log decay), solved with its inverse (`unit_lower_inverse`); the chunks then pass the state
    along with a scan (transformers' `torch_chunk_gated_delta_rule`, with document masks).
    """
    b, t, h, dk = q.shape
    dv = v.shape[-1]
    f32 = jnp.float32
    seg = (jnp.zeros((b, t), jnp.int32) if segment_ids_BxT is None
           else segment_ids_BxT.astype(jnp.int32))
    pad = (-t) % chunk
    n = (t + pad) // chunk

    def prep(x, fill=0):  # [B, T, H, ...] -> [B, H, N, C, ...], zero-padded
        x = jnp.moveaxis(x.astype(f32), 2, 1)
        x = jnp.pad(x, ((0, 0), (0, 0), (0, pad)) + ((0, 0),) * (x.ndim - 3),
                    constant_values=fill)
        return x.reshape((b, h, n, chunk) + x.shape[3:])

    q, k, v, g, beta = (prep(x) for x in (q, k, v, g, beta))
    seg = jnp.pad(seg, ((0, 0), (0, pad)), mode="edge").reshape(b, 1, n, chunk)
    prev_last = jnp.concatenate([seg[:, :, :1, 0], seg[:, :, :-1, -1]], axis=2)  # [B,1,N]
    same_state = seg == prev_last[..., None]  # position sees the state carried in
    last = seg[..., -1:]
    same_last = seg == last  # position's update survives to the chunk's end

    cum = jnp.cumsum(g, axis=-1)  # [B, H, N, C]
    causal = jnp.tril(jnp.ones((chunk, chunk), bool))
    pair_ok = causal & (seg[..., :, None] == seg[..., None, :])
    pair_decay = jnp.exp(jnp.where(pair_ok, cum[..., :, None] - cum[..., None, :], -jnp.inf))

    k_beta = k * beta[..., None]
    v_beta = v * beta[..., None]
    strict = pair_decay * (1.0 - jnp.eye(chunk, dtype=f32))
    system = jnp.einsum("...ik,...jk->...ij", k_beta, k) * strict + jnp.eye(chunk, dtype=f32)
    decayed_k_beta = k_beta * (jnp.exp(cum) * same_state)[..., None]
    solved = unit_lower_inverse(system) @ jnp.concatenate([v_beta, decayed_k_beta], axis=-1)
    u, w = solved[..., :dv], solved[..., dv:]  # new values, decayed keys reading the state
    intra = jnp.einsum("...ik,...jk->...ij", q, k) * pair_decay
    q_dec = q * (jnp.exp(cum) * same_state)[..., None]
    k_dec = k * (jnp.exp(cum[..., -1:] - cum) * same_last)[..., None]
    chunk_decay = jnp.exp(cum[..., -1]) * (last[..., 0] == prev_last)  # [B, H, N]

    def step(state, xs):
        u_c, w_c, intra_c, q_c, k_c, decay_c = xs
        v_new = u_c - jnp.einsum("bhck,bhkv->bhcv", w_c, state)
        out = jnp.einsum("bhck,bhkv->bhcv", q_c, state) + \
            jnp.einsum("bhcj,bhjv->bhcv", intra_c, v_new)
        state = state * decay_c[..., None, None] + jnp.einsum("bhck,bhcv->bhkv", k_c, v_new)
        return state, out

    xs = tuple(jnp.moveaxis(x, 2, 0) for x in (u, w, intra, q_dec, k_dec, chunk_decay))
    _, out = jax.lax.scan(step, jnp.zeros((b, h, dk, dv), f32), xs)  # [N, B, H, C, V]
    out = jnp.moveaxis(out, 0, 2).reshape(b, h, n * chunk, dv)[:, :, :t]
    return jnp.moveaxis(out, 1, 2)


class GatedRMSNorm(nnx.Module):
    """weight * rmsnorm(x) * silu(gate); weight one-centred (starts at 1), not 1 + w."""

    def __init__(self, dim: int, eps: float, param_dtype=jnp.float32):
        self.weight = nnx.Param(jnp.ones((dim,), param_dtype))
        self.eps = eps

    def __call__(self, x: jax.Array, gate: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + self.eps)
        y = self.weight[...] * y.astype(x.dtype)
        return (y * jax.nn.silu(gate.astype(jnp.float32))).astype(x.dtype)


class GatedDeltaNet(nnx.Module):
    """Qwen3.5 linear-attention layer: in-projections, causal conv + SiLU on q/k/v, decay
    and beta gates, gated delta rule, gated RMSNorm, out-projection.

    Parameters (input dim first, as every hldstudy projection): `in_qkv [D, 2 Hk K + Hv V]`,
    `in_z [D, Hv V]`, `in_b`, `in_a [D, Hv]`, `conv [2 Hk K + Hv V, kernel]`, `A_log`,
    `dt_bias [Hv]`, `norm.weight [V]`, `out [Hv V, D]`.
    """

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        d = cfg.d_model
        hk, hv, dk, dv = cfg.linear_k_heads, cfg.linear_v_heads, cfg.linear_k_head_dim, \
            cfg.linear_v_head_dim
        pdt = jnp.dtype(cfg.param_dtype)
        conv_dim = 2 * hk * dk + hv * dv
        self.in_qkv = nnx.Param(_init_normal(rngs, (d, conv_dim), d, pdt))
        self.in_z = nnx.Param(_init_normal(rngs, (d, hv * dv), d, pdt))
        self.in_b = nnx.Param(_init_normal(rngs, (d, hv), d, pdt))
        self.in_a = nnx.Param(_init_normal(rngs, (d, hv), d, pdt))
        self.conv = nnx.Param(_init_normal(rngs, (conv_dim, cfg.linear_conv_kernel),
                                           cfg.linear_conv_kernel, pdt))
        # transformers' init: A ~ U(0.01, 16) (log kept finite), dt_bias = 1.
        self.A_log = nnx.Param(jnp.log(jax.random.uniform(rngs.params(), (hv,), jnp.float32,
                                                          0.01, 16.0)).astype(pdt))
        self.dt_bias = nnx.Param(jnp.ones((hv,), pdt))
        self.norm = GatedRMSNorm(dv, cfg.norm_eps, pdt)
        self.out = nnx.Param(_init_normal(rngs, (hv * dv, d), hv * dv, pdt))
        self.shape = (hk, hv, dk, dv)
        self.chunk = cfg.deltanet_chunk
        self.compute_dtype = jnp.dtype(cfg.dtype)

    def __call__(self, x_BxTxD, segment_ids_BxT=None, *, recurrent: bool = False):
        """recurrent=True runs the token-by-token form (the reference) instead of chunks."""
        dt = self.compute_dtype
        hk, hv, dk, dv = self.shape
        b, t, d = x_BxTxD.shape
        x_MxD = x_BxTxD.astype(dt).reshape(b * t, d)
        qkv = (x_MxD @ self.in_qkv[...].astype(dt)).reshape(b, t, -1)
        qkv = jax.nn.silu(causal_depthwise_conv(qkv, self.conv[...].astype(dt), segment_ids_BxT))
        q = qkv[..., :hk * dk].reshape(b, t, hk, dk)
        k = qkv[..., hk * dk:2 * hk * dk].reshape(b, t, hk, dk)
        v = qkv[..., 2 * hk * dk:].reshape(b, t, hv, dv)
        z = (x_MxD @ self.in_z[...].astype(dt)).reshape(b, t, hv, dv)
        beta = jax.nn.sigmoid((x_MxD @ self.in_b[...].astype(dt)).reshape(b, t, hv))
        a = (x_MxD @ self.in_a[...].astype(dt)).reshape(b, t, hv).astype(jnp.float32)
        g = -jnp.exp(self.A_log[...].astype(jnp.float32)) * jax.nn.softplus(
            a + self.dt_bias[...].astype(jnp.float32))
        if hv != hk:  # each key head serves hv / hk consecutive value heads
            q, k = jnp.repeat(q, hv // hk, axis=2), jnp.repeat(k, hv // hk, axis=2)
        q = l2_normalize(q.astype(jnp.float32)) * dk ** -0.5
        k = l2_normalize(k.astype(jnp.float32))
        if recurrent:
            o = delta_rule_recurrent(q, k, v, g, beta, segment_ids_BxT)
        else:
            o = delta_rule_chunked(q, k, v, g, beta, segment_ids_BxT, chunk=self.chunk)
        o = self.norm(o.astype(dt), z)
        out_MxD = o.reshape(b * t, hv * dv) @ self.out[...].astype(dt)
        return out_MxD.reshape(b, t, d)
