"""Analytic FLOP accounting and compute matching (DESIGN.md, "FLOP accounting").

Design notes: `docs/flops.md`, under this file's name.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field

from hldstudy.config import Config, ModelConfig
from hldstudy.distill import methods
from hldstudy.distill.pairs import resolve_layer_pairs
from hldstudy.errors import ConfigError
from hldstudy.family import GEMMA3, QWEN3_5, family_of
from hldstudy.flops.layers_qwen import (
    grouped_matmuls_run_dense,
    qwen_elementwise_per_token,
    qwen_flops_per_token,
    qwen_train_mixing_flops,
)
from hldstudy.shapes import ModelShape, causal_context
from hldstudy.teacher_source import is_remote

# --------------------------------------------------------------------------- #
# Per-token forward counts
# --------------------------------------------------------------------------- #


def _shape(m: ModelConfig | ModelShape) -> ModelShape:
    return m if isinstance(m, ModelShape) else ModelShape.from_model_config(m)


def matmul_params_per_layer(m: ModelConfig | ModelShape) -> int:
    """Weights of q, k, v, o, gate, up, down in one block (norm scales excluded; gemma3)."""
    return _shape(m).layer_matmul_params_active()


def layer_contexts(m: ModelConfig | ModelShape, seq_len: int, attention: str = "causal",
                   n_layers: int | None = None) -> list[float]:
    """Per layer context length: causal average (model FLOPs) or T (dense implementation)."""
    _check_attention(attention)
    n = m.n_layers if n_layers is None else n_layers
    if attention == "dense":
        return [float(seq_len)] * n
    return [causal_context(seq_len, m.window(i)) for i in range(n)]


def _check_attention(attention: str) -> None:
    if attention not in ("causal", "dense"):
        raise ConfigError("attention", f"{attention!r} is not one of causal, dense")


def flops_per_token(model_cfg: ModelConfig | ModelShape, seq_len: int, *,
                    attention: str = "causal", n_layers: int | None = None, head: bool = True,
                    elementwise: bool = False,
                    grouped_dense: bool = False) -> dict[str, float]:
    """Forward FLOPs per token: {"nonemb", "deembed", "attention", ["elementwise"], "total"}.

    The one dispatch on the model family: gemma3 counts with the formulas above, qwen3_5
    with `hldstudy.flops.layers_qwen` (its "attention" is all sequence mixing: gated
    attention scores and the DeltaNet's conv and chunked delta rule).
    n_layers: run only the first n blocks (HLDF stage 1); head: include the LM head.
    attention: "causal" (model FLOPs, the budget figure) or "dense" (what the
    masked implementation executes). elementwise: add the calibrated forward
    elementwise estimate (hardware figure only; needs a ModelConfig).
    grouped_dense: MoE experts as XLA CPU runs `ragged_dot` (hardware figure only).
    """
    m = _shape(model_cfg)
    _check_attention(attention)
    n = m.n_layers if n_layers is None else n_layers
    if not 0 <= n <= m.n_layers:
        raise ConfigError("n_layers", f"{n} is out of range 0..{m.n_layers}")
    out = _FAMILY_TERMS[m.fam].forward(m, seq_len, attention=attention, n_layers=n, head=head,
                                       grouped_dense=grouped_dense)
    out.pop("total", None)
    if elementwise:
        out["elementwise"] = elementwise_per_token(model_cfg, seq_len, n_layers=n, head=head,
                                                   train=False)
    out["total"] = sum(out.values())
    return out


def train_mixing_flops_per_token(m: ModelConfig | ModelShape, seq_len: int, *,
                                 n_layers: int | None = None) -> float:
    """Sequence mixing of a training step per token as executed (dense attention),
    forward + backward: 3x the forward's matmuls, and for the DeltaNet the triangular
    solve's backward (`layers_qwen.deltanet_mixing_flops`)."""
    shape = _shape(m)
    return _FAMILY_TERMS[shape.fam].train_mixing(shape, seq_len, n_layers=n_layers)


# Elementwise FLOPs per element, (forward, forward + backward), fitted to
# XLA's CPU cost analysis of the model's forward / value_and_grad (jax 0.10.2,
# 14 shapes, residuals < 1% of the term). Keys: "score" per dense attention
# score [layer, head, query, key]; "logit_nll" per student logit with the NLL
# loss; "hidden" per layer x d_model (4 RMSNorms, residuals); "ffn" per layer
# x d_ff (GeGLU); "q"/"kv" per layer x n_heads*head_dim / n_kv_heads*head_dim
# (RoPE, query scale); "qk_norm" per layer x (n_heads + n_kv_heads)*head_dim;
# "embed" per d_model (embedding scale). KD entries are per logit of the
# materialized KD loss (student + teacher softmaxes, NLL included).
_EW = {
    "score": (5.4, 18.3), "score_softcap": (2.1, 14.2),
    "logit_nll": (3.0, 4.0), "logit_softcap": (3.0, 16.3),
    "logit_forward_kl": (18.0, 29.0), "logit_reverse_kl": (18.0, 34.0),
    "logit_jsd": (48.0, 86.0), "logit_kd_softcap": (4.0, 11.0),
    "hidden": (17.8, 74.7), "ffn": (9.0, 44.9), "q": (0.6, 4.3), "kv": (4.8, 13.8),
    "qk_norm": (5.0, 19.5), "embed": (12.4, 32.5),
    "nmse": (3.0, 5.0),  # per token x d_t of a hidden-alignment pair
}
OPTIMIZER_FLOPS_PER_PARAM = 19.0  # AdamW + decoupled weight decay + clipping (XLA count)


def elementwise_per_token(m: ModelConfig, seq_len: int, *, n_layers: int | None = None,
                          head: bool = True, train: bool = False,
                          loss: str = "nll", embedding: bool = True) -> float:
    """Calibrated elementwise FLOPs per token (hardware figure only).

    loss: "nll" or a KD divergence ("forward_kl", "reverse_kl", "jsd") for the
    logit-level terms (materialized-loss constants; the fused loss is similar).
    embedding: include the embedding's own work (Gemma's scale; Qwen's lookup has none).
    qwen3_5 blocks count with `layers_qwen.qwen_elementwise_per_token`; the head and the
    losses are shared code, counted with the same constants for both families.
    """
    i = 1 if train else 0
    n = m.n_layers if n_layers is None else n_layers
    ew = _FAMILY_TERMS[family_of(m)].elementwise(m, seq_len, n, train, embedding)
    if head:
        if loss == "nll":
            ew += m.vocab_size * (_EW["logit_nll"][i]
                                  + (_EW["logit_softcap"][i] if m.final_softcap else 0.0))
        else:
            ew += m.vocab_size * (_EW[f"logit_{loss}"][i]
                                  + (_EW["logit_kd_softcap"][i] if m.final_softcap else 0.0))
    return ew


def _gemma_forward(m: ModelShape, seq_len: int, *, attention: str, n_layers: int,
                   head: bool, grouped_dense: bool) -> dict:
    return {
        "nonemb": 2.0 * n_layers * m.layer_matmul_params_active(),
        "deembed": 2.0 * m.d_model * m.vocab_size if head else 0.0,
        "attention": 4.0 * sum(layer_contexts(m, seq_len, attention, n_layers)) * m.n_heads
        * m.head_dim,
    }


def _gemma_train_mixing(m: ModelShape, seq_len: int, *, n_layers: int | None) -> float:
    return 3.0 * flops_per_token(m, seq_len, attention="dense", n_layers=n_layers,
                                 head=False)["attention"]


def _gemma_elementwise(m: ModelConfig, seq_len: int, n: int, train: bool,
                       embedding: bool) -> float:
    i = 1 if train else 0
    ew = n * m.n_heads * seq_len * (_EW["score"][i]
                                    + (_EW["score_softcap"][i] if m.attn_softcap else 0.0))
    ew += n * (_EW["hidden"][i] * m.d_model + _EW["ffn"][i] * m.d_ff
               + _EW["q"][i] * m.n_heads * m.head_dim
               + _EW["kv"][i] * m.n_kv_heads * m.head_dim
               + (_EW["qk_norm"][i] * (m.n_heads + m.n_kv_heads) * m.head_dim
                  if m.qk_norm else 0))
    return ew + (_EW["embed"][i] * m.d_model if embedding else 0.0)


def _qwen_train_mixing(m: ModelShape, seq_len: int, *, n_layers: int | None) -> float:
    return qwen_train_mixing_flops(m, seq_len, n_layers=n_layers) / seq_len


def _qwen_elementwise(m: ModelConfig, seq_len: int, n: int, train: bool,
                      embedding: bool) -> float:
    return qwen_elementwise_per_token(ModelShape.from_model_config(m), seq_len, n_layers=n,
                                      train=train)


@dataclass(frozen=True)
class FamilyTerms:
    """One family's blocks, counted: forward FLOPs per token by term, a training step's
    sequence mixing per token, calibrated elementwise FLOPs per token."""

    forward: Callable
    train_mixing: Callable
    elementwise: Callable


_FAMILY_TERMS = {
    GEMMA3: FamilyTerms(_gemma_forward, _gemma_train_mixing, _gemma_elementwise),
    QWEN3_5: FamilyTerms(qwen_flops_per_token, _qwen_train_mixing, _qwen_elementwise),
}


def trainable_params(m: ModelConfig | ModelShape, n_layers: int | None = None) -> int:
    """Parameters the optimizer updates: all of them, or (HLDF stage 1) the
    embedding and the first `n_layers` blocks (the rest, the final norm and an untied
    head are frozen)."""
    shape = _shape(m)
    if n_layers is None:
        return shape.total_params()
    return shape.embedding_params + sum(shape.block_params(i) for i in range(n_layers))


# --------------------------------------------------------------------------- #
# Per-step counts
# --------------------------------------------------------------------------- #

@dataclass(frozen=True)
class FlopBreakdown:
    """FLOPs of one training step (all tokens of the batch).

    Model-FLOP terms (the budget figure): `nonemb`, `deembed`, `attention`
    (student, training = 3x forward), `regressor`, `teacher` (its forward);
    `total` includes `teacher` only when `count_teacher`. `hardware` holds
    the terms of the executed-FLOPs estimate (dense attention, recompute,
    elementwise, optimizer, the teacher when it runs in the step) and
    `hardware_total` their sum for the colocated layout.
    """

    method: str
    stage: str
    tokens: int
    nonemb: float
    deembed: float
    attention: float
    regressor: float
    teacher: float
    total: float
    count_teacher: bool
    student_layers: int = 0
    student_head: bool = True
    teacher_layers: int = 0
    teacher_head: bool = False
    layer_pairs: tuple = ()
    teacher_head_flops: float = 0.0  # part of `teacher`: 2 d_t V per token (rebuilt student-side)
    # The losses' own FLOPs by term (kd_loss, nmse, logit_rebuild); in `total` only with
    # count_loss (budget.count_loss).
    loss_terms: dict = field(default_factory=dict)
    count_loss: bool = False
    hardware: dict = field(default_factory=dict)
    hardware_total: float = 0.0

    @property
    def student(self) -> float:
        return self.nonemb + self.deembed + self.attention

    @property
    def loss(self) -> float:
        return sum(self.loss_terms.values())

    def hardware_flops(self, layout: str = "colocated") -> float:
        """Executed FLOPs: colocated (teacher forward inside the step) or
        disaggregated (only the teacher head is rebuilt student-side)."""
        if layout == "colocated":
            return self.hardware_total
        if layout == "disaggregated":
            h = self.hardware
            return (self.hardware_total - h.get("teacher", 0.0)
                    + h.get("teacher_head", 0.0))
        raise ConfigError("layout", f"{layout!r} is not one of colocated, disaggregated")

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["student"] = self.student
        d["loss"] = self.loss
        d["layer_pairs"] = [list(p) for p in self.layer_pairs]
        return d


def fused_loss_recomputes(cfg: Config) -> bool:
    """Whether the configured fused KD loss recomputes logits in its backward.

    The XLA path (the CPU default) uses one vocabulary chunk per row window
    and forms the gradient in the forward rule: no recompute. The Pallas
    kernels (auto on GPU / TPU) chunk the vocabulary and rebuild the logits.
    """
    if cfg.distill.loss_impl != "fused":
        return False
    backend = cfg.distill.fused_backend
    if backend == "auto":
        import jax

        backend = "pallas" if jax.default_backend() in ("gpu", "tpu", "cuda", "rocm") else "xla"
    return backend.startswith("pallas")


def step_flops(cfg: Config, method: str | None = None, stage: str | None = None,
               teacher_model: ModelConfig | None = None, *,
               count_teacher: bool | None = None,
               fused_recompute: bool | None = None,
               grouped_dense: bool | None = None) -> FlopBreakdown:
    """FLOPs of one training step of `method` (default `cfg.distill.method`) at `stage`.

    teacher_model: the teacher's ModelConfig (the config only names a
    checkpoint); required by every method but baseline.
    count_teacher: overrides `cfg.budget.count_teacher`.
    fused_recompute: whether the fused KD loss rebuilds logit chunks in its
        backward (hardware figure only); None -> `fused_loss_recomputes(cfg)`.
    grouped_dense: whether the backend that runs the step executes the MoE's grouped
        matmuls densely over all experts (hardware figure only); None -> this process's
        backend (`grouped_matmuls_run_dense`); a compile for another target says its own.
    """
    spec = methods.get(method or cfg.distill.method)
    method = spec.name
    st = spec.stage(cfg, stage)
    stage = st.name
    count_teacher = cfg.budget.count_teacher if count_teacher is None else count_teacher
    if spec.needs_teacher and teacher_model is None:
        raise ConfigError("teacher", f"method {method!r} needs the teacher's model config",
                          "pass teacher_model= (CLI: --teacher-preset NAME, or a teacher "
                          "checkpoint that is an hldstudy run directory)")
    s, t = cfg.model, teacher_model
    seq, tokens = cfg.data.seq_len, cfg.data.batch_size * cfg.data.seq_len
    pairs = resolve_layer_pairs(cfg, t, method) if st.spec.aligns else ()

    # What runs: the student up to its deepest aligned layer when the stage says so
    # (then without its head); the whole teacher and its head for the KD term, else
    # the teacher up to its deepest aligned layer.
    s_layers, s_head = s.n_layers, st.spec.student_head
    if st.spec.depth == "aligned":
        s_layers = max(p[0] for p in pairs)
    t_head = st.spec.teacher_head
    t_layers = t.n_layers if t_head else (max(p[1] for p in pairs) if pairs else 0)
    kd_loss = st.spec.kd

    fs = flops_per_token(s, seq, n_layers=s_layers, head=s_head)
    nonemb, deembed, attention = (3.0 * tokens * fs[k] for k in ("nonemb", "deembed", "attention"))
    # distill.regressor=false aligns raw states: no regressor matmul, no regressor params.
    n_regressors = len(pairs) if cfg.distill.regressor else 0
    regressor = 6.0 * tokens * n_regressors * s.d_model * (t.d_model if t is not None else 0)
    teacher = teacher_head_flops = 0.0
    if t is not None and (t_layers > 0 or t_head):
        ft = flops_per_token(t, seq, n_layers=t_layers, head=t_head)
        teacher = tokens * ft["total"]
        teacher_head_flops = tokens * ft["deembed"]
    loss_terms = _loss_terms(cfg, st, tokens, pairs, t, teacher_head_flops, count_teacher)
    total = nonemb + deembed + attention + regressor + (teacher if count_teacher else 0.0) \
        + (sum(loss_terms.values()) if cfg.budget.count_loss else 0.0)

    # Hardware (executed) estimate.
    loss_kind = cfg.distill.divergence if kd_loss else "nll"
    if grouped_dense is None:
        grouped_dense = grouped_matmuls_run_dense()
    fs_dense = flops_per_token(s, seq, n_layers=s_layers, head=s_head, attention="dense",
                               grouped_dense=grouped_dense)
    hw = {
        "student_matmul": 3.0 * tokens * (fs_dense["nonemb"] + fs_dense["deembed"]),
        "student_attention_dense": tokens * train_mixing_flops_per_token(s, seq,
                                                                         n_layers=s_layers),
        "regressor": regressor,
        "elementwise": tokens * (elementwise_per_token(s, seq, n_layers=s_layers, head=s_head,
                                                       train=True, loss=loss_kind)
                                 + len(pairs) * _EW["nmse"][1] * (t.d_model if t else 0)),
        "optimizer": OPTIMIZER_FLOPS_PER_PARAM * (
            trainable_params(s, s_layers if not s_head else None)
            + n_regressors * (s.d_model + 1) * (t.d_model if t else 0)),
        "recompute_remat": 0.0,
        "recompute_fused": 0.0,
        "teacher": 0.0,
        "teacher_head": 0.0,
    }
    if s.remat:  # every block's forward runs again in the backward pass
        hw["recompute_remat"] = tokens * (
            fs_dense["nonemb"] + fs_dense["attention"]
            + elementwise_per_token(s, seq, n_layers=s_layers, head=False, train=False,
                                    embedding=False))
    if kd_loss and (fused_recompute if fused_recompute is not None
                    else fused_loss_recomputes(cfg)):
        # Backward rebuilds each chunk's student and teacher logits.
        hw["recompute_fused"] = tokens * 2.0 * (s.d_model + t.d_model) * s.vocab_size
    if t is not None and (t_layers > 0 or t_head):
        ftd = flops_per_token(t, seq, n_layers=t_layers, head=t_head, attention="dense",
                              elementwise=True, grouped_dense=grouped_dense)
        hw["teacher"] = tokens * ftd["total"]
        hw["teacher_head"] = teacher_head_flops
    hardware_total = sum(v for k, v in hw.items() if k != "teacher_head")

    return FlopBreakdown(
        method=method, stage=stage, tokens=tokens, nonemb=nonemb, deembed=deembed,
        attention=attention, regressor=regressor, teacher=teacher, total=total,
        count_teacher=count_teacher, student_layers=s_layers, student_head=s_head,
        teacher_layers=t_layers, teacher_head=t_head, layer_pairs=pairs,
        teacher_head_flops=teacher_head_flops, loss_terms=loss_terms,
        count_loss=cfg.budget.count_loss, hardware=hw, hardware_total=hardware_total)


def _loss_terms(cfg: Config, st, tokens: int, pairs, teacher: ModelConfig | None,
                teacher_head_flops: float, count_teacher: bool) -> dict[str, float]:
    """The losses' own FLOPs per step: the KD divergence over the vocabulary beyond the
    NLL over the same logits (calibrated per logit, forward + backward), the NMSE per
    aligned pair, and, for a served teacher, its logits rebuilt student-side (2 d_t V per
    token; already in the teacher's forward when the teacher is counted)."""
    out = {}
    vocab = cfg.model.vocab_size
    if st.spec.kd:
        kind = f"logit_{cfg.distill.divergence}"
        out["kd_loss"] = tokens * vocab * (_EW[kind][1] - _EW["logit_nll"][1])
        if is_remote(cfg.teacher.checkpoint) and not count_teacher:
            out["logit_rebuild"] = teacher_head_flops
    if pairs:
        out["nmse"] = tokens * len(pairs) * _EW["nmse"][1] * teacher.d_model
    return out


# --------------------------------------------------------------------------- #
# XLA's count
# --------------------------------------------------------------------------- #


# XLA's HloCostAnalysis counts the body of a while loop (scan) ONCE, not once
# per trip. The fused KD loss scans over row windows of 64 rows (XLA path), so
# XLA's count of a fused-loss step is only comparable when the step has at
# most 64 tokens (one window); use loss_impl=materialized for larger checks.
# The model itself is loop-free (blocks are unrolled), so baseline, HLDF
# stage 1 and materialized-loss steps are counted fully at any size.
FUSED_XLA_ROW_BLOCK = 64


def xla_count_is_complete(cfg: Config, method: str, stage: str,
                          teacher_model: ModelConfig | None = None) -> bool:
    """False where XLA would count a loop body only once: the fused loss's row-window
    scan over more than one window, or a Gated DeltaNet's chunk scan (student, or a
    teacher run inside the step) over more than one chunk."""
    kd = methods.get(method).stage(cfg, stage).spec.kd
    tokens = cfg.data.batch_size * cfg.data.seq_len
    models = (cfg.model,) + ((teacher_model,) if teacher_model is not None else ())
    chunked = any(cfg.data.seq_len > m.deltanet_chunk
                  and any(m.layer_type(i) == "linear_attention" for i in range(m.n_layers))
                  for m in models)
    return not (kd and cfg.distill.loss_impl == "fused" and tokens > FUSED_XLA_ROW_BLOCK) \
        and not chunked
