"""Model families as data: what differs between Gemma 3 and Qwen3.5 decoders, said once.

A family decides the block a layer builds (from `ModelConfig.layer_type(i)`) and how
tokens enter the stack; everything else (embedding table, final norm, head, hidden-state
numbering) is shared by `Transformer`. The layer types a family accepts and its default
pattern live with the config (`hldstudy.config.LAYER_TYPES`), where they are validated.

    gemma3   Block: pre+post norms, (local/global) attention, GeGLU; embedding * sqrt(d)
    qwen3_5  QwenBlock: pre-norm, gated attention or Gated DeltaNet, SwiGLU or MoE;
             embedding unscaled
"""

from __future__ import annotations

from flax import nnx

from hldstudy.config import ModelConfig
from hldstudy.model.layers import Block
from hldstudy.model.qwen_layers import QwenBlock

__all__ = ["build_block", "embeds_scaled", "returns_aux"]


def build_block(cfg: ModelConfig, layer_idx: int, rngs: nnx.Rngs) -> nnx.Module:
    if cfg.family == "qwen3_5":
        return QwenBlock(cfg, layer_idx, rngs)
    return Block(cfg, layer_idx, rngs)


def embeds_scaled(cfg: ModelConfig) -> bool:
    """Gemma multiplies the token embedding by sqrt(d_model); Qwen does not."""
    return cfg.family == "gemma3"


def returns_aux(cfg: ModelConfig) -> bool:
    """Whether blocks return (x, load-balancing loss) rather than x."""
    return cfg.family == "qwen3_5"
