"""AdamW with warmup then cosine / linear decay and global-norm clipping.

The peak learning rate is `cfg.lr` (a constant of the program), or a traced scalar
(`lr=`): a cohort's students each train at their own peak inside one compiled step,
building their optimizer inside the step (optax's schedules are plain arithmetic in
the peak, and the optimizer state does not depend on it)."""

from __future__ import annotations

import jax
import optax

from hldstudy.config import TrainConfig


def lr_schedule(cfg: TrainConfig, total_steps: int | None = None,
                lr: float | jax.Array | None = None) -> optax.Schedule:
    """The schedule peaking at `lr` (default `cfg.lr`; a traced scalar inside a step)."""
    peak = cfg.lr if lr is None else lr
    total = total_steps or cfg.steps
    warmup = min(cfg.warmup_steps, max(total - 1, 0))
    end = peak * cfg.min_lr_ratio
    decay_steps = max(total - warmup, 1)
    if cfg.schedule == "cosine":
        decay = optax.cosine_decay_schedule(peak, decay_steps, alpha=cfg.min_lr_ratio)
    elif cfg.schedule == "linear":
        decay = optax.linear_schedule(peak, end, decay_steps)
    else:
        decay = optax.constant_schedule(peak)
    if warmup == 0:
        return decay
    return optax.join_schedules([optax.linear_schedule(0.0, peak, warmup), decay], [warmup])


def _decay_mask(params):
    # Decay matrices only: norms' scales and biases stay undecayed.
    return jax.tree_util.tree_map(lambda x: getattr(x, "ndim", 0) >= 2, params)


def _path_keys(path) -> list:
    return [getattr(k, "key", getattr(k, "idx", getattr(k, "name", None))) for k in path]


def frozen_labels(params, trainable_layers: int):
    """'train' / 'freeze' per leaf: student blocks past `trainable_layers`, the final norm
    (and so the head) are frozen; the embedding and any aux modules train."""

    def label(path, _):
        keys = _path_keys(path)
        if keys and keys[0] == "student":
            if "final_norm" in keys:
                return "freeze"
            if "blocks" in keys:
                layer = int(keys[keys.index("blocks") + 1])
                return "train" if layer < trainable_layers else "freeze"
        return "train"

    return jax.tree_util.tree_map_with_path(label, params)


def make_optimizer(cfg: TrainConfig, total_steps: int | None = None,
                   trainable_layers: int | None = None,
                   lr: float | jax.Array | None = None) -> optax.GradientTransformation:
    """AdamW chain; with `trainable_layers`, only the first that many student blocks
    (plus embedding and aux modules) are updated: frozen ones see neither Adam nor decay.
    `lr`: the peak learning rate when not `cfg.lr` (a traced scalar: build the optimizer
    inside the step; its `init` is the same for every peak)."""
    parts = []
    if cfg.grad_clip > 0:
        parts.append(optax.clip_by_global_norm(cfg.grad_clip))
    parts.append(optax.adamw(lr_schedule(cfg, total_steps, lr), b1=cfg.b1, b2=cfg.b2,
                             weight_decay=cfg.weight_decay, mask=_decay_mask))
    opt = optax.chain(*parts)
    if trainable_layers is None:
        return opt
    return optax.multi_transform(
        {"train": opt, "freeze": optax.set_to_zero()},
        lambda params: frozen_labels(params, trainable_layers))
