"""Jitted train and eval steps, generic over distillation strategies.

The train state is a plain pytree `{"params": {"student": State, "aux":
State | None}, "opt_state": ..., "step": int32}` so orbax, optax and
shardings all see ordinary arrays.

Mixed precision: the state's floating parameters are float32 master weights
whatever `model.param_dtype` says (`split_params` makes them), so the optimizer's
moments are float32 too; every forward (train and eval) first casts the student's
masters to `param_dtype` (`GraphDefs.param_dtype`), and the gradient flows back
through that cast to the masters in float32. With float32 parameters nothing is
cast. The teacher enters as the step's third
argument `teacher_in`, whatever the teacher's `StageFeed.inputs` gives (the
colocated teacher's parameters, a remote teacher's streamed hidden states),
and `teacher_forward(teacher_in, batch) -> TeacherOutputs` (the feed's
`forward`) turns it into the loss's teacher outputs inside the same compiled
step, under stop_gradient. With `teacher_forward=None`, `teacher_in` already is
the `TeacherOutputs` (or None: no teacher).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from hldstudy.distill.base import Stage, Strategy
from hldstudy.eval.head import target_logprobs

MASTER_DTYPE = jnp.float32


@dataclass(frozen=True)
class GraphDefs:
    student: Any
    aux: Any | None
    # The student's declared parameter dtype (model.param_dtype): its forward runs on the
    # float32 masters cast to this.
    param_dtype: str = "float32"


def _floating(x) -> bool:
    return jnp.issubdtype(getattr(x, "dtype", jnp.int32), jnp.floating)


def _as(x, dt):
    if isinstance(x, jax.ShapeDtypeStruct):  # an abstract tree (eval_shape)
        return jax.ShapeDtypeStruct(x.shape, dt, sharding=x.sharding)
    return x.astype(dt)


def to_master(tree):
    """Float32 master copies of a parameter tree's floating leaves (others unchanged);
    float32 leaves are returned as they are (no copy, no rounding)."""
    return jax.tree_util.tree_map(
        lambda x: _as(x, MASTER_DTYPE) if _floating(x) and x.dtype != MASTER_DTYPE else x,
        tree)


def cast_params(tree, dtype: str):
    """The floating leaves of `tree` in `dtype` (the forward's copy of the masters)."""
    dt = jnp.dtype(dtype)
    if dt == MASTER_DTYPE:
        return tree
    return jax.tree_util.tree_map(lambda x: _as(x, dt) if _floating(x) else x, tree)


def split_params(student: nnx.Module, aux: nnx.Module | None):
    """(GraphDefs, {"student", "aux"}): the modules' graphs and their parameters as float32
    masters (a bfloat16 `model.param_dtype` is recorded in the GraphDefs and applied in
    the forward)."""
    gd_s, p_s = nnx.split(student, nnx.Param)
    model_cfg = getattr(student, "cfg", None)
    pdt = str(jnp.dtype(getattr(model_cfg, "param_dtype", "float32")))
    p_s = to_master(p_s)
    if aux is None:
        return GraphDefs(gd_s, None, pdt), {"student": p_s, "aux": None}
    gd_a, p_a = nnx.split(aux, nnx.Param)
    return GraphDefs(gd_s, gd_a, pdt), {"student": p_s, "aux": to_master(p_a)}


def merge_params(graphdefs: GraphDefs, params):
    student = nnx.merge(graphdefs.student, cast_params(params["student"], graphdefs.param_dtype))
    aux = nnx.merge(graphdefs.aux, params["aux"]) if graphdefs.aux is not None else None
    return student, aux


def teacher_outputs(teacher_in, batch, teacher_forward: Callable | None = None):
    """The loss's teacher outputs from a step's `teacher_in` (None: no teacher), under
    stop_gradient: the teacher is frozen."""
    if teacher_in is None:
        return None
    teacher = teacher_forward(teacher_in, batch) if teacher_forward else teacher_in
    return jax.lax.stop_gradient(teacher)


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
    """Returns `step(state, batch, teacher_in) -> (state, metrics)` (not yet jitted)."""
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
    """`step(state, batch, teacher_in, hps, bad_step) -> (state, metrics, bad_step)`: the
    train step, plus the first global step whose loss or gradient norm was not finite
    (kept on the device, so checking it costs no host sync per step). `hps`: a cohort
    step's per-member hyperparameters; empty for a solo step (it adds no operand)."""

    def step(state, batch, teacher_in, hps, bad_step):
        state, metrics = train_step(state, batch, teacher_in)
        finite = jnp.isfinite(metrics["loss"]) & jnp.isfinite(metrics["grad_norm"])
        bad_step = jnp.where((bad_step == 0) & ~finite, state["step"], bad_step)
        return state, metrics, bad_step

    return step


def make_eval_step(graphdefs: GraphDefs):
    """Token-summed validation NLL: `(nll_sum, n_tokens)` for one batch.

    The head runs fused with the log-softmax over vocabulary chunks (`target_logprobs`),
    never building tokens x vocab: materialized, the 123M step's validation logits took
    8 GiB per H100 (a 262k vocabulary would take 64). It is mapped over the sequences so
    that the batch axis, sharded over the mesh, stays a map axis, not a loop's."""

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
