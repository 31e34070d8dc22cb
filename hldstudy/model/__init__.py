"""Gemma-style decoder (Flax NNX), presets and checkpoint import."""

from hldstudy.model.presets import PRESETS, preset
from hldstudy.model.transformer import ModelOutput, Transformer, count_module_params, count_params

__all__ = ["PRESETS", "ModelOutput", "Transformer", "count_module_params", "count_params", "preset"]
