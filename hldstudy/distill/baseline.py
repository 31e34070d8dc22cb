"""Self-supervised baseline: next-token NLL, no teacher."""

from __future__ import annotations

from hldstudy.distill.base import Stage, Strategy
from hldstudy.losses.kd import nll_from_logits


class Baseline(Strategy):
    name = "baseline"
    needs_teacher = False

    def loss(self, stage: Stage, student, aux, batch, teacher):
        out = student(batch["tokens"], batch["positions"], batch["segment_ids"])
        nll = nll_from_logits(out.logits, batch["targets"], batch["mask"])
        return nll, {"nll": nll}
