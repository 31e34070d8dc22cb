"""What each target compiler keeps live at a train step's peak: one row per compiler,
read by `hldstudy.plan.step_memory`.

The planner's terms (`hldstudy.plan.terms`) count bytes; when those bytes are live
together is the compiler's schedule, and the three compilers the study meets schedule
differently. The rows are measured against each compiler's own `memory_analysis()` and
buffer assignment (`XLA_FLAGS=--xla_dump_to=DIR`: `*live-range.txt` names the values live
at the peak), not derived; they hold for every chip of the platform (chip facts are
`hldstudy.chips`'s).

- XLA CPU ("cpu", the default suite's compiler; tests/test_plan.py, test_cohort_plan.py):
  a step's gradients, saved activations and logits peak are counted live together, a
  vmapped cohort keeps ~25% more activation bytes per member than K solo steps (batched-dot
  operand layouts: per-member temporaries of the tiny KD step 12.7 MB for K <= 3, 14.3 MB
  for K = 4, vs the solo step's 13.3 MB of which 9.6 MB activations), a colocated
  teacher's forward keeps the whole training working set of its largest block plus
  `TEACHER_LIVE_COPIES` residual-stream buffers.
- XLA GPU ("gpu"): the CPU row (the 123M KD step on 8 x H100, Triton loss: planner 46.33
  GiB / compiled 51.92 = 0.89; no GPU cohort compile has been measured).
- libtpu ("tpu", compile-only v5e:2x4 topology, libtpu 0.0.42; the 123M KD step of
  experiments/c4_123m_kd.py, XLA loss, dense attention, no FSDP): it schedules against the
  device memory and rematerializes what does not fit, so a step's peak is where its own
  working sets are largest, not the sum of them.
  * The student: at the K = 4 vmapped cohort's peak (2 sequences per chip, bfloat16 teacher:
    temporaries 3.30 GiB) every member holds its saved block inputs, one block's attention
    scores and the head-gradient accumulator and no gradient yet (the forward/backward
    turn); the gradients fill as those are freed. No extra per vmapped member.
  * The teacher's forward (the default batch, 32 sequences per chip, float32 teacher; the
    compiler refuses it at 22.76 GiB = arguments 13.62 + temporaries 9.14): at its peak it
    holds the MLP's gate and up products and two residual-stream buffers, 2 F + 2 d float32
    values per token, 0.22 of the block's training working set (its attention scores are
    not live then); of its outputs only the kept ones stay (no extra residual copies).
  Planner / compiled with this row (tests/test_aot_compile.py): K = 4 cohort 15.15 / 14.85
  GiB (1.02, both fit; the CPU row said 16.61, does not fit), the default batch 22.98 /
  22.76 (1.01, neither fits; CPU row 46.33), the solo step at 2 sequences per chip 8.40 /
  9.33 (0.90: with 6 GiB to spare libtpu keeps recomputed MLP products it need not).
"""

from __future__ import annotations

import dataclasses

from hldstudy.errors import ConfigError
from hldstudy.plan.terms import TEACHER_LIVE_COPIES


@dataclasses.dataclass(frozen=True)
class PeakHabits:
    """How one compiler overlaps a train step's buffers at its peak."""

    name: str
    # True: gradients, saved activations and logits are live at once (the sum). False:
    # the peak is the larger of the forward/backward turn (activations + logits, no
    # gradient yet) and the end of the backward (every gradient + one block's working set).
    grads_beside_activations: bool
    # A vmapped cohort member keeps this share of its activations more than a solo step.
    vmap_activation_extra: float
    # Share of the largest teacher block's training working set
    # (`terms.layer_activation_bytes_per_token`) live at the teacher forward's peak.
    teacher_forward_share: float
    # Residual-stream-sized teacher buffers live at the peak (its kept outputs at least).
    teacher_live_copies: int


CPU = PeakHabits("cpu", grads_beside_activations=True, vmap_activation_extra=0.25,
                 teacher_forward_share=1.0, teacher_live_copies=TEACHER_LIVE_COPIES)
GPU = dataclasses.replace(CPU, name="gpu")
TPU = PeakHabits("tpu", grads_beside_activations=False, vmap_activation_extra=0.0,
                 teacher_forward_share=0.22, teacher_live_copies=0)

COMPILERS = {h.name: h for h in (CPU, GPU, TPU)}


def peak_habits(compiler: str) -> PeakHabits:
    """The row of `compiler` ("cpu", "gpu", "tpu": `jax.default_backend()`'s spelling),
    or a ConfigError naming the choices."""
    if compiler not in COMPILERS:
        raise ConfigError("compiler", f"{compiler!r} is not one of {', '.join(COMPILERS)}")
    return COMPILERS[compiler]
