"""XLA's own count of the trainer's real step, for checking the FLOP accounting: the
train program (`hldstudy.train.program.abstract_train_program`) compiled from abstract
shapes, nothing allocated. It lives in `train/` because it compiles the trainer's step;
the analytic accounting (`hldstudy.flops`) stays free of the trainer.
"""

from __future__ import annotations

import dataclasses

import jax

from hldstudy.config import Config, ModelConfig
from hldstudy.distill import methods
from hldstudy.flops.xla_count import KEEP_LOOPS, completed_flops
from hldstudy.train.program import abstract_train_program


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


def baseline_train_step(cfg: Config):
    """(step_fn(state, batch), abstract_state, abstract_batch) of the baseline step."""
    program, (state, batch, _, hps, _) = abstract_train_program(cfg, methods.BASELINE)
    return (lambda state, batch: program(state, batch, None, hps, 0)[:2]), state, batch


def xla_flops_for(cfg: Config, method: str | None = None, stage: str | None = None,
                  teacher_model: ModelConfig | None = None, *,
                  layout: str = "colocated") -> float:
    """XLA's count of the compiled train program of (method, stage). Counted with the
    layers unrolled: XLA's cost analysis counts a loop's body once, and a scanned stack
    computes what the unrolled one does (hldstudy.model.stack)."""
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, scan_layers=False))
    program, args = abstract_train_program(cfg, method, stage, teacher_model, layout=layout)
    return xla_step_flops(program, *args)
