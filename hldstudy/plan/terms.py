"""Memory and network terms of the planner: pure functions of model shapes, bytes.

Memory terms (bytes per device):

- weights / grads: `P * param_bytes / D`; AdamW: `2 * P * param_bytes / D`
  (optax keeps mu and nu in the parameter dtype); FSDP all-gather buffer: two
  layers' full weights (double-buffered prefetch) when D > 1.
- activations (training, per token per layer, compute dtype `c` bytes):
  `c * (4 d + 4 F + 4 (N + 2K) H)` + attention scores `N * T * (8 + c)`
  (dense implementation: float32 logits and probabilities plus the cast
  probabilities, as hldstudy's model builds them) or `8 N` (flash-style:
  row statistics only). The copy counts are calibrated against XLA's
  `memory_analysis()` of the compiled baseline step (see
  `hldstudy.plan.step_memory.predict_step_memory`). With `remat`, only each block's input survives
  (`c d` per layer) plus one block's working set during its recompute.
- logits peak: materialized = student logits + their gradient + teacher
  logits, float32 `[tokens, V]` (`3 * tokens * V * 4`); fused =
  `4 * row_block * vocab_block * 4` (student/teacher chunk, probabilities,
  gradient) + the `d_s x V` float32 head-gradient accumulator + per-row
  statistics (`16` bytes per token).
- ring (disaggregated): `K * tokens_dev_step * n_streamed * d_t * stream_bytes`.
- fan-out window (a replica serving a cohort of trainer processes,
  `hldstudy.teacher.fanout`): `W * tokens_per_step * n_union * d_t *
  stream_bytes` of host memory per replica, W = `--window` steps of the
  hidden states of the union of the members' layers (`fanout_window_bytes`).

Network bytes per step: hidden = `tokens * n_streamed * d_t * stream_bytes`
(n_streamed = final hidden + `hidden_layers` intermediate layers) versus
logits = `tokens * V * stream_bytes`; the ratio is `V / (n_streamed * d_t)`.
GB are decimal (1e9 bytes).
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


def weights_bytes(m: PlanModel, nbytes: int, devices: int = 1) -> float:
    return m.total_params() * nbytes / devices


def optimizer_bytes(m: PlanModel, nbytes: int, devices: int = 1, states: int = 2) -> float:
    return states * m.total_params() * nbytes / devices


def fsdp_gather_bytes(m: PlanModel, nbytes: int, devices: int, buffers: int = 2) -> float:
    return 0.0 if devices <= 1 else float(buffers * m.layer_params() * nbytes)


def score_bytes_per_token_layer(m: PlanModel, seq_len: int, compute_bytes: int,
                                attention: str = "dense") -> float:
    if attention == "dense":
        return m.n_heads * seq_len * (8 + compute_bytes)
    if attention == "flash":
        return 8.0 * m.n_heads
    raise ConfigError("attention", f"{attention!r} is not one of dense, flash")


def layer_activation_bytes_per_token(m: PlanModel, seq_len: int, compute_bytes: int,
                                     attention: str = "dense") -> float:
    """What one block keeps per token for its backward (no remat)."""
    c = compute_bytes
    qkv = (m.n_heads + 2 * m.n_kv_heads) * m.head_dim
    return c * (ACT_COPIES["d"] * m.d_model + ACT_COPIES["ffn"] * m.ffn_width_active
                + ACT_COPIES["qkv"] * qkv) + score_bytes_per_token_layer(m, seq_len, c, attention)


def train_activation_bytes(m: PlanModel, tokens: float, seq_len: int, compute_bytes: int, *,
                           remat: bool = False, attention: str = "dense",
                           n_layers: int | None = None) -> float:
    """Saved activations of a training forward over `tokens` tokens (logits excluded)."""
    n = m.n_layers if n_layers is None else n_layers
    per_layer = layer_activation_bytes_per_token(m, seq_len, compute_bytes, attention)
    head = 2 * m.d_model * compute_bytes  # final norm in / out
    if remat:
        return tokens * (n * m.d_model * compute_bytes + per_layer + head)
    return tokens * (n * per_layer + head)


def inference_activation_bytes(m: PlanModel, tokens: float, seq_len: int, compute_bytes: int,
                               *, attention: str = "dense", kept_layers: int = 1) -> float:
    """A forward without backward: one block's working set + the kept hidden states."""
    return tokens * (layer_activation_bytes_per_token(m, seq_len, compute_bytes, attention)
                     + (1 + kept_layers) * m.d_model * compute_bytes)


def logits_bytes_materialized(tokens: float, vocab: int, with_teacher: bool = True) -> float:
    """Float32 student logits + their gradient (+ teacher logits)."""
    return (LOGIT_COPIES_TRAIN + (1 if with_teacher else 0)) * tokens * vocab * 4.0


def logits_bytes_fused(tokens: float, vocab: int, d_student: int, row_block: int = 256,
                       vocab_block: int = 512) -> float:
    """Chunk workspace + float32 head-gradient accumulator + per-row statistics."""
    rb, vb = min(row_block, max(1, int(tokens))), min(vocab_block, vocab)
    return 4.0 * rb * vb * 4 + d_student * vocab * 4.0 + 16.0 * tokens


def ring_bytes(ring: int, tokens: float, n_streamed: int, d_teacher: int,
               stream_bytes: int = 2) -> float:
    return ring * tokens * n_streamed * d_teacher * stream_bytes


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

