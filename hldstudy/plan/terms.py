"""Memory and network terms of the planner: pure functions of model shapes, bytes.

Design notes: `docs/planner.md`, under this file's name.
"""

from __future__ import annotations

from hldstudy.errors import ConfigError
from hldstudy.shapes import ModelShape as PlanModel

GB = 1e9
DTYPE_BYTES = {"float32": 4, "fp32": 4, "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2,
               "fp8": 1, "float8": 1}

# Activation copies per token per layer (compute dtype), calibrated against
# XLA's memory_analysis() of the compiled baseline step (12 CPU shapes:
# temp bytes within -19%..+14%, total within 17%).
ACT_COPIES = {"d": 4, "ffn": 4, "qkv": 4}
# A colocated teacher's forward is scheduled alongside the student's: XLA keeps
# about this many residual-stream-sized teacher buffers per token live at the
# peak (measured: 5.6-6.6 x d_t over teacher widths 128/256 and 256-512 tokens),
# its outputs included.
TEACHER_LIVE_COPIES = 6
LOGIT_COPIES_TRAIN = 2  # student logits + their gradient (float32)


def dtype_bytes(name: str | int) -> int:
    if isinstance(name, int):
        return name
    if name not in DTYPE_BYTES:
        raise ConfigError("dtype", f"unknown dtype {name!r}",
                          f"one of {', '.join(sorted(DTYPE_BYTES))}")
    return DTYPE_BYTES[name]


def score_bytes_per_token_layer(m: PlanModel, seq_len: int, compute_bytes: int,
                                attention: str = "dense") -> float:
    if attention == "dense":
        return m.n_heads * seq_len * (8 + compute_bytes)
    if attention == "flash":
        return 8.0 * m.n_heads
    raise ConfigError("attention", f"{attention!r} is not one of dense, flash")


# Qwen3.5 (qwen3_5) blocks, per token, from what the layers build (hldstudy.model.deltanet,
# moe, qwen_layers). A gated-attention layer adds its output gate (n_heads x head_dim) to the
# q, k, v copies. A Gated DeltaNet layer keeps, in the compute dtype, `DELTANET_COPIES["conv"]`
# copies of the conv channels (projection, conv + SiLU) and `["value"]` of the value width
# (z, gated-norm in/out); in float32 per value head `["key"]` x K (normalised q, k, decayed
# keys, solve) and `["head_v"]` x V (values, new values, output), `["chunk"]` x C (the in-chunk
# decay, system and attention rows), and the state entering each chunk (K x V / C). An MoE
# layer adds the router's float32 probabilities (`MOE_COPIES["router"]` x E) and the routed
# rows gathered by expert (`["rows"]` x k x d).
# Refitted when the chunk's triangular solve became a matmul-only inverse (deltanet.
# unit_lower_inverse keeps one [2s, 2s] block per level for its backward: ~2C more per token
# and head than LAPACK's solve did).
DELTANET_COPIES = {"conv": 6, "value": 3, "key": 6, "head_v": 4, "chunk": 19}
MOE_COPIES = {"router": 2, "rows": 2}


def capacity_bytes(m: PlanModel, tokens: float, compute_bytes: int, factor: float) -> float:
    """One MoE layer's capacity buffers (`hldstudy.model.moe.capacity_swiglu`): the routed
    rows laid out [E, C, d], the gate and up products [E, C, F] and the output [E, C, d],
    with E C = factor x tokens x k. 0 for a dense model."""
    if not m.n_experts:
        return 0.0
    slots = factor * tokens * m.experts_per_token
    return compute_bytes * slots * 2 * (m.d_model + m.d_expert)


def grouped_dense_bytes(m: PlanModel, tokens: float, compute_bytes: int,
                        n_layers: int | None = None) -> float:
    """Extra memory of an MoE forward where `ragged_dot` runs dense over all experts (XLA
    CPU; `hldstudy.flops.layers_qwen.grouped_matmuls_run_dense`): a laid-out copy of every
    MoE layer's expert weights (3 E d F), and one layer's expanded product [E, M, max(d, F)]
    with its routed rows and outputs [M, d + F], M = tokens x k (measured on
    `grouped_swiglu` alone: within 2% over 4 shapes); n_layers: the blocks run. 0 for a
    dense model."""
    if not m.n_experts:
        return 0.0
    d, e, f = m.d_model, m.n_experts, m.d_expert
    rows = tokens * m.experts_per_token
    n = m.n_layers if n_layers is None else n_layers
    return compute_bytes * (n * 3 * e * d * f + e * rows * max(d, f) + rows * (d + f))


def deltanet_activation_bytes_per_token(m: PlanModel, compute_bytes: int) -> float:
    """What a Gated DeltaNet mixer keeps per token for its backward (no remat)."""
    hv, dk, dv, ch = m.linear_v_heads, m.linear_k_head_dim, m.linear_v_head_dim, m.deltanet_chunk
    k = DELTANET_COPIES
    return (compute_bytes * (k["conv"] * m.linear_conv_dim + k["value"] * hv * dv)
            + 4.0 * hv * (k["key"] * dk + k["head_v"] * dv + k["chunk"] * ch + dk * dv / ch))


def deltanet_state_bytes(m: PlanModel, sequences: float, compute_bytes: int) -> float:
    """The recurrent state of every linear-attention layer for `sequences` sequences
    (decoding / serving): float32 [Hv, K, V] plus the conv's last kernel-1 inputs."""
    per_layer = 4.0 * m.linear_v_heads * m.linear_k_head_dim * m.linear_v_head_dim + \
        compute_bytes * m.linear_conv_dim * (m.linear_conv_kernel - 1)
    return sequences * m.linear_layers * per_layer


def _mlp_bytes_per_token(m: PlanModel, compute_bytes: int) -> float:
    out = compute_bytes * ACT_COPIES["ffn"] * m.ffn_width_active
    if m.n_experts:
        out += 4.0 * MOE_COPIES["router"] * m.n_experts + \
            compute_bytes * MOE_COPIES["rows"] * m.experts_per_token * m.d_model
    return out


def layer_activation_bytes_per_token(m: PlanModel, seq_len: int, compute_bytes: int,
                                     attention: str = "dense", layer: int | None = None) -> float:
    """What block `layer` keeps per token for its backward (no remat); layer None: the
    largest block (a full-attention one)."""
    c = compute_bytes
    base = c * ACT_COPIES["d"] * m.d_model + _mlp_bytes_per_token(m, c)
    if layer is not None and m.is_linear(layer):
        return base + deltanet_activation_bytes_per_token(m, c)
    qkv = (m.n_heads + 2 * m.n_kv_heads) * m.head_dim
    gate = m.n_heads * m.head_dim if m.fam.gated_attention else 0
    return base + c * ACT_COPIES["qkv"] * (qkv + gate) + \
        score_bytes_per_token_layer(m, seq_len, c, attention)


def train_activation_bytes(m: PlanModel, tokens: float, seq_len: int, compute_bytes: int, *,
                           remat: bool = False, attention: str = "dense",
                           n_layers: int | None = None) -> float:
    """Saved activations of a training forward over `tokens` tokens (logits excluded)."""
    n = m.n_layers if n_layers is None else n_layers
    per_layer = [layer_activation_bytes_per_token(m, seq_len, compute_bytes, attention, i)
                 for i in range(n)]
    head = 2 * m.d_model * compute_bytes  # final norm in / out
    if remat:
        return tokens * (n * m.d_model * compute_bytes + max(per_layer, default=0.0) + head)
    return tokens * (sum(per_layer) + head)


def logits_bytes_materialized(tokens: float, vocab: int, with_teacher: bool = True) -> float:
    """Float32 student logits + their gradient (+ teacher logits)."""
    return (LOGIT_COPIES_TRAIN + (1 if with_teacher else 0)) * tokens * vocab * 4.0


def logits_bytes_fused(tokens: float, vocab: int, d_student: int, row_block: int = 256,
                       vocab_block: int = 512) -> float:
    """Chunk workspace + float32 head-gradient accumulator + per-row statistics."""
    rb, vb = min(row_block, max(1, int(tokens))), min(vocab_block, vocab)
    return 4.0 * rb * vb * 4 + d_student * vocab * 4.0 + 16.0 * tokens


def fanout_window_bytes(window: int, tokens_per_step: float, n_union: int, d_teacher: int,
                        stream_bytes: int = 2) -> float:
    """Host memory of a cohort replica's window: W whole steps (a replica computes every
    token of a step) of the union of the members' streamed tensors."""
    return window * tokens_per_step * n_union * d_teacher * stream_bytes


def network_bytes_per_step(tokens: float, n_streamed: int, d_teacher: int, vocab: int,
                           stream_bytes: int = 2) -> dict[str, float]:
    hidden = tokens * n_streamed * d_teacher * stream_bytes
    logits = tokens * vocab * stream_bytes
    return {"hidden": hidden, "logits": logits, "logits_over_hidden": logits / hidden}

