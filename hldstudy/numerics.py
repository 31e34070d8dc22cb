"""Small numerical functions the model and the losses share (jax only)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def softcap(x: jax.Array, cap: float | None) -> jax.Array:
    """Gemma-2 soft-cap `cap * tanh(x / cap)`; identity when cap is None.
    Its derivative is `1 - (softcap(x) / cap)^2`."""
    return x if cap is None else cap * jnp.tanh(x / cap)
