"""The forward of an FP8-compressed model with the real FP8 dot where the chip has one.

`fp8_model(model, quantized)` returns a copy of `model` whose quantized linears hold an
`FP8Weight` (the FP8 values and their float32 scales) instead of float32 weights. The
model's own forward code runs unchanged: it reads a projection as
`x @ param[...].astype(dtype).reshape(in, out)`, and an `FP8Weight` answers `astype`
and `reshape` on its FP8 values and `x @ w` with `fp8.fp8_dot`: the FP8 x FP8 matmul
(activations quantized per tensor, float32 accumulation) where the backend has FP8
matrix units (`chips.py`'s `fp8_matmul`, via `fp8.backend_has_fp8_matmul`), the
simulated path (weights dequantized, float32 matmul: the same numbers as the pipeline's
dequantized model) elsewhere. `real=True` forces the FP8 dot (XLA emulates it on CPU:
how the tests check its numbers), `real=False` the simulation.

Mixture-of-experts weights stay dequantized (the grouped `ragged_dot` has no FP8 form
here); every other target linear (layout.py) runs in FP8.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from hldstudy.compress.fp8 import fp8_dot
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


def fp8_model(model, quantized: dict, *, real: bool | None = None):
    """A copy of `model` whose quantized linears (`{target key: (q, scale)}` from the
    pipeline's FP8 stage) multiply in FP8; `real` as in `fp8.fp8_dot`."""
    out = nnx.clone(model)
    for key, (q, scale) in quantized.items():
        t = Target.from_key(key)
        if t.expert is not None:
            continue  # stacked experts keep their dequantized values (module doc)
        module = getattr(out.blocks[t.layer], t.module)
        setattr(module, t.name, nnx.Param(FP8Weight(jnp.asarray(q), jnp.asarray(
            np.asarray(scale, np.float32)), real)))
    return out
