"""Hidden-state alignment (HLD / FitNets): learned regressor + normalized MSE."""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx


def normalized_mse(pred_TxD: jax.Array, target_TxD: jax.Array, mask_T: jax.Array | None = None,
                   norm: jax.Array | None = None, form: str = "batch"):
    """`sum_valid ||pred - target||^2 / sum_valid ||target||^2` (float32).

    Scale-free: multiplying pred and target by the same constant leaves it
    unchanged, so its weight is comparable across layers and models. Leading
    dims `[..., T, D]` are allowed; `mask_T` has the shape `[..., T]`. `norm`: the
    denominator when the batch is a micro-batch of a larger one (its teacher norms).
    form="token": the mean over valid positions of each position's own ratio (`norm` is
    then ignored: a micro-batch's share is weighted by its tokens).
    """
    dtype = jnp.promote_types(target_TxD.dtype, jnp.float32)  # f32, or f64 under x64
    pred = pred_TxD.astype(dtype)
    target = target_TxD.astype(dtype)
    if mask_T is None:
        mask_T = jnp.ones(target.shape[:-1], bool)
    valid = mask_T.astype(bool)[..., None]
    if form == "token":
        err_T = jnp.sum(jnp.square(pred - target), axis=-1)
        norm_T = jnp.sum(jnp.square(target), axis=-1)
        ratio_T = err_T / jnp.maximum(norm_T, jnp.finfo(dtype).tiny)
        count = jnp.maximum(jnp.sum(valid[..., 0].astype(dtype)), 1.0)
        return jnp.sum(jnp.where(valid[..., 0], ratio_T, 0.0)) / count
    err = jnp.sum(jnp.where(valid, jnp.square(pred - target), 0.0))
    if norm is None:
        norm = jnp.sum(jnp.where(valid, jnp.square(target), 0.0))
    # Tiny floor only guards the all-masked / all-zero-target case (returns err / eps).
    return err / jnp.maximum(norm, jnp.finfo(dtype).tiny)


class Regressor(nnx.Module):
    """Dense `d_in -> d_out` with bias, float32 params (HLD's one-layer regressor).

    Init: LeCun-normal kernel (variance 1/d_in), zero bias, so `R(h)` has about
    the scale of `h` per coordinate at init -- a neutral start for the
    normalized MSE, which then only has to learn the rotation/scale.
    """

    def __init__(self, d_in: int, d_out: int, *, rngs: nnx.Rngs):
        self.d_in, self.d_out = d_in, d_out
        self.kernel = nnx.Param(
            nnx.initializers.lecun_normal()(rngs.params(), (d_in, d_out), jnp.float32)
        )
        self.bias = nnx.Param(jnp.zeros((d_out,), jnp.float32))

    def __call__(self, h_TxD: jax.Array) -> jax.Array:
        # Compute in float32 whatever the activations' dtype: the regressor is tiny.
        return jnp.dot(h_TxD.astype(jnp.float32), self.kernel[...]) + self.bias[...]


def hidden_alignment_loss(
    student_hiddens: Sequence[jax.Array],
    teacher_hiddens: Sequence[jax.Array],
    regressors: Sequence[Regressor],
    mask: jax.Array | None = None,
    norms: Sequence[jax.Array] | None = None,
    form: str = "batch",
) -> jax.Array:
    """Mean over (student, teacher, regressor) pairs of `normalized_mse(R(h_s), h_t)`.

    The teacher side gets no gradient. One pair is HLD; several are Patient KD.
    """
    if not (len(student_hiddens) == len(teacher_hiddens) == len(regressors)) or not regressors:
        raise ValueError(
            "student_hiddens/teacher_hiddens/regressors: need the same non-zero number of each, "
            f"got {len(student_hiddens)}, {len(teacher_hiddens)}, {len(regressors)}"
        )
    norms = [None] * len(regressors) if norms is None else norms
    losses = [
        normalized_mse(reg(h_s), jax.lax.stop_gradient(h_t), mask, norm, form)
        for h_s, h_t, reg, norm in zip(student_hiddens, teacher_hiddens, regressors, norms,
                                       strict=True)
    ]
    return sum(losses) / len(losses)
