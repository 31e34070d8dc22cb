"""The strategy: a method's declared stages turned into losses.

A method is declared once in `hldstudy.distill.methods` (its stages, the
loss terms of each, how deep the student runs, which layer pairs it aligns).
`Strategy` reads that declaration and computes the loss of one batch; the
trainer is the same for every method. A method whose loss is not a
combination of the declared terms gives its own subclass
(`MethodSpec.strategy`) and overrides `loss`.
"""

from __future__ import annotations

import importlib
from typing import TypedDict

import jax
import jax.numpy as jnp
from flax import nnx, struct

from hldstudy.distill import methods
from hldstudy.distill.methods import Stage
from hldstudy.distill.pairs import resolve_layer_pairs
from hldstudy.errors import ConfigError
from hldstudy.losses import (
    Regressor,
    fused_kd_loss,
    hidden_alignment_loss,
    materialized_kd_loss,
    nll_from_logits,
)


class Batch(TypedDict):
    """One training batch, every array `[B, T]` (packed documents)."""

    tokens: jax.Array  # int32 input ids
    positions: jax.Array  # int32 position within each document (RoPE)
    segment_ids: jax.Array  # int32 document id; attention stays within a document
    targets: jax.Array  # int32 next-token ids
    mask: jax.Array  # bool/int, 1 where the target counts in the loss


@struct.dataclass
class TeacherOutputs:
    """What the student side sees of the teacher for one batch (never logits)."""

    final_hidden: jax.Array | None  # final_hidden_BxTxD: input of the teacher's LM head
    hidden: dict  # {teacher layer: hidden_BxTxD}
    head_weight: jax.Array | None  # head_DxV: to rebuild teacher logits inside the loss
    # [B] share of each row's routed expert slots the teacher's MoE dropped (capacity
    # dispatch: hldstudy.model.moe); None for a dense teacher or where not reported.
    expert_drop_rate: jax.Array | None = None


@struct.dataclass
class WholeBatch:
    """The denominators of the whole batch when the loss sees one micro-batch of it
    (gradient accumulation): its valid tokens and, per aligned teacher layer, the sum of
    the teacher's squares over them. With these, each micro-batch's loss and metrics are
    its share of the whole batch's, and their sum is the whole batch's."""

    tokens: jax.Array
    teacher_sq: dict  # {teacher layer: sum of squares over the valid positions}


class Regressors(nnx.Module):
    """One learned dense regressor d_s -> d_t per aligned pair."""

    def __init__(self, d_student: int, d_teacher: int, n_pairs: int, rngs: nnx.Rngs):
        self.items = nnx.List([Regressor(d_student, d_teacher, rngs=rngs) for _ in range(n_pairs)])


def check_compatible(student, teacher, method: str) -> None:
    """Logit KD needs one vocabulary and one final soft-cap for both ModelConfigs."""
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


class Strategy:
    """The loss of one method, computed from its declared stages.

    Terms combine as `kd + hidden_weight * nmse` (HLDC, Patient KD; likewise
    `nll + hidden_weight * nmse`); a stage with one term optimises it alone
    (the baseline's NLL, logit KD, HLDF's stage-1 NMSE). Metrics: each term
    by name, plus the KD loss's own breakdown.
    """

    def __init__(self, cfg, student, teacher):
        """cfg: the run's Config; student / teacher: their ModelConfigs (teacher None
        for a method without one). Config types are not imported: distill/ sits
        below config, which validates against the method registry."""
        self.cfg = cfg
        self.spec = methods.get(cfg.distill.method)
        self.name = self.spec.name
        self.student_cfg = student
        self.teacher_cfg = teacher
        if any(st.kd for st in self.spec.stages):
            check_compatible(student, teacher, self.name)
            if cfg.distill.divergence == "jsd" and cfg.distill.loss_impl == "fused":
                raise ConfigError("distill.loss_impl",
                                  "the fused loss streams forward/reverse KL only",
                                  "use distill.loss_impl=materialized for jsd")
        self.pairs = resolve_layer_pairs(cfg, teacher) if self.spec.aligns else ()
        if self.pairs and not cfg.distill.regressor and student.d_model != teacher.d_model:
            raise ConfigError("distill.regressor",
                              f"student hidden size {student.d_model} differs from the teacher's "
                              f"{teacher.d_model} and no regressor maps between them",
                              "set distill.regressor=true")

    @property
    def needs_teacher(self) -> bool:
        return self.spec.needs_teacher

    # -- what a stage runs (read by the trainer, the teacher and the FLOP probe) --

    def stages(self) -> tuple[Stage, ...]:
        return self.spec.resolve_stages(self.cfg)

    def teacher_layers(self, stage: Stage) -> tuple[int, ...]:
        """Teacher hidden layers the loss needs at this stage."""
        return tuple(t for _, t in self.pairs) if stage.spec.aligns else ()

    def teacher_needs_head(self, stage: Stage) -> bool:
        """Whether the loss needs the teacher's final hidden state and head."""
        return stage.spec.teacher_head

    def trainable_student_layers(self, stage: Stage) -> int | None:
        """Blocks the stage runs and trains (None = the whole student); the rest is frozen."""
        return max(s for s, _ in self.pairs) if stage.spec.depth == "aligned" else None

    def init_aux(self, stage: Stage, rngs: nnx.Rngs) -> nnx.Module | None:
        """Regressors for a stage that aligns through them; None otherwise."""
        if not (stage.spec.aligns and self.cfg.distill.regressor):
            return None
        return Regressors(self.student_cfg.d_model, self.teacher_cfg.d_model, len(self.pairs),
                          rngs)

    # -- the loss ---------------------------------------------------------------

    def kd_loss(self, student, final_hidden_BxTxD, batch: Batch, teacher: TeacherOutputs):
        """The logit-KD objective from the student's final hidden state."""
        d = self.cfg.distill
        if d.loss_impl == "fused":
            impl, kwargs = fused_kd_loss, {"backend": d.fused_backend}
        else:
            impl, kwargs = materialized_kd_loss, {"jsd_beta": d.jsd_beta}
        return impl(final_hidden_BxTxD, student.head_weight(), teacher.final_hidden,
                    teacher.head_weight, batch["targets"], batch["mask"] > 0,
                    temperature=d.temperature, alpha=d.alpha, divergence=d.divergence,
                    softcap=self.student_cfg.final_softcap, **kwargs)

    def alignment(self, hidden: dict, aux, batch: Batch, teacher: TeacherOutputs,
                  whole: WholeBatch | None = None):
        """Normalized MSE averaged over the aligned pairs."""
        regressors = list(aux.items) if aux is not None else [lambda h: h] * len(self.pairs)
        form = self.cfg.distill.nmse
        args = ([hidden[s] for s, _ in self.pairs], [teacher.hidden[t] for _, t in self.pairs],
                regressors, batch["mask"] > 0)
        if form == "token":  # a token mean: a micro-batch's share is its tokens'
            return self._shared(hidden_alignment_loss(*args, form=form), batch, whole)
        norms = None if whole is None else [whole.teacher_sq[t] for _, t in self.pairs]
        return hidden_alignment_loss(*args, norms)

    def whole_batch(self, stage: Stage, batch: Batch, teacher: TeacherOutputs | None
                    ) -> WholeBatch:
        """The whole batch's denominators, for a loss computed micro-batch by micro-batch."""
        mask = batch["mask"] > 0
        teacher_sq = {}
        if stage.spec.aligns:
            for _, t in self.pairs:
                h = teacher.hidden[t].astype(jnp.float32)
                teacher_sq[t] = jnp.sum(jnp.where(mask[..., None], jnp.square(h), 0.0))
        return WholeBatch(jnp.sum(mask.astype(jnp.float32)), teacher_sq)

    def loss(self, stage: Stage, student, aux, batch: Batch, teacher: TeacherOutputs | None,
             whole: WholeBatch | None = None) -> tuple[jax.Array, dict]:
        """Scalar loss and a dict of scalar metrics for one batch; an MoE student adds its
        router's load-balancing loss x model.router_aux_weight (metric `router_aux`). With
        `whole`, the batch is a micro-batch and both are its share of the whole batch's."""
        loss, metrics, out = self._loss(stage, student, aux, batch, teacher, whole)
        # Experts' dropped slots, the student's and the teacher's: never silent (0: dropless).
        if out.expert_drop_rate is not None:
            metrics = {**metrics, "expert_drop_rate": self._shared(
                jnp.mean(out.expert_drop_rate), batch, whole)}
        if teacher is not None and teacher.expert_drop_rate is not None:
            metrics = {**metrics, "teacher_expert_drop_rate": self._shared(
                jnp.mean(teacher.expert_drop_rate), batch, whole)}
        weight = student.cfg.router_aux_weight
        if out.router_aux_loss is None or not weight:
            return loss, metrics
        # The router's balance is a statistic of its own batch: a micro-batch's is weighted
        # by its tokens, which is not exactly the whole batch's balance.
        aux_loss = self._shared(out.router_aux_loss, batch, whole)
        return loss + weight * aux_loss, {**metrics, "router_aux": aux_loss}

    @staticmethod
    def _shared(value, batch: Batch, whole: WholeBatch | None):
        """A token mean over `batch` as its share of the whole batch's (as it is without
        `whole`)."""
        if whole is None:
            return value
        tokens = jnp.sum((batch["mask"] > 0).astype(jnp.float32))
        return value * (tokens / jnp.maximum(whole.tokens, 1.0))

    def _loss(self, stage: Stage, student, aux, batch: Batch, teacher: TeacherOutputs | None,
              whole: WholeBatch | None = None):
        """(loss, metrics, the student's ModelOutput) of the method's own terms."""
        spec = stage.spec
        kwargs = {}
        if spec.aligns:
            kwargs["hidden_layers"] = tuple(s for s, _ in self.pairs)
        if spec.depth == "aligned":
            kwargs["max_layer"] = max(s for s, _ in self.pairs)
        elif spec.kd:
            kwargs["return_logits"] = False  # the KD loss builds logits chunk by chunk
        out = student(batch["tokens"], batch["positions"], batch["segment_ids"], **kwargs)
        terms, metrics = {}, {}
        if "nll" in spec.terms:
            terms["nll"] = self._shared(
                nll_from_logits(out.logits, batch["targets"], batch["mask"]), batch, whole)
            metrics["nll"] = terms["nll"]
        if spec.kd:
            kd, kd_metrics = self.kd_loss(student, out.final_hidden, batch, teacher)
            terms["kd"] = self._shared(kd, batch, whole)
            metrics.update({k: self._shared(v, batch, whole) for k, v in kd_metrics.items()})
        if not spec.aligns:
            return terms.get("kd", terms.get("nll")), metrics, out
        nmse = self.alignment(out.hidden, aux, batch, teacher, whole)
        metrics["nmse"] = nmse
        if not terms:  # alignment alone (HLDF stage 1): its weight would only rescale it
            return nmse, metrics, out
        name, main = next(iter(terms.items()))
        metrics[name] = main
        return main + self.cfg.distill.hidden_weight * nmse, metrics, out


def strategy_class(spec: methods.MethodSpec) -> type[Strategy]:
    """The spec's strategy class ("module:Class" is imported on first use)."""
    if not spec.strategy:
        return Strategy
    if isinstance(spec.strategy, str):
        module, _, name = spec.strategy.partition(":")
        return getattr(importlib.import_module(module), name)
    return spec.strategy


def make_strategy(cfg, student_cfg, teacher_cfg=None) -> Strategy:
    return strategy_class(methods.get(cfg.distill.method))(cfg, student_cfg, teacher_cfg)
