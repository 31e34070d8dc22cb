"""Named model shapes.

Real Gemma 3 shapes (`gemma3-*`), the paper's layouts with a configurable
vocabulary (`paper-*`, default 32768), and tiny CPU shapes. Presets are
`ModelConfig` values; override any field with `dataclasses.replace` or
`--set model.field=value`.
"""

from __future__ import annotations

import dataclasses

from hldstudy.config import ModelConfig
from hldstudy.errors import ConfigError

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
}

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
