"""Real-checkpoint import: Gemma 3 from GGUF (llama.cpp) or Hugging Face safetensors, and
Qwen3.5 dense / MoE from Hugging Face safetensors (mapping: hldstudy.model.hf_qwen).

Design notes: `docs/model.md`, under this file's name.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import jax
import jax.numpy as jnp
import ml_dtypes  # noqa: F401 - registers bfloat16 with numpy (safetensors reads it by name)
import numpy as np
from flax import nnx
from gguf.quants import dequantize
from safetensors import SafetensorError
from safetensors.numpy import load_file, save_file

from hldstudy.config import ModelConfig
from hldstudy.data.tokenizer import JsonTokenizer, Tokenizer
from hldstudy.errors import ConfigError, InputError
from hldstudy.family import GEMMA3, QWEN3_5, family_of, family_of_hf, hf_model_types
from hldstudy.model import hf_qwen
from hldstudy.model.gguf_tokenizer import sp_proto_from_gguf, tokenizer_from_proto
from hldstudy.model.transformer import Transformer

__all__ = [
    "checkpoint_format",
    "export_hf",
    "gguf_model_config",
    "hf_model_config",
    "load_gguf",
    "load_hf",
    "load_pretrained",
]

_SHAPE_FIELDS = ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim",
                 "d_ff", "qk_norm", "family", "layer_types", "tie_embeddings", "linear_k_heads",
                 "linear_v_heads", "linear_k_head_dim", "linear_v_head_dim", "linear_conv_kernel",
                 "n_experts", "d_expert", "d_shared_expert")

# hldstudy block sub-tree <- HF layer prefix (norm weights, HF convention).
_BLOCK_NORMS = {
    "pre_attn_norm": "input_layernorm",
    "post_attn_norm": "post_attention_layernorm",
    "pre_mlp_norm": "pre_feedforward_layernorm",
    "post_mlp_norm": "post_feedforward_layernorm",
}

# GGUF (llama.cpp) tensor name -> HF name.  `{i}` is the layer index.
_GGUF_TO_HF = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "blk.{i}.attn_q.weight": "model.layers.{i}.self_attn.q_proj.weight",
    "blk.{i}.attn_k.weight": "model.layers.{i}.self_attn.k_proj.weight",
    "blk.{i}.attn_v.weight": "model.layers.{i}.self_attn.v_proj.weight",
    "blk.{i}.attn_output.weight": "model.layers.{i}.self_attn.o_proj.weight",
    "blk.{i}.attn_q_norm.weight": "model.layers.{i}.self_attn.q_norm.weight",
    "blk.{i}.attn_k_norm.weight": "model.layers.{i}.self_attn.k_norm.weight",
    "blk.{i}.attn_norm.weight": "model.layers.{i}.input_layernorm.weight",
    "blk.{i}.post_attention_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    "blk.{i}.ffn_norm.weight": "model.layers.{i}.pre_feedforward_layernorm.weight",
    "blk.{i}.post_ffw_norm.weight": "model.layers.{i}.post_feedforward_layernorm.weight",
    "blk.{i}.ffn_gate.weight": "model.layers.{i}.mlp.gate_proj.weight",
    "blk.{i}.ffn_up.weight": "model.layers.{i}.mlp.up_proj.weight",
    "blk.{i}.ffn_down.weight": "model.layers.{i}.mlp.down_proj.weight",
}
_GGUF_PATTERNS = [
    (re.compile("^" + re.escape(k).replace(r"\{i\}", r"(\d+)") + "$"), v)
    for k, v in _GGUF_TO_HF.items()
]


# --------------------------------------------------------------------------------------
# Canonical (HF-named numpy) weights <-> hldstudy parameter tree
# --------------------------------------------------------------------------------------


def _expected_hf_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    d, n, k, h, f = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.d_ff
    shapes = {"model.embed_tokens.weight": (cfg.vocab_size, d), "model.norm.weight": (d,)}
    for i in range(cfg.n_layers):
        p = f"model.layers.{i}."
        shapes.update({
            p + "self_attn.q_proj.weight": (n * h, d),
            p + "self_attn.k_proj.weight": (k * h, d),
            p + "self_attn.v_proj.weight": (k * h, d),
            p + "self_attn.o_proj.weight": (d, n * h),
            p + "mlp.gate_proj.weight": (f, d),
            p + "mlp.up_proj.weight": (f, d),
            p + "mlp.down_proj.weight": (d, f),
        })
        if cfg.qk_norm:
            shapes[p + "self_attn.q_norm.weight"] = (h,)
            shapes[p + "self_attn.k_norm.weight"] = (h,)
        for hf in _BLOCK_NORMS.values():
            shapes[p + hf + ".weight"] = (d,)
    return shapes


def _hf_to_pure(cfg: ModelConfig, get, source: str) -> dict:
    """Builds the hldstudy pure param dict from HF-named `[out, in]` arrays.

    `get(name)` returns a float numpy array or None when the tensor is absent.
    """
    d, n, k, h = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    pdt = np.dtype(jnp.dtype(cfg.param_dtype))
    fetch = hf_qwen.checked_reader(get, _expected_hf_shapes(cfg), source,
                                   "checkpoint incomplete or not a Gemma 3 text model")

    def cast(x: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(x).astype(pdt, copy=False)

    blocks = {}
    for i in range(cfg.n_layers):
        p = f"model.layers.{i}."
        attn = {
            "q": cast(fetch(p + "self_attn.q_proj.weight").T.reshape(d, n, h)),
            "k": cast(fetch(p + "self_attn.k_proj.weight").T.reshape(d, k, h)),
            "v": cast(fetch(p + "self_attn.v_proj.weight").T.reshape(d, k, h)),
            "o": cast(fetch(p + "self_attn.o_proj.weight").T.reshape(n, h, d)),
        }
        if cfg.qk_norm:
            attn["q_norm"] = {"scale": cast(fetch(p + "self_attn.q_norm.weight"))}
            attn["k_norm"] = {"scale": cast(fetch(p + "self_attn.k_norm.weight"))}
        block = {
            "attn": attn,
            "mlp": {
                "gate": cast(fetch(p + "mlp.gate_proj.weight").T),
                "up": cast(fetch(p + "mlp.up_proj.weight").T),
                "down": cast(fetch(p + "mlp.down_proj.weight").T),
            },
        }
        for ours, hf in _BLOCK_NORMS.items():
            block[ours] = {"scale": cast(fetch(p + hf + ".weight"))}
        blocks[i] = block
    embedding = fetch("model.embed_tokens.weight")
    head = get("lm_head.weight")
    if head is not None and not np.array_equal(np.asarray(head, np.float32), embedding):
        raise InputError(f"{source}: has an untied LM head (lm_head / output.weight differs from "
                         f"the token embedding); hldstudy models tie the head")
    return {"embedding": cast(embedding), "blocks": blocks,
            "final_norm": {"scale": cast(fetch("model.norm.weight"))}}


def _pure_to_hf(model) -> dict[str, np.ndarray]:
    """hldstudy model -> HF-named float arrays (`[out, in]`, HF norm convention)."""
    cfg: ModelConfig = model.cfg
    pure = nnx.state(model, nnx.Param).to_pure_dict()
    d, n, k, h = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    out = {"model.embed_tokens.weight": np.asarray(pure["embedding"])}
    for i in range(cfg.n_layers):
        b, p = pure["blocks"][i], f"model.layers.{i}."
        a = b["attn"]
        out[p + "self_attn.q_proj.weight"] = np.asarray(a["q"]).reshape(d, n * h).T
        out[p + "self_attn.k_proj.weight"] = np.asarray(a["k"]).reshape(d, k * h).T
        out[p + "self_attn.v_proj.weight"] = np.asarray(a["v"]).reshape(d, k * h).T
        out[p + "self_attn.o_proj.weight"] = np.asarray(a["o"]).reshape(n * h, d).T
        out[p + "self_attn.q_norm.weight"] = np.asarray(a["q_norm"]["scale"])
        out[p + "self_attn.k_norm.weight"] = np.asarray(a["k_norm"]["scale"])
        out[p + "mlp.gate_proj.weight"] = np.asarray(b["mlp"]["gate"]).T
        out[p + "mlp.up_proj.weight"] = np.asarray(b["mlp"]["up"]).T
        out[p + "mlp.down_proj.weight"] = np.asarray(b["mlp"]["down"]).T
        for ours, hf in _BLOCK_NORMS.items():
            out[p + hf + ".weight"] = np.asarray(b[ours]["scale"])
    out["model.norm.weight"] = np.asarray(pure["final_norm"]["scale"])
    return {name: np.ascontiguousarray(x) for name, x in out.items()}


def _abstract_model(cfg: ModelConfig):
    return nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))


def _to_state(cfg: ModelConfig, pure: dict) -> nnx.State:
    """The `nnx.split(model, nnx.Param)` state of a Transformer(cfg) holding `pure`."""
    _, state = nnx.split(_abstract_model(cfg), nnx.Param)
    expected = jax.tree_util.tree_map(lambda x: (tuple(x.shape), x.dtype), state.to_pure_dict())
    got = jax.tree_util.tree_map(lambda x: (tuple(x.shape), x.dtype), pure)
    if expected != got:  # a bug here, not a user error: mapping and model disagree
        raise AssertionError(f"importer produced a parameter tree that does not match "
                             f"Transformer({cfg})")
    nnx.replace_by_pure_dict(state, jax.tree_util.tree_map(jnp.asarray, pure))
    return state


def _apply_overrides(cfg: ModelConfig, overrides: dict[str, Any], source: str) -> ModelConfig:
    if not overrides:
        return cfg
    bad = [k for k in overrides if k in _SHAPE_FIELDS]
    if bad:
        raise InputError(f"{source}: cannot override shape field(s) {bad} of a checkpoint")
    unknown = [k for k in overrides if k not in {f.name for f in dataclasses.fields(ModelConfig)}]
    if unknown:
        raise InputError(f"{source}: unknown ModelConfig field(s) {unknown}")
    return dataclasses.replace(cfg, **overrides)


def _global_every_from_flags(is_global: list[bool], source: str) -> int:
    """Turns per-layer global flags into ModelConfig's `global_every` (1 = all global)."""
    if all(is_global):
        return 1
    if not any(is_global):
        raise InputError(f"{source}: every layer is sliding-window; hldstudy needs at least one "
                         f"global layer per `global_every` period")
    every = is_global.index(True) + 1
    want = [(i + 1) % every == 0 for i in range(len(is_global))]
    if want != is_global:
        raise InputError(f"{source}: local/global layer pattern {is_global} is not "
                         f"'every {every}th layer global'; hldstudy cannot represent it")
    return every


# --------------------------------------------------------------------------------------
# GGUF
# --------------------------------------------------------------------------------------


def _gguf_reader(path: Path):
    if not path.is_file():
        raise InputError(f"{path}: GGUF file not found")
    try:
        return gguf.GGUFReader(str(path), "r")
    except Exception as e:  # noqa: BLE001 - gguf raises ValueError/struct errors on junk
        raise InputError(f"{path}: not a readable GGUF file ({e})") from None


def _field(reader, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    if f is None:
        return default
    val = f.contents()
    if isinstance(val, float):  # GGUF floats are float32: undo the float32 noise
        val = float(f"{val:.7g}")
    return val


def _uniform(val: Any, key: str, source: str) -> Any:
    if isinstance(val, list):
        if not val or any(v != val[0] for v in val):
            raise InputError(f"{source}: per-layer {key} {val} is not uniform; unsupported")
        return val[0]
    return val


def _gguf_config(reader, source: str) -> ModelConfig:
    arch = _field(reader, "general.architecture")
    if arch not in GEMMA3.gguf_architectures:
        raise InputError(f"{source}: architecture {arch!r} is not supported (only "
                         f"{', '.join(map(repr, GEMMA3.gguf_architectures))})")

    def req(key: str) -> Any:
        val = _field(reader, f"{arch}.{key}")
        if val is None:
            raise InputError(f"{source}: metadata key {arch}.{key} is missing")
        return _uniform(val, key, source)

    def opt(key: str, default: Any = None) -> Any:
        val = _field(reader, f"{arch}.{key}")
        return default if val is None else _uniform(val, key, source)

    d_model, n_layers, n_heads = req("embedding_length"), req("block_count"), \
        req("attention.head_count")
    head_dim = opt("attention.key_length", d_model // n_heads)
    if opt("attention.value_length", head_dim) != head_dim:
        raise InputError(f"{source}: key_length != value_length is unsupported")
    scaling = opt("rope.scaling.type")
    if scaling not in (None, "none") and opt("rope.scaling.factor", 1.0) != 1.0:
        raise InputError(f"{source}: rope scaling {scaling!r} x{opt('rope.scaling.factor')} is not "
                         f"supported by hldstudy's RoPE")
    embd = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    if embd is None:
        raise InputError(f"{source}: missing tensor 'token_embd.weight'")
    vocab = int(embd.shape[-1])  # GGUF shapes are reversed: [D, V]

    window = opt("attention.sliding_window")
    pattern = _field(reader, f"{arch}.attention.sliding_window_pattern")
    if window is None:
        global_every = 1
    elif pattern is None:
        global_every = 6  # llama.cpp: gemma3 hardcodes set_swa_pattern(6)
    elif isinstance(pattern, list):  # per-layer "is sliding" flags
        global_every = _global_every_from_flags([not bool(v) for v in pattern], source)
    else:
        global_every = int(pattern)
    # llama.cpp: the 27B model scales queries by (d_model / n_heads)^-1/2, others by head_dim^-1/2.
    scale = opt("attention.scale")
    if scale is not None:
        qpas = 1.0 / float(scale) ** 2
    elif n_layers == 62 and d_model == 5376:
        qpas = float(d_model // n_heads)
    else:
        qpas = float(head_dim)
    return ModelConfig(
        vocab_size=vocab, d_model=d_model, n_layers=n_layers, n_heads=n_heads,
        n_kv_heads=opt("attention.head_count_kv", n_heads), head_dim=head_dim,
        d_ff=req("feed_forward_length"), max_seq_len=opt("context_length", 8192),
        rope_base_global=float(opt("rope.freq_base", 1_000_000.0)),
        rope_base_local=float(opt("rope.freq_base_swa", 10_000.0)),
        sliding_window=window, global_every=global_every if window is not None else 1,
        qk_norm=True, attn_softcap=opt("attn_logit_softcapping"),
        final_softcap=opt("final_logit_softcapping"), query_pre_attn_scalar=qpas,
        norm_eps=float(opt("attention.layer_norm_rms_epsilon", 1e-6)),
    )


def _gguf_hf_weights(reader, source: str) -> Callable[[str], np.ndarray | None]:
    """GGUF tensors renamed to HF names, lazily dequantized, norms un-folded (-1)."""
    tensors = {}
    for t in reader.tensors:
        for pat, hf in _GGUF_PATTERNS:
            m = pat.match(t.name)
            if m:
                tensors[hf.replace("{i}", m.group(1)) if m.groups() else hf] = t
                break
        else:
            raise InputError(f"{source}: unexpected tensor {t.name!r}; not a Gemma 3 text model?")

    def get(name: str):
        t = tensors.get(name)
        if t is None:
            return None
        shape = tuple(int(s) for s in reversed(t.shape))
        arr = np.asarray(dequantize(t.data, t.tensor_type), np.float32).reshape(shape)
        if name.endswith("norm.weight"):
            arr = arr - 1.0  # llama.cpp folds Gemma's (1 + w) into the stored weight
        return arr

    return get


def load_gguf(path: str | Path, **overrides) -> tuple[ModelConfig, nnx.State, Any]:
    """Reads a gemma3 GGUF file: (config, `nnx.split(model, nnx.Param)` state, tokenizer).

    Quantized tensors are dequantized to float32 (then cast to `param_dtype`).
    The tokenizer (hldstudy `Tokenizer`) is rebuilt from the file's metadata
    (see `hldstudy.model.gguf_tokenizer`); None when the file has no tokenizer.
    """
    path = Path(path)
    reader = _gguf_reader(path)
    cfg = _apply_overrides(_gguf_config(reader, str(path)), overrides, str(path))
    state = _to_state(cfg, _hf_to_pure(cfg, _gguf_hf_weights(reader, str(path)), str(path)))
    tokenizer = None
    if "tokenizer.ggml.model" in reader.fields:
        tokenizer = tokenizer_from_proto(sp_proto_from_gguf(reader, str(path)))
    return cfg, state, tokenizer


# --------------------------------------------------------------------------------------
# Hugging Face directories
# --------------------------------------------------------------------------------------

def _read_safetensors(path: Path) -> dict[str, np.ndarray]:
    try:
        return load_file(path)
    except (OSError, SafetensorError) as e:
        raise InputError(f"{path}: not a readable safetensors file ({e})") from None
    except (TypeError, AttributeError) as e:  # a dtype numpy does not know (e.g. float8)
        raise InputError(f"{path}: unsupported tensor dtype ({e})") from None


# Prefixes under which Gemma 3 text weights appear (CausalLM, multimodal checkpoints).
_HF_PREFIXES = ("model.language_model.", "language_model.model.", "model.")


log = logging.getLogger("hldstudy.model")


def _hf_config(raw: dict, source: str) -> ModelConfig:
    fam = family_of_hf(raw.get("model_type"))
    if fam is None:
        raise InputError(f"{source}: model_type {raw.get('model_type')!r} is not supported "
                         f"(supported: {', '.join(hf_model_types())})")
    return _HF_CONFIG[fam](raw, source)


def _gemma_hf_config(raw: dict, source: str) -> ModelConfig:
    if raw.get("model_type") in GEMMA3.hf_multimodal and "text_config" in raw:
        raw = raw["text_config"]  # multimodal Gemma 3: only the text decoder is used
    mtype = raw.get("model_type")
    if mtype not in GEMMA3.hf_model_types:
        raise InputError(f"{source}: model_type {mtype!r} is not a Gemma 3 text model "
                         f"({', '.join(GEMMA3.hf_model_types)})")
    act = raw.get("hidden_activation") or raw.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise InputError(f"{source}: hidden_activation {act!r} unsupported (gelu_pytorch_tanh)")
    if not raw.get("tie_word_embeddings", True):
        raise InputError(f"{source}: tie_word_embeddings=false is unsupported")
    if raw.get("use_bidirectional_attention"):
        raise InputError(f"{source}: use_bidirectional_attention=true is unsupported")
    if raw.get("attention_bias"):
        raise InputError(f"{source}: attention_bias=true is unsupported")
    try:
        d, n_layers, n_heads = raw["hidden_size"], raw["num_hidden_layers"], \
            raw["num_attention_heads"]
        vocab, d_ff = raw["vocab_size"], raw["intermediate_size"]
    except KeyError as e:
        raise InputError(f"{source}: config.json lacks {e.args[0]!r}") from None

    # RoPE: transformers >= 5 writes rope_parameters per layer type, older versions
    # rope_theta / rope_local_base_freq / rope_scaling.
    rp = raw.get("rope_parameters") or {}
    full = rp.get("full_attention", rp if "rope_theta" in rp else {})
    slide = rp.get("sliding_attention", {})
    theta_g = full.get("rope_theta", raw.get("rope_theta", 1_000_000.0))
    theta_l = slide.get("rope_theta", raw.get("rope_local_base_freq", 10_000.0))
    for spec in (full, slide, raw.get("rope_scaling") or {}):
        rtype = spec.get("rope_type", spec.get("type", "default"))
        if rtype != "default" and not (rtype == "linear" and spec.get("factor", 1.0) == 1.0):
            raise InputError(f"{source}: rope scaling {spec} is not supported by hldstudy's RoPE")

    layer_types = raw.get("layer_types")
    if layer_types is None:
        every = int(raw.get("sliding_window_pattern", 6))
        layer_types = ["full_attention" if (i + 1) % every == 0 else "sliding_attention"
                       for i in range(n_layers)]
    if len(layer_types) != n_layers or set(layer_types) - {"full_attention", "sliding_attention"}:
        raise InputError(f"{source}: layer_types {layer_types} do not describe {n_layers} layers")
    global_every = _global_every_from_flags([t == "full_attention" for t in layer_types], source)
    window = raw.get("sliding_window") if global_every > 1 else None
    return ModelConfig(
        vocab_size=vocab, d_model=d, n_layers=n_layers, n_heads=n_heads,
        n_kv_heads=raw.get("num_key_value_heads", n_heads),
        head_dim=raw.get("head_dim") or d // n_heads, d_ff=d_ff,
        max_seq_len=raw.get("max_position_embeddings", 8192),
        rope_base_global=float(theta_g), rope_base_local=float(theta_l),
        sliding_window=window, global_every=global_every, qk_norm=True,
        # transformers' Gemma 3 reads attn_logit_softcapping but never applies it (Gemma 3
        # has no attention soft-cap; Gemma 2 had); do the same.
        attn_softcap=None, final_softcap=raw.get("final_logit_softcapping"),
        query_pre_attn_scalar=float(raw.get("query_pre_attn_scalar", 256)),
        norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
    )


def _hf_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [path / f for f in sorted(set(weight_map.values()))]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        if list(path.glob("*.bin")) or list(path.glob("*.pth")):
            raise InputError(f"{path}: only PyTorch .bin/.pth weights found; convert them to "
                             f"safetensors first")
        raise InputError(f"{path}: no *.safetensors weights found")
    return files


def load_hf(path: str | Path, **overrides) -> tuple[ModelConfig, nnx.State, Any]:
    """Reads a Hugging Face Gemma 3 or Qwen3.5 directory (config.json + *.safetensors,
    one file or an index of shards; float32 or bfloat16).

    Returns (config, `nnx.split(model, nnx.Param)` state, tokenizer or None); the
    tokenizer comes from `tokenizer.model` (SentencePiece) or `tokenizer.json`
    (`JsonTokenizer`) when the directory has one.
    """
    path = Path(path)
    raw = _read_hf_config(path)
    cfg = _apply_overrides(_hf_config(raw, str(path / "config.json")), overrides, str(path))

    tensors: dict[str, np.ndarray] = {}
    for f in _hf_files(path):
        for name, arr in _read_safetensors(f).items():
            if name == "language_model.lm_head.weight":  # older multimodal checkpoints
                name = "lm_head.weight"
            for prefix in _HF_PREFIXES:
                if name.startswith(prefix):
                    name = "model." + name[len(prefix):]
                    break
            tensors[name] = arr
    state = _HF_STATE[family_of(cfg)](cfg, tensors, path)
    return cfg, state, _hf_tokenizer(path)


def _hf_tokenizer(path: Path):
    """tokenizer.model (SentencePiece) or tokenizer.json (Hugging Face tokenizers), or None."""
    if (path / "tokenizer.model").is_file():
        return Tokenizer.load(path / "tokenizer.model")
    if (path / "tokenizer.json").is_file():
        return JsonTokenizer.load(path / "tokenizer.json")
    return None


def _qwen_state(cfg: ModelConfig, tensors: dict[str, np.ndarray], path: Path) -> nnx.State:
    mtp = sorted(k for k in tensors if k.startswith("mtp."))
    if mtp:
        log.warning("%s: skipping %d multi-token-prediction tensors (mtp.*): hldstudy runs the "
                    "next-token head only", path, len(mtp))
    tensors = {k: v for k, v in tensors.items() if not hf_qwen.skipped(k)}
    fused = any(k.endswith("mlp.experts.gate_up_proj") for k in tensors)
    extra = sorted(set(tensors) - set(hf_qwen.expected_shapes(cfg, fused)))
    if extra:
        raise InputError(f"{path}: unexpected tensor {extra[0]!r} ({len(extra)} in all) for the "
                         f"{cfg.n_layers}-layer Qwen3.5 model its config.json describes")
    pdt = np.dtype(jnp.dtype(cfg.param_dtype))
    pure = hf_qwen.hf_to_pure(cfg, tensors.get, str(path), fused)
    return _to_state(cfg, jax.tree_util.tree_map(
        lambda x: np.ascontiguousarray(x).astype(pdt, copy=False), pure))


def _gemma_state(cfg: ModelConfig, tensors: dict[str, np.ndarray], path: Path) -> nnx.State:
    known = set(_expected_hf_shapes(cfg)) | {"lm_head.weight"}
    extra = sorted(k for k in tensors if k not in known and not k.endswith("rotary_emb.inv_freq")
                   and "vision_tower" not in k and "multi_modal_projector" not in k)
    if extra:
        raise InputError(f"{path}: unexpected tensors {extra[:5]} for a {cfg.n_layers}-layer "
                         f"Gemma 3 text model")
    return _to_state(cfg, _hf_to_pure(cfg, tensors.get, str(path)))


def _int_if_integral(x: float) -> int | float:
    return int(x) if float(x).is_integer() else float(x)


def export_hf(model, path: str | Path, *, tokenizer=None, dtype: str = "float32") -> Path:
    """Writes `model` as a Hugging Face `Gemma3ForCausalLM` directory.

    config.json is readable by transformers 4.5x (rope_theta / rope_local_base_freq)
    and 5.x (which converts those keys). `tokenizer`: a SentencePiece processor or
    anything with `serialized_model_proto()` / `.sp`; written as tokenizer.model.
    """
    cfg: ModelConfig = model.cfg
    other_family = _HF_EXPORT.get(family_of(cfg))  # Gemma 3 is written below
    if other_family is not None:
        return other_family(model, Path(path), tokenizer=tokenizer, dtype=dtype)
    if not cfg.qk_norm:
        raise ConfigError("model.qk_norm", "Gemma 3 (HF) always has QK-norm",
                          "export a model with qk_norm=true")
    if cfg.attn_softcap is not None:
        raise ConfigError("model.attn_softcap", "transformers' Gemma 3 ignores attention "
                          "soft-capping, the exported model would differ", "set it to null")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    layer_types = ["full_attention" if cfg.is_global_layer(i) else "sliding_attention"
                   for i in range(cfg.n_layers)]
    config = {
        "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model,
        "intermediate_size": cfg.d_ff, "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim, "hidden_activation": "gelu_pytorch_tanh",
        "max_position_embeddings": cfg.max_seq_len, "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_base_global, "rope_local_base_freq": cfg.rope_base_local,
        "rope_scaling": None, "sliding_window": cfg.sliding_window or cfg.max_seq_len,
        "sliding_window_pattern": cfg.global_every if cfg.sliding_window else 1,
        "layer_types": layer_types,
        # transformers 5 validates this field as int.
        "query_pre_attn_scalar": _int_if_integral(cfg.query_pre_attn_scalar or cfg.head_dim),
        "attn_logit_softcapping": None,
        "final_logit_softcapping": cfg.final_softcap,
        "attention_bias": False, "attention_dropout": 0.0, "tie_word_embeddings": True,
        "use_bidirectional_attention": False, "initializer_range": 0.02,
        "pad_token_id": 0, "eos_token_id": 1, "bos_token_id": 2,
        "torch_dtype": dtype, "dtype": dtype,
    }
    if tokenizer is not None:
        sp = getattr(tokenizer, "sp", tokenizer)
        for key, fn in (("pad_token_id", "pad_id"), ("eos_token_id", "eos_id"),
                        ("bos_token_id", "bos_id")):
            if hasattr(sp, fn) and getattr(sp, fn)() >= 0:
                config[key] = int(getattr(sp, fn)())
        proto = (tokenizer.serialized_model_proto() if hasattr(tokenizer, "serialized_model_proto")
                 else sp.serialized_model_proto())
        (path / "tokenizer.model").write_bytes(proto)
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    np_dtype = np.dtype(jnp.dtype(dtype))
    weights = {k: v.astype(np_dtype) for k, v in _pure_to_hf(model).items()}
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    return path


def _export_qwen(model, path: Path, *, tokenizer, dtype: str) -> Path:
    """A Qwen3.5 model as `Qwen3_5ForCausalLM` / `Qwen3_5MoeForCausalLM` (per-expert
    tensors, as transformers saves them); a JsonTokenizer is written as tokenizer.json."""
    cfg: ModelConfig = model.cfg
    path.mkdir(parents=True, exist_ok=True)
    config = hf_qwen.export_config(cfg, dtype)
    if tokenizer is not None:
        if not isinstance(tokenizer, JsonTokenizer):
            raise ConfigError("tokenizer", "a Qwen3.5 export writes tokenizer.json; this "
                              "tokenizer is SentencePiece", "export without a tokenizer")
        (path / "tokenizer.json").write_bytes(tokenizer.serialized())
        for key, tid in (("eos_token_id", tokenizer.eos_id), ("bos_token_id", tokenizer.bos_id)):
            if tid >= 0:
                config[key] = tid
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    np_dtype = np.dtype(jnp.dtype(dtype))
    pure = nnx.state(model, nnx.Param).to_pure_dict()
    weights = {k: v.astype(np_dtype) for k, v in hf_qwen.pure_to_hf(cfg, pure).items()}
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    return path


# --------------------------------------------------------------------------------------
# Dispatch
# --------------------------------------------------------------------------------------


def _is_gguf(path: Path) -> bool:
    try:
        with path.open("rb") as fh:
            return fh.read(4) == b"GGUF"
    except OSError:
        return False


def checkpoint_format(path: str | Path) -> str:
    """"gguf" (a GGUF file) or "hf" (a Hugging Face directory, or its config.json or
    *.safetensors file); InputError for anything else."""
    path = Path(path)
    if not path.exists():
        raise InputError(f"{path}: checkpoint not found (expected a .gguf file or a Hugging "
                         f"Face directory)")
    if path.is_file() and (path.suffix == ".gguf" or _is_gguf(path)):
        return "gguf"
    if path.is_dir() or path.name == "config.json" or path.suffix == ".safetensors":
        return "hf"
    raise InputError(f"{path}: neither a GGUF file nor a Hugging Face checkpoint directory")


def _hf_dir(path: Path) -> Path:
    return path if path.is_dir() else path.parent


def _read_hf_config(path: Path) -> dict:
    if not path.is_dir():
        raise InputError(f"{path}: Hugging Face checkpoint directory not found")
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise InputError(f"{path}: no config.json (not a Hugging Face checkpoint directory)")
    try:
        return json.loads(cfg_file.read_text())
    except ValueError as e:
        raise InputError(f"{cfg_file}: invalid JSON ({e})") from None


def hf_model_config(path: str | Path) -> ModelConfig:
    """The ModelConfig of a Hugging Face Gemma 3 directory (or its config.json), weights unread."""
    path = _hf_dir(Path(path))
    return _hf_config(_read_hf_config(path), str(path / "config.json"))


def gguf_model_config(path: str | Path) -> ModelConfig:
    """The ModelConfig of a gemma3 GGUF file, from its header (tensors are not read)."""
    path = Path(path)
    return _gguf_config(_gguf_reader(path), str(path))


def load_pretrained(path: str | Path, **overrides):
    """(Transformer, tokenizer | None) from a GGUF file or a Hugging Face directory.

    A path to a directory's config.json or *.safetensors file means that directory.
    """
    path = Path(path)
    if checkpoint_format(path) == "gguf":
        cfg, state, tok = load_gguf(path, **overrides)
    else:
        cfg, state, tok = load_hf(_hf_dir(path), **overrides)
    graphdef, _ = nnx.split(_abstract_model(cfg), nnx.Param)
    return nnx.merge(graphdef, state), tok


# Each family's Hugging Face config reader and state reader; the exporters of the families
# other than Gemma 3 (`export_hf` writes Gemma 3 itself).
_HF_CONFIG = {GEMMA3: _gemma_hf_config, QWEN3_5: hf_qwen.qwen_config}
_HF_STATE = {GEMMA3: _gemma_state, QWEN3_5: _qwen_state}
_HF_EXPORT = {QWEN3_5: _export_qwen}
