"""XLA's own count of the trainer's real step, for checking the FLOP accounting.

`train_step_probe` builds the step `python -m hldstudy.train` runs (the same
strategy, optimizer and teacher forward) from abstract shapes, so XLA can
compile it and report `cost_analysis()` / `memory_analysis()` without
allocating anything. It lives in `train/` because it compiles the trainer's
step; the analytic accounting (`hldstudy.flops`) stays free of the trainer.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from hldstudy.config import Config, ModelConfig
from hldstudy.distill import methods
from hldstudy.distill.base import TeacherOutputs, make_strategy
from hldstudy.errors import ConfigError
from hldstudy.flops.xla_count import KEEP_LOOPS, completed_flops
from hldstudy.model.transformer import Transformer
from hldstudy.teacher.colocated import teacher_forward_fn
from hldstudy.train.optim import make_optimizer
from hldstudy.train.step import make_train_step, split_params


def cost_analysis(compiled) -> dict:
    """`compiled.cost_analysis()` as one dict (older jax returns a list of dicts)."""
    ca = compiled.cost_analysis()
    if isinstance(ca, (list, tuple)):
        ca = ca[0] if ca else {}
    return dict(ca or {})


def xla_step_flops(fn, *args, **kwargs) -> float:
    """FLOPs XLA counts for `jit(fn)(*args)`; args may be `jax.ShapeDtypeStruct`s. Triangular
    solves (which XLA reports as -1) are counted by their closed form (`completed_flops`);
    one-trip loops stay loops (`KEEP_LOOPS`)."""
    compiled = jax.jit(fn).lower(*args, **kwargs).compile(compiler_options=KEEP_LOOPS)
    return completed_flops(cost_analysis(compiled).get("flops", 0.0), compiled.as_text())


def _abstract_batch(cfg: Config):
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
    spec = methods.get(method or cfg.distill.method)
    stage = spec.stage(cfg, stage).name
    cfg = dataclasses.replace(cfg, distill=dataclasses.replace(cfg.distill, method=spec.name))
    if spec.needs_teacher and teacher_model is None:
        raise ConfigError("teacher", f"method {spec.name!r} needs the teacher's model config")
    strategy = make_strategy(cfg, cfg.model, teacher_model if spec.needs_teacher else None)
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
    step, state, batch, _ = train_step_probe(cfg, methods.BASELINE, None)
    return (lambda state, batch: step(state, batch, None)), state, batch


def xla_flops_for(cfg: Config, method: str | None = None, stage: str | None = None,
                  teacher_model: ModelConfig | None = None, *,
                  layout: str = "colocated") -> float:
    """XLA's count of the compiled train step of (method, stage)."""
    step, state, batch, teacher_in = train_step_probe(cfg, method, stage, teacher_model,
                                                      layout=layout)
    return xla_step_flops(step, state, batch, teacher_in)
