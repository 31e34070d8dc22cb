"""Named model shapes.

Real Gemma 3 shapes (`gemma3-*`), the paper's layouts with a configurable
vocabulary (`paper-*`, default 32768), Qwen3.5 dense and MoE (`qwen3.5-*`: the
disaggregated experiment's 9B student and 35B-A3B teacher, and the 122B-A10B), and tiny
CPU shapes. Presets are `ModelConfig` values; override any field with
`dataclasses.replace` or `--set model.field=value`.
"""

from __future__ import annotations

import dataclasses

from hldstudy.config import ModelConfig
from hldstudy.errors import ConfigError
from hldstudy.family import QWEN3_5

_GEMMA3_COMMON = dict(
    n_kv_heads=1, head_dim=256, rope_base_global=1_000_000.0, rope_base_local=10_000.0,
    global_every=6, qk_norm=True, query_pre_attn_scalar=256.0, norm_eps=1e-6,
    max_seq_len=32768,
)

PRESETS: dict[str, ModelConfig] = {
    # Gemma 3 270M: layers 5, 11, 17 (0-based) global.
    "gemma3-270m": ModelConfig(vocab_size=262144, d_model=640, n_layers=18, n_heads=4,
                               d_ff=2048, sliding_window=512, **_GEMMA3_COMMON),
    "gemma3-1b": ModelConfig(vocab_size=262144, d_model=1152, n_layers=26, n_heads=4,
                             d_ff=6912, sliding_window=512, **_GEMMA3_COMMON),
    "gemma3-4b": ModelConfig(vocab_size=262208, d_model=2560, n_layers=34, n_heads=8,
                             d_ff=10240, sliding_window=1024,
                             **{**_GEMMA3_COMMON, "n_kv_heads": 4}),
    # Tiny CPU shapes: GQA and a local:global pattern so every code path runs.
    "tiny": ModelConfig(vocab_size=512, d_model=64, n_layers=4, n_heads=4, n_kv_heads=2,
                        head_dim=16, d_ff=192, max_seq_len=512, sliding_window=32,
                        global_every=2, qk_norm=True),
    "tiny-teacher": ModelConfig(vocab_size=512, d_model=128, n_layers=6, n_heads=4,
                                n_kv_heads=2, head_dim=32, d_ff=384, max_seq_len=512,
                                sliding_window=32, global_every=3, qk_norm=True),
    # The real-text study (hldstudy.study): a 6-layer student past the quickstart's 4
    # layers, a teacher 4x its width; a few-thousand-piece vocabulary trained on the corpus.
    "text-student": ModelConfig(vocab_size=4096, d_model=64, n_layers=6, n_heads=4,
                                n_kv_heads=2, head_dim=16, d_ff=192, max_seq_len=512,
                                sliding_window=64, global_every=3, qk_norm=True),
    "text-teacher": ModelConfig(vocab_size=4096, d_model=192, n_layers=8, n_heads=6,
                                n_kv_heads=2, head_dim=32, d_ff=576, max_seq_len=512,
                                sliding_window=64, global_every=4, qk_norm=True),
}

# Qwen3.5 (family qwen3_5): three Gated DeltaNet layers then one gated full-attention
# layer, head_dim 256 with a quarter rotated, 248k vocabulary, untied head. The shapes
# are transformers' Qwen3_5TextConfig / Qwen3_5MoeTextConfig defaults, which its docs
# give as the 9B-style and 35B-A3B configurations (8.95e9 and 34.7e9 parameters; 3.45e9
# active per token in the MoE, embedding and head included). rope theta 1e7.
_QWEN35_COMMON = dict(
    family=QWEN3_5.name, vocab_size=248320, head_dim=256, rotary_fraction=0.25,
    rope_base_global=10_000_000.0, norm_eps=1e-6, tie_embeddings=False, max_seq_len=32768,
    linear_k_heads=16, linear_v_heads=32, linear_k_head_dim=128, linear_v_head_dim=128,
    linear_conv_kernel=4, deltanet_chunk=64,
)
PRESETS["qwen3.5-9b"] = ModelConfig(d_model=4096, n_layers=32, n_heads=16, n_kv_heads=4,
                                    d_ff=12288, **_QWEN35_COMMON)
PRESETS["qwen3.5-35b-a3b"] = ModelConfig(
    d_model=2048, n_layers=40, n_heads=16, n_kv_heads=2, d_ff=512, n_experts=256,
    experts_per_token=8, d_expert=512, d_shared_expert=512, router_aux_weight=0.001,
    **_QWEN35_COMMON)
# Qwen3.5-122B-A10B, the next larger of the family (the decision map's larger pair, teacher of
# the 35B-A3B): 48 layers (12 gated-attention), d 3072, 32 query / 2 kv heads of 256, 256
# experts of 1024 (8 routed + 1 shared of 1024), 248,320 vocabulary, as its public
# config.json is summarised on its model pages (apxml.com/models/qwen35-122b-a10b,
# awesomeagents.ai/models/qwen-3-5-122b-a10b). Its DeltaNet has 64 value heads (16 key heads
# of 128): with them the count is 122.1e9 parameters, 9.77e9 active (the name's 122B-A10B);
# with the 35B's 32 it would be 120.7e9 / 8.40e9.
PRESETS["qwen3.5-122b-a10b"] = dataclasses.replace(
    PRESETS["qwen3.5-35b-a3b"], d_model=3072, n_layers=48, n_heads=32, n_kv_heads=2,
    d_ff=1024, d_expert=1024, d_shared_expert=1024, linear_v_heads=64)
# Tiny CPU Qwen3.5 pair (a student and an MoE teacher sharing a vocabulary).
_QWEN35_TINY = dict(
    family=QWEN3_5.name, vocab_size=512, n_heads=4, n_kv_heads=2, head_dim=16, rotary_fraction=0.25,
    max_seq_len=512, tie_embeddings=False, linear_k_heads=2, linear_v_heads=4,
    linear_k_head_dim=16, linear_v_head_dim=16, deltanet_chunk=32)
PRESETS["tiny-qwen"] = ModelConfig(d_model=64, n_layers=4, d_ff=192, **_QWEN35_TINY)
PRESETS["tiny-qwen-moe"] = ModelConfig(d_model=96, n_layers=4, d_ff=64, n_experts=8,
                                       experts_per_token=2, d_expert=64, d_shared_expert=96,
                                       **_QWEN35_TINY)

# The study's shapes: same layouts as Gemma 3 270M / 1B / 4B, ~32k vocabulary.
PAPER_VOCAB = 32768
PRESETS["paper-123m"] = dataclasses.replace(PRESETS["gemma3-270m"], vocab_size=PAPER_VOCAB)
PRESETS["paper-735m"] = dataclasses.replace(PRESETS["gemma3-1b"], vocab_size=PAPER_VOCAB)
PRESETS["paper-teacher-3.4b"] = dataclasses.replace(PRESETS["gemma3-4b"], vocab_size=PAPER_VOCAB)


def preset(name: str, **overrides) -> ModelConfig:
    if name not in PRESETS:
        raise ConfigError("model preset", f"unknown preset {name!r}",
                          f"choose one of {', '.join(sorted(PRESETS))}")
    return dataclasses.replace(PRESETS[name], **overrides)


def check_teacher_preset(name: str | None) -> None:
    """teacher.preset names a preset, even beside a checkpoint whose own config wins: a
    typo is refused when the run starts, not when the shape is first needed."""
    if name is not None and name not in PRESETS:
        raise ConfigError("teacher.preset", f"{name!r} is not a model preset",
                          f"one of {', '.join(sorted(PRESETS))}, or unset it")
