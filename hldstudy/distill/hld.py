"""Hidden-layer distillation: HLDF (two stages), HLDC (joint) and Patient KD.

A learned dense regressor per (student layer, teacher layer) pair maps the
student's hidden state onto the teacher's; the alignment loss is the
normalized MSE of DESIGN.md, averaged over pairs.
"""

from __future__ import annotations

from flax import nnx

from hldstudy.config import Config, ModelConfig
from hldstudy.distill.base import Stage
from hldstudy.distill.kd import LogitKD
from hldstudy.distill.pairs import resolve_layer_pairs
from hldstudy.errors import ConfigError


class Regressors(nnx.Module):
    """One regressor per aligned pair."""

    def __init__(self, d_student: int, d_teacher: int, n_pairs: int, rngs: nnx.Rngs):
        from hldstudy.losses import Regressor

        self.items = nnx.List([Regressor(d_student, d_teacher, rngs=rngs) for _ in range(n_pairs)])


class _Aligning(LogitKD):
    """Shared machinery: resolved pairs, regressors, the alignment term."""

    def __init__(self, cfg: Config, student: ModelConfig, teacher: ModelConfig | None):
        super().__init__(cfg, student, teacher)
        self.pairs = resolve_layer_pairs(cfg, teacher)
        if not cfg.distill.regressor and student.d_model != teacher.d_model:
            raise ConfigError("distill.regressor",
                              f"student hidden size {student.d_model} differs from the teacher's "
                              f"{teacher.d_model} and no regressor maps between them",
                              "set distill.regressor=true")

    def init_aux(self, stage: Stage, rngs: nnx.Rngs):
        if not self.cfg.distill.regressor:
            return None
        return Regressors(self.student_cfg.d_model, self.teacher_cfg.d_model, len(self.pairs), rngs)

    def teacher_layers(self, stage: Stage) -> tuple[int, ...]:
        return tuple(t for _, t in self.pairs)

    def alignment(self, out, aux, batch, teacher):
        from hldstudy.losses import hidden_alignment_loss

        regressors = list(aux.items) if aux is not None else [lambda h: h] * len(self.pairs)
        return hidden_alignment_loss([out.hidden[s] for s, _ in self.pairs],
                                     [teacher.hidden[t] for _, t in self.pairs],
                                     regressors, batch["mask"] > 0)

    def joint_loss(self, student, aux, batch, teacher):
        out = student(batch["tokens"], batch["positions"], batch["segment_ids"],
                      hidden_layers=tuple(s for s, _ in self.pairs), return_logits=False)
        kd, metrics = self.kd_loss(student, out, batch, teacher)
        nmse = self.alignment(out, aux, batch, teacher)
        return kd + self.cfg.distill.hidden_weight * nmse, {**metrics, "kd": kd, "nmse": nmse}


class HLDC(_Aligning):
    """alpha * NLL + (1 - alpha) * tau^2 * KL + beta * NMSE, one stage."""

    name = "hldc"

    def loss(self, stage, student, aux, batch, teacher):
        return self.joint_loss(student, aux, batch, teacher)


class Patient(_Aligning):
    """Patient KD: logit KD plus several evenly mapped hidden pairs."""

    name = "patient"

    def loss(self, stage, student, aux, batch, teacher):
        return self.joint_loss(student, aux, batch, teacher)


class HLDF(_Aligning):
    """FitNets-style: stage 1 aligns the student's layers up to the aligned one
    (NMSE only, no head); stage 2 is plain logit KD on the whole student. The
    regressor exists only in stage 1."""

    name = "hldf"

    def stages(self) -> tuple[Stage, ...]:
        share = self.cfg.distill.hldf_stage1_share
        return (Stage("stage1", share), Stage("stage2", 1.0 - share))

    def init_aux(self, stage, rngs):
        return super().init_aux(stage, rngs) if stage.name == "stage1" else None

    def teacher_layers(self, stage):
        return super().teacher_layers(stage) if stage.name == "stage1" else ()

    def teacher_needs_head(self, stage) -> bool:
        return stage.name == "stage2"

    def trainable_student_layers(self, stage) -> int | None:
        return max(s for s, _ in self.pairs) if stage.name == "stage1" else None

    def loss(self, stage, student, aux, batch, teacher):
        if stage.name == "stage2":
            return super().loss(stage, student, aux, batch, teacher)
        deepest = max(s for s, _ in self.pairs)
        out = student(batch["tokens"], batch["positions"], batch["segment_ids"],
                      hidden_layers=tuple(s for s, _ in self.pairs), max_layer=deepest)
        nmse = self.alignment(out, aux, batch, teacher)
        return nmse, {"nmse": nmse}
