"""Qwen3.5 blocks: gated full attention, SwiGLU, and the pre-norm block around a token
mixer (gated attention or Gated DeltaNet) and an MLP (SwiGLU or mixture of experts).

Gated attention (transformers' Qwen3_5Attention): GQA with QK-norm (RMSNorm 1 + w on the
head dim), rotary on the first `rotary_fraction` of each head (half-split layout within
those dims), queries scaled by head_dim^-1/2, and the output multiplied by a sigmoid gate
projected from the block input before the out-projection. Parameters: `q`, `q_gate
[D, N, H]` (transformers stores them interleaved per head in one q_proj), `k`, `v
[D, K, H]`, `o [N, H, D]`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from hldstudy.config import ModelConfig
from hldstudy.model.attention import attend, check_implementation
from hldstudy.model.deltanet import GatedDeltaNet
from hldstudy.model.layers import RMSNorm, _init_normal, _tokens, apply_rope
from hldstudy.model.moe import MoE

__all__ = ["GatedAttention", "QwenBlock", "SwiGLU", "block_aux_zeros"]


class GatedAttention(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        d, n, k, h = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        pdt = jnp.dtype(cfg.param_dtype)
        self.q = nnx.Param(_init_normal(rngs, (d, n, h), d, pdt))
        self.q_gate = nnx.Param(_init_normal(rngs, (d, n, h), d, pdt))
        self.k = nnx.Param(_init_normal(rngs, (d, k, h), d, pdt))
        self.v = nnx.Param(_init_normal(rngs, (d, k, h), d, pdt))
        self.o = nnx.Param(_init_normal(rngs, (n, h, d), n * h, pdt))
        self.q_norm = RMSNorm(h, cfg.norm_eps, pdt)
        self.k_norm = RMSNorm(h, cfg.norm_eps, pdt)
        self.n_heads, self.n_kv_heads, self.head_dim = n, k, h
        self.rotary_dims = int(h * cfg.rotary_fraction)
        self.rope_base = cfg.rope_base_global
        self.compute_dtype = jnp.dtype(cfg.dtype)
        check_implementation(cfg.attention, dtype=cfg.dtype, softcap=None, head_dim=h)
        self.implementation = cfg.attention

    def _rope(self, x_BxTxNxH, positions_BxT):
        r = self.rotary_dims
        rotated = apply_rope(x_BxTxNxH[..., :r], positions_BxT, self.rope_base)
        return jnp.concatenate([rotated, x_BxTxNxH[..., r:]], axis=-1)

    def __call__(self, x_BxTxD, positions_BxT, segment_ids_BxT):
        dt = self.compute_dtype
        b, t, d = x_BxTxD.shape
        n, k, h = self.n_heads, self.n_kv_heads, self.head_dim
        x_MxD = _tokens(x_BxTxD.astype(dt))
        q = (x_MxD @ self.q[...].astype(dt).reshape(d, n * h)).reshape(b, t, n, h)
        gate_MxNH = x_MxD @ self.q_gate[...].astype(dt).reshape(d, n * h)
        kk = (x_MxD @ self.k[...].astype(dt).reshape(d, k * h)).reshape(b, t, k, h)
        v = (x_MxD @ self.v[...].astype(dt).reshape(d, k * h)).reshape(b, t, k, h)
        q = self._rope(self.q_norm(q), positions_BxT) * h ** -0.5
        kk = self._rope(self.k_norm(kk), positions_BxT)
        out = attend(q, kk, v, segment_ids_BxT, implementation=self.implementation, window=None,
                     softcap=None)
        out_MxNH = out.reshape(b * t, n * h) * jax.nn.sigmoid(gate_MxNH)
        out_MxD = out_MxNH @ self.o[...].astype(dt).reshape(n * h, d)
        return out_MxD.reshape(b, t, d)


class SwiGLU(nnx.Module):
    """silu(x W_gate) * (x W_up) W_down."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        d, f = cfg.d_model, cfg.d_ff
        pdt = jnp.dtype(cfg.param_dtype)
        self.gate = nnx.Param(_init_normal(rngs, (d, f), d, pdt))
        self.up = nnx.Param(_init_normal(rngs, (d, f), d, pdt))
        self.down = nnx.Param(_init_normal(rngs, (f, d), f, pdt))
        self.compute_dtype = jnp.dtype(cfg.dtype)

    def __call__(self, x_BxTxD):
        dt = self.compute_dtype
        x_MxD = _tokens(x_BxTxD.astype(dt))
        h = jax.nn.silu(x_MxD @ self.gate[...].astype(dt)) * (x_MxD @ self.up[...].astype(dt))
        out_MxD = h @ self.down[...].astype(dt)
        return out_MxD.reshape(x_BxTxD.shape[:-1] + (out_MxD.shape[-1],))


class QwenBlock(nnx.Module):
    """x + mixer(norm(x)), then + mlp(norm(x)); returns (x, {"router_aux_loss": the
    load-balancing loss or 0, "expert_drop_rate": [B] share of routed slots dropped or 0})."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, rngs: nnx.Rngs):
        pdt = jnp.dtype(cfg.param_dtype)
        self.layer_type = cfg.layer_type(layer_idx)
        self.pre_attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps, pdt)
        if self.layer_type == "linear_attention":
            self.mixer = GatedDeltaNet(cfg, rngs)
        else:
            self.mixer = GatedAttention(cfg, rngs)
        self.pre_mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps, pdt)
        self.mlp = MoE(cfg, rngs) if cfg.n_experts else SwiGLU(cfg, rngs)

    def __call__(self, x_BxTxD, positions_BxT, segment_ids_BxT):
        h = self.pre_attn_norm(x_BxTxD)
        if self.layer_type == "linear_attention":
            h = self.mixer(h, segment_ids_BxT)
        else:
            h = self.mixer(h, positions_BxT, segment_ids_BxT)
        x_BxTxD = x_BxTxD + h
        h = self.mlp(self.pre_mlp_norm(x_BxTxD))
        if not isinstance(h, tuple):  # a dense MLP: no router, nothing dropped
            return x_BxTxD + h, block_aux_zeros(x_BxTxD.shape[0])
        h, aux, dropped = h
        return x_BxTxD + h, {"router_aux_loss": aux, "expert_drop_rate": dropped}


def block_aux_zeros(batch: int) -> dict:
    """What a QwenBlock reports beside its output, before any block ran."""
    return {"router_aux_loss": jnp.zeros((), jnp.float32),
            "expert_drop_rate": jnp.zeros((batch,), jnp.float32)}
