"""The distillation strategy interface.

A method is a small strategy object (after Tunix): it names its stages and
their shares of the FLOP budget, says which teacher layers it needs, may own
auxiliary trainable modules (regressors), and computes the loss of one
batch. The trainer is the same for every method.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass

import jax
from flax import nnx, struct

from hldstudy.config import Config, ModelConfig


@dataclass(frozen=True)
class Stage:
    name: str  # "main", or "stage1" / "stage2" for HLDF
    share: float  # share of the FLOP budget (and of train.steps when no budget is set)


@struct.dataclass
class TeacherOutputs:
    """What the student side sees of the teacher for one batch (never logits)."""

    final_hidden: jax.Array | None  # [B, T, D_t], input of the teacher's LM head
    hidden: dict  # {teacher layer: [B, T, D_t]}
    head_weight: jax.Array | None  # [D_t, V], to rebuild teacher logits inside the loss


class Strategy(abc.ABC):
    name: str = ""
    needs_teacher: bool = True

    def __init__(self, cfg: Config, student: ModelConfig, teacher: ModelConfig | None):
        self.cfg = cfg
        self.student_cfg = student
        self.teacher_cfg = teacher

    def stages(self) -> tuple[Stage, ...]:
        return (Stage("main", 1.0),)

    def teacher_layers(self, stage: Stage) -> tuple[int, ...]:
        """Teacher hidden layers the loss needs at this stage."""
        return ()

    def teacher_needs_head(self, stage: Stage) -> bool:
        """Whether the loss needs the teacher's final hidden state and head."""
        return self.needs_teacher

    def init_aux(self, stage: Stage, rngs: nnx.Rngs) -> nnx.Module | None:
        """Extra trainable modules for this stage (e.g. regressors); None if none."""
        return None

    def trainable_student_layers(self, stage: Stage) -> int | None:
        """Blocks the stage trains (None = the whole student); the rest is frozen."""
        return None

    @abc.abstractmethod
    def loss(self, stage: Stage, student, aux, batch: dict,
             teacher: TeacherOutputs | None) -> tuple[jax.Array, dict]:
        """Scalar loss and a dict of scalar metrics for one batch."""
