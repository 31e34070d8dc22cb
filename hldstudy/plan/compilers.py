"""What each target compiler keeps live at a train step's peak and at a teacher replica's
forward's: one row per compiler, read by `hldstudy.plan.step_memory`.

Design notes: `docs/planner.md`, under this file's name.
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
    # The same with a memory-efficient attention path (chunked, cuDNN, splash: no [T, T]
    # scores, the planner's "flash"); None: as with dense attention.
    replica_forward_share_flash: float | None = None
    # Share of a sharded replica's weights (each device's share) copied into its micro-batch
    # loop: XLA GPU holds a "while" value that size beside the arguments (the 35B-A3B over 8
    # H100s: 7.7 of 7.95 GiB; the 122B-A10B over 4 H200s: 55.3 of 58.0 at 8 micro-batches,
    # 37.3 at 64); XLA CPU and libtpu do not (a v5p host's 122B replica: none).
    sharded_loop_weight_copy: float = 0.0
    # Copies of a scanned stack's saved buffers (`step_memory.scan_stack_bytes`) more at
    # the peak than the other terms count. libtpu's peak (`peak_memory_in_bytes`) holds
    # about one stack more on the scanned steps measured: 8.18 GiB over the planner's other
    # terms on the 9B DisaggKD student on v5p (its stack 8.00), 2.47 on the 735M KD step on
    # v5e (1.69), 0.49 on the 123M on v5p (1.41): the scan's stacked outputs allocated
    # beside the stack the backward reads (`AllocateBuffer`, one [groups, ...] per layer
    # of the period) and the tiled layouts' padding.
    scan_stack_extra_copies: int = 0
    # Share of a block's training working set held beyond it while the block's backward
    # runs (the TPU row's end of the backward): its recomputed forward and its own
    # cotangents together. libtpu's live-range peak, both on v5p in one block's backward:
    # 1.25x (the 9B Qwen3.5 student, recomputed products 19.02 + backward 4.12 GiB against
    # 18.50) and 1.22x (the 123M Gemma-style student, 8.59 against 7.06).
    block_backward_extra: float = 0.0
    # The planner's figure over the compiled one (`step_memory.compiled_peak`), lowest and
    # highest, per kind of program ("train": `predict_step_memory`'s steps, "replica":
    # `predict_teacher_forward_memory`'s forwards), on the programs of
    # benchmarks/planner_validation.py's validation list for this compiler: programs no
    # constant above was fitted on. A kind without one is (1, 1) (XLA CPU's constants are
    # pinned in-sample by tests/test_plan.py).
    validated_band: tuple[tuple[str, tuple[float, float]], ...] = ()


CPU = PeakHabits("cpu", grads_beside_activations=True, vmap_activation_extra=0.25,
                 teacher_forward_share=1.0, teacher_live_copies=TEACHER_LIVE_COPIES,
                 replica_forward_share=0.15)
# XLA GPU's replica share with chunked attention: Qwen3.5-35B-A3B in bf16 over 8 H100s
# (capacity dispatch), micro-batches of 4, 8 and 16 sequences per device (implied 0.17-0.19;
# dense attention's 0.30 was three score buffers of one micro-batch).
# The validation spans (benchmarks/results/planner_validation.md, 2026-12-06): XLA GPU's
# train steps 0.63 (the 9B student with its 35B-A3B teacher colocated on 8 H200s) to 1.55
# (the 123M step on 8 A100s), its replicas 0.94-1.06; libtpu's train steps 0.92-1.18, its
# replicas 1.01-1.05.
GPU = dataclasses.replace(CPU, name="gpu", replica_forward_share=0.30,
                          replica_forward_share_flash=0.18, sharded_loop_weight_copy=1.0,
                          validated_band=(("train", (0.6321, 1.5456)),
                                          ("replica", (0.9406, 1.0555))))
# libtpu's replica shares: dense attention fitted on the 3.4B replica on one v5e; splash
# ("flash") on the 35B-A3B replica over v5p:2x2x2 with ragged dispatch per batch shard
# (peak 22.75 GiB; before routing stayed on the shard it was 45.72, the partitioner's global
# sort of every MoE layer's expert ids).
TPU = PeakHabits("tpu", grads_beside_activations=False, vmap_activation_extra=0.0,
                 teacher_forward_share=0.22, teacher_live_copies=0,
                 replica_forward_share=0.55, replica_forward_share_flash=0.16,
                 scan_stack_extra_copies=1,
                 block_backward_extra=0.23,
                 validated_band=(("train", (0.9203, 1.1797)), ("replica", (1.0111, 1.0467))))

COMPILERS = {h.name: h for h in (CPU, GPU, TPU)}


PROGRAM_KINDS = ("train", "replica")


def validation_band(planned_bytes: float, compiler: str,
                    kind: str = "train") -> tuple[float, float]:
    """(low, high): the compiled figure a planner figure of a `kind` program implies on
    `compiler`, bytes: the figure over its row's `validated_band`, widened to hold the
    figure itself. What reads a planner-only verdict reads `high`, the pessimistic end."""
    if kind not in PROGRAM_KINDS:
        raise ConfigError("kind", f"{kind!r} is not one of {', '.join(PROGRAM_KINDS)}")
    lo, hi = dict(peak_habits(compiler).validated_band).get(kind, (1.0, 1.0))
    return planned_bytes * min(1.0, 1.0 / hi), planned_bytes * max(1.0, 1.0 / lo)


def peak_habits(compiler: str) -> PeakHabits:
    """The row of `compiler` ("cpu", "gpu", "tpu": `jax.default_backend()`'s spelling),
    or a ConfigError naming the choices."""
    if compiler not in COMPILERS:
        raise ConfigError("compiler", f"{compiler!r} is not one of {', '.join(COMPILERS)}")
    return COMPILERS[compiler]
