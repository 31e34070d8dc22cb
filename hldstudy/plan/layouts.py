"""The per-device plan of one run: colocated vs disaggregated teacher.

Design notes: `docs/planner.md`, under this file's name.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from hldstudy.errors import ConfigError
from hldstudy.flops import flops_per_token
from hldstudy.plan.terms import (
    GB,
    TEACHER_LIVE_COPIES,
    dtype_bytes,
    fanout_window_bytes,
    fsdp_gather_bytes,
    inference_activation_bytes,
    layer_activation_bytes_per_token,
    logits_bytes_fused,
    logits_bytes_materialized,
    network_bytes_per_step,
    optimizer_bytes,
    ring_bytes,
    train_activation_bytes,
    weights_bytes,
)
from hldstudy.shapes import ModelShape as PlanModel


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


def check_inputs(p: PlanInputs) -> None:
    """Raises ConfigError naming the flag of the first input out of its domain."""
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


def _layout_memory(p: PlanInputs, tok_step_dev: float, tok_micro: float,
                   vocab: int) -> tuple[dict, dict]:
    """Bytes per device by term: (colocated, disaggregated trainer)."""
    s, t, d_dev = p.student, p.teacher, p.devices
    pb, cb = p.param_bytes, dtype_bytes(p.compute_dtype)
    tb, sb = dtype_bytes(p.teacher_dtype), dtype_bytes(p.stream_dtype)
    n_streamed = 1 + p.hidden_layers
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
    return colocated, disagg


def teacher_side_memory(p: PlanInputs, n_dev: int,
                        microbatches: int | None = None) -> dict[str, float]:
    """Bytes per device of a disaggregated teacher spread over `n_dev` devices, its step's
    forward in `microbatches` pieces (default: the trainer's `grad_accum`)."""
    t, n_streamed = p.teacher, 1 + p.hidden_layers
    tb, cb, sb = dtype_bytes(p.teacher_dtype), dtype_bytes(p.compute_dtype), \
        dtype_bytes(p.stream_dtype)
    micro = p.grad_accum if microbatches is None else microbatches
    tok_t = p.tokens_per_step / n_dev / micro  # one forward's share
    return {
        "teacher_weights": weights_bytes(t, tb, n_dev),
        "teacher_fsdp_gather": fsdp_gather_bytes(t, tb, n_dev),
        "teacher_activations": inference_activation_bytes(t, tok_t, p.seq_len, cb,
                                                          attention=p.attention,
                                                          kept_layers=n_streamed),
        "send_buffer": tok_t * micro * n_streamed * t.d_model * sb,
    }


def _step_flops(p: PlanInputs, vocab: int) -> tuple[dict, float, float, float]:
    """(FLOPs per step by term, colocated step time, disaggregated trainer step time,
    teacher step time)."""
    s, t = p.student, p.teacher
    T, tok = p.seq_len, p.tokens_per_step
    student_train = 3.0 * tok * flops_per_token(s, T)["total"]
    head_rebuild = 2.0 * tok * t.d_model * vocab
    recompute = 2.0 * tok * (s.d_model + t.d_model) * vocab if (
        p.loss == "fused" and p.fused_recompute) else 0.0
    regressors = 6.0 * tok * p.hidden_layers * s.d_model * t.d_model
    if p.remat:
        recompute += tok * flops_per_token(s, T, head=False)["total"]
    teacher_fwd = tok * flops_per_token(t, T)["total"]
    eff = p.tflops * 1e12 * p.mfu
    flops = {"student_train": student_train, "teacher_head_rebuild": head_rebuild,
             "recompute": recompute, "regressors": regressors,
             "teacher_forward": teacher_fwd}
    student_side_flops = student_train + head_rebuild + recompute + regressors
    # Colocated: the teacher body runs inside the step (its head is part of teacher_fwd).
    colocated_time = (student_train + recompute + regressors + teacher_fwd) / (p.devices * eff)
    disagg_time = student_side_flops / (p.devices * eff)
    teacher_time = (teacher_fwd - head_rebuild) / ((p.teacher_devices or p.devices) * eff)
    return flops, colocated_time, disagg_time, teacher_time


def _model_facts(m) -> dict:
    return {"name": m.name, "total_params": m.total_params(), "active_params": m.active_params(),
            "d_model": m.d_model, "n_layers": m.n_layers, "vocab_size": m.vocab_size}


def plan(p: PlanInputs) -> dict:
    """Per-device memory of both layouts, network bytes, link requirement, verdicts."""
    check_inputs(p)
    s, t = p.student, p.teacher
    vocab = min(s.vocab_size, t.vocab_size)
    d_dev, t_dev = p.devices, p.teacher_devices or p.devices
    tok_step_dev = p.tokens_per_step / d_dev  # tokens per device per optimizer step
    tok_micro = tok_step_dev / p.grad_accum  # ... per micro-step (activations)
    n_streamed = 1 + p.hidden_layers
    limit = p.hbm_gb * GB * p.usable

    colocated, disagg = _layout_memory(p, tok_step_dev, tok_micro, vocab)
    teacher_side = teacher_side_memory(p, t_dev)
    # Fewest teacher devices whose memory fits (None if even 4096 do not).
    teacher_devices_for_memory = next(
        (n for n in range(1, 4097) if sum(teacher_side_memory(p, n).values()) <= limit), None)
    flops, colocated_time, disagg_time, teacher_time = _step_flops(p, vocab)

    sb = dtype_bytes(p.stream_dtype)
    net = network_bytes_per_step(p.tokens_per_step, n_streamed, t.d_model, vocab, sb)
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
    for_throughput = math.ceil(teacher_time * t_dev / disagg_time - 1e-9)

    inputs = dataclasses.asdict(p)
    inputs["teacher"], inputs["student"] = t.name, s.name
    return {
        "inputs": inputs,
        "models": {"teacher": _model_facts(t), "student": _model_facts(s)},
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
                          "teacher_devices_for_throughput": for_throughput,
                          "teacher_devices_for_memory": teacher_devices_for_memory,
                          "teacher_devices_needed": max(
                              for_throughput, teacher_devices_for_memory or 10**9),
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
# The whole grid on one replica set (`python -m hldstudy.sweep --teacher-replicas`)
# --------------------------------------------------------------------------- #


def grid_teacher_flops(segments: list[tuple[int, int, float]]) -> dict[str, float]:
    """Teacher FLOPs of a grid whose runs all stream from one replica set.

    `segments`: (first step, end step, teacher FLOPs per step) of every run's stages
    that need the teacher. At step s the replicas compute one forward for the union
    of what the runs still training at s need; the teachers' needs are prefixes of one
    forward (layers up to the deepest, the final state with the head), so the union
    costs the largest of them. Returns {"teacher_flops": the sum over steps of that
    largest, "bound": the longest schedule's steps x the largest per-step forward
    (every step a whole forward), "longest_steps"}. A step recomputed for a member
    that fell behind the window is not counted (the bound of a grid that keeps pace).
    """
    for lo, hi, f in segments:
        if not (0 <= lo <= hi) or not (math.isfinite(f) and f >= 0):
            raise ValueError(f"bad segment {(lo, hi, f)}")
    cuts = sorted({s for lo, hi, _ in segments for s in (lo, hi)})
    total = 0.0
    for a, b in zip(cuts, cuts[1:], strict=False):
        here = [f for lo, hi, f in segments if lo <= a and b <= hi]
        total += (b - a) * max(here, default=0.0)
    longest = max((hi for _, hi, _ in segments), default=0)
    return {"teacher_flops": total, "longest_steps": longest,
            "bound": longest * max((f for _, _, f in segments), default=0.0)}
