"""Which matrices compression touches, in every model family, and their 2-D `[in, out]` views.

Design notes: `docs/compression.md`, under this file's name.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from hldstudy.family import family_of

# Every linear name, in the order a block's forward reaches them.
LINEARS = ("q", "q_gate", "k", "v", "o", "in_qkv", "in_z", "out", "gate", "up", "down",
           "shared_gate", "shared_up", "shared_down")
MODULES = ("attn", "mixer", "mlp")
EXPERT_LINEARS = ("gate", "up", "down")
# number of leading input axes of each linear's parameter (an expert slice counts as 2-D)
_IN_AXES = {name: 1 for name in LINEARS} | {"o": 2}


def _experts_param(module, name: str) -> bool:
    """True for a mixture-of-experts weight stacked over experts (`[E, in, out]`)."""
    return name in EXPERT_LINEARS and hasattr(module, "router")


@dataclass(frozen=True)
class Target:
    layer: int
    module: str  # one of MODULES
    name: str  # one of LINEARS
    expert: int | None = None  # the expert's index for a stacked MoE weight

    @property
    def param_key(self) -> str:
        """Dotted parameter path inside the student, e.g. 'blocks.3.attn.q'."""
        return f"blocks.{self.layer}.{self.module}.{self.name}"

    @property
    def key(self) -> str:
        """The parameter path, plus '.E' for one expert of a stacked weight."""
        return self.param_key if self.expert is None else f"{self.param_key}.{self.expert}"

    @classmethod
    def from_key(cls, key: str) -> Target:
        parts = key.split(".")
        if len(parts) not in (4, 5) or parts[0] != "blocks" or parts[2] not in MODULES \
                or parts[3] not in LINEARS:
            raise ValueError(f"{key!r} is not a compression target key")
        return cls(int(parts[1]), parts[2], parts[3],
                   int(parts[4]) if len(parts) == 5 else None)

    def param(self, model):
        return getattr(getattr(model.blocks[self.layer], self.module), self.name)

    def get2d(self, model) -> jnp.ndarray:
        w = self.param(model)[...]
        return to2d(self.name, w if self.expert is None else w[self.expert])

    def set2d(self, model, w2d) -> None:
        p = self.param(model)
        full = p[...]
        if self.expert is None:
            p[...] = from2d(w2d, full.shape).astype(full.dtype)
        else:
            p[...] = full.at[self.expert].set(from2d(w2d, full.shape[1:]).astype(full.dtype))


def to2d(name: str, w) -> jnp.ndarray:
    k = _IN_AXES[name]
    shape = w.shape
    return w.reshape(int(np.prod(shape[:k])), int(np.prod(shape[k:])))


def from2d(w2d, shape) -> jnp.ndarray:
    return jnp.reshape(w2d, shape)


def targets(model, names: tuple[str, ...] = LINEARS) -> list[Target]:
    """Every target linear of `model` named in `names`, block by block in forward order
    (an MoE weight gives one target per expert)."""
    out = []
    for layer, block in enumerate(model.blocks):
        for mod_name in MODULES:
            module = getattr(block, mod_name, None)
            if module is None:
                continue
            for name in LINEARS:
                if name not in names or not isinstance(getattr(module, name, None), nnx.Param):
                    continue
                if _experts_param(module, name):
                    n_experts = getattr(module, name)[...].shape[0]
                    out += [Target(layer, mod_name, name, e) for e in range(n_experts)]
                else:
                    out.append(Target(layer, mod_name, name))
    return out


def in_dim(model, t: Target) -> int:
    """Input dimension of a target's 2-D view (what N:M groups run along), from its shape."""
    shape = t.param(model)[...].shape
    if t.expert is not None:
        shape = shape[1:]
    return int(np.prod(shape[:_IN_AXES[t.name]]))


def out_shape(param_key: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The output axes of a parameter (an FP8 scale per output channel has this shape;
    stacked experts keep their leading expert axis)."""
    name = param_key.rsplit(".", 1)[1]
    lead = 1 if _stacked(name, shape) else 0
    return (shape[:lead] if lead else ()) + tuple(shape[lead + _IN_AXES[name]:])


def _stacked(name: str, shape) -> bool:
    # a GeGLU / SwiGLU gate, up, down is 2-D; the MoE's stacked weight is 3-D
    return name in EXPERT_LINEARS and len(shape) == 3


def masks_by_param(masks: dict, shapes: dict[str, tuple[int, ...]]) -> dict[str, np.ndarray]:
    """{target key: mask [in, out]} -> {parameter key: mask in the parameter's shape};
    experts without a mask of their own keep every weight."""
    out: dict[str, np.ndarray] = {}
    for key, mask in masks.items():
        t = Target.from_key(key)
        shape = tuple(shapes[t.param_key])
        if t.expert is None:
            out[t.param_key] = np.asarray(mask).reshape(shape)
        else:
            full = out.setdefault(t.param_key, np.ones(shape, bool))
            full[t.expert] = np.asarray(mask).reshape(shape[1:])
    return out


def map_2d(param_key: str, w, fn) -> jax.Array:
    """fn applied to the 2-D view of a parameter (of each expert's slice when stacked),
    reshaped back."""
    name = param_key.rsplit(".", 1)[1]
    if _stacked(name, w.shape):
        return jax.vmap(lambda x: jnp.reshape(fn(to2d(name, x)), x.shape))(w)
    return jnp.reshape(fn(to2d(name, w)), w.shape)


def input_dims(cfg) -> dict[str, int]:
    """Input dimension of each linear a ModelConfig's blocks hold (what 2:4 groups run
    along), without building the model."""
    dims = {"q": cfg.d_model, "k": cfg.d_model, "v": cfg.d_model,
            "o": cfg.n_heads * cfg.head_dim, "gate": cfg.d_model, "up": cfg.d_model,
            "down": cfg.d_ff}
    fam = family_of(cfg)
    if fam.gated_attention:
        dims["q_gate"] = cfg.d_model
    if fam.has_linear_attention:
        dims |= {"in_qkv": cfg.d_model, "in_z": cfg.d_model,
                 "out": cfg.linear_v_heads * cfg.linear_v_head_dim}
    if cfg.n_experts:
        dims |= {"down": cfg.d_expert, "shared_gate": cfg.d_model,
                 "shared_up": cfg.d_model, "shared_down": cfg.d_shared_expert}
    return dims
