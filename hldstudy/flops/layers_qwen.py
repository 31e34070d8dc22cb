"""Closed-form FLOPs of the Qwen3.5 layers: the family's branch of `hldstudy.flops`.

Design notes: `docs/flops.md`, under this file's name.
"""

from __future__ import annotations

import math

from hldstudy.chips import traced_target
from hldstudy.config import experts_run_dense
from hldstudy.shapes import ModelShape, causal_context

__all__ = ["deltanet_flops", "deltanet_mixing_flops", "gated_attention_flops",
           "grouped_matmuls_run_dense", "mlp_flops_per_token", "moe_flops",
           "qwen_flops_per_token", "qwen_forward_flops", "qwen_train_mixing_flops",
           "unit_lower_inverse_flops"]


def unit_lower_inverse_flops(n: int) -> float:
    """`hldstudy.model.deltanet.unit_lower_inverse` of one n x n matrix: n padded to P, the
    next power of two; at block size s = 1, 2, ..., P/2, P/(2s) products D^-1 B A^-1 of two
    s x s x s matmuls: sum 2P s^2 = 2P(P^2 - 1)/3."""
    p = 1 << max(0, (n - 1).bit_length())
    return 2.0 * p * (p * p - 1) / 3.0


def attention_projection_flops(m: ModelShape) -> float:
    """Per token: q, output gate, k, v, o."""
    return 2.0 * m.attn_params


def attention_mixing_flops(m: ModelShape, seq_len: int, *, dense: bool = False) -> float:
    """Per sequence: scores and values; dense=True every query against all T keys (what the
    masked `dense` kernel executes) instead of the causal average context."""
    context = float(seq_len) if dense else causal_context(seq_len, None)
    return 4.0 * seq_len * context * m.n_heads * m.head_dim


def gated_attention_flops(m: ModelShape, seq_len: int, *, dense: bool = False) -> float:
    """One gated attention layer over a sequence of `seq_len` tokens."""
    return seq_len * attention_projection_flops(m) + attention_mixing_flops(m, seq_len,
                                                                            dense=dense)


def deltanet_projection_flops(m: ModelShape) -> float:
    """Per token: in_qkv, in_z, in_b, in_a, out."""
    return 2.0 * m.linear_matmul_params


def deltanet_mixing_flops(m: ModelShape, seq_len: int, *, train: bool = False) -> float:
    """Per sequence: the causal conv and the chunked delta rule (forward, or train = forward
    + backward: 3x, every term a matmul)."""
    hv, dk, dv, c = m.linear_v_heads, m.linear_k_head_dim, m.linear_v_head_dim, m.deltanet_chunk
    chunks = math.ceil(seq_len / c)
    conv = 2.0 * seq_len * m.linear_conv_dim * m.linear_conv_kernel
    per_chunk = (4.0 * c * c * dk + 2.0 * c * c * dv + 6.0 * c * dk * dv
                 + unit_lower_inverse_flops(c) + 2.0 * c * c * (dv + dk))
    forward = conv + chunks * hv * per_chunk
    return 3.0 * forward if train else forward


def deltanet_flops(m: ModelShape, seq_len: int) -> float:
    """One Gated DeltaNet layer's forward over a sequence of `seq_len` tokens."""
    return seq_len * deltanet_projection_flops(m) + deltanet_mixing_flops(m, seq_len)


def moe_flops(m: ModelShape, tokens: int, *, grouped_dense: bool = False) -> float:
    d, e, f, fs = m.d_model, m.n_experts, m.d_expert, m.d_shared_expert
    rows = tokens * m.experts_per_token
    routed = 6.0 * rows * d * f * (e if grouped_dense else 1)  # dense: each row x every expert
    router = 2.0 * tokens * d * e
    shared = 6.0 * tokens * d * fs + (2.0 * tokens * d if fs else 0.0)
    return routed + router + shared


def mlp_flops_per_token(m: ModelShape, *, grouped_dense: bool = False) -> float:
    if m.n_experts:
        return moe_flops(m, 1, grouped_dense=grouped_dense)
    return 6.0 * m.d_model * m.d_ff


def grouped_matmuls_run_dense() -> bool:
    """Whether the running backend executes an MoE's routed experts (auto dispatch) as a
    dense pass over all experts (`config.experts_run_dense`: on XLA CPU; the hardware
    figure follows what runs)."""
    backend, chip = traced_target()
    return experts_run_dense("auto", backend, chip is not None and chip.hopper,
                             forward_only=False)


def qwen_flops_per_token(m: ModelShape, seq_len: int, *, attention: str = "causal",
                         n_layers: int | None = None, head: bool = True,
                         grouped_dense: bool = False) -> dict[str, float]:
    """Forward FLOPs per token of the first `n_layers` blocks (+ head), by term:
    nonemb (every weight matmul of the blocks: projections, MLP / experts, router),
    deembed (the LM head), attention (sequence mixing: full-attention scores and values,
    the DeltaNet's conv and chunked delta rule), total. attention "dense" counts every
    query against all T keys (the masked kernel); grouped_dense: routed experts as XLA CPU
    runs them."""
    n = m.n_layers if n_layers is None else n_layers
    linear = sum(m.is_linear(i) for i in range(n))
    full = n - linear
    dense = attention == "dense"
    nonemb = (full * attention_projection_flops(m) + linear * deltanet_projection_flops(m)
              + n * mlp_flops_per_token(m, grouped_dense=grouped_dense))
    mixing = (full * attention_mixing_flops(m, seq_len, dense=dense)
              + linear * deltanet_mixing_flops(m, seq_len)) / seq_len
    out = {"nonemb": nonemb, "deembed": 2.0 * m.d_model * m.vocab_size if head else 0.0,
           "attention": mixing}
    out["total"] = sum(out.values())
    return out


def qwen_forward_flops(m: ModelShape, seq_len: int, *, head: bool = True) -> dict[str, float]:
    """Forward FLOPs of one sequence, by layer kind: attention (gated attention layers),
    deltanet, mlp, deembed, total."""
    linear = sum(m.is_linear(i) for i in range(m.n_layers))
    full = m.n_layers - linear
    out = {"attention": full * gated_attention_flops(m, seq_len),
           "deltanet": linear * deltanet_flops(m, seq_len),
           "mlp": m.n_layers * seq_len * mlp_flops_per_token(m),
           "deembed": 2.0 * seq_len * m.d_model * m.vocab_size if head else 0.0}
    out["total"] = sum(out.values())
    return out


def qwen_train_mixing_flops(m: ModelShape, seq_len: int, *,
                            n_layers: int | None = None) -> float:
    """Per sequence, forward + backward, as executed: dense gated-attention scores and the
    DeltaNet's conv and delta rule (`deltanet_mixing_flops(train=True)`)."""
    n = m.n_layers if n_layers is None else n_layers
    linear = sum(m.is_linear(i) for i in range(n))
    return (3.0 * (n - linear) * attention_mixing_flops(m, seq_len, dense=True)
            + linear * deltanet_mixing_flops(m, seq_len, train=True))


# --------------------------------------------------------------------------- #
# Elementwise work (hardware figure only)
# --------------------------------------------------------------------------- #

# Per token of one block, by feature: "hidden" per d_model (2 RMSNorms, residuals), "ffn"
# per MLP width (SwiGLU; an MoE layer's active width), gated attention's "qkv" per
# (2 n_heads + n_kv_heads) x head_dim (QK-norm, partial rotary, scale, sigmoid gate) and
# "score" per n_heads x T (mask, softmax); the DeltaNet's "vectors" per conv channel + value
# head x (K + V) (conv taps and SiLU, L2 norms, decays, gated RMSNorm) and "chunk" per value
# head x C (the in-chunk decay, masks and system, padded to whole chunks).
EW_FEATURES = ("hidden", "ffn", "qkv", "score", "vectors", "chunk")


def elementwise_features(m: ModelShape, seq_len: int, kind: str) -> list[float]:
    """The features of `EW_FEATURES` for one block of `kind` over a sequence of seq_len."""
    ffn = m.d_ff if not m.n_experts else m.experts_per_token * m.d_expert + m.d_shared_expert
    f = dict.fromkeys(EW_FEATURES, 0.0)
    f["hidden"], f["ffn"] = float(m.d_model), float(ffn)
    hv = m.linear_v_heads
    if kind == "linear_attention":
        c = m.deltanet_chunk
        chunks_per_token = math.ceil(seq_len / c) / seq_len  # padded to whole chunks
        f["vectors"] = float(m.linear_conv_dim + hv * (m.linear_k_head_dim + m.linear_v_head_dim))
        f["chunk"] = hv * c * c * chunks_per_token
    else:
        f["qkv"] = float((2 * m.n_heads + m.n_kv_heads) * m.head_dim)
        f["score"] = float(m.n_heads * seq_len)
    return [f[k] for k in EW_FEATURES]


# Fitted by scripts/calibrate_qwen_flops.py (jax 0.10.2, XLA CPU; non-negative least
# squares over 10 random 3-layer models, the trainer's baseline step and the forward
# alone; residuals <= 1.1% (forward) and <= 1.6% (train) of XLA's count, fitted when the
# DeltaNet ran a LAPACK solve; with the matmul inverse every tested step stays within 1.1%,
# not refitted: tests/test_qwen35_flops.py): (forward, train)
# FLOPs per unit of each feature. The d_model and MLP-width terms are partly collinear over
# the fitted shapes; their sum is what is determined.
_EW_QWEN = {"hidden": (3.4, 121.6), "ffn": (18.3, 0.0), "qkv": (0.0, 0.0),
            "score": (1.6, 30.7), "vectors": (50.9, 49.7), "chunk": (6.6, 50.3)}


def qwen_elementwise_per_token(m: ModelShape, seq_len: int, *, n_layers: int | None = None,
                               train: bool = False) -> float:
    """Calibrated elementwise FLOPs per token of the first `n_layers` blocks."""
    i = 1 if train else 0
    n = m.n_layers if n_layers is None else n_layers
    total = 0.0
    for layer in range(n):
        kind = "linear_attention" if m.is_linear(layer) else "full_attention"
        feats = elementwise_features(m, seq_len, kind)
        total += sum(_EW_QWEN[k][i] * f for k, f in zip(EW_FEATURES, feats, strict=True))
    return total
