"""Gemma-style building blocks in Flax NNX.

Design notes: `docs/model.md`, under this file's name.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from hldstudy.config import ModelConfig
from hldstudy.model.attention import attend, attention_mask, check_implementation

__all__ = ["Attention", "Block", "GeGLU", "RMSNorm", "apply_rope", "attention_mask"]


def _dtype(name: str):
    return jnp.dtype(name)


def _tokens(x_BxTxD: jax.Array) -> jax.Array:
    """[B, T, D] -> [B*T, D] (a bitcast)."""
    return x_BxTxD.reshape(-1, x_BxTxD.shape[-1])


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


class Attention(nnx.Module):
    """Multi-query / grouped-query attention with optional QK-norm and logit soft-cap.

    `window` (None = global) is this layer's sliding window; the kernel is
    `cfg.attention` (hldstudy.model.attention).
    """

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, window: int | None = None):
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
        self.window = window
        # Fail at construction, not at the first traced step, if the kernel cannot run here.
        check_implementation(cfg.attention, dtype=cfg.dtype, softcap=cfg.attn_softcap, head_dim=h)
        self.implementation = cfg.attention

    def __call__(self, x_BxTxD, positions_BxT, segment_ids_BxT, rope_base: float):
        """segment_ids_BxT: packed-document ids, or None for one document per row."""
        dt = self.compute_dtype
        b, t, d = x_BxTxD.shape
        n, k, h = self.n_heads, self.n_kv_heads, self.head_dim
        x_MxD = _tokens(x_BxTxD.astype(dt))  # M = B * T tokens
        q_BxTxNxH = (x_MxD @ self.q[...].astype(dt).reshape(d, n * h)).reshape(b, t, n, h)
        k_BxSxKxH = (x_MxD @ self.k[...].astype(dt).reshape(d, k * h)).reshape(b, t, k, h)
        v_BxSxKxH = (x_MxD @ self.v[...].astype(dt).reshape(d, k * h)).reshape(b, t, k, h)
        if self.q_norm is not None:
            q_BxTxNxH = self.q_norm(q_BxTxNxH)
            k_BxSxKxH = self.k_norm(k_BxSxKxH)
        q_BxTxNxH = apply_rope(q_BxTxNxH, positions_BxT, rope_base) * self.query_scale
        k_BxSxKxH = apply_rope(k_BxSxKxH, positions_BxT, rope_base)
        out_BxTxNxH = attend(q_BxTxNxH, k_BxSxKxH, v_BxSxKxH, segment_ids_BxT,
                             implementation=self.implementation, window=self.window,
                             softcap=self.softcap)
        out_MxD = out_BxTxNxH.reshape(b * t, n * h) @ self.o[...].astype(dt).reshape(n * h, d)
        return out_MxD.reshape(b, t, d)


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
        x_MxD = _tokens(x_BxTxD.astype(dt))
        gate_MxF = jax.nn.gelu(x_MxD @ self.gate[...].astype(dt), approximate=True)
        out_MxD = (gate_MxF * (x_MxD @ self.up[...].astype(dt))) @ self.down[...].astype(dt)
        return out_MxD.reshape(x_BxTxD.shape[:-1] + (out_MxD.shape[-1],))


class Block(nnx.Module):
    """Pre- and post-norm around attention and MLP (Gemma 2/3)."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, rngs: nnx.Rngs):
        pdt = _dtype(cfg.param_dtype)
        self.pre_attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps, pdt)
        self.attn = Attention(cfg, rngs, window=cfg.window(layer_idx))
        self.post_attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps, pdt)
        self.pre_mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps, pdt)
        self.mlp = GeGLU(cfg, rngs)
        self.post_mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps, pdt)
        self.rope_base = cfg.rope_base(layer_idx)
        self.is_global = cfg.is_global_layer(layer_idx)

    def __call__(self, x_BxTxD, positions_BxT, segment_ids_BxT):
        attn_out = self.attn(self.pre_attn_norm(x_BxTxD), positions_BxT, segment_ids_BxT,
                             self.rope_base)
        x_BxTxD = x_BxTxD + self.post_attn_norm(attn_out)
        mlp_out = self.mlp(self.pre_mlp_norm(x_BxTxD))
        return x_BxTxD + self.post_mlp_norm(mlp_out)
