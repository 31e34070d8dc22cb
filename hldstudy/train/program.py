"""The step programs, built in one place: the train program of one run or of a cohort's
members stacked on axis 0, the eval program, and both over abstract inputs for XLA's
analyses and `hldstudy.aot`. The loop, the cohort, the FLOP probe and aot all ask here.

A train program is `step(state, batch, teacher_in, hps, bad) -> (state, metrics, bad)`:
`hps` holds a cohort's traced per-member hyperparameters (empty for one run), `bad` the
first step whose loss or gradient norm was not finite (kept on the device). The teacher
runs once per step, whatever the number of members. `docs/training.md` has the why.
"""

from __future__ import annotations

import copy
import dataclasses
import os
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from hldstudy.config import Config, ModelConfig, traced_members
from hldstudy.distill import methods
from hldstudy.distill.base import Stage, Strategy, TeacherOutputs, make_strategy
from hldstudy.errors import ConfigError
from hldstudy.eval.head import target_logprobs
from hldstudy.model.transformer import Transformer
from hldstudy.teacher.colocated import teacher_forward_fn
from hldstudy.train.optim import make_optimizer
from hldstudy.train.step import GraphDefs, cast_params, merge_params, split_params, teacher_outputs

# Per-member hyperparameters that enter the compiled step: {name: (section, field)} of the
# fields tagged member="traced" (train.seed, member="init", only seeds the init).
HPARAMS = traced_members()

MODES = ("vmap", "map")


@dataclasses.dataclass(frozen=True)
class Members:
    """A cohort inside one program: `make_opt(lr)` builds a member's optimizer around its
    traced peak lr; `mode` runs the members batched (vmap) or one after the other (map)."""

    make_opt: Callable[[Any], optax.GradientTransformation]
    mode: str = "vmap"


def default_mode(platform: str) -> str:
    """How a cohort's members run inside the step: "map" on the CPU, where the vmapped
    layers of the tiny models run slower than K solo steps (benchmarks/cohort.py: 2,500
    vs 15,000 tokens/s per member), "vmap" on accelerators. HLDSTUDY_COHORT_MODE (vmap or
    map) overrides it (benchmarks/cohort.py measures both)."""
    forced = os.environ.get("HLDSTUDY_COHORT_MODE")
    if forced:
        if forced not in MODES:
            raise ConfigError("HLDSTUDY_COHORT_MODE", f"{forced!r} is not one of "
                              f"{', '.join(MODES)}")
        return forced
    return "map" if platform == "cpu" else "vmap"


def with_hparams(strategy, hp: dict):
    """A view of `strategy` whose distill.* member fields are `hp`'s (traced) values."""
    changes = {k: v for k, v in hp.items() if HPARAMS[k][0] == "distill"}
    if not changes:
        return strategy
    view = copy.copy(strategy)
    view.cfg = dataclasses.replace(strategy.cfg,
                                   distill=dataclasses.replace(strategy.cfg.distill, **changes))
    return view


def make_loss_fn(strategy: Strategy, stage: Stage, graphdefs: GraphDefs,
                 teacher_forward: Callable | None = None):
    def loss_fn(params, batch, teacher_in):
        student, aux = merge_params(graphdefs, params)
        teacher = teacher_outputs(teacher_in, batch, teacher_forward)
        return strategy.loss(stage, student, aux, batch, teacher)

    return loss_fn


def make_train_step(strategy: Strategy, stage: Stage, graphdefs: GraphDefs,
                    optimizer: optax.GradientTransformation,
                    teacher_forward: Callable | None = None):
    """`step(state, batch, teacher_in) -> (state, metrics)`: one member's update."""
    loss_fn = make_loss_fn(strategy, stage, graphdefs, teacher_forward)

    def train_step(state, batch, teacher_in):
        (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(
            state["params"], batch, teacher_in)
        updates, opt_state = optimizer.update(grads, state["opt_state"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        metrics = {**metrics, "loss": loss, "grad_norm": optax.global_norm(grads)}
        return {"params": params, "opt_state": opt_state, "step": state["step"] + 1}, metrics

    return train_step


def with_finite_record(train_step):
    """The update plus the first global step whose loss or gradient norm was not finite
    (on the device: checking it costs no host sync per step)."""

    def step(state, batch, teacher_in, hps, bad_step):
        state, metrics = train_step(state, batch, teacher_in)
        finite = jnp.isfinite(metrics["loss"]) & jnp.isfinite(metrics["grad_norm"])
        bad_step = jnp.where((bad_step == 0) & ~finite, state["step"], bad_step)
        return state, metrics, bad_step

    return step


def make_cohort_step(strategy, stage, graphdefs, optimizer, make_opt, teacher_forward,
                     mode: str = "vmap"):
    """The train program of K members stacked on axis 0; hps: {name: [K] float32} for the
    hyperparameters that vary (the others are the program's constants); bad: [K]."""

    def step(states, batch, teacher_in, hps, bad):
        teacher = teacher_outputs(teacher_in, batch, teacher_forward)  # once for all

        def member(state, hp, bad_k):
            opt = make_opt(hp["lr"]) if "lr" in hp else optimizer
            train_step = make_train_step(with_hparams(strategy, hp), stage, graphdefs, opt)
            return with_finite_record(train_step)(state, batch, teacher, hp, bad_k)

        if mode == "map":  # sequential over the members: the solo step's shapes
            return jax.lax.map(lambda x: member(*x), (states, hps, bad))
        if mode != "vmap":
            raise ConfigError("cohort", f"mode {mode!r} is not one of {', '.join(MODES)}")
        return jax.vmap(member)(states, hps, bad)

    return step


def train_program(strategy: Strategy, stage: Stage, graphdefs: GraphDefs,
                  optimizer: optax.GradientTransformation,
                  teacher_forward: Callable | None = None, members: Members | None = None):
    """The train program (not jitted) of one run, or of a cohort with `members`."""
    if members is None:
        return with_finite_record(make_train_step(strategy, stage, graphdefs, optimizer,
                                                  teacher_forward))
    return make_cohort_step(strategy, stage, graphdefs, optimizer, members.make_opt,
                            teacher_forward, members.mode)


def make_eval_step(graphdefs: GraphDefs):
    """Token-summed validation NLL: `(nll_sum, n_tokens)` for one batch. The head runs
    fused with the log-softmax over vocabulary chunks (never tokens x vocab: 8 GiB per
    H100 at the 123M step), mapped over the sequences so the sharded batch axis stays
    a map axis."""

    def eval_step(params, batch):
        student = nnx.merge(graphdefs.student,
                            cast_params(params["student"], graphdefs.param_dtype))
        out = student(batch["tokens"], batch["positions"], batch["segment_ids"],
                      return_logits=False)
        w_DxV, cap = student.head_weight(), student.cfg.final_softcap
        logp_BxT = jax.vmap(lambda h_TxD, t_T: target_logprobs(h_TxD, w_DxV, t_T, cap=cap)[0])(
            out.final_hidden, batch["targets"])
        mask = batch["mask"] > 0
        return jnp.sum(jnp.where(mask, -logp_BxT, 0.0)), jnp.sum(mask.astype(jnp.float32))

    return eval_step


# ---- the same programs over abstract inputs (nothing allocated) ---------------------- #


def abstract_batch(cfg: Config, sharding=None) -> dict:
    """The global batch's arrays, abstract (placed by `sharding` when given)."""
    shape = (cfg.data.batch_size, cfg.data.seq_len)
    i32 = jax.ShapeDtypeStruct(shape, jnp.int32, sharding=sharding)
    return {"tokens": i32, "positions": i32, "segment_ids": i32, "targets": i32,
            "mask": jax.ShapeDtypeStruct(shape, jnp.bool_, sharding=sharding)}


@dataclasses.dataclass(frozen=True)
class AbstractRun:
    """A run's pieces for one (method, stage), built as the trainer builds them, with an
    abstract train state, batch and teacher input."""

    cfg: Config
    strategy: Strategy
    stage: Stage
    graphdefs: GraphDefs
    optimizer: optax.GradientTransformation
    teacher_forward: Callable | None
    state: Any
    batch: dict
    teacher_in: Any

    def make_opt(self, lr):
        return make_optimizer(self.cfg.train, self.cfg.train.steps, lr=lr,
                              trainable_layers=self.strategy.trainable_student_layers(self.stage))


def _abstract_teacher(cfg: Config, strategy, st, teacher_model: ModelConfig, layout: str):
    """(teacher_forward, teacher_in) as the colocated teacher (its params an argument, its
    forward inside the step) or the disaggregated one (streamed outputs) gives them."""
    tdt = jnp.dtype(cfg.teacher.dtype)
    tcfg = dataclasses.replace(teacher_model, dtype=cfg.teacher.dtype, remat=False)
    layers, needs_head = strategy.teacher_layers(st), strategy.teacher_needs_head(st)
    shape = (cfg.data.batch_size, cfg.data.seq_len, tcfg.d_model)
    if layout == "colocated":
        t_gd, t_params = nnx.split(nnx.eval_shape(
            lambda: Transformer(tcfg, rngs=nnx.Rngs(2))), nnx.Param)
        return (teacher_forward_fn(t_gd, layers, needs_head),
                jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, tdt), t_params))
    if layout == "disaggregated":
        return None, TeacherOutputs(
            final_hidden=jax.ShapeDtypeStruct(shape, tdt) if needs_head else None,
            hidden={layer: jax.ShapeDtypeStruct(shape, tdt) for layer in layers},
            head_weight=(jax.ShapeDtypeStruct((tcfg.d_model, tcfg.vocab_size), tdt)
                         if needs_head else None))
    raise ConfigError("layout", f"{layout!r} is not one of colocated, disaggregated")


def abstract_run(cfg: Config, method: str | None = None, stage: str | None = None,
                 teacher_model: ModelConfig | None = None, *,
                 layout: str = "colocated") -> AbstractRun:
    """The pieces of (method, stage)'s train program, all abstract."""
    spec = methods.get(method or cfg.distill.method)
    stage = spec.stage(cfg, stage).name
    cfg = dataclasses.replace(cfg, distill=dataclasses.replace(cfg.distill, method=spec.name))
    if spec.needs_teacher and teacher_model is None:
        raise ConfigError("teacher", f"method {spec.name!r} needs the teacher's model config")
    strategy = make_strategy(cfg, cfg.model, teacher_model if spec.needs_teacher else None)
    st = next(s for s in strategy.stages() if s.name == stage)
    graphdefs, params = split_params(*nnx.eval_shape(
        lambda: (Transformer(cfg.model, rngs=nnx.Rngs(0)), strategy.init_aux(st, nnx.Rngs(1)))))
    optimizer = make_optimizer(cfg.train, cfg.train.steps,
                               trainable_layers=strategy.trainable_student_layers(st))
    state = jax.eval_shape(lambda p: {"params": p, "opt_state": optimizer.init(p),
                                      "step": jnp.zeros((), jnp.int32)}, params)
    forward = teacher_in = None
    if strategy.needs_teacher:
        forward, teacher_in = _abstract_teacher(cfg, strategy, st, teacher_model, layout)
    return AbstractRun(cfg, strategy, st, graphdefs, optimizer, forward, state,
                       abstract_batch(cfg), teacher_in)


def abstract_train_program(cfg: Config, method: str | None = None, stage: str | None = None,
                           teacher_model: ModelConfig | None = None, *,
                           layout: str = "colocated", cohort: int | None = None,
                           varying: tuple[str, ...] = ("lr", "temperature"),
                           mode: str = "vmap"):
    """`(program, args)`: the train program the trainer compiles for (method, stage), one
    run or (`cohort` K) K members with `varying` hyperparameters traced, and its abstract
    arguments: `jax.jit(program, donate_argnums=(0,)).lower(*args)` for XLA's analyses."""
    run = abstract_run(cfg, method, stage, teacher_model, layout=layout)
    if cohort is None:
        program = train_program(run.strategy, run.stage, run.graphdefs, run.optimizer,
                                run.teacher_forward)
        return program, (run.state, run.batch, run.teacher_in, {},
                         jax.ShapeDtypeStruct((), jnp.int32))
    program = train_program(run.strategy, run.stage, run.graphdefs, run.optimizer,
                            run.teacher_forward, Members(run.make_opt, mode))
    states = jax.tree_util.tree_map(
        lambda x: jax.ShapeDtypeStruct((cohort, *x.shape), x.dtype), run.state)
    hps = {n: jax.ShapeDtypeStruct((cohort,), jnp.float32) for n in varying}
    return program, (states, run.batch, run.teacher_in, hps,
                     jax.ShapeDtypeStruct((cohort,), jnp.int32))
