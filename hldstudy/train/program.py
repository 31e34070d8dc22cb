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
import inspect
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
from hldstudy.teacher.colocated import forward_config, teacher_forward_fn
from hldstudy.teacher_source import LAYOUTS
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
    def loss_fn(params, batch, teacher_in, whole=None):
        student, aux = merge_params(graphdefs, params)
        teacher = teacher_outputs(teacher_in, batch, teacher_forward)
        if whole is None:
            return strategy.loss(stage, student, aux, batch, teacher)
        return strategy.loss(stage, student, aux, batch, teacher, whole=whole)

    return loss_fn


def _split(x, k: int):
    """[B, ...] -> [k, B/k, ...]: micro-batch i is rows i, i + k, i + 2k, ...: a device
    holding a contiguous block of the batch holds a part of every micro-batch."""
    return jnp.swapaxes(x.reshape(x.shape[0] // k, k, *x.shape[1:]), 0, 1)


def _merge(x):
    """The inverse of `_split`."""
    return jnp.swapaxes(x, 0, 1).reshape(-1, *x.shape[2:])


def microbatch_candidates(microbatches: int, batch_size: int, n_devices: int) -> list[int]:
    """The micro-batch counts a run may use, fewest first: `microbatches` itself, or
    (0, auto) every k whose micro-batches split evenly over the devices' rows. A count
    whose micro-batches do not split so is refused: a device left without rows of its own
    would compute another's (every device ran the whole micro-batch: on 8 v5e chips, 8
    sequences in 4 micro-batches counted 1.7x the step's FLOPs)."""
    rows = batch_size // n_devices
    if microbatches:
        if rows % microbatches:
            raise ConfigError(
                "train.microbatches", f"{microbatches} micro-batches of data.batch_size="
                f"{batch_size} leave {batch_size // microbatches} sequences each for "
                f"{n_devices} devices, not a whole number per device",
                f"give a divisor of {rows} (the sequences per device), or 0 (auto)")
        return [microbatches]
    return [k for k in range(1, rows + 1) if rows % k == 0]


def micro_teacher_outputs(teacher_in, batch, teacher_forward: Callable | None, k: int):
    """The whole batch's teacher outputs (under stop_gradient), a colocated teacher's
    forward run one micro-batch at a time (its activations bounded by a micro-batch)."""
    if teacher_in is None or teacher_forward is None or k == 1:
        return teacher_outputs(teacher_in, batch, teacher_forward)
    micro = jax.tree_util.tree_map(lambda x: _split(x, k), batch)
    # The first micro-batch outside the map gives the head weight once (not k copies).
    first = teacher_forward(teacher_in, jax.tree_util.tree_map(lambda x: x[0], micro))
    rest = jax.lax.map(lambda mb: teacher_forward(teacher_in, mb).replace(head_weight=None),
                       jax.tree_util.tree_map(lambda x: x[1:], micro))
    joined = jax.tree_util.tree_map(lambda a, b: _merge(jnp.concatenate([a[None], b])),
                                    first.replace(head_weight=None), rest)
    return jax.lax.stop_gradient(joined.replace(head_weight=first.head_weight))


def _check_accumulates(strategy: Strategy, k: int) -> None:
    if k > 1 and "whole" not in inspect.signature(strategy.loss).parameters:
        raise ConfigError("train.microbatches", f"the strategy of method "
                          f"{strategy.cfg.distill.method!r} ({type(strategy).__name__}) computes "
                          "its loss over a whole batch only (its loss() takes no `whole`)",
                          "set train.microbatches=1, or give its loss() a `whole` argument "
                          "(hldstudy.distill.base.WholeBatch)")


def _accumulated_grads(loss_fn, strategy, stage, params, batch, teacher, k: int):
    """(loss, metrics, grads) of the whole batch, summed over k micro-batches: each
    micro-batch's loss is its share of the whole batch's (`WholeBatch`)."""
    whole = strategy.whole_batch(stage, batch, teacher)
    head = None if teacher is None else teacher.head_weight
    split = (jax.tree_util.tree_map(lambda x: _split(x, k), batch),
             None if teacher is None else
             jax.tree_util.tree_map(lambda x: _split(x, k), teacher.replace(head_weight=None)))
    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)

    def one(x):
        mb, t_mb = x
        t_mb = None if t_mb is None else t_mb.replace(head_weight=head)
        (loss, metrics), grads = grad_fn(params, mb, t_mb, whole)
        return loss, metrics, grads

    def body(acc, x):
        return jax.tree_util.tree_map(jnp.add, acc, one(x)), None

    shapes = jax.eval_shape(one, jax.tree_util.tree_map(lambda x: x[0], split))
    zeros = jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
    return jax.lax.scan(body, zeros, split)[0]


def make_train_step(strategy: Strategy, stage: Stage, graphdefs: GraphDefs,
                    optimizer: optax.GradientTransformation,
                    teacher_forward: Callable | None = None, microbatches: int = 1):
    """`step(state, batch, teacher_in) -> (state, metrics)`: one member's update, its
    gradient summed over `microbatches` micro-batches of the batch."""
    _check_accumulates(strategy, microbatches)
    loss_fn = make_loss_fn(strategy, stage, graphdefs, teacher_forward)
    # accumulating: the teacher's outputs come first, the loss sees them as they are
    outputs_loss_fn = make_loss_fn(strategy, stage, graphdefs) if microbatches > 1 else None

    def train_step(state, batch, teacher_in):
        if microbatches == 1:
            (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(
                state["params"], batch, teacher_in)
        else:
            teacher = micro_teacher_outputs(teacher_in, batch, teacher_forward, microbatches)
            loss, metrics, grads = _accumulated_grads(outputs_loss_fn, strategy, stage,
                                                      state["params"], batch, teacher,
                                                      microbatches)
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
                     mode: str = "vmap", microbatches: int = 1):
    """The train program of K members stacked on axis 0; hps: {name: [K] float32} for the
    hyperparameters that vary (the others are the program's constants); bad: [K]."""
    _check_accumulates(strategy, microbatches)

    def step(states, batch, teacher_in, hps, bad):
        # once for all members
        teacher = micro_teacher_outputs(teacher_in, batch, teacher_forward, microbatches)

        def member(state, hp, bad_k):
            opt = make_opt(hp["lr"]) if "lr" in hp else optimizer
            train_step = make_train_step(with_hparams(strategy, hp), stage, graphdefs, opt,
                                         microbatches=microbatches)
            return with_finite_record(train_step)(state, batch, teacher, hp, bad_k)

        if mode == "map":  # sequential over the members: the solo step's shapes
            return jax.lax.map(lambda x: member(*x), (states, hps, bad))
        if mode != "vmap":
            raise ConfigError("cohort", f"mode {mode!r} is not one of {', '.join(MODES)}")
        return jax.vmap(member)(states, hps, bad)

    return step


def train_program(strategy: Strategy, stage: Stage, graphdefs: GraphDefs,
                  optimizer: optax.GradientTransformation,
                  teacher_forward: Callable | None = None, members: Members | None = None,
                  microbatches: int = 1):
    """The train program (not jitted) of one run, or of a cohort with `members`; its
    gradient accumulated over `microbatches` micro-batches of the batch."""
    if members is None:
        return with_finite_record(make_train_step(strategy, stage, graphdefs, optimizer,
                                                  teacher_forward, microbatches))
    return make_cohort_step(strategy, stage, graphdefs, optimizer, members.make_opt,
                            teacher_forward, members.mode, microbatches)


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
        # Chunked (direct_logits=0): under the vmap a row's one-piece head would be the
        # whole batch's tokens x vocab.
        logp_BxT = jax.vmap(lambda h_TxD, t_T: target_logprobs(
            h_TxD, w_DxV, t_T, cap=cap, direct_logits=0)[0])(out.final_hidden, batch["targets"])
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
    tcfg = forward_config(teacher_model, cfg.teacher)
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
    raise ConfigError("layout", f"{layout!r} is not one of {', '.join(LAYOUTS)}")


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
    k = max(cfg.train.microbatches, 1)  # auto compiles one micro-batch first
    if cohort is None:
        program = train_program(run.strategy, run.stage, run.graphdefs, run.optimizer,
                                run.teacher_forward, microbatches=k)
        return program, (run.state, run.batch, run.teacher_in, {},
                         jax.ShapeDtypeStruct((), jnp.int32))
    program = train_program(run.strategy, run.stage, run.graphdefs, run.optimizer,
                            run.teacher_forward, Members(run.make_opt, mode), k)
    states = jax.tree_util.tree_map(
        lambda x: jax.ShapeDtypeStruct((cohort, *x.shape), x.dtype), run.state)
    hps = {n: jax.ShapeDtypeStruct((cohort,), jnp.float32) for n in varying}
    return program, (states, run.batch, run.teacher_in, hps,
                     jax.ShapeDtypeStruct((cohort,), jnp.int32))
