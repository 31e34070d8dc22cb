"""Closed-form memory / network planner: colocated vs disaggregated teacher.

Answers "will this OOM / will the network stall" before anyone rents a
cluster (DESIGN.md, "Disaggregated teacher"). Everything is a pure function
of model shapes and a few hardware numbers; `python -m hldstudy.plan` prints
the tables (`--json` for one machine-readable object).

Layouts (D trainer devices, FSDP: weights, grads and optimizer states are
sharded over all D; every device processes `tokens_per_step / (D * A)`
tokens per micro-step, A = gradient-accumulation steps):

- **colocated**: teacher and student on the same D devices; the teacher's
  weights (inference dtype) are sharded too and its forward runs inside the
  step.
- **disaggregated**: the trainer holds the student (weights, grads, AdamW
  states, activations), the teacher's LM head only (to rebuild the teacher
  logits inside the fused loss) and a prefetch ring of K steps of streamed
  teacher hidden states; the teacher runs on `teacher_devices` separate
  devices holding its weights in inference dtype and the activations of one
  forward.

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
  `predict_step_memory`). With `remat`, only each block's input survives
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

Step time: student-side FLOPs per step (3x forward, teacher-head rebuild,
regressors, fused-loss recompute when chunked, block recompute under remat) over `D * tflops * mfu`
(defaults: 989 TFLOPS peak bf16, H100 SXM, at 40% MFU ~ 400 TFLOPS
effective per device). `required_link_gbps` is the per-trainer-device
inbound bandwidth that keeps the ring from emptying: hidden bytes per step
/ D / step time. The teacher side must also keep up: its forward over
`teacher_devices` at the same MFU (`teacher_bound`); `teacher_devices_needed`
is the fewest teacher devices that both keep up and fit in memory.

Verdicts: colocated "fits" / "out of memory"; disaggregated "out of memory"
(either side over `hbm * usable`), else "network-bound" (link below the
requirement), else "fits". GB are decimal (1e9 bytes).

Not modelled: MoE routing buffers and expert parallelism (MoE weights are
FSDP-sharded like dense ones; activations use the *active* FFN width),
pipeline parallelism, CUDA/XLA runtime reserve beyond `usable`, the
optimizer's transient update tree, and hybrid linear-attention layers
(every layer is treated as softmax attention).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from dataclasses import dataclass

from hldstudy.cli_common import SWEEPS, find_builtin, warn_long_sequence
from hldstudy.config import Config, ModelConfig
from hldstudy.distill import methods
from hldstudy.errors import ConfigError, user_errors
from hldstudy.flops import step_flops, trainable_params
from hldstudy.shapes import ModelShape as PlanModel
from hldstudy.sweep.cohorts import device_hours, group, study_flops
from hldstudy.sweep.spec import expand, load_sweep, teacher_model_config

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


# --------------------------------------------------------------------------- #
# Model shapes (dense or mixture-of-experts)
# --------------------------------------------------------------------------- #


# Planner-local shapes (not model presets: hldstudy cannot train MoE layers).
# Plausible, documented numbers in the style of the named families, not
# official specifications.
PLAN_PRESETS: dict[str, PlanModel] = {
    # "35B-A3B" MoE teacher, Qwen3-MoE style: 40 layers, d 2048, 32 query / 4
    # KV heads of 256, 256 routed experts of width 512, 8 routed + 1 shared
    # per token, untied head, 151,936-token vocabulary: 34.5B total, 3.3B
    # active parameters.
    "moe-35b-a3b": PlanModel(name="moe-35b-a3b", vocab_size=151936, d_model=2048, n_layers=40,
                             n_heads=32, n_kv_heads=4, head_dim=256, d_ff=0, tied_head=False,
                             n_experts=256, experts_per_token=8, shared_experts=1, d_expert=512),
    # 9B dense student, Qwen3-8B-like: 36 layers, d 4096, 32 / 8 heads of 128,
    # d_ff 14336, untied head, same vocabulary: 9.1B parameters.
    "dense-9b": PlanModel(name="dense-9b", vocab_size=151936, d_model=4096, n_layers=36,
                          n_heads=32, n_kv_heads=8, head_dim=128, d_ff=14336, tied_head=False),
}


def plan_model(name: str) -> PlanModel:
    """A planner preset, or any `hldstudy.model.presets` name."""
    if name in PLAN_PRESETS:
        return PLAN_PRESETS[name]
    from hldstudy.model.presets import PRESETS

    if name in PRESETS:
        return PlanModel.from_model_config(PRESETS[name], name)
    raise ConfigError("preset", f"unknown model {name!r}",
                      f"choose one of {', '.join(sorted({**PLAN_PRESETS, **PRESETS}))}")


# --------------------------------------------------------------------------- #
# Memory terms (pure functions, bytes)
# --------------------------------------------------------------------------- #


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


# --------------------------------------------------------------------------- #
# The plan
# --------------------------------------------------------------------------- #


@dataclass(frozen=True)
class PlanInputs:
    teacher: PlanModel
    student: PlanModel
    tokens_per_step: int
    devices: int
    hbm_gb: float
    link_gbps: float
    seq_len: int = 4096
    loss: str = "fused"  # fused | materialized
    remat: bool = False
    ring: int = 4
    param_bytes: int = 4
    compute_dtype: str = "bf16"
    teacher_dtype: str = "bf16"
    stream_dtype: str = "bf16"
    hidden_layers: int = 0
    teacher_devices: int | None = None
    grad_accum: int = 1
    tflops: float = 989.0
    mfu: float = 0.4
    attention: str = "flash"  # dense (hldstudy's implementation) | flash
    row_block: int = 256
    vocab_block: int = 512
    usable: float = 0.9
    fused_recompute: bool = True
    fanout_window: int = 0  # cohort replicas: steps held (0 = no fan-out)
    fanout_union_layers: int = 0  # streamed tensors of the cohort's union (0: n_streamed)


# Each numeric input's domain, named by its command-line flag: (flag, low, low
# included, high, high included, what it means). Floats are also finite.
_INPUT_DOMAINS = {
    "tokens_per_step": ("--tokens-per-step", 1, True, math.inf, False, "tokens per optimizer step"),
    "devices": ("--devices", 1, True, math.inf, False, "trainer devices"),
    "seq_len": ("--seq-len", 1, True, math.inf, False, "tokens per sequence"),
    "grad_accum": ("--grad-accum", 1, True, math.inf, False, "micro-steps per step"),
    "param_bytes": ("--param-bytes", 1, True, 8, True, "bytes per parameter, e.g. 4 (float32)"),
    "ring": ("--ring", 0, True, math.inf, False, "prefetch ring depth"),
    "hidden_layers": ("--hidden-layers", 0, True, math.inf, False, "streamed teacher layers"),
    "fanout_window": ("--fanout-window", 0, True, math.inf, False,
                      "steps a cohort replica holds, 0 = no fan-out"),
    "fanout_union_layers": ("--fanout-union-layers", 0, True, math.inf, False,
                            "streamed tensors of the cohort's union, 0 = 1 + --hidden-layers"),
    "row_block": ("--row-block", 1, True, math.inf, False, "fused-loss row window"),
    "vocab_block": ("--vocab-block", 1, True, math.inf, False, "fused-loss vocabulary chunk"),
    "hbm_gb": ("--hbm", 0, False, math.inf, False, "GB of memory per device, e.g. 80"),
    "link_gbps": ("--link", 0, False, math.inf, False, "Gbps inbound per device, e.g. 400"),
    "tflops": ("--tflops", 0, False, math.inf, False, "peak TFLOPS per device, e.g. 989"),
    "mfu": ("--mfu", 0, False, 1, True, "model FLOPs utilisation, a fraction, e.g. 0.4"),
    "usable": ("--usable", 0, False, 1, True, "usable fraction of HBM, e.g. 0.9"),
}


def _check(p: PlanInputs) -> None:
    for name, (flag, lo, lo_in, hi, hi_in, what) in _INPUT_DOMAINS.items():
        v = getattr(p, name)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise ConfigError(flag, f"must be a finite number, got {v!r}", what)
        if not ((v >= lo if lo_in else v > lo) and (v <= hi if hi_in else v < hi)):
            rng = (f"{'[' if lo_in else '('}{lo}, {hi}{']' if hi_in else ')'}"
                   if hi < math.inf else f"{'>=' if lo_in else '>'} {lo}")
            raise ConfigError(flag, f"must be {'in ' if hi < math.inf else ''}{rng}, got {v}",
                              what)
    if p.teacher_devices is not None and p.teacher_devices < 1:
        raise ConfigError("--teacher-devices", f"must be >= 1, got {p.teacher_devices}",
                          "omit it to let the planner find the fewest that keep up")
    if p.loss not in ("fused", "materialized"):
        raise ConfigError("loss", f"{p.loss!r} is not one of fused, materialized")
    if p.hidden_layers > p.teacher.n_layers:
        raise ConfigError("hidden-layers", f"the teacher has {p.teacher.n_layers} layers")
    if p.tokens_per_step % (p.devices * p.grad_accum):
        raise ConfigError("tokens-per-step", f"{p.tokens_per_step} is not divisible by "
                          f"devices x grad-accum = {p.devices * p.grad_accum}")
    if p.seq_len > p.tokens_per_step:
        raise ConfigError("--seq-len", f"{p.seq_len} is longer than --tokens-per-step "
                          f"{p.tokens_per_step}: a step would hold no whole sequence",
                          "lower --seq-len or raise --tokens-per-step")


def plan(p: PlanInputs) -> dict:
    """Per-device memory of both layouts, network bytes, link requirement, verdicts."""
    _check(p)
    s, t = p.student, p.teacher
    vocab = min(s.vocab_size, t.vocab_size)
    d_dev = p.devices
    t_dev = p.teacher_devices or p.devices
    pb, cb = p.param_bytes, dtype_bytes(p.compute_dtype)
    tb, sb = dtype_bytes(p.teacher_dtype), dtype_bytes(p.stream_dtype)
    tok_step_dev = p.tokens_per_step / d_dev  # tokens per device per optimizer step
    tok_micro = tok_step_dev / p.grad_accum  # ... per micro-step (activations)
    n_streamed = 1 + p.hidden_layers
    limit = p.hbm_gb * GB * p.usable

    student_state = {
        "student_weights": weights_bytes(s, pb, d_dev),
        "student_grads": weights_bytes(s, pb, d_dev),
        "student_optimizer": optimizer_bytes(s, pb, d_dev),
        "student_fsdp_gather": fsdp_gather_bytes(s, pb, d_dev),
        "student_activations": train_activation_bytes(s, tok_micro, p.seq_len, cb,
                                                      remat=p.remat, attention=p.attention),
    }
    if p.loss == "materialized":
        logits = logits_bytes_materialized(tok_micro, vocab, with_teacher=True)
    else:
        logits = logits_bytes_fused(tok_micro, vocab, s.d_model, p.row_block, p.vocab_block)

    colocated = dict(student_state)
    colocated.update({
        "teacher_weights": weights_bytes(t, tb, d_dev),
        "teacher_fsdp_gather": fsdp_gather_bytes(t, tb, d_dev),
        # The teacher's forward runs before the student's: its working set is
        # transient and only counts where it exceeds the student's own peak;
        # its outputs (final hidden + streamed layers) stay live.
        "teacher_outputs": tok_micro * max(n_streamed, TEACHER_LIVE_COPIES) * t.d_model * cb,
        "teacher_activations": max(0.0, tok_micro * layer_activation_bytes_per_token(
            t, p.seq_len, cb, p.attention) - student_state["student_activations"] - logits),
        "logits_peak": logits,
    })
    disagg = dict(student_state)
    disagg.update({
        "teacher_head": t.head_params * tb / d_dev,
        "ring": ring_bytes(p.ring, tok_step_dev, n_streamed, t.d_model, sb),
        "logits_peak": logits,
    })
    def teacher_side_terms(n_dev: int) -> dict[str, float]:
        tok_t = p.tokens_per_step / n_dev / p.grad_accum  # one forward's share
        return {
            "teacher_weights": weights_bytes(t, tb, n_dev),
            "teacher_fsdp_gather": fsdp_gather_bytes(t, tb, n_dev),
            "teacher_activations": inference_activation_bytes(t, tok_t, p.seq_len, cb,
                                                              attention=p.attention,
                                                              kept_layers=n_streamed),
            "send_buffer": tok_t * p.grad_accum * n_streamed * t.d_model * sb,
        }

    teacher_side = teacher_side_terms(t_dev)
    # Fewest teacher devices whose memory fits (None if even 4096 do not).
    teacher_devices_for_memory = next(
        (n for n in range(1, 4097) if sum(teacher_side_terms(n).values()) <= limit), None)

    # FLOPs and step times.
    T, tok = p.seq_len, p.tokens_per_step
    student_train = 3.0 * tok * s.forward_flops_per_token(T)
    head_rebuild = 2.0 * tok * t.d_model * vocab
    recompute = 2.0 * tok * (s.d_model + t.d_model) * vocab if (
        p.loss == "fused" and p.fused_recompute) else 0.0
    regressors = 6.0 * tok * p.hidden_layers * s.d_model * t.d_model
    remat_recompute = tok * (s.forward_flops_per_token(T, head=False)) if p.remat else 0.0
    recompute += remat_recompute
    teacher_fwd = tok * t.forward_flops_per_token(T)
    eff = p.tflops * 1e12 * p.mfu
    flops = {"student_train": student_train, "teacher_head_rebuild": head_rebuild,
             "recompute": recompute, "regressors": regressors,
             "teacher_forward": teacher_fwd}
    student_side_flops = student_train + head_rebuild + recompute + regressors
    # Colocated: the teacher body runs inside the step (its head is part of teacher_fwd).
    colocated_time = (student_train + recompute + regressors + teacher_fwd) / (d_dev * eff)
    disagg_time = student_side_flops / (d_dev * eff)
    teacher_time = (teacher_fwd - head_rebuild) / (t_dev * eff)

    net = network_bytes_per_step(tok, n_streamed, t.d_model, vocab, sb)
    required = net["hidden"] / d_dev * 8 / disagg_time / 1e9
    required_logits = net["logits"] / d_dev * 8 / disagg_time / 1e9

    col_total = sum(colocated.values())
    dis_total = sum(disagg.values())
    tea_total = sum(teacher_side.values())
    col_verdict = "fits" if col_total <= limit else "out of memory"
    if dis_total > limit or tea_total > limit:
        dis_verdict = "out of memory"
    elif required > p.link_gbps:
        dis_verdict = "network-bound"
    else:
        dis_verdict = "fits"

    inputs = dataclasses.asdict(p)
    inputs["teacher"], inputs["student"] = t.name, s.name
    return {
        "inputs": inputs,
        "models": {
            "teacher": {"name": t.name, "total_params": t.total_params(),
                        "active_params": t.active_params(), "d_model": t.d_model,
                        "n_layers": t.n_layers, "vocab_size": t.vocab_size},
            "student": {"name": s.name, "total_params": s.total_params(),
                        "active_params": s.active_params(), "d_model": s.d_model,
                        "n_layers": s.n_layers, "vocab_size": s.vocab_size},
        },
        "tokens_per_device_step": tok_step_dev,
        "tokens_per_device_micro_step": tok_micro,
        "hbm_limit_bytes": limit,
        "colocated": {"bytes_per_device": col_total, "breakdown": colocated,
                      "verdict": col_verdict, "step_time_s": colocated_time},
        "disaggregated": {"bytes_per_device": dis_total, "breakdown": disagg,
                          "teacher_bytes_per_device": tea_total,
                          "teacher_breakdown": teacher_side, "verdict": dis_verdict,
                          "step_time_s": max(disagg_time, teacher_time),
                          "student_step_time_s": disagg_time,
                          "teacher_step_time_s": teacher_time,
                          "teacher_bound": teacher_time > disagg_time,
                          "teacher_devices_for_throughput": math.ceil(
                              teacher_time * t_dev / disagg_time - 1e-9),
                          "teacher_devices_for_memory": teacher_devices_for_memory,
                          "teacher_devices_needed": max(
                              math.ceil(teacher_time * t_dev / disagg_time - 1e-9),
                              teacher_devices_for_memory or 10**9),
                          "fanout_window_bytes": fanout_window_bytes(
                              p.fanout_window, p.tokens_per_step,
                              p.fanout_union_layers or n_streamed, t.d_model, sb)},
        "network_bytes_per_step": net,
        "required_link_gbps": required,
        "required_link_gbps_if_logits": required_logits,
        "flops_per_step": flops,
        "n_streamed_layers": n_streamed,
    }


# --------------------------------------------------------------------------- #
# What XLA reports for a compiled step (small configs)
# --------------------------------------------------------------------------- #


def predict_step_memory(cfg: Config, teacher_model: ModelConfig | None = None, *,
                        method: str | None = None, stage: str | None = None,
                        layout: str = "colocated", donate: bool = True,
                        attention: str = "dense") -> dict:
    """Predicted `compiled.memory_analysis()` of one train step on one device.

    Terms map onto XLA's report:
      argument_bytes: the train state (student params + regressors, AdamW mu
        and nu of the *trainable* ones in the param dtype, step counter), the
        batch (tokens, positions, segment ids, targets int32 + mask bool), and
        the teacher's input: its params (colocated) or the streamed hidden
        states and head (disaggregated).
      output_bytes: the new state (+ a few scalar metrics).
      alias_bytes: the state again when it is donated (the trainer donates).
      temp_bytes: gradients + saved activations of the layers run + the logits
        peak + the teacher's kept outputs (colocated; its forward's working
        set only where it exceeds the student's peak, as it runs first).
      total_bytes: argument + output - alias + temp (resident at the peak).

    method / stage default to the config's; layout: "colocated" or
    "disaggregated" (ignored for baseline).
    """
    spec = methods.get(method or cfg.distill.method)
    method = spec.name
    m = cfg.model
    s = PlanModel.from_model_config(m, "student")
    pb, cb = dtype_bytes(m.param_dtype), dtype_bytes(m.dtype)
    b, seq = cfg.data.batch_size, cfg.data.seq_len
    tok = b * seq
    bd = step_flops(cfg, method, stage, teacher_model if spec.needs_teacher else None)
    d_t = teacher_model.d_model if teacher_model is not None else 0
    n_pairs = len(bd.layer_pairs)
    aux = n_pairs * (m.d_model * d_t + d_t) * 4  # float32 regressors
    trainable = trainable_params(m, None if bd.student_head else bd.student_layers) * pb + aux
    params = s.total_params() * pb + aux
    state = params + 2 * trainable + 4
    batch = tok * (4 * 4 + 1)
    acts = train_activation_bytes(s, tok, seq, cb, remat=m.remat, attention=attention,
                                  n_layers=bd.student_layers)
    acts += n_pairs * 2 * tok * d_t * 4  # regressor outputs and their error
    if not bd.student_head:
        logits = 0.0
    elif not bd.teacher_head:
        logits = logits_bytes_materialized(tok, m.vocab_size, with_teacher=False)
    elif cfg.distill.loss_impl == "fused":
        logits = logits_bytes_fused(tok, m.vocab_size, m.d_model, 64, 1 << 20)
    else:
        logits = logits_bytes_materialized(tok, m.vocab_size, with_teacher=True)
    terms = {"params": params, "optimizer": 2 * trainable, "batch": batch, "grads": trainable,
             "activations": acts, "logits": logits}
    argument = state + batch
    temp = trainable + acts + logits
    working = 0.0
    if spec.needs_teacher:
        t = PlanModel.from_model_config(teacher_model, "teacher")
        tpb = dtype_bytes(cfg.teacher.dtype)
        kept = tok * d_t * tpb * (len({tt for _, tt in bd.layer_pairs}) + int(bd.teacher_head))
        head = t.head_params * tpb if bd.teacher_head else 0.0
        if layout == "colocated":
            # jit drops unused arguments: HLDF stage 1 passes only the blocks it runs.
            terms["teacher_params"] = trainable_params(
                teacher_model, None if bd.teacher_head else bd.teacher_layers) * tpb
            working = tok * layer_activation_bytes_per_token(t, seq, tpb, attention)
            terms["teacher_outputs"] = max(kept, TEACHER_LIVE_COPIES * tok * d_t * tpb)
            terms["teacher_activations"] = max(0.0, working - acts - logits)
            argument += terms["teacher_params"]
            temp += terms["teacher_outputs"] + terms["teacher_activations"]
        elif layout == "disaggregated":
            terms["teacher_inputs"] = kept + head
            argument += terms["teacher_inputs"]
        else:
            raise ConfigError("layout", f"{layout!r} is not one of colocated, disaggregated")
    output = state + 4 * 4
    alias = state if donate else 0.0
    return {"argument_bytes": argument, "output_bytes": output, "alias_bytes": alias,
            "temp_bytes": temp, "total_bytes": argument + output - alias + temp, "terms": terms,
            "state_bytes": state, "teacher_working_bytes": working if layout == "colocated" else 0.0}


# Measured, not derived: XLA (CPU) keeps ~25% more activation bytes per member in the
# vmapped cohort step than K solo steps would (batched-dot operand layouts; per-member
# temporaries of the tiny KD step: 12.7 MB for K <= 3, 14.3 MB for K = 4, 8 vs the solo
# step's 13.3 MB, of which 9.6 MB activations). Calibrated on tests/test_cohort_plan.py's
# shapes (K = 2..8 within 10%).
VMAP_ACT_EXTRA = 0.25


def cohort_memory(cfg: Config, teacher_model: ModelConfig | None, k: int, *,
                  method: str | None = None, stage: str | None = None,
                  layout: str = "colocated", varying: int = 2, donate: bool = True,
                  attention: str = "dense", mode: str = "vmap") -> dict:
    """Predicted `compiled.memory_analysis()` of one cohort step (`hldstudy.train.cohort`):
    K students, one teacher.

    mode "vmap" (batched members, the accelerator default): every member's gradients,
    activations and logits are live at once. mode "map" (`jax.lax.map`, one member after
    the other, the CPU default): one member's working set, plus the stacked new states
    being written (K states) and the member being updated (one state) - measured on XLA
    CPU: temporaries grow by one state per member.

    Per member (x K): the train state (params + optimizer state, argument, output and
    aliased when donated), and in temporaries its gradients, activations and logits
    peak. Once: the batch, the teacher's params (colocated) or streamed outputs
    (disaggregated), the teacher's kept outputs, and its forward's working set where it
    exceeds the K students' peak (it runs first). Plus K x `varying` float32
    hyperparameters and the [K] int32 divergence record. Same keys as
    `predict_step_memory` (k = 1 is the solo step plus those few bytes), and
    "per_member_bytes" / "shared_bytes" (what one more member adds / what stays)."""
    if k < 1:
        raise ConfigError("cohort", f"a cohort has at least one member, got {k}")
    one = predict_step_memory(cfg, teacher_model, method=method, stage=stage, layout=layout,
                              donate=donate, attention=attention)
    t = one["terms"]
    state = one["state_bytes"]
    member_temp = t["grads"] + t["activations"] + t["logits"]
    if mode not in ("vmap", "map"):
        raise ConfigError("mode", f"{mode!r} is not one of vmap, map")
    if k > 1 and mode == "vmap":  # batched layers: XLA keeps more of each member's activations
        member_temp += VMAP_ACT_EXTRA * t["activations"]
    small = k * (4 * varying + 4)  # hyperparameters and the divergence record
    argument = k * state + t["batch"] + t.get("teacher_params", 0.0) \
        + t.get("teacher_inputs", 0.0) + small
    output = k * (state + 4 * 4) + 4 * k
    alias = k * state if donate else 0.0
    live = k if mode == "vmap" else 1  # members whose working set is live at the peak
    teacher_temp = t.get("teacher_outputs", 0.0) \
        + max(0.0, one["teacher_working_bytes"] - live * (t["activations"] + t["logits"]))
    if mode == "vmap":
        temp = k * member_temp + teacher_temp
        per_member = 2 * state + member_temp - (state if donate else 0.0)
    else:
        temp = member_temp + teacher_temp + ((k + 1) * state if k > 1 else 0.0)
        per_member = 3 * state - (state if donate else 0.0)
    total = argument + output - alias + temp
    return {"argument_bytes": argument, "output_bytes": output, "alias_bytes": alias,
            "temp_bytes": temp, "total_bytes": total, "k": k,
            "per_member_bytes": per_member, "shared_bytes": total - k * per_member}


def largest_cohort(fits, k_max: int) -> int:
    """The largest K in 1..k_max with fits(K) (memory grows with K); 0 when none fits."""
    best = 0
    for k in range(1, max(k_max, 0) + 1):
        if not fits(k):
            break
        best = k
    return best


def auto_cohort(runs, teacher_model: ModelConfig | None, limit_bytes: float,
                devices: int = 1, mode: str = "vmap") -> dict:
    """`--cohort auto`: the largest K such that every cohort of the grid (each method's
    compatible runs, each of its stages) fits `limit_bytes` of one device per
    `cohort_memory`, the run's batch split over `devices` data-parallel devices (each
    holding the whole cohort's state: FSDP would need less). Returns {"k", "limit_bytes", "largest_group", "bytes_at_k",
    "bytes_at_k_plus_1"} (the worst cohort's predicted total; k = 0: not even one
    student fits; k = largest_group: every compatible run fits in one cohort)."""
    groups = group(runs, max(len(runs), 1))

    def need(k: int) -> float:
        worst = 0.0
        for members in groups:
            run = members[0]
            t = teacher_model if methods.get(run.method).needs_teacher else None
            cfg = run.config
            if devices > 1:
                cfg = dataclasses.replace(cfg, data=dataclasses.replace(
                    cfg.data, batch_size=max(cfg.data.batch_size // devices, 1)))
            for stage in run.stage_steps:
                mem = cohort_memory(cfg, t, min(k, len(members)), method=run.method,
                                    stage=stage, mode=mode)
                worst = max(worst, mem["total_bytes"])
        return worst

    largest = max((len(g) for g in groups), default=0)
    k = largest_cohort(lambda n: need(n) <= limit_bytes, largest)
    return {"k": k, "limit_bytes": limit_bytes, "largest_group": largest,
            "bytes_at_k": need(k) if k else need(1),
            "bytes_at_k_plus_1": need(k + 1) if k < largest else None}


def xla_memory(compiled) -> dict[str, float]:
    """The same keys from XLA's `compiled.memory_analysis()`."""
    ma = compiled.memory_analysis()
    if isinstance(ma, (list, tuple)):
        ma = ma[0]
    out = {"argument_bytes": ma.argument_size_in_bytes, "output_bytes": ma.output_size_in_bytes,
           "alias_bytes": ma.alias_size_in_bytes, "temp_bytes": ma.temp_size_in_bytes}
    out["total_bytes"] = (out["argument_bytes"] + out["output_bytes"] - out["alias_bytes"]
                          + out["temp_bytes"])
    return {k: float(v) for k, v in out.items()}


# --------------------------------------------------------------------------- #
# CLI
# --------------------------------------------------------------------------- #


def _gb(x: float) -> str:
    return f"{x / GB:.2f}"


def format_markdown(r: dict) -> str:
    i = r["inputs"]
    col, dis = r["colocated"], r["disaggregated"]
    lines = [
        f"**{i['teacher']} -> {i['student']}**: {i['tokens_per_step']} tokens/step, "
        f"{i['devices']} devices x {i['hbm_gb']:g} GB (usable {i['usable']:.0%}), "
        f"link {i['link_gbps']:g} Gbps/device, T={i['seq_len']}, loss={i['loss']}, "
        f"remat={i['remat']}, attention={i['attention']}, ring={i['ring']}, "
        f"streamed layers={r['n_streamed_layers']}, params {i['param_bytes']} B, "
        f"compute {i['compute_dtype']}, teacher {i['teacher_dtype']}, "
        f"grad-accum {i['grad_accum']}, teacher devices {i['teacher_devices'] or i['devices']}",
        "",
        "| GB per device | colocated | disaggregated (trainer) | disaggregated (teacher) |",
        "|---|---:|---:|---:|",
    ]
    keys = []
    for d in (col["breakdown"], dis["breakdown"], dis["teacher_breakdown"]):
        keys += [k for k in d if k not in keys]
    for k in keys:
        cells = [col["breakdown"].get(k), dis["breakdown"].get(k), dis["teacher_breakdown"].get(k)]
        lines.append(f"| {k} | " + " | ".join("-" if c is None else _gb(c) for c in cells) + " |")
    lines.append(f"| **total** | **{_gb(col['bytes_per_device'])}** | "
                 f"**{_gb(dis['bytes_per_device'])}** | **{_gb(dis['teacher_bytes_per_device'])}** |")
    lines.append(f"| verdict | {col['verdict']} | {dis['verdict']} | "
                 f"{'teacher-bound' if dis['teacher_bound'] else 'keeps up'} "
                 f"(needs {dis['teacher_devices_needed']} devices) |")
    lines.append(f"| step time (s) | {col['step_time_s']:.3f} | {dis['student_step_time_s']:.3f} | "
                 f"{dis['teacher_step_time_s']:.3f} |")
    if i.get("fanout_window"):
        lines.append(f"| fan-out window ({i['fanout_window']} steps, host, per replica) | - | - | "
                     f"{_gb(dis['fanout_window_bytes'])} |")
    net = r["network_bytes_per_step"]
    lines += ["",
              f"Network per step: hidden {_gb(net['hidden'])} GB vs logits {_gb(net['logits'])} GB "
              f"({net['logits_over_hidden']:.1f}x); required link {r['required_link_gbps']:.1f} "
              f"Gbps/device (logits would need {r['required_link_gbps_if_logits']:.0f})."]
    return "\n".join(lines)


def study_main(argv: list[str]) -> int:
    """`--sweep SWEEP`: teacher, student and total FLOPs of a whole grid under the
    colocated, disaggregated and cohort layouts, and device-hours."""
    ap = argparse.ArgumentParser(prog="python -m hldstudy.plan --sweep",
                                 description="FLOPs and device-hours of a whole sweep: colocated "
                                             "vs disaggregated vs cohort teacher.")
    ap.add_argument("--sweep", required=True, help="sweep file or built-in sweep name")
    ap.add_argument("--cohort", default=None, metavar="K|auto",
                    help="at most K students per cohort (default: every compatible run of a "
                         "method in one cohort); auto: the largest K whose cohorts fit --hbm")
    ap.add_argument("--hbm", type=float, default=None,
                    help="GB of memory per device (with --cohort auto)")
    ap.add_argument("--usable", type=float, default=0.9,
                    help="usable fraction of --hbm (with --cohort auto)")
    ap.add_argument("--devices", type=int, default=1,
                    help="data-parallel devices per run, splitting its batch (with --cohort auto)")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="K=V")
    ap.add_argument("--tflops", type=float, default=989.0, help="peak TFLOPS per device")
    ap.add_argument("--mfu", type=float, default=0.4)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--debug", action="store_true")
    a = ap.parse_args(argv)
    with user_errors(a.debug, prog="hldstudy.plan"):
        auto = a.cohort == "auto"
        if auto:
            if a.hbm is None or not (math.isfinite(a.hbm) and a.hbm > 0):
                raise ConfigError("--hbm", "--cohort auto needs the device memory",
                                  "give --hbm GB (> 0) per device")
            if not 0 < a.usable <= 1:
                raise ConfigError("--usable", f"{a.usable} is out of range", "0 < F <= 1")
        elif a.cohort is not None:
            try:
                a.cohort = int(a.cohort)
            except ValueError:
                raise ConfigError("--cohort", f"{a.cohort!r} is not a number",
                                  "--cohort K (K >= 1) or --cohort auto") from None
            if a.cohort < 1:
                raise ConfigError("--cohort", f"must be >= 1, got {a.cohort}")
        for name, value in (("--mfu", a.mfu), ("--tflops", a.tflops)):
            if not (math.isfinite(value) and value > 0) or (name == "--mfu" and value > 1):
                raise ConfigError(name, f"{value} is out of range",
                                  "--mfu in (0, 1], --tflops > 0 and finite")
        sweep = load_sweep(find_builtin(a.sweep, SWEEPS))
        runs = expand(sweep, a.overrides)
        teacher = teacher_model_config(runs[0].config.teacher.checkpoint, sweep.teacher_preset)
        chosen = None
        if auto:
            if a.devices < 1:
                raise ConfigError("--devices", f"must be >= 1, got {a.devices}")
            chosen = auto_cohort(runs, teacher, a.hbm * GB * a.usable, a.devices)
            if chosen["k"] == 0:
                raise ConfigError("--cohort", f"not even one student fits: the largest cohort "
                                  f"step needs {_gb(chosen['bytes_at_k'])} GB of the "
                                  f"{_gb(chosen['limit_bytes'])} GB usable "
                                  f"({a.hbm:g} GB x {a.usable:g}) with the batch over "
                                  f"{a.devices} device(s)",
                                  "more data-parallel devices (--devices N), or a device with "
                                  "more memory")
            a.cohort = chosen["k"]
        r = study_flops(runs, teacher, a.cohort or len(runs))
        if chosen is not None:
            r["cohort_auto"] = chosen
        r.update({"sweep": sweep.name, "mfu": a.mfu, "peak_tflops": a.tflops})
        for lay in r["layouts"].values():
            lay["device_hours"] = device_hours(lay["total_flops"], a.mfu, a.tflops)
        colo, coh = r["layouts"]["colocated"], r["layouts"]["cohort"]
        r["cohort_savings"] = {
            "teacher": colo["teacher_flops"] / max(coh["teacher_flops"], 1e-30),
            "total": colo["total_flops"] / coh["total_flops"]}
        if a.json:
            print(json.dumps(r, sort_keys=True))
            return 0
        if chosen is not None:
            nxt = chosen["bytes_at_k_plus_1"]
            print(f"--cohort auto: K = {chosen['k']}, the largest cohort that fits "
                  f"{_gb(chosen['limit_bytes'])} GB ({a.hbm:g} GB x {a.usable:g} usable, the "
                  f"batch over {a.devices} device(s)): "
                  f"its step needs {_gb(chosen['bytes_at_k'])} GB"
                  + (f", K = {chosen['k'] + 1} would need {_gb(nxt)} GB" if nxt else
                     " (every compatible run of a method in one cohort)"))
        print(f"sweep {sweep.name}: {r['runs']} runs, {r['cohorts']} cohorts "
              f"(at most {r['cohort_size']} students each); device-hours at "
              f"{a.mfu:.0%} MFU of {a.tflops:g} TFLOPS")
        print("| layout | teacher FLOPs | student FLOPs | total FLOPs | device-hours |")
        print("|---|---:|---:|---:|---:|")
        for name, lay in r["layouts"].items():
            print(f"| {name} | {lay['teacher_flops']:.3e} | {lay['student_flops']:.3e} | "
                  f"{lay['total_flops']:.3e} | {lay['device_hours']:,.0f} |")
        s = r["cohort_savings"]
        print(f"cohorts: teacher FLOPs {s['teacher']:.1f}x lower, total {s['total']:.2f}x lower")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if any(a == "--sweep" or a.startswith("--sweep=") for a in argv):
        return study_main(argv)
    ap = argparse.ArgumentParser(prog="python -m hldstudy.plan",
                                 description="Memory / network planner: colocated vs "
                                             "disaggregated teacher.")
    ap.add_argument("--teacher", required=True, help="preset (model or planner preset)")
    ap.add_argument("--student", required=True)
    ap.add_argument("--tokens-per-step", type=int, required=True)
    ap.add_argument("--devices", type=int, required=True, help="trainer devices")
    ap.add_argument("--hbm", type=float, required=True, help="GB of memory per device")
    ap.add_argument("--link", type=float, required=True, help="Gbps inbound per trainer device")
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--loss", choices=("fused", "materialized"), default="fused")
    ap.add_argument("--remat", action="store_true")
    ap.add_argument("--ring", type=int, default=4)
    ap.add_argument("--param-bytes", type=int, default=4)
    ap.add_argument("--compute-dtype", default="bf16")
    ap.add_argument("--teacher-dtype", default="bf16")
    ap.add_argument("--stream-dtype", default="bf16")
    ap.add_argument("--hidden-layers", type=int, default=0,
                    help="teacher intermediate layers streamed besides the final hidden")
    ap.add_argument("--teacher-devices", type=int, default=None)
    ap.add_argument("--grad-accum", type=int, default=1)
    ap.add_argument("--tflops", type=float, default=989.0, help="peak TFLOPS per device")
    ap.add_argument("--mfu", type=float, default=0.4)
    ap.add_argument("--attention", choices=("dense", "flash"), default="flash")
    ap.add_argument("--row-block", type=int, default=256)
    ap.add_argument("--vocab-block", type=int, default=512)
    ap.add_argument("--usable", type=float, default=0.9, help="usable fraction of HBM")
    ap.add_argument("--no-fused-recompute", action="store_true")
    ap.add_argument("--fanout-window", type=int, default=0,
                    help="steps a cohort replica holds (serve --window); 0 = no fan-out")
    ap.add_argument("--fanout-union-layers", type=int, default=0,
                    help="streamed tensors of the cohort's union of layers (0: as one run)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--debug", action="store_true")
    a = ap.parse_args(argv)
    with user_errors(a.debug, prog="hldstudy.plan"):
        p = PlanInputs(teacher=plan_model(a.teacher), student=plan_model(a.student),
                       tokens_per_step=a.tokens_per_step, devices=a.devices, hbm_gb=a.hbm,
                       link_gbps=a.link, seq_len=a.seq_len, loss=a.loss, remat=a.remat,
                       ring=a.ring, param_bytes=a.param_bytes, compute_dtype=a.compute_dtype,
                       teacher_dtype=a.teacher_dtype, stream_dtype=a.stream_dtype,
                       hidden_layers=a.hidden_layers, teacher_devices=a.teacher_devices,
                       grad_accum=a.grad_accum, tflops=a.tflops, mfu=a.mfu,
                       attention=a.attention, row_block=a.row_block, vocab_block=a.vocab_block,
                       usable=a.usable, fused_recompute=not a.no_fused_recompute,
                       fanout_window=a.fanout_window, fanout_union_layers=a.fanout_union_layers)
        dtype_bytes(p.compute_dtype), dtype_bytes(p.teacher_dtype), dtype_bytes(p.stream_dtype)
        _check(p)
        warn_long_sequence("hldstudy.plan", "--seq-len", p.seq_len)
        r = plan(p)
        if a.json:
            print(json.dumps(r, sort_keys=True))
        else:
            print(format_markdown(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
