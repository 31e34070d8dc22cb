"""AdamW with warmup then cosine / linear decay and global-norm clipping.

The peak learning rate is `cfg.lr` (a constant of the program), or a traced scalar
(`lr=`): a cohort's students each train at their own peak inside one compiled step,
building their optimizer inside the step (optax's schedules are plain arithmetic in
the peak, and the optimizer state does not depend on it).

The optimizer only takes float32 parameters (the master weights,
`hldstudy.train.step.split_params`): its `init` refuses bfloat16 / float16 ones, whose
Adam moments and updates would be rounded to 8 bits of mantissa (`model.param_dtype`
below float32 is kept as a float32 master copy, cast for the forward)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from hldstudy.config import TrainConfig
from hldstudy.errors import ConfigError


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


def check_master_params(params) -> None:
    """Raises ConfigError (naming model.param_dtype) when a floating parameter is not
    float32: the optimizer would keep its state, and apply its updates, in that dtype."""
    low = sorted({str(x.dtype) for x in jax.tree_util.tree_leaves(params)
                  if jnp.issubdtype(x.dtype, jnp.floating) and x.dtype != jnp.float32})
    if low:
        raise ConfigError("model.param_dtype",
                          f"{'/'.join(low)} parameters reached the optimizer without a float32 "
                          "master copy (its moments and updates would be rounded to "
                          f"{'/'.join(low)})",
                          "build the state with hldstudy.train.step.split_params (float32 "
                          "masters, cast for the forward), or set model.param_dtype=float32 "
                          "and keep model.dtype=bfloat16 for bfloat16 compute")


def _master_only(opt: optax.GradientTransformation) -> optax.GradientTransformation:
    def init(params):
        check_master_params(params)
        return opt.init(params)

    return optax.GradientTransformation(init, opt.update)


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
        return _master_only(opt)
    return _master_only(optax.multi_transform(
        {"train": opt, "freeze": optax.set_to_zero()},
        lambda params: frozen_labels(params, trainable_layers)))


def carry_moments(prev, fresh):
    """`fresh` (the next stage's initial optimizer state) with the previous stage's step
    count and Adam moments for every parameter both stages train: zero for the ones the
    previous stage froze; the ones only it had (a regressor) are dropped."""
    def field(state, name):
        return optax.tree_utils.tree_get_all_with_path(state, name)[0][1]

    def masked(x):
        return isinstance(x, optax.MaskedNode)

    out = fresh
    for name in ("mu", "nu"):
        old, _ = jax.tree_util.tree_flatten_with_path(field(prev, name), is_leaf=masked)
        trained = {jax.tree_util.keystr(p): v for p, v in old if not masked(v)}
        filled = jax.tree_util.tree_map_with_path(
            lambda p, v, t=trained: t.get(jax.tree_util.keystr(p), v), field(fresh, name))
        out = optax.tree_utils.tree_set(out, **{name: filled})
    return optax.tree_utils.tree_set(out, count=field(prev, "count"))
