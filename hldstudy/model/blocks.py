"""The block each family builds (`hldstudy.family` holds the rest of what differs):
Gemma 3's `Block` (pre+post norms, local/global attention, GeGLU) and Qwen3.5's
`QwenBlock` (pre-norm, gated attention or Gated DeltaNet, SwiGLU or MoE)."""

from __future__ import annotations

from flax import nnx

from hldstudy.config import ModelConfig
from hldstudy.family import GEMMA3, QWEN3_5, family_of
from hldstudy.model.layers import Block
from hldstudy.model.qwen_layers import QwenBlock

__all__ = ["build_block"]

BLOCKS = {GEMMA3: Block, QWEN3_5: QwenBlock}


def build_block(cfg: ModelConfig, layer_idx: int, rngs: nnx.Rngs) -> nnx.Module:
    return BLOCKS[family_of(cfg)](cfg, layer_idx, rngs)
