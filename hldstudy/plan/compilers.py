"""What each target compiler keeps live at a train step's peak and at a teacher replica's
forward's: one row per compiler, read by `hldstudy.plan.step_memory`.

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
- XLA GPU ("gpu"): the CPU row for the train step (the 123M KD step on 8 x H100, Triton
  loss: planner 46.33 GiB / compiled 51.92 = 0.89; no GPU cohort compile has been
  measured); its own share of a replica's forward (below).
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

A teacher's forward compiled alone (a replica: `hldstudy.teacher.microbatch`, the
disaggregated teacher side) keeps `replica_forward_share` of its largest block's training
working set live, plus its kept hidden states (`predict_teacher_forward_memory`). XLA CPU:
0.15, fitted on the tiny MoE teachers of tests/test_plan.py. GPU and TPU: fitted on the
3.4B teacher's replica (dense attention, the whole batch of 256 x 2048 on one chip in
micro-batches of M sequences), `python -m hldstudy.aot --config experiments/c4_123m_kd.py
--set data.path=/x --teacher-preset paper-teacher-3.4b --parts teacher --target T --set
teacher.replica_batch=M [--set teacher.dtype=bfloat16] --json` (libtpu 0.0.42, the CUDA
plugin 0.10.2). Totals per device, GiB, then planner / compiled and the verdict against
the chip (H100 79.65, v5e 15.75) where it changes; "refused": libtpu's figure for what
it needed; h100 f32 M = 32 is the compile that found the gap, not re-run:

  target   dtype   M    compiled (temporaries)   CPU row 0.15     this row (share)
  h100     f32   256    90.29 (73.02) no fit     61.79 0.68 fits  95.99 1.06 no fit (0.30)
  h100     f32   128    56.77 (39.50)            39.69 0.70       56.79 1.00
  h100     f32    64    36.52 (19.25)            28.64 0.78       37.19 1.02
  h100     f32    32    26.65 ( 9.38)            23.11 0.87       27.39 1.03
  h100     bf16  256    61.16 (52.52)            35.70 0.58       57.60 0.94
  h100     bf16   64    22.27 (13.63)            15.52 0.70       21.00 0.94
  v5e      f32    16    26.60 refused            20.35 0.77       26.05 0.98 no fit (0.55)
  v5e      bf16   32    17.50 refused            12.16 0.70 fits  19.46 1.11 no fit
  v5e      bf16   16    13.58 ( 4.94)            10.48 0.77       14.13 1.04
  v5e      bf16    8    11.67 ( 3.03)             9.64 0.83       11.46 0.98
  v5e      f32     1    24.68 refused            17.76 0.72       18.11 0.73 no fit

(the last: auto's pick where nothing fits, the compiler's word on it; a refused figure is
what libtpu needed when it gave up, not a schedule, and far from any share here.)

The shares implied one point at a time: XLA GPU 0.28-0.30 in float32 (its peak: three
dense-attention dot_general buffers of one micro-batch, 22.50 GiB at M = 128), 0.33-0.34
in bfloat16; libtpu 0.44-0.63, falling as the micro-batch nears the device's memory (it
schedules against it: with memory to spare it keeps more), so one share over-counts the
largest micro-batches a little and under-counts small ones.
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
    # Share of the largest teacher block's training working set live at the peak of the
    # teacher's forward compiled alone (a replica, the disaggregated teacher side:
    # `predict_teacher_forward_memory`); not the colocated one above, which the train
    # step's backward overlaps.
    replica_forward_share: float


CPU = PeakHabits("cpu", grads_beside_activations=True, vmap_activation_extra=0.25,
                 teacher_forward_share=1.0, teacher_live_copies=TEACHER_LIVE_COPIES,
                 replica_forward_share=0.15)
GPU = dataclasses.replace(CPU, name="gpu", replica_forward_share=0.30)
TPU = PeakHabits("tpu", grads_beside_activations=False, vmap_activation_extra=0.0,
                 teacher_forward_share=0.22, teacher_live_copies=0,
                 replica_forward_share=0.55)

COMPILERS = {h.name: h for h in (CPU, GPU, TPU)}


def peak_habits(compiler: str) -> PeakHabits:
    """The row of `compiler` ("cpu", "gpu", "tpu": `jax.default_backend()`'s spelling),
    or a ConfigError naming the choices."""
    if compiler not in COMPILERS:
        raise ConfigError("compiler", f"{compiler!r} is not one of {', '.join(COMPILERS)}")
    return COMPILERS[compiler]
