"""Analytic FLOP accounting and compute matching (DESIGN.md, "FLOP accounting").

Two figures, kept apart on purpose:

**Model FLOPs** (the budget figure; what compute matching uses). Per token,
forward, for the layers a step runs:

    nonemb    = 2 * (matmul params of the blocks run: q, k, v, o, gate, up, down)
    deembed   = 2 * d * V                       (LM head; 0 when the head is not run)
    attention = 4 * sum_layers ctx_eff(layer) * n_heads * head_dim

`ctx_eff` is the *causal average* context for a sequence of T tokens:
`(T + 1) / 2` on global layers, `mean_t min(t + 1, W)` on local layers with
window W. Norms, RoPE, softmax, activations and the optimizer are left out,
as in the 6ND / MFU conventions (they are a few percent at real sizes).
Training the student is 3x its forward (backward = 2x forward: every matmul
needs both the input and the weight gradient, including the first block,
whose input feeds the trainable embedding). A regressor pair adds
`6 d_s d_t` per token (2 forward + 4 backward; its bias is ignored). The
teacher adds its forward only, `2 N_t + 2 d_t V + attention_t`, and enters
`total` only when `budget.count_teacher` is set (the study counts
student-side compute; every report says which). HLDF stage 1 runs the
student only up to its deepest aligned layer, with no LM head, and the
teacher only up to its deepest aligned layer. Recomputation (the fused
loss's backward rebuilding logit chunks, `model.remat`) is *not* model FLOPs.

**Hardware FLOPs** (`FlopBreakdown.hardware`; what the compiled step
executes, checked against XLA's `cost_analysis()`): the same matmuls, but
attention counted *dense* (`ctx = T` on every layer: the implementation
builds the full `T x T` score matrix and masks it, and XLA counts the
masked half), plus the recomputation (fused-loss logit chunks, remat
blocks), the teacher's forward whenever it runs inside the step, the
elementwise work (norms, RoPE, softmax, GeGLU, losses) from constants
calibrated against XLA's CPU cost model (jax 0.10.2; see `_EW`), and the
AdamW update (19 FLOPs per parameter in XLA's count). Matmul terms are exact;
the elementwise constants are fitted, so treat that term as +-10% (it is
~5% of the total on the tiny CPU shapes and well under 1% at real sizes).

Compute matching: a budget C gives stage s `floor(C * share_s / flops_per_step_s)`
steps (`steps_for_budget`), with `tokens per step = data.batch_size * data.seq_len`.

Checked against XLA (`xla_flops_for`, `--check-xla`): the trainer's real
step of every method, colocated or disaggregated, is compiled from abstract
shapes (`train_step_probe`) and XLA's `cost_analysis()["flops"]` is compared
with the hardware figure (tests: within 5%; measured 0.97-1.004). One XLA
limitation matters: HloCostAnalysis counts a while-loop (scan) body once, so
the fused KD loss's row-window scan is undercounted above 64 tokens per step
(`xla_count_is_complete`; the CLI warns).

CLI: `python -m hldstudy.flops --config experiments/X.py --method kd
--teacher-preset tiny-teacher --budget 1e15 --check-xla --json`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path

from hldstudy.config import METHODS, Config, ModelConfig, apply_overrides, load_experiment
from hldstudy.distill.pairs import resolve_layer_pairs
from hldstudy.errors import ConfigError, user_errors

# --------------------------------------------------------------------------- #
# Per-token forward counts
# --------------------------------------------------------------------------- #


def matmul_params_per_layer(m: ModelConfig) -> int:
    """Weights of q, k, v, o, gate, up, down in one block (norm scales excluded)."""
    d, n, k, h, f = m.d_model, m.n_heads, m.n_kv_heads, m.head_dim, m.d_ff
    return 2 * d * n * h + 2 * d * k * h + 3 * d * f


def causal_context(seq_len: int, window: int | None) -> float:
    """Average number of keys a query attends to: mean over t of min(t + 1, W)."""
    t = seq_len
    if window is None or window >= t:
        return (t + 1) / 2
    w = window
    return (w * (w + 1) / 2 + (t - w) * w) / t


def layer_contexts(m: ModelConfig, seq_len: int, attention: str = "causal",
                   n_layers: int | None = None) -> list[float]:
    """Per layer context length: causal average (model FLOPs) or T (dense implementation)."""
    if attention not in ("causal", "dense"):
        raise ConfigError("attention", f"{attention!r} is not one of causal, dense")
    n = m.n_layers if n_layers is None else n_layers
    if attention == "dense":
        return [float(seq_len)] * n
    return [causal_context(seq_len, m.window(i)) for i in range(n)]


def flops_per_token(model_cfg: ModelConfig, seq_len: int, *, attention: str = "causal",
                    n_layers: int | None = None, head: bool = True,
                    elementwise: bool = False) -> dict[str, float]:
    """Forward FLOPs per token: {"nonemb", "deembed", "attention", ["elementwise"], "total"}.

    n_layers: run only the first n blocks (HLDF stage 1); head: include the LM head.
    attention: "causal" (model FLOPs, the budget figure) or "dense" (what the
    masked implementation executes). elementwise: add the calibrated forward
    elementwise estimate (hardware figure only).
    """
    m = model_cfg
    n = m.n_layers if n_layers is None else n_layers
    if not 0 <= n <= m.n_layers:
        raise ConfigError("n_layers", f"{n} is out of range 0..{m.n_layers}")
    out = {
        "nonemb": 2.0 * n * matmul_params_per_layer(m),
        "deembed": 2.0 * m.d_model * m.vocab_size if head else 0.0,
        "attention": 4.0 * sum(layer_contexts(m, seq_len, attention, n)) * m.n_heads * m.head_dim,
    }
    if elementwise:
        out["elementwise"] = elementwise_per_token(m, seq_len, n_layers=n, head=head, train=False)
    out["total"] = sum(out.values())
    return out


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
                          loss: str = "nll") -> float:
    """Calibrated elementwise FLOPs per token (hardware figure only).

    loss: "nll" or a KD divergence ("forward_kl", "reverse_kl", "jsd") for the
    logit-level terms (materialized-loss constants; the fused loss is similar).
    """
    i = 1 if train else 0
    n = m.n_layers if n_layers is None else n_layers
    ew = n * m.n_heads * seq_len * (_EW["score"][i]
                                    + (_EW["score_softcap"][i] if m.attn_softcap else 0.0))
    ew += n * (_EW["hidden"][i] * m.d_model + _EW["ffn"][i] * m.d_ff
               + _EW["q"][i] * m.n_heads * m.head_dim + _EW["kv"][i] * m.n_kv_heads * m.head_dim
               + (_EW["qk_norm"][i] * (m.n_heads + m.n_kv_heads) * m.head_dim if m.qk_norm else 0))
    ew += _EW["embed"][i] * m.d_model
    if head:
        if loss == "nll":
            ew += m.vocab_size * (_EW["logit_nll"][i]
                                  + (_EW["logit_softcap"][i] if m.final_softcap else 0.0))
        else:
            ew += m.vocab_size * (_EW[f"logit_{loss}"][i]
                                  + (_EW["logit_kd_softcap"][i] if m.final_softcap else 0.0))
    return ew


def trainable_params(m: ModelConfig, n_layers: int | None = None) -> int:
    """Parameters the optimizer updates: all of them, or (HLDF stage 1) the
    embedding and the first `n_layers` blocks (the rest and the final norm are frozen)."""
    from hldstudy.model.transformer import count_params

    c = count_params(m)
    if n_layers is None:
        return c["total"]
    per_layer = (c["non_embedding"] - m.d_model) // m.n_layers
    return c["embedding"] + n_layers * per_layer


# --------------------------------------------------------------------------- #
# Per-step counts
# --------------------------------------------------------------------------- #

KD_METHODS = ("kd", "hldc", "patient")  # plus hldf stage 2


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
    hardware: dict = field(default_factory=dict)
    hardware_total: float = 0.0

    @property
    def student(self) -> float:
        return self.nonemb + self.deembed + self.attention

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
        d["layer_pairs"] = [list(p) for p in self.layer_pairs]
        return d


def method_stages(cfg: Config, method: str | None = None) -> list[tuple[str, float]]:
    """[(stage, share of the budget)]: hldf has two stages, the others one ("main")."""
    method = method or cfg.distill.method
    if method == "hldf":
        s = cfg.distill.hldf_stage1_share
        return [("stage1", s), ("stage2", 1.0 - s)]
    return [("main", 1.0)]


def _resolve_stage(cfg: Config, method: str, stage: str | None) -> str:
    names = [s for s, _ in method_stages(cfg, method)]
    if stage is None:
        if len(names) > 1:
            raise ConfigError("stage", f"method {method!r} has stages {', '.join(names)}; name one")
        return names[0]
    if stage not in names:
        raise ConfigError("stage", f"{stage!r} is not a stage of {method!r}",
                          f"stages: {', '.join(names)}")
    return stage


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
               fused_recompute: bool | None = None) -> FlopBreakdown:
    """FLOPs of one training step of `method` (default `cfg.distill.method`) at `stage`.

    teacher_model: the teacher's ModelConfig (the config only names a
    checkpoint); required by every method but baseline.
    count_teacher: overrides `cfg.budget.count_teacher`.
    fused_recompute: whether the fused KD loss rebuilds logit chunks in its
        backward (hardware figure only); None -> `fused_loss_recomputes(cfg)`.
    """
    method = method or cfg.distill.method
    if method not in METHODS:
        raise ConfigError("distill.method", f"{method!r} is not one of {', '.join(METHODS)}")
    stage = _resolve_stage(cfg, method, stage)
    count_teacher = cfg.budget.count_teacher if count_teacher is None else count_teacher
    if method != "baseline" and teacher_model is None:
        raise ConfigError("teacher", f"method {method!r} needs the teacher's model config",
                          "pass teacher_model= (CLI: --teacher-preset NAME, or a teacher "
                          "checkpoint that is an hldstudy run directory)")
    s, t = cfg.model, teacher_model
    seq, tokens = cfg.data.seq_len, cfg.data.batch_size * cfg.data.seq_len
    pairs = resolve_layer_pairs(cfg, t, method) if method in ("hldc", "patient") or (
        method == "hldf" and stage == "stage1") else ()

    # What runs.
    s_layers, s_head = s.n_layers, True
    t_layers, t_head = (t.n_layers if t is not None else 0), method != "baseline"
    kd_loss = method in KD_METHODS or (method == "hldf" and stage == "stage2")
    if method == "hldf" and stage == "stage1":
        s_layers, s_head = max(p[0] for p in pairs), False
        t_layers, t_head = max(p[1] for p in pairs), False
    if method == "baseline":
        t_layers = 0

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
    total = nonemb + deembed + attention + regressor + (teacher if count_teacher else 0.0)

    # Hardware (executed) estimate.
    loss_kind = cfg.distill.divergence if kd_loss else "nll"
    fs_dense = flops_per_token(s, seq, n_layers=s_layers, head=s_head, attention="dense")
    hw = {
        "student_matmul": 3.0 * tokens * (fs_dense["nonemb"] + fs_dense["deembed"]),
        "student_attention_dense": 3.0 * tokens * fs_dense["attention"],
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
            + elementwise_per_token(s, seq, n_layers=s_layers, head=False, train=False)
            - _EW["embed"][0] * s.d_model)
    if kd_loss and (fused_recompute if fused_recompute is not None
                    else fused_loss_recomputes(cfg)):
        # Backward rebuilds each chunk's student and teacher logits.
        hw["recompute_fused"] = tokens * 2.0 * (s.d_model + t.d_model) * s.vocab_size
    if t is not None and (t_layers > 0 or t_head):
        ftd = flops_per_token(t, seq, n_layers=t_layers, head=t_head, attention="dense",
                              elementwise=True)
        hw["teacher"] = tokens * ftd["total"]
        hw["teacher_head"] = teacher_head_flops
    hardware_total = sum(v for k, v in hw.items() if k != "teacher_head")

    return FlopBreakdown(
        method=method, stage=stage, tokens=tokens, nonemb=nonemb, deembed=deembed,
        attention=attention, regressor=regressor, teacher=teacher, total=total,
        count_teacher=count_teacher, student_layers=s_layers, student_head=s_head,
        teacher_layers=t_layers, teacher_head=t_head, layer_pairs=pairs,
        teacher_head_flops=teacher_head_flops, hardware=hw, hardware_total=hardware_total)


def steps_for_budget(cfg: Config, budget_flops: float | None = None,
                     teacher_model: ModelConfig | None = None,
                     method: str | None = None) -> dict[str, int]:
    """{stage: floor(budget * share / flops_per_step(stage))}; budget defaults to budget.flops."""
    budget = cfg.budget.flops if budget_flops is None else budget_flops
    if not budget > 0:
        raise ConfigError("budget.flops", f"a FLOP budget must be > 0, got {budget}")
    method = method or cfg.distill.method
    out = {}
    for stage, share in method_stages(cfg, method):
        per_step = step_flops(cfg, method, stage, teacher_model).total
        out[stage] = int(math.floor(budget * share / per_step))
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


def xla_count_is_complete(cfg: Config, method: str, stage: str) -> bool:
    """False where XLA would count the fused loss's row-window scan body only once."""
    kd = method in KD_METHODS or (method == "hldf" and stage == "stage2")
    tokens = cfg.data.batch_size * cfg.data.seq_len
    return not (kd and cfg.distill.loss_impl == "fused" and tokens > FUSED_XLA_ROW_BLOCK)


def cost_analysis(compiled) -> dict:
    """`compiled.cost_analysis()` as one dict (older jax returns a list of dicts)."""
    ca = compiled.cost_analysis()
    if isinstance(ca, (list, tuple)):
        ca = ca[0] if ca else {}
    return dict(ca or {})


def xla_step_flops(fn, *args, **kwargs) -> float:
    """FLOPs XLA counts for `jit(fn)(*args)`; args may be `jax.ShapeDtypeStruct`s."""
    import jax

    return float(cost_analysis(jax.jit(fn).lower(*args, **kwargs).compile()).get("flops", 0.0))


def _abstract_batch(cfg: Config):
    import jax
    import jax.numpy as jnp

    shape = (cfg.data.batch_size, cfg.data.seq_len)
    i32 = jax.ShapeDtypeStruct(shape, jnp.int32)
    return {"tokens": i32, "positions": i32, "segment_ids": i32, "targets": i32,
            "mask": jax.ShapeDtypeStruct(shape, jnp.bool_)}


def train_step_probe(cfg: Config, method: str | None = None, stage: str | None = None,
                     teacher_model: ModelConfig | None = None, *, layout: str = "colocated"):
    """`(step, state, batch, teacher_in)` of the trainer's real step, all abstract.

    Built from the trainer's public pieces (`make_strategy`,
    `hldstudy.train.step.make_train_step`, `make_optimizer`), so XLA compiles
    exactly what `python -m hldstudy.train` runs; nothing is allocated.
    layout: "colocated" (the teacher's params are an argument and its forward
    runs inside the step, as `ColocatedTeacher` does) or "disaggregated" (the
    streamed `TeacherOutputs` are the argument).
    """
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from hldstudy.distill import make_strategy
    from hldstudy.distill.base import TeacherOutputs
    from hldstudy.model.transformer import Transformer
    from hldstudy.teacher.colocated import teacher_forward_fn
    from hldstudy.train.optim import make_optimizer
    from hldstudy.train.step import make_train_step, split_params

    method = method or cfg.distill.method
    stage = _resolve_stage(cfg, method, stage)
    cfg = dataclasses.replace(cfg, distill=dataclasses.replace(cfg.distill, method=method))
    if method != "baseline" and teacher_model is None:
        raise ConfigError("teacher", f"method {method!r} needs the teacher's model config")
    strategy = make_strategy(cfg, cfg.model, teacher_model if method != "baseline" else None)
    st = next(s for s in strategy.stages() if s.name == stage)

    def build():
        return (Transformer(cfg.model, rngs=nnx.Rngs(0)), strategy.init_aux(st, nnx.Rngs(1)))

    graphdefs, params = split_params(*nnx.eval_shape(build))
    optimizer = make_optimizer(cfg.train, cfg.train.steps,
                               trainable_layers=strategy.trainable_student_layers(st))
    state = jax.eval_shape(lambda p: {"params": p, "opt_state": optimizer.init(p),
                                      "step": jnp.zeros((), jnp.int32)}, params)
    batch = _abstract_batch(cfg)
    teacher_forward = teacher_in = None
    if strategy.needs_teacher:
        tdt = jnp.dtype(cfg.teacher.dtype)
        tcfg = dataclasses.replace(teacher_model, dtype=cfg.teacher.dtype, remat=False)
        layers, needs_head = strategy.teacher_layers(st), strategy.teacher_needs_head(st)
        shape = (cfg.data.batch_size, cfg.data.seq_len, tcfg.d_model)
        if layout == "colocated":
            t_gd, t_params = nnx.split(nnx.eval_shape(
                lambda: Transformer(tcfg, rngs=nnx.Rngs(2))), nnx.Param)
            teacher_in = jax.tree_util.tree_map(
                lambda x: jax.ShapeDtypeStruct(x.shape, tdt), t_params)
            teacher_forward = teacher_forward_fn(t_gd, layers, needs_head)
        elif layout == "disaggregated":
            teacher_in = TeacherOutputs(
                final_hidden=jax.ShapeDtypeStruct(shape, tdt) if needs_head else None,
                hidden={layer: jax.ShapeDtypeStruct(shape, tdt) for layer in layers},
                head_weight=(jax.ShapeDtypeStruct((tcfg.d_model, tcfg.vocab_size), tdt)
                             if needs_head else None))
        else:
            raise ConfigError("layout", f"{layout!r} is not one of colocated, disaggregated")
    step = make_train_step(strategy, st, graphdefs, optimizer, teacher_forward)
    return step, state, batch, teacher_in


def baseline_train_step(cfg: Config):
    """(step_fn(state, batch), abstract_state, abstract_batch) of the baseline step."""
    step, state, batch, _ = train_step_probe(cfg, "baseline", "main")
    return (lambda state, batch: step(state, batch, None)), state, batch


def xla_flops_for(cfg: Config, method: str | None = None, stage: str | None = None,
                  teacher_model: ModelConfig | None = None, *,
                  layout: str = "colocated") -> float:
    """XLA's count of the compiled train step of (method, stage)."""
    step, state, batch, teacher_in = train_step_probe(cfg, method, stage, teacher_model,
                                                      layout=layout)
    return xla_step_flops(step, state, batch, teacher_in)


# --------------------------------------------------------------------------- #
# CLI
# --------------------------------------------------------------------------- #


def teacher_model_from_config(cfg: Config) -> ModelConfig | None:
    """The teacher's ModelConfig when `teacher.checkpoint` is an hldstudy run dir; else None."""
    ckpt = cfg.teacher.checkpoint
    if not ckpt or ckpt.startswith("remote://"):
        return None
    path = Path(ckpt) / "config.json"
    if not path.is_file():
        return None
    from hldstudy.config import read_config

    return read_config(path).model


def _fmt(x: float) -> str:
    return f"{x:.4g}"


def _stage_report(cfg, method, stage, share, teacher_model, budget, check_xla,
                  layout="colocated") -> dict:
    b = step_flops(cfg, method, stage, teacher_model)
    rep = {"share": share, "analytic_flops_per_step": b.total,
           "hardware_flops_per_step": b.hardware_flops(layout), "breakdown": b.as_dict()}
    if budget:
        rep["steps"] = int(math.floor(budget * share / b.total))
    if check_xla:
        x = xla_flops_for(cfg, method, stage, teacher_model, layout=layout)
        rep["xla_flops_per_step"] = x
        rep["xla_over_hardware"] = x / b.hardware_flops(layout)
        rep["xla_over_analytic"] = x / b.total
        if not xla_count_is_complete(cfg, method, stage):
            rep["xla_warning"] = (f"XLA counts the fused loss's row-window loop body once; "
                                  f"its figure is low for more than {FUSED_XLA_ROW_BLOCK} "
                                  f"tokens per step (use --set distill.loss_impl=materialized)")
    return rep


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m hldstudy.flops", description=__doc__.split("\n")[0])
    ap.add_argument("--config", required=True, help="experiments/<file>.py")
    ap.add_argument("--method", choices=METHODS, default=None)
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="K=V")
    ap.add_argument("--budget", type=float, default=None, help="FLOP budget (default budget.flops)")
    ap.add_argument("--teacher-preset", default=None, help="teacher model preset name")
    ap.add_argument("--count-teacher", action="store_true", default=None,
                    help="count the teacher forward in the budget (default budget.count_teacher)")
    ap.add_argument("--check-xla", action="store_true", help="compile the step, compare with XLA")
    ap.add_argument("--layout", choices=("colocated", "disaggregated"), default="colocated",
                    help="teacher layout of the hardware figure and of --check-xla")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--debug", action="store_true")
    args = ap.parse_args(argv)
    with user_errors(args.debug, prog="hldstudy.flops"):
        cfg = apply_overrides(load_experiment(args.config), args.overrides)
        method = args.method or cfg.distill.method
        cfg = dataclasses.replace(cfg, distill=dataclasses.replace(cfg.distill, method=method))
        if args.count_teacher:
            cfg = dataclasses.replace(cfg, budget=dataclasses.replace(cfg.budget,
                                                                      count_teacher=True))
        if args.teacher_preset:
            from hldstudy.model.presets import preset

            teacher_model = preset(args.teacher_preset)
        else:
            teacher_model = teacher_model_from_config(cfg)
        if method != "baseline" and teacher_model is None:
            raise ConfigError("teacher", f"method {method!r} needs the teacher's shape",
                              "pass --teacher-preset NAME, or a teacher.checkpoint run directory")
        budget = args.budget if args.budget is not None else (cfg.budget.flops or None)
        stages = {st: _stage_report(cfg, method, st, share, teacher_model, budget, args.check_xla,
                                    args.layout)
                  for st, share in method_stages(cfg, method)}
        result = {"method": method, "layout": args.layout,
                  "tokens_per_step": cfg.data.batch_size * cfg.data.seq_len,
                  "count_teacher": cfg.budget.count_teacher, "budget": budget, "stages": stages}
        if len(stages) == 1:
            only = next(iter(stages.values()))
            result.update({k: v for k, v in only.items() if k != "share"})
        if args.json:
            print(json.dumps(result, indent=None, sort_keys=True))
            return 0
        print(f"method {method}  tokens/step {result['tokens_per_step']}  "
              f"teacher counted in budget: {cfg.budget.count_teacher}")
        cols = ("nonemb", "deembed", "attention", "regressor", "teacher", "total")
        print(f"{'stage':8s} {'share':>6s} " + " ".join(f"{c:>11s}" for c in cols)
              + f" {'hardware':>11s} {'xla':>11s} {'steps':>10s}")
        for st, rep in stages.items():
            bd = rep["breakdown"]
            print(f"{st:8s} {rep['share']:6.3f} " + " ".join(f"{_fmt(bd[c]):>11s}" for c in cols)
                  + f" {_fmt(rep['hardware_flops_per_step']):>11s}"
                  + f" {_fmt(rep['xla_flops_per_step']) if 'xla_flops_per_step' in rep else '-':>11s}"
                  + f" {rep.get('steps', '-')!s:>10s}")
        for st, rep in stages.items():
            if "xla_warning" in rep:
                print(f"warning ({st}): {rep['xla_warning']}")
        print("total = model FLOPs (causal attention, no recompute) = the budget figure; "
              f"hardware = executed estimate ({args.layout} teacher), compared with XLA")
    return 0


if __name__ == "__main__":
    sys.exit(main())
