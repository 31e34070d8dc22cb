"""Self-supervised baseline: next-token NLL, no teacher."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from hldstudy.distill.base import Stage, Strategy


def masked_nll(logits_BxTxV: jax.Array, targets_BxT: jax.Array, mask_BxT: jax.Array):
    """Mean of lse(z) - z[y] over tokens where mask is set."""
    logits = logits_BxTxV.astype(jnp.float32)
    lse = jax.nn.logsumexp(logits, axis=-1)
    target_logit = jnp.take_along_axis(logits, targets_BxT[..., None], axis=-1)[..., 0]
    mask = mask_BxT.astype(jnp.float32)
    return jnp.sum((lse - target_logit) * mask) / jnp.maximum(jnp.sum(mask), 1.0)


class Baseline(Strategy):
    name = "baseline"
    needs_teacher = False

    def loss(self, stage: Stage, student, aux, batch, teacher):
        out = student(batch["tokens"], batch["positions"], batch["segment_ids"])
        nll = masked_nll(out.logits, batch["targets"], batch["mask"])
        return nll, {"nll": nll}
