"""Writes the Qwen3.5 parity fixtures: tiny random transformers models and their reference outputs.

Run with a Python that has torch and transformers >= 5.2 (never the project's venv):

    /work/venv-ref/bin/python scripts/make_qwen35_fixtures.py [--out tests/fixtures/qwen35]

For each of `dense` (`qwen3_5_text`, Qwen3_5ForCausalLM) and `moe` (`qwen3_5_moe_text`,
Qwen3_5MoeForCausalLM) it builds a tiny model from a config (no download), gives every
parameter a non-trivial random value (norm weights and the DeltaNet decay parameters too,
so the `1 + weight` and gate conventions are exercised), saves it with `save_pretrained`
(float32 safetensors) into OUT/<name>/ and writes OUT/<name>/reference.npz with, for two
token sequences of different lengths (neither a multiple of the DeltaNet chunk size):

    tokens_<j>  [1, T_j] int32
    logits_<j>  [1, T_j, V] float32
    hidden_<j>  [n_layers + 1, 1, T_j, D] float32: embeddings, then the residual stream
                after every decoder layer (before the final norm), hldstudy's numbering.

OUT/tokenizer.json is a small byte-level BPE tokenizer trained by `tokenizers` on a few
sentences (the tokenizer tests read it).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch
import transformers

SEQ_LENS = (37, 70)  # chunk sizes used in tests: 16 and 64; neither divides these
SEED = 1234

COMMON = dict(
    vocab_size=128, hidden_size=32, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, linear_conv_kernel_dim=4, linear_key_head_dim=8,
    linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4,
    max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=False,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
    layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
)
CONFIGS = {
    "dense": (transformers.Qwen3_5TextConfig, transformers.Qwen3_5ForCausalLM,
              dict(COMMON, intermediate_size=64)),
    "moe": (transformers.Qwen3_5MoeTextConfig, transformers.Qwen3_5MoeForCausalLM,
            dict(COMMON, moe_intermediate_size=16, shared_expert_intermediate_size=24,
                 num_experts=4, num_experts_per_tok=2)),
}

TOKENIZER_TEXT = [
    "The quick brown fox jumps over the lazy dog.",
    "Hidden-layer distillation aligns a student's hidden states with its teacher's.",
    "Gated DeltaNet layers keep a recurrent state; full attention layers see every token.",
    "A mixture of experts routes each token to a few of its experts.",
]


def _randomize(model: torch.nn.Module, gen: torch.Generator) -> None:
    """Every parameter random at a scale that keeps activations O(1) through 4 layers."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.empty_like(p).uniform_(-1.0, 1.0, generator=gen))
            elif name.endswith("dt_bias"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
            elif p.ndim == 1 or "norm" in name:
                # RMSNorm weights (1 + w, zero-centred) and the gated norm (w, one-centred).
                base = 1.0 if name.endswith("linear_attn.norm.weight") else 0.0
                p.copy_(base + 0.2 * torch.randn(p.shape, generator=gen))
            elif "embed_tokens" in name:
                p.copy_(torch.randn(p.shape, generator=gen))
            else:
                fan_in = p.shape[-1]
                p.copy_(torch.randn(p.shape, generator=gen) * fan_in ** -0.5)


def _reference(model, tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    layers = model.model.layers
    captured: list[torch.Tensor] = []
    hooks = [layer.register_forward_hook(lambda _m, _i, out: captured.append(
        (out[0] if isinstance(out, tuple) else out).detach().clone())) for layer in layers]
    embeds = model.model.embed_tokens(torch.tensor(tokens)).detach().clone()
    with torch.no_grad():
        logits = model(torch.tensor(tokens)).logits.float().numpy()
    for h in hooks:
        h.remove()
    hidden = np.stack([embeds.numpy()] + [c.float().numpy() for c in captured])
    return logits, hidden


def _tokenizer(out: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>", "<|im_start|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(TOKENIZER_TEXT, trainer)
    tok.save(str(out / "tokenizer.json"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(Path(__file__).resolve().parents[1]
                                             / "tests" / "fixtures" / "qwen35"))
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(SEED)
    gen = torch.Generator().manual_seed(SEED)
    rng = np.random.default_rng(SEED)
    for name, (config_cls, model_cls, kwargs) in CONFIGS.items():
        cfg = config_cls(**kwargs)
        model = model_cls(cfg).float().eval()
        _randomize(model, gen)
        model.save_pretrained(out / name, safe_serialization=True)
        arrays = {}
        for j, t in enumerate(SEQ_LENS):
            tokens = rng.integers(0, cfg.vocab_size, size=(1, t)).astype(np.int32)
            logits, hidden = _reference(model, tokens)
            arrays.update({f"tokens_{j}": tokens, f"logits_{j}": logits.astype(np.float32),
                           f"hidden_{j}": hidden.astype(np.float32)})
        np.savez_compressed(out / name / "reference.npz", **arrays)
        (out / name / "generated_by.json").write_text(json.dumps(
            {"script": "scripts/make_qwen35_fixtures.py", "torch": torch.__version__,
             "transformers": transformers.__version__, "seed": SEED}, indent=2) + "\n")
        print(f"{name}: {sum(p.numel() for p in model.parameters())} parameters -> {out / name}")
    _tokenizer(out)


if __name__ == "__main__":
    main()
