"""Closed-form planner: a program's memory per device (step_memory), time and network
(layouts), colocated vs disaggregated teacher.

Design notes: `docs/planner.md`, under this file's name.
"""

from hldstudy.plan.compilers import COMPILERS, PeakHabits, peak_habits
from hldstudy.plan.layouts import PlanInputs, plan
from hldstudy.plan.presets import plan_model
from hldstudy.plan.step_memory import (
    VMAP_ACT_EXTRA,
    cohort_memory,
    compiled_peak,
    fits_device,
    largest_cohort,
    predict_step_memory,
    predict_teacher_forward_memory,
    xla_memory,
)
from hldstudy.plan.terms import (
    DTYPE_BYTES,
    GB,
    PlanModel,
    dtype_bytes,
    fanout_window_bytes,
    layer_activation_bytes_per_token,
    logits_bytes_fused,
    logits_bytes_materialized,
    network_bytes_per_step,
    score_bytes_per_token_layer,
    train_activation_bytes,
)

__all__ = [
    "COMPILERS", "DTYPE_BYTES", "GB", "VMAP_ACT_EXTRA", "PeakHabits", "PlanInputs", "PlanModel",
    "cohort_memory", "compiled_peak", "dtype_bytes", "fanout_window_bytes", "fits_device",
    "largest_cohort", "layer_activation_bytes_per_token",
    "logits_bytes_fused", "logits_bytes_materialized", "network_bytes_per_step",
    "peak_habits", "plan", "plan_model", "predict_step_memory",
    "predict_teacher_forward_memory",
    "score_bytes_per_token_layer", "train_activation_bytes", "xla_memory",
]
