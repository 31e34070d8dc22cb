"""The train state's parameters: float32 masters, their cast for the forward, and the
stop-gradient teacher outputs the loss sees.

The state is a plain pytree `{"params": {"student", "aux"}, "opt_state", "step"}`; a
bfloat16 `model.param_dtype` is kept as float32 masters (so are Adam's moments) and cast
in every forward; the gradient flows back through the cast in float32. The programs that
use them are built in `hldstudy.train.program`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

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
