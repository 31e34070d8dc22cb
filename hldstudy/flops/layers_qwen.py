"""Closed-form forward FLOPs of the Qwen3.5 layers (model FLOPs: the matmuls of the
algorithm hldstudy runs; elementwise work is not counted).

    gated_attention_flops   q, gate, k, v, o projections + causal scores and values
    deltanet_flops          projections, causal conv, and the chunked delta rule
    moe_flops               router, the top-k routed SwiGLU experts, the shared expert

Per sequence of T tokens (batch 1); multiply by the batch. The chunked delta rule per value
head and chunk of C tokens (K, V the key and value head dims; hldstudy.model.deltanet):

    intra-chunk:   k_beta k^T and q k^T (2 x 2 C^2 K), the unit-triangular solve for the
                   new values and decayed keys (C^2 (V + K): C(C-1)/2 multiply-adds per
                   right-hand column), intra-chunk attention x new values (2 C^2 V)
    state:         read by the decayed keys and the queries (2 x 2 C K V) and the update
                   (2 C K V)

`moe_flops(..., grouped_dense=True)` is what XLA's CPU backend executes for
`jax.lax.ragged_dot`: every row against every expert (a dense matmul over all experts).
"""

from __future__ import annotations

import math

from hldstudy.config import ModelConfig
from hldstudy.shapes import causal_context

__all__ = ["deltanet_flops", "gated_attention_flops", "moe_flops", "qwen_forward_flops"]


def gated_attention_flops(m: ModelConfig, seq_len: int, *, dense: bool = False) -> float:
    """dense=True: every query against all T keys (what the masked `dense` kernel executes)
    instead of the causal average context."""
    d, n, k, h = m.d_model, m.n_heads, m.n_kv_heads, m.head_dim
    projections = 2.0 * seq_len * d * (3 * n * h + 2 * k * h)  # q, gate, o; k, v
    context = float(seq_len) if dense else causal_context(seq_len, None)
    scores = 4.0 * seq_len * context * n * h
    return projections + scores


def deltanet_flops(m: ModelConfig, seq_len: int, *, solve: bool = True) -> float:
    """solve=False leaves out the triangular solve (XLA's cost analysis cannot count it)."""
    d, hk, hv = m.d_model, m.linear_k_heads, m.linear_v_heads
    dk, dv, c = m.linear_k_head_dim, m.linear_v_head_dim, m.deltanet_chunk
    conv_dim = 2 * hk * dk + hv * dv
    projections = 2.0 * seq_len * d * (conv_dim + 2 * hv * dv + 2 * hv)
    conv = 2.0 * seq_len * conv_dim * m.linear_conv_kernel
    chunks = math.ceil(seq_len / c)
    per_chunk = 4.0 * c * c * dk + 2.0 * c * c * dv + 6.0 * c * dk * dv + \
        (c * c * (dv + dk) if solve else 0.0)
    return projections + conv + chunks * hv * per_chunk


def moe_flops(m: ModelConfig, tokens: int, *, grouped_dense: bool = False) -> float:
    d, e, f, fs = m.d_model, m.n_experts, m.d_expert, m.d_shared_expert
    rows = tokens * m.experts_per_token
    routed = 6.0 * rows * d * f * (e if grouped_dense else 1)
    router = 2.0 * tokens * d * e
    shared = 6.0 * tokens * d * fs + (2.0 * tokens * d if fs else 0.0)
    return routed + router + shared


def qwen_forward_flops(m: ModelConfig, seq_len: int, *, head: bool = True) -> dict[str, float]:
    """Forward FLOPs of one sequence, by term: mixers, MLPs, head, total."""
    full = sum(m.layer_type(i) == "full_attention" for i in range(m.n_layers))
    linear = m.n_layers - full
    mlp = moe_flops(m, seq_len) if m.n_experts else 6.0 * seq_len * m.d_model * m.d_ff
    out = {"attention": full * gated_attention_flops(m, seq_len),
           "deltanet": linear * deltanet_flops(m, seq_len),
           "mlp": m.n_layers * mlp,
           "deembed": 2.0 * seq_len * m.d_model * m.vocab_size if head else 0.0}
    out["total"] = sum(out.values())
    return out
