"""Mixture of experts (Qwen3.5-MoE): softmax router, top-k, dropless grouped SwiGLU experts,
one sigmoid-gated shared expert, and the router's load-balancing loss.

Design notes: `docs/model.md`, under this file's name.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from hldstudy.config import ModelConfig
from hldstudy.model.layers import _init_normal
from hldstudy.sharding import expert_dim_metadata

__all__ = ["MoE", "load_balancing_loss", "route"]


def route(logits_MxE: jax.Array, k: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(probs [M, E] float32, top-k weights [M, k] renormalised, expert ids [M, k])."""
    probs = jax.nn.softmax(logits_MxE.astype(jnp.float32), axis=-1)
    top_w, top_i = jax.lax.top_k(probs, k)
    return probs, top_w / jnp.sum(top_w, axis=-1, keepdims=True), top_i


def load_balancing_loss(probs_MxE: jax.Array, experts_MxK: jax.Array) -> jax.Array:
    """E * sum_e (share of assignments to e) * (mean probability of e); float32 scalar."""
    n_experts = probs_MxE.shape[-1]
    assigned = jax.nn.one_hot(experts_MxK, n_experts, dtype=jnp.float32)  # [M, k, E]
    share = jnp.mean(assigned, axis=0)  # [k, E]
    return n_experts * jnp.sum(share * jnp.mean(probs_MxE, axis=0)[None])


def _ragged_dot(rows_MxI, w_ExIxO, sizes_E) -> jax.Array:
    """`jax.lax.ragged_dot`, or the weight's own grouped matmul where it brings one (an
    FP8-compressed model's experts: hldstudy.compress.fp8_forward.FP8Experts)."""
    own = getattr(w_ExIxO, "grouped_matmul", None)
    return jax.lax.ragged_dot(rows_MxI, w_ExIxO, sizes_E) if own is None else own(rows_MxI, sizes_E)


def grouped_swiglu(x_MxD, experts_MxK, gate_ExDxF, up_ExDxF, down_ExFxD):
    """Each (token, slot) row through its expert's SwiGLU, dropless: [M, k, D]."""
    m, d = x_MxD.shape
    k = experts_MxK.shape[1]
    n_experts = gate_ExDxF.shape[0]
    flat = experts_MxK.reshape(-1)
    order = jnp.argsort(flat, stable=True)  # rows grouped by expert, token order within
    rows = jnp.take(x_MxD, order // k, axis=0)
    sizes = jnp.bincount(flat, length=n_experts).astype(jnp.int32)
    h = jax.nn.silu(_ragged_dot(rows, gate_ExDxF, sizes)) * _ragged_dot(rows, up_ExDxF, sizes)
    out_sorted = _ragged_dot(h, down_ExFxD, sizes)
    out = jnp.zeros_like(out_sorted).at[order].set(out_sorted, unique_indices=True)
    return out.reshape(m, k, d)


class MoE(nnx.Module):
    """Router `[D, E]`, experts `gate/up [E, D, F]`, `down [E, F, D]`, shared expert
    `shared_gate/shared_up [D, Fs]`, `shared_down [Fs, D]`, `shared_expert_gate [D, 1]`."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        d, e, f, fs = cfg.d_model, cfg.n_experts, cfg.d_expert, cfg.d_shared_expert
        pdt = jnp.dtype(cfg.param_dtype)
        self.router = nnx.Param(_init_normal(rngs, (d, e), d, pdt))
        # Dimension 0 indexes experts: split over the mesh's expert axis (hldstudy.sharding).
        experts = expert_dim_metadata(0)
        self.gate = nnx.Param(_init_normal(rngs, (e, d, f), d, pdt), **experts)
        self.up = nnx.Param(_init_normal(rngs, (e, d, f), d, pdt), **experts)
        self.down = nnx.Param(_init_normal(rngs, (e, f, d), f, pdt), **experts)
        if fs:
            self.shared_gate = nnx.Param(_init_normal(rngs, (d, fs), d, pdt))
            self.shared_up = nnx.Param(_init_normal(rngs, (d, fs), d, pdt))
            self.shared_down = nnx.Param(_init_normal(rngs, (fs, d), fs, pdt))
            self.shared_expert_gate = nnx.Param(_init_normal(rngs, (d, 1), d, pdt))
        self.has_shared = bool(fs)
        self.k = cfg.experts_per_token
        self.compute_dtype = jnp.dtype(cfg.dtype)

    def __call__(self, x_BxTxD) -> tuple[jax.Array, jax.Array]:
        """(output [B, T, D], this layer's load-balancing loss)."""
        dt = self.compute_dtype
        b, t, d = x_BxTxD.shape
        x_MxD = x_BxTxD.astype(dt).reshape(b * t, d)
        probs, weights, experts = route(x_MxD @ self.router[...].astype(dt), self.k)
        routed = grouped_swiglu(x_MxD, experts, self.gate[...].astype(dt),
                                self.up[...].astype(dt), self.down[...].astype(dt))
        out = jnp.sum(routed * weights.astype(dt)[..., None], axis=1)
        if self.has_shared:
            shared = (jax.nn.silu(x_MxD @ self.shared_gate[...].astype(dt))
                      * (x_MxD @ self.shared_up[...].astype(dt))) @ self.shared_down[...].astype(dt)
            out = out + jax.nn.sigmoid(x_MxD @ self.shared_expert_gate[...].astype(dt)) * shared
        return out.reshape(b, t, d), load_balancing_loss(probs, experts)
