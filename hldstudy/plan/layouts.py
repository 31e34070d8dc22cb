"""The time and network plan of one run from model presets: colocated vs disaggregated
teacher, its FLOPs per step at an MFU, the stream's bytes against the link, the replica
devices that keep up. Memory is not here: one model sizes a program's peak per device,
aot's planner (`hldstudy.aot.planned`, `hldstudy plan --config EXP --target T`).
Design notes: `docs/planner.md`, under this file's name.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from hldstudy.errors import ConfigError
from hldstudy.flops import flops_per_token
from hldstudy.plan.terms import dtype_bytes, fanout_window_bytes, network_bytes_per_step
from hldstudy.shapes import ModelShape as PlanModel


@dataclass(frozen=True)
class PlanInputs:
    teacher: PlanModel
    student: PlanModel
    tokens_per_step: int
    devices: int
    link_gbps: float
    seq_len: int = 4096
    loss: str = "fused"  # fused | materialized
    remat: bool = False
    stream_dtype: str = "bf16"
    hidden_layers: int = 0
    teacher_devices: int | None = None
    grad_accum: int = 1
    tflops: float = 989.0
    mfu: float = 0.4
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
    "hidden_layers": ("--hidden-layers", 0, True, math.inf, False, "streamed teacher layers"),
    "fanout_window": ("--fanout-window", 0, True, math.inf, False,
                      "steps a cohort replica holds, 0 = no fan-out"),
    "fanout_union_layers": ("--fanout-union-layers", 0, True, math.inf, False,
                            "streamed tensors of the cohort's union, 0 = 1 + --hidden-layers"),
    "link_gbps": ("--link", 0, False, math.inf, False, "Gbps inbound per device, e.g. 400"),
    "tflops": ("--tflops", 0, False, math.inf, False, "peak TFLOPS per device, e.g. 989"),
    "mfu": ("--mfu", 0, False, 1, True, "model FLOPs utilisation, a fraction, e.g. 0.4"),
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
    """Step times of both layouts, the stream's network bytes and link requirement, and
    the teacher devices that keep the student busy."""
    check_inputs(p)
    s, t = p.student, p.teacher
    vocab = min(s.vocab_size, t.vocab_size)
    d_dev, t_dev = p.devices, p.teacher_devices or p.devices
    n_streamed = 1 + p.hidden_layers
    flops, colocated_time, disagg_time, teacher_time = _step_flops(p, vocab)

    sb = dtype_bytes(p.stream_dtype)
    net = network_bytes_per_step(p.tokens_per_step, n_streamed, t.d_model, vocab, sb)
    required = net["hidden"] / d_dev * 8 / disagg_time / 1e9
    required_logits = net["logits"] / d_dev * 8 / disagg_time / 1e9
    inputs = dataclasses.asdict(p)
    inputs["teacher"], inputs["student"] = t.name, s.name
    return {
        "inputs": inputs,
        "models": {"teacher": _model_facts(t), "student": _model_facts(s)},
        "tokens_per_device_step": p.tokens_per_step / d_dev,
        "colocated": {"step_time_s": colocated_time},
        "disaggregated": {"step_time_s": max(disagg_time, teacher_time),
                          "student_step_time_s": disagg_time,
                          "teacher_step_time_s": teacher_time,
                          "teacher_bound": teacher_time > disagg_time,
                          "network_bound": required > p.link_gbps,
                          "teacher_devices_for_throughput": math.ceil(
                              teacher_time * t_dev / disagg_time - 1e-9),
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
