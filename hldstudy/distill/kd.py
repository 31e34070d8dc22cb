"""Logit knowledge distillation: alpha * NLL + (1 - alpha) * tau^2 * D(p_t, p_s).

The loss never sees model logits: it takes the student's final hidden state
and tied head, the teacher's final hidden state and head, and (by default)
streams over vocabulary chunks in the fused loss.
"""

from __future__ import annotations

from hldstudy.config import Config, ModelConfig
from hldstudy.distill.base import Stage, Strategy
from hldstudy.errors import ConfigError


def check_compatible(student: ModelConfig, teacher: ModelConfig | None, method: str) -> None:
    if teacher is None:
        raise ConfigError("teacher.checkpoint", f"method {method!r} needs a teacher",
                          "pass --set teacher.checkpoint=RUN_DIR")
    if teacher.vocab_size != student.vocab_size:
        raise ConfigError("model.vocab_size",
                          f"student vocabulary {student.vocab_size} differs from the teacher's "
                          f"{teacher.vocab_size}; logit KD needs one shared vocabulary",
                          "train the student with the teacher's tokenizer and vocab_size")
    if teacher.final_softcap != student.final_softcap:
        raise ConfigError("model.final_softcap",
                          f"student soft-cap {student.final_softcap} differs from the teacher's "
                          f"{teacher.final_softcap}; the fused loss applies one cap to both")


class LogitKD(Strategy):
    name = "kd"

    def __init__(self, cfg: Config, student: ModelConfig, teacher: ModelConfig | None):
        super().__init__(cfg, student, teacher)
        check_compatible(student, teacher, cfg.distill.method)
        if cfg.distill.divergence == "jsd" and cfg.distill.loss_impl == "fused":
            raise ConfigError("distill.loss_impl", "the fused loss streams forward/reverse KL only",
                              "use distill.loss_impl=materialized for jsd")

    def kd_loss(self, student, out, batch, teacher):
        """The logit-KD objective from the student's final hidden state."""
        from hldstudy.losses import fused_kd_loss, materialized_kd_loss

        d = self.cfg.distill
        impl = fused_kd_loss if d.loss_impl == "fused" else materialized_kd_loss
        kwargs = {"backend": d.fused_backend} if d.loss_impl == "fused" else {"jsd_beta": d.jsd_beta}
        return impl(out.final_hidden, student.head_weight(), teacher.final_hidden,
                    teacher.head_weight, batch["targets"], batch["mask"] > 0,
                    temperature=d.temperature, alpha=d.alpha, divergence=d.divergence,
                    softcap=self.student_cfg.final_softcap, **kwargs)

    def loss(self, stage: Stage, student, aux, batch, teacher):
        out = student(batch["tokens"], batch["positions"], batch["segment_ids"],
                      return_logits=False)
        return self.kd_loss(student, out, batch, teacher)
