"""The forward of an FP8-compressed model with the real FP8 dot where the chip has one.

Design notes: `docs/compression.md`, under this file's name.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from hldstudy.compress.fp8 import fp8_dot, fp8_ragged_dot
from hldstudy.compress.layout import Target


@jax.tree_util.register_pytree_node_class
class FP8Weight:
    """FP8 values q [in, out] (a projection's 2-D view) and float32 scales [out] or []."""

    def __init__(self, q, scale, real: bool | None = None):
        self.q, self.scale, self.real = q, scale, real

    def tree_flatten(self):
        return (self.q, self.scale), self.real

    @classmethod
    def tree_unflatten(cls, real, children):
        return cls(*children, real=real)

    @property
    def shape(self):
        return self.q.shape

    def __getitem__(self, index):
        if index is not Ellipsis:
            raise TypeError("an FP8 weight is read whole (param[...])")
        return self

    def astype(self, dtype):
        return self  # the compute dtype applies to the dot's float32 result

    def reshape(self, *shape):
        shape = shape[0] if len(shape) == 1 and isinstance(shape[0], tuple) else shape
        if tuple(shape) != tuple(self.q.shape):
            raise ValueError(f"an FP8 weight is stored as its 2-D view {self.q.shape}; the "
                             f"forward asked for {tuple(shape)}")
        return self

    def __rmatmul__(self, x):
        return fp8_dot(x, self.q, self.scale, real=self.real).astype(x.dtype)


@jax.tree_util.register_pytree_node_class
class FP8Experts(FP8Weight):
    """A stacked expert weight: FP8 values q [E, in, out] and float32 scales [E, out] (per
    expert and output channel) or [E] (per expert); read whole by the MoE's forward and
    multiplied by its grouped matmul hook."""

    def reshape(self, *shape):
        raise TypeError("stacked FP8 experts are multiplied by grouped_matmul, not reshaped")

    def __rmatmul__(self, x):
        raise TypeError("stacked FP8 experts are multiplied by grouped_matmul, not @")

    def grouped_matmul(self, rows, group_sizes):
        """rows [M, in] grouped by expert (as `jax.lax.ragged_dot`) -> [M, out]."""
        return fp8_ragged_dot(rows, self.q, self.scale, group_sizes,
                              real=self.real).astype(rows.dtype)


def _stacked_experts(quantized: dict) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """{parameter key: (q [E, in, out], scales [E, out] or [E])} of the stacked expert
    weights among the pipeline's per-expert targets; every expert must be there."""
    by_param: dict[str, dict[int, tuple]] = {}
    for key, qs in quantized.items():
        t = Target.from_key(key)
        if t.expert is not None:
            by_param.setdefault(t.param_key, {})[t.expert] = qs
    out = {}
    for param_key, experts in by_param.items():
        if sorted(experts) != list(range(len(experts))):
            raise ValueError(f"{param_key}: FP8 values for experts {sorted(experts)} only; "
                             "the grouped matmul needs every expert")
        q = np.stack([np.asarray(experts[e][0]) for e in range(len(experts))])
        scale = np.stack([np.asarray(experts[e][1], np.float32) for e in range(len(experts))])
        out[param_key] = (q, scale)
    return out


def fp8_model(model, quantized: dict, *, real: bool | None = None):
    """A copy of `model` whose quantized linears (`{target key: (q, scale)}` from the
    pipeline's FP8 stage) multiply in FP8, the experts of an MoE included; `real` as in
    `fp8.fp8_dot`."""
    out = nnx.clone(model)
    for key, (q, scale) in quantized.items():
        t = Target.from_key(key)
        if t.expert is not None:
            continue  # stacked below, one FP8Experts per parameter
        module = getattr(out.blocks[t.layer], t.module)
        setattr(module, t.name, nnx.Param(FP8Weight(jnp.asarray(q), jnp.asarray(
            np.asarray(scale, np.float32)), real)))
    for param_key, (q, scale) in _stacked_experts(quantized).items():
        t = Target.from_key(param_key)
        module = getattr(out.blocks[t.layer], t.module)
        if tuple(getattr(module, t.name)[...].shape) != q.shape:
            raise ValueError(f"{param_key}: FP8 values {q.shape} do not match the model's "
                             f"{tuple(getattr(module, t.name)[...].shape)}")
        setattr(module, t.name, nnx.Param(FP8Experts(jnp.asarray(q), jnp.asarray(scale), real)))
    return out
