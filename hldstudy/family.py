"""Model families as data: what differs between a Gemma 3 and a Qwen3.5 decoder, said once.

Everything that branches on the family (config validation, shapes, FLOP and planner
terms, the model's blocks, checkpoint import and export) asks the `Family` here, never
its name. A Qwen3.5 MoE is a Qwen3.5 with `n_experts > 0`, not a family of its own.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, eq=False)  # one object per family: compared and hashed by identity
class Family:
    name: str                             # ModelConfig.family, as stored in configs
    title: str                            # as people write it
    layer_types: tuple[str, ...]          # the block kinds it builds
    default_layer_types: tuple[str, ...]  # its pattern, repeated over n_layers
    embeds_scaled: bool                   # token embedding * sqrt(d_model)
    blocks_return_aux: bool               # blocks return (x, load-balancing loss)
    gated_attention: bool                 # full attention has an output gate (q_gate)
    norms_per_block: int                  # RMSNorms of d_model per block (pre+post: 4)
    always_qk_norm: bool                  # QK-norm whatever model.qk_norm says
    head_always_tied: bool                # the head is the embedding (no tie_embeddings)
    windowed: bool                        # local/global sliding windows
    optional_fields: tuple[str, ...]      # ModelConfig fields only this family may set
    hf_model_types: tuple[str, ...]       # Hugging Face config model_type of its text model
    hf_multimodal: dict                   # a multimodal wrapper's model_type -> the text one's
    gguf_architectures: tuple[str, ...]   # GGUF general.architecture values it imports

    @property
    def has_linear_attention(self) -> bool:
        return "linear_attention" in self.layer_types


GEMMA3 = Family(
    name="gemma3", title="Gemma 3", layer_types=("attention",),
    default_layer_types=("attention",), embeds_scaled=True, blocks_return_aux=False,
    gated_attention=False, norms_per_block=4, always_qk_norm=False, head_always_tied=True,
    windowed=True, optional_fields=(), hf_model_types=("gemma3_text", "gemma3"),
    hf_multimodal={"gemma3": "gemma3_text"}, gguf_architectures=("gemma3",))

QWEN3_5 = Family(
    name="qwen3_5", title="Qwen3.5", layer_types=("full_attention", "linear_attention"),
    default_layer_types=("linear_attention",) * 3 + ("full_attention",), embeds_scaled=False,
    blocks_return_aux=True, gated_attention=True, norms_per_block=2, always_qk_norm=True,
    head_always_tied=False, windowed=False,
    optional_fields=("n_experts", "linear_k_heads"),
    hf_model_types=("qwen3_5_text", "qwen3_5_moe_text"),
    hf_multimodal={"qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text"},
    gguf_architectures=())

FAMILIES: dict[str, Family] = {f.name: f for f in (GEMMA3, QWEN3_5)}


def family_of(model) -> Family:
    """The family of a ModelConfig (or anything with a `family` name)."""
    return FAMILIES[model.family]


def family_of_hf(model_type: str | None) -> Family | None:
    """The family whose text model (or multimodal wrapper) has this HF model_type."""
    for fam in FAMILIES.values():
        if model_type in fam.hf_model_types or model_type in fam.hf_multimodal:
            return fam
    return None


def hf_model_types() -> list[str]:
    """Every HF model_type some family imports (for messages)."""
    return [t for fam in FAMILIES.values() for t in (*fam.hf_model_types, *fam.hf_multimodal)]
