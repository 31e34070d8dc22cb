"""Recovery distillation with 2:4 masks held (and optionally the FP8 grid in the loop).

Design notes: `docs/compression.md`, under this file's name.
"""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from hldstudy.compress.fp8 import fake_quant
from hldstudy.compress.layout import Target, map_2d, masks_by_param
from hldstudy.model.loading import load_model
from hldstudy.train import loop


class HoldState(NamedTuple):
    inner: optax.OptState
    masks: dict  # {target key: bool mask in the parameter's shape}
    latent: dict  # {target key: float32 latent weight} (empty without quant)


def _key(path) -> str | None:
    """'blocks.0.attn.q' for a student parameter's path in the train state, else None."""
    keys = [getattr(k, "key", getattr(k, "idx", getattr(k, "name", None))) for k in path]
    keys = [str(k) for k in keys if k != "value"]
    if not keys or keys[0] != "student":
        return None
    return ".".join(keys[1:])


def _quantize_like(w, key: str, quant):
    fmt, gran = quant
    return map_2d(key, w, lambda w2d: fake_quant(w2d, fmt, gran))


def hold_masks(inner: optax.GradientTransformation, masks: dict[str, np.ndarray],
               quant: tuple[str, str] | None = None) -> optax.GradientTransformation:
    """masks: {target key: bool [in, out] mask} (one per expert for stacked MoE weights);
    held per parameter."""
    target_masks = masks
    masks = {}  # {parameter key: mask in the parameter's shape}, filled by init

    def leaves(tree):
        return {k: v for p, v in jax.tree_util.tree_leaves_with_path(tree)
                if (k := _key(p)) in masks}

    def init(params):
        shapes = {k: v.shape for p, v in jax.tree_util.tree_leaves_with_path(params)
                  if (k := _key(p)) is not None}
        missing = sorted({Target.from_key(k).param_key for k in target_masks} - set(shapes))
        if missing:
            raise KeyError(f"hold_masks: no parameter for {missing[:3]}")
        masks.clear()
        masks.update(masks_by_param(target_masks, shapes))
        found = leaves(params)
        m = {k: jnp.asarray(masks[k]) for k in found}
        latent = {k: found[k].astype(jnp.float32) for k in found} if quant else {}
        return HoldState(inner.init(params), m, latent)

    def apply_mask(tree, m):
        return jax.tree_util.tree_map_with_path(
            lambda p, x: jnp.where(m[k], x, jnp.zeros_like(x)) if (k := _key(p)) in m else x,
            tree)

    def update(grads, state, params=None):
        grads = apply_mask(grads, state.masks)
        base = params
        if quant and params is not None:  # the inner optimizer (weight decay) sees latents
            base = jax.tree_util.tree_map_with_path(
                lambda p, x: state.latent[k] if (k := _key(p)) in state.latent else x, params)
        updates, inner_state = inner.update(grads, state.inner, base)
        updates = apply_mask(updates, state.masks)
        latent = state.latent
        if quant:
            found = leaves(updates)
            latent = {k: latent[k] + found[k] for k in latent}

            def to_grid(p, u, w):
                k = _key(p)
                if k not in latent:
                    return u
                target = _quantize_like(latent[k], k, quant)
                target = jnp.where(state.masks[k], target, 0.0)
                return target - w

            updates = jax.tree_util.tree_map_with_path(to_grid, updates, params)
        return updates, HoldState(inner_state, state.masks, latent)

    return optax.GradientTransformation(init, update)


def recovery_config(run_cfg, ccfg, *, teacher_path: str, workdir: Path):
    """The training config of a recovery run: the checkpoint's model and data, the
    recovery objective of the compress section."""
    d = run_cfg.distill
    distill = dataclasses.replace(d, method=ccfg.method, divergence=ccfg.divergence,
                                  alpha=ccfg.alpha, temperature=ccfg.temperature,
                                  layer_pairs=ccfg.layer_pairs)
    train = dataclasses.replace(run_cfg.train, steps=max(ccfg.recover_steps, 1), lr=ccfg.lr,
                                warmup_steps=min(ccfg.warmup_steps, max(ccfg.recover_steps - 1, 0)),
                                eval_every=0, checkpoint_every=0, keep_checkpoints=2,
                                progress=ccfg.progress, seed=ccfg.seed)
    budget = dataclasses.replace(run_cfg.budget, flops=ccfg.recover_flops)
    teacher = dataclasses.replace(run_cfg.teacher, checkpoint=str(teacher_path))
    wandb = dataclasses.replace(run_cfg.wandb, enabled=False)
    return dataclasses.replace(run_cfg, name=f"{run_cfg.name}-recover", distill=distill,
                               train=train, budget=budget, teacher=teacher, wandb=wandb)


def recover(model, masks: dict[str, np.ndarray], run_cfg, ccfg, *, teacher_path: str,
            data, workdir: Path, quant: tuple[str, str] | None = None):
    """Trains `model` (pruned, in place semantics: returns the new model) with the masks
    held; returns (model, trainer result dict)."""
    workdir = Path(workdir)
    if workdir.exists():
        shutil.rmtree(workdir)  # a fresh recovery each time: never resume a stale one
    cfg = recovery_config(run_cfg, ccfg, teacher_path=teacher_path, workdir=workdir)
    _, student = nnx.split(model, nnx.Param)
    masks_shaped = {k: np.asarray(v) for k, v in masks.items()}
    trainer = loop.Trainer(cfg, workdir, data=data, init_student=student,
                           wrap_optimizer=lambda opt: hold_masks(opt, masks_shaped, quant))
    result = trainer.run()
    loaded = load_model(workdir)
    return loaded.model, result
