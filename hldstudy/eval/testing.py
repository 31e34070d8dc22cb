"""Tiny models, tokenizers and run directories for eval tests and benchmarks (seconds, CPU)."""

from __future__ import annotations

from pathlib import Path

from hldstudy.config import Config, DataConfig, save_config


def tiny_config(vocab_size: int = 384, seq_len: int = 64, **model) -> Config:
    from hldstudy.model import preset

    return Config(name="eval-tiny", model=preset("tiny", vocab_size=vocab_size, **model),
                  data=DataConfig(seq_len=seq_len, batch_size=8, tokenizer_vocab_size=vocab_size,
                                  synthetic_docs=300, synthetic_valid_docs=32))


def init_model(model_cfg, seed: int = 0):
    """A Transformer with random weights drawn by numpy: matrices N(0, 1/fan_in) (the
    embedding N(0, 1/d_model), as the model's own init), norm scales 0. JAX's init
    compiles a truncated normal per parameter shape (seconds on a busy CPU); tests
    and benchmarks only need some fixed random model."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from hldstudy.model import Transformer

    abstract = nnx.eval_shape(lambda: Transformer(model_cfg, rngs=nnx.Rngs(seed)))
    graphdef, state = nnx.split(abstract)
    rng = np.random.default_rng(seed)

    def draw(x):
        if not hasattr(x, "shape") or not hasattr(x, "dtype"):
            return x
        if len(x.shape) < 2:
            return jnp.zeros(x.shape, x.dtype)
        if x.shape[0] == model_cfg.vocab_size:  # embedding [V, D]
            fan_in = model_cfg.d_model
        elif len(x.shape) == 3 and x.shape[-1] == model_cfg.d_model:  # attention out [H, K, D]
            fan_in = int(np.prod(x.shape[:-1]))
        else:  # [D, ...] projections
            fan_in = x.shape[0]
        std = fan_in ** -0.5
        return jnp.asarray(rng.standard_normal(x.shape, np.float32) * std, x.dtype)

    return nnx.merge(graphdef, jax.tree_util.tree_map(draw, state))


def tiny_tokenizer(directory: str | Path, vocab_size: int = 384, n_docs: int = 300):
    from hldstudy.data.synthetic import generate_documents
    from hldstudy.data.tokenizer import train_tokenizer

    return train_tokenizer(generate_documents(n_docs, 0), vocab_size, Path(directory) / "tokenizer")


def tiny_run_dir(directory: str | Path, cfg: Config | None = None, *, seed: int = 0,
                 tokenizer: bool = True) -> Path:
    """A run directory as `python -m hldstudy.train` leaves it (config.json,
    tokenizer.model, checkpoints/<step>/ with params.student), holding a freshly
    initialized model (no training)."""
    from flax import nnx

    from hldstudy.checkpoint import Checkpointer

    cfg = cfg or tiny_config()
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    save_config(cfg, d / "config.json")
    if tokenizer:
        tiny_tokenizer(d, cfg.data.tokenizer_vocab_size)
    model = init_model(cfg.model, seed)
    ck = Checkpointer(d / "checkpoints", keep=1)
    ck.save(1, {"params": {"student": nnx.state(model, nnx.Param)}}, {"step": 1})
    ck.close()
    return d
