"""The pieces of one tiny train program, built as the trainer builds them, for tests that
compare two ways of computing the same step (micro-batches, scanned layers)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from hldstudy.config import Config, DataConfig, DistillConfig, TrainConfig
from hldstudy.distill.base import make_strategy
from hldstudy.model import Transformer
from hldstudy.teacher.colocated import teacher_forward_fn
from hldstudy.train.step import split_params


def keep_grads():
    """Test double of an optimizer: no update; its state is the last gradient it saw."""
    return optax.GradientTransformation(
        lambda params: jax.tree_util.tree_map(jnp.zeros_like, params),
        lambda grads, state, params=None: (jax.tree_util.tree_map(jnp.zeros_like, grads), grads))


def program_pieces(method: str, stage: str, model, teacher_model, *, batch_size: int,
                   seq_len: int, uneven_mask: bool):
    """(strategy, stage, graphdefs, params, teacher forward, teacher params, batch) of a
    materialized-loss step; `uneven_mask`: rows with different numbers of valid tokens
    (a weighting must count them), else every token counts."""
    cfg = Config(model=model, data=DataConfig(batch_size=batch_size, seq_len=seq_len),
                 distill=DistillConfig(method=method, loss_impl="materialized"),
                 train=TrainConfig(seed=0))
    strategy = make_strategy(cfg, cfg.model, teacher_model)
    st = next(s for s in strategy.stages() if s.name == stage)
    graphdefs, params = split_params(Transformer(cfg.model, rngs=nnx.Rngs(0)),
                                     strategy.init_aux(st, nnx.Rngs(1)))
    t_gd, t_params = nnx.split(Transformer(teacher_model, rngs=nnx.Rngs(2)), nnx.Param)
    forward = teacher_forward_fn(t_gd, strategy.teacher_layers(st), strategy.teacher_needs_head(st))
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, model.vocab_size, (batch_size, seq_len), dtype=np.int32)
    if uneven_mask:
        mask = rng.random((batch_size, seq_len)) < np.linspace(0.3, 1.0, batch_size)[:, None]
    else:
        mask = np.ones((batch_size, seq_len), bool)
    batch = {"tokens": jnp.asarray(tokens), "targets": jnp.asarray(np.roll(tokens, -1, 1)),
             "positions": jnp.tile(jnp.arange(seq_len, dtype=jnp.int32), (batch_size, 1)),
             "segment_ids": jnp.ones((batch_size, seq_len), jnp.int32), "mask": jnp.asarray(mask)}
    return strategy, st, graphdefs, params, forward, t_params, batch
