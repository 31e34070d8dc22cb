"""Gemma-style building blocks in Flax NNX.

Parameter layouts are chosen so checkpoint import is a reshape, not a
rewrite: projections are stored input-dim first (`q: [D, N, H]`,
`o: [N, H, D]`, `gate/up: [D, F]`, `down: [F, D]`). Normalisation and
softmax run in float32 whatever the compute dtype.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from hldstudy.config import ModelConfig

_NEG_INF = -2.3819763e38  # finite "minus infinity": keeps fully-masked rows NaN-free


def _dtype(name: str):
    return jnp.dtype(name)


def _init_normal(rngs: nnx.Rngs, shape: tuple[int, ...], fan_in: int, dtype) -> jax.Array:
    std = fan_in ** -0.5
    return (std * jax.random.truncated_normal(rngs.params(), -2.0, 2.0, shape)).astype(dtype)


class RMSNorm(nnx.Module):
    """x * rsqrt(mean(x^2) + eps) * (1 + scale); scale starts at 0 (identity)."""

    def __init__(self, dim: int, eps: float, param_dtype=jnp.float32):
        self.scale = nnx.Param(jnp.zeros((dim,), param_dtype))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        var = jnp.mean(jnp.square(x32), axis=-1, keepdims=True)
        y = x32 * jax.lax.rsqrt(var + self.eps) * (1.0 + self.scale[...].astype(jnp.float32))
        return y.astype(x.dtype)


def apply_rope(x_BxTxNxH: jax.Array, positions_BxT: jax.Array, base: float) -> jax.Array:
    """Rotary embedding, half-split layout (Gemma / HF `rotate_half`)."""
    head_dim = x_BxTxNxH.shape[-1]
    half = head_dim // 2
    inv_freq = base ** (-jnp.arange(half, dtype=jnp.float32) * 2.0 / head_dim)
    angles_BxTxH2 = positions_BxT[..., None].astype(jnp.float32) * inv_freq
    sin = jnp.sin(angles_BxTxH2)[:, :, None, :]
    cos = jnp.cos(angles_BxTxH2)[:, :, None, :]
    x32 = x_BxTxNxH.astype(jnp.float32)
    x1, x2 = x32[..., :half], x32[..., half:]
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x_BxTxNxH.dtype)


def attention_mask(segment_ids_BxT: jax.Array, window: int | None) -> jax.Array:
    """[B, T, S] bool: causal, within one packed document, and inside the window.

    A local layer with window W lets query t see keys s with t - W < s <= t
    (W keys including itself), as Gemma 3 does.
    """
    seq_len = segment_ids_BxT.shape[1]
    q_idx = jnp.arange(seq_len)[:, None]
    k_idx = jnp.arange(seq_len)[None, :]
    allowed_TxS = k_idx <= q_idx
    if window is not None:
        allowed_TxS &= (q_idx - k_idx) < window
    same_doc_BxTxS = segment_ids_BxT[:, :, None] == segment_ids_BxT[:, None, :]
    return allowed_TxS[None] & same_doc_BxTxS


class Attention(nnx.Module):
    """Multi-query / grouped-query attention with optional QK-norm and logit soft-cap."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        d, n, k, h = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        pdt = _dtype(cfg.param_dtype)
        self.q = nnx.Param(_init_normal(rngs, (d, n, h), d, pdt))
        self.k = nnx.Param(_init_normal(rngs, (d, k, h), d, pdt))
        self.v = nnx.Param(_init_normal(rngs, (d, k, h), d, pdt))
        self.o = nnx.Param(_init_normal(rngs, (n, h, d), n * h, pdt))
        if cfg.qk_norm:
            self.q_norm = RMSNorm(h, cfg.norm_eps, pdt)
            self.k_norm = RMSNorm(h, cfg.norm_eps, pdt)
        else:
            self.q_norm = self.k_norm = None
        self.n_heads, self.n_kv_heads, self.head_dim = n, k, h
        self.query_scale = (cfg.query_pre_attn_scalar or h) ** -0.5
        self.softcap = cfg.attn_softcap
        self.compute_dtype = _dtype(cfg.dtype)

    def __call__(self, x_BxTxD, positions_BxT, mask_BxTxS, rope_base: float):
        dt = self.compute_dtype
        x = x_BxTxD.astype(dt)
        q_BxTxNxH = jnp.einsum("btd,dnh->btnh", x, self.q[...].astype(dt))
        k_BxSxKxH = jnp.einsum("btd,dkh->btkh", x, self.k[...].astype(dt))
        v_BxSxKxH = jnp.einsum("btd,dkh->btkh", x, self.v[...].astype(dt))
        if self.q_norm is not None:
            q_BxTxNxH = self.q_norm(q_BxTxNxH)
            k_BxSxKxH = self.k_norm(k_BxSxKxH)
        q_BxTxNxH = apply_rope(q_BxTxNxH, positions_BxT, rope_base) * self.query_scale
        k_BxSxKxH = apply_rope(k_BxSxKxH, positions_BxT, rope_base)

        b, t = x.shape[:2]
        groups = self.n_heads // self.n_kv_heads
        q_BxTxKxGxH = q_BxTxNxH.reshape(b, t, self.n_kv_heads, groups, self.head_dim)
        logits_BxKxGxTxS = jnp.einsum("btkgh,bskh->bkgts", q_BxTxKxGxH, k_BxSxKxH,
                                      preferred_element_type=jnp.float32)
        if self.softcap is not None:
            logits_BxKxGxTxS = jnp.tanh(logits_BxKxGxTxS / self.softcap) * self.softcap
        logits_BxKxGxTxS = jnp.where(mask_BxTxS[:, None, None], logits_BxKxGxTxS, _NEG_INF)
        probs = jax.nn.softmax(logits_BxKxGxTxS, axis=-1).astype(dt)
        out_BxTxKxGxH = jnp.einsum("bkgts,bskh->btkgh", probs, v_BxSxKxH)
        out_BxTxNxH = out_BxTxKxGxH.reshape(b, t, self.n_heads, self.head_dim)
        return jnp.einsum("btnh,nhd->btd", out_BxTxNxH, self.o[...].astype(dt))


class GeGLU(nnx.Module):
    """gelu_tanh(x W_gate) * (x W_up) W_down."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        d, f = cfg.d_model, cfg.d_ff
        pdt = _dtype(cfg.param_dtype)
        self.gate = nnx.Param(_init_normal(rngs, (d, f), d, pdt))
        self.up = nnx.Param(_init_normal(rngs, (d, f), d, pdt))
        self.down = nnx.Param(_init_normal(rngs, (f, d), f, pdt))
        self.compute_dtype = _dtype(cfg.dtype)

    def __call__(self, x_BxTxD):
        dt = self.compute_dtype
        x = x_BxTxD.astype(dt)
        gate_BxTxF = jax.nn.gelu(x @ self.gate[...].astype(dt), approximate=True)
        return (gate_BxTxF * (x @ self.up[...].astype(dt))) @ self.down[...].astype(dt)


class Block(nnx.Module):
    """Pre- and post-norm around attention and MLP (Gemma 2/3)."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, rngs: nnx.Rngs):
        pdt = _dtype(cfg.param_dtype)
        self.pre_attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps, pdt)
        self.attn = Attention(cfg, rngs)
        self.post_attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps, pdt)
        self.pre_mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps, pdt)
        self.mlp = GeGLU(cfg, rngs)
        self.post_mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps, pdt)
        self.rope_base = cfg.rope_base(layer_idx)
        self.is_global = cfg.is_global_layer(layer_idx)

    def __call__(self, x_BxTxD, positions_BxT, mask_BxTxS):
        attn_out = self.attn(self.pre_attn_norm(x_BxTxD), positions_BxT, mask_BxTxS,
                             self.rope_base)
        x_BxTxD = x_BxTxD + self.post_attn_norm(attn_out)
        mlp_out = self.mlp(self.pre_mlp_norm(x_BxTxD))
        return x_BxTxD + self.post_mlp_norm(mlp_out)
