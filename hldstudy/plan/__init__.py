"""Closed-form memory / network planner: colocated vs disaggregated teacher.

Answers "will this OOM / will the network stall" before anyone rents a cluster
(DESIGN.md, "Disaggregated teacher"). Everything here is a pure function of
model shapes and a few hardware numbers; nothing imports the trainer, the
teacher runtime or the sweep:

- `terms`: memory terms (weights, optimizer, activations, logits peak, ring,
  fan-out window) and network bytes per step;
- `presets`: the planner's model shapes (every model preset, Qwen3.5 MoE included);
- `layouts`: the per-device plan of one run, colocated vs disaggregated, with
  step times, the link it needs and verdicts;
- `step_memory`: XLA's `memory_analysis()` of one compiled step (solo or a
  cohort of K students), predicted, as each target compiler schedules it
  (`compilers`: what XLA CPU, XLA GPU and libtpu keep live at a step's peak).

The command line (`hldstudy plan`, `plan/__main__.py`) prints the
tables; its `--sweep` mode also reads a grid (`hldstudy.sweep`), which sits
above this package and imports it (`--cohort auto`), never the other way.

DESIGN.md's layout lists the planner under teacher/; it is a package of its own
because it sizes the whole step (the student's state, activations and logits, a
cohort of students, a grid's FLOPs per layout), not the teacher alone, and no
teacher module uses it. It sits on the floor above flops/ and model/ (whose
counts and presets it reads), beside teacher/, below sweep/ (tests/test_structure.py).
"""

from hldstudy.plan.compilers import COMPILERS, PeakHabits, peak_habits
from hldstudy.plan.layouts import PlanInputs, plan
from hldstudy.plan.presets import plan_model
from hldstudy.plan.step_memory import (
    VMAP_ACT_EXTRA,
    cohort_memory,
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
    fsdp_gather_bytes,
    inference_activation_bytes,
    layer_activation_bytes_per_token,
    logits_bytes_fused,
    logits_bytes_materialized,
    network_bytes_per_step,
    optimizer_bytes,
    ring_bytes,
    score_bytes_per_token_layer,
    train_activation_bytes,
    weights_bytes,
)

__all__ = [
    "COMPILERS", "DTYPE_BYTES", "GB", "VMAP_ACT_EXTRA", "PeakHabits", "PlanInputs", "PlanModel",
    "cohort_memory", "dtype_bytes", "fanout_window_bytes", "fsdp_gather_bytes",
    "inference_activation_bytes", "largest_cohort", "layer_activation_bytes_per_token",
    "logits_bytes_fused", "logits_bytes_materialized", "network_bytes_per_step",
    "optimizer_bytes", "peak_habits", "plan", "plan_model", "predict_step_memory",
    "predict_teacher_forward_memory", "ring_bytes",
    "score_bytes_per_token_layer", "train_activation_bytes", "weights_bytes", "xla_memory",
]
