"""The decoder (Flax NNX) of every family -- Gemma 3 and Qwen3.5 dense / MoE -- presets and checkpoint import."""

from hldstudy.model.presets import PRESETS, preset
from hldstudy.model.transformer import ModelOutput, Transformer, count_module_params, count_params

__all__ = ["PRESETS", "ModelOutput", "Transformer", "count_module_params", "count_params", "preset"]
