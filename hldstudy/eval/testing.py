"""Tiny models, tokenizers and run directories for eval tests and benchmarks (seconds, CPU)."""

from __future__ import annotations

from pathlib import Path

from hldstudy.config import Config, DataConfig, save_config


def tiny_config(vocab_size: int = 384, seq_len: int = 64, **model) -> Config:
    from hldstudy.model import preset

    return Config(name="eval-tiny", model=preset("tiny", vocab_size=vocab_size, **model),
                  data=DataConfig(seq_len=seq_len, batch_size=8, tokenizer_vocab_size=vocab_size,
                                  synthetic_docs=300, synthetic_valid_docs=32))


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

    from hldstudy.model import Transformer
    from hldstudy.train.checkpoint import Checkpointer

    cfg = cfg or tiny_config()
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    save_config(cfg, d / "config.json")
    if tokenizer:
        tiny_tokenizer(d, cfg.data.tokenizer_vocab_size)
    model = Transformer(cfg.model, rngs=nnx.Rngs(seed))
    ck = Checkpointer(d / "checkpoints", keep=1)
    ck.save(1, {"params": {"student": nnx.state(model, nnx.Param)}}, {"step": 1})
    ck.close()
    return d
