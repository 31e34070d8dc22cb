"""Which matrices compression touches, and their 2-D `[in, out]` views.

The block linears of hldstudy's decoder (model/layers.py) are stored input
dimension first: q `[D, N, H]`, k/v `[D, K, H]`, o `[N, H, D]`, gate/up
`[D, F]`, down `[F, D]`. Flattening the input axes and the output axes gives
`[in, out]` (`o` has two input axes, N and H, flattened head-major, the order
of the attention output the projection contracts). Embeddings, the tied head
and norms are never touched.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax.numpy as jnp
import numpy as np

LINEARS = ("q", "k", "v", "o", "gate", "up", "down")
_MODULE = {"q": "attn", "k": "attn", "v": "attn", "o": "attn",
           "gate": "mlp", "up": "mlp", "down": "mlp"}
# number of leading axes that are input axes
_IN_AXES = {"q": 1, "k": 1, "v": 1, "o": 2, "gate": 1, "up": 1, "down": 1}


@dataclass(frozen=True)
class Target:
    layer: int
    name: str  # one of LINEARS

    @property
    def key(self) -> str:
        """Dotted parameter path inside the student, e.g. 'blocks.3.attn.q'."""
        return f"blocks.{self.layer}.{_MODULE[self.name]}.{self.name}"

    def param(self, model):
        return getattr(getattr(model.blocks[self.layer], _MODULE[self.name]), self.name)

    def get2d(self, model) -> jnp.ndarray:
        return to2d(self.name, self.param(model)[...])

    def set2d(self, model, w2d) -> None:
        p = self.param(model)
        p[...] = from2d(w2d, p[...].shape).astype(p[...].dtype)


def to2d(name: str, w) -> jnp.ndarray:
    k = _IN_AXES[name]
    shape = w.shape
    return w.reshape(int(np.prod(shape[:k])), int(np.prod(shape[k:])))


def from2d(w2d, shape) -> jnp.ndarray:
    return jnp.reshape(w2d, shape)


def targets(n_layers: int, names: tuple[str, ...] = LINEARS) -> list[Target]:
    """Every (layer, linear) in forward order: q, k, v, o, gate, up, down per block."""
    return [Target(i, n) for i in range(n_layers) for n in LINEARS if n in names]


def input_dims(cfg) -> dict[str, int]:
    """Input dimension of each linear for a ModelConfig (what 2:4 groups run along)."""
    return {"q": cfg.d_model, "k": cfg.d_model, "v": cfg.d_model,
            "o": cfg.n_heads * cfg.head_dim, "gate": cfg.d_model, "up": cfg.d_model,
            "down": cfg.d_ff}
