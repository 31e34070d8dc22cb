"""Qwen3.5 (dense and MoE) <-> Hugging Face safetensors: config and tensor mapping.

Design notes: `docs/model.md`, under this file's name.
"""

from __future__ import annotations

import numpy as np

from hldstudy.config import ModelConfig
from hldstudy.errors import InputError
from hldstudy.family import QWEN3_5

__all__ = ["MODEL_TYPES", "export_config", "expected_shapes", "hf_to_pure",
           "pure_to_hf", "qwen_config", "skipped"]

MODEL_TYPES = QWEN3_5.hf_model_types
_MULTIMODAL = QWEN3_5.hf_multimodal


def skipped(name: str) -> bool:
    """Tensors a Qwen3.5 checkpoint may carry that hldstudy does not use."""
    return name.startswith(("mtp.", "model.visual.", "visual.")) or "rotary_emb" in name


def _period(types: list[str]) -> list[str]:
    """The shortest prefix whose cyclic repetition is `types` (the config's layer_types)."""
    for p in range(1, len(types) + 1):
        if all(types[i] == types[i % p] for i in range(len(types))):
            return types[:p]
    return types


def qwen_config(raw: dict, source: str) -> ModelConfig:
    if raw.get("model_type") in _MULTIMODAL:
        raw = raw.get("text_config") or {}
    mtype = raw.get("model_type")
    if mtype not in MODEL_TYPES:
        raise InputError(f"{source}: model_type {mtype!r} is not a Qwen3.5 text model "
                         f"({', '.join(MODEL_TYPES)})")
    if raw.get("hidden_act", "silu") != "silu":
        raise InputError(f"{source}: hidden_act {raw['hidden_act']!r} unsupported (silu)")
    if raw.get("attention_bias"):
        raise InputError(f"{source}: attention_bias=true is unsupported")
    try:
        d, n_layers = raw["hidden_size"], raw["num_hidden_layers"]
        n_heads, vocab = raw["num_attention_heads"], raw["vocab_size"]
    except KeyError as e:
        raise InputError(f"{source}: config.json lacks {e.args[0]!r}") from None
    rp = raw.get("rope_parameters") or {}
    rtype = rp.get("rope_type", "default")
    if rtype != "default":
        raise InputError(f"{source}: rope_parameters.rope_type {rtype!r} is not supported "
                         "(default only)")
    types = raw.get("layer_types") or [
        "linear_attention" if (i + 1) % raw.get("full_attention_interval", 4) else
        "full_attention" for i in range(n_layers)]
    if len(types) != n_layers:
        raise InputError(f"{source}: layer_types has {len(types)} entries for "
                         f"num_hidden_layers={n_layers}")
    for i, t in enumerate(types):
        if t not in QWEN3_5.layer_types:
            raise InputError(f"{source}: layer_types[{i}] = {t!r} is not a Qwen3.5 layer type "
                             f"({', '.join(QWEN3_5.layer_types)})")
    moe = mtype == "qwen3_5_moe_text"
    d_expert = raw.get("moe_intermediate_size", 0) if moe else 0
    return ModelConfig(
        family=QWEN3_5.name, layer_types=",".join(_period(list(types))),
        vocab_size=vocab, d_model=d, n_layers=n_layers, n_heads=n_heads,
        n_kv_heads=raw.get("num_key_value_heads", n_heads),
        head_dim=raw.get("head_dim") or d // n_heads,
        d_ff=raw.get("intermediate_size") or d_expert,
        max_seq_len=raw.get("max_position_embeddings", 32768),
        rope_base_global=float(rp.get("rope_theta", raw.get("rope_theta", 10_000_000.0))),
        rotary_fraction=float(rp.get("partial_rotary_factor",
                                     raw.get("partial_rotary_factor", 0.25))),
        qk_norm=True, query_pre_attn_scalar=None, norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(raw.get("tie_word_embeddings", False)),
        linear_k_heads=raw.get("linear_num_key_heads", 16),
        linear_v_heads=raw.get("linear_num_value_heads", 32),
        linear_k_head_dim=raw.get("linear_key_head_dim", 128),
        linear_v_head_dim=raw.get("linear_value_head_dim", 128),
        linear_conv_kernel=raw.get("linear_conv_kernel_dim", 4),
        n_experts=raw.get("num_experts", 0) if moe else 0,
        experts_per_token=raw.get("num_experts_per_tok", 0) if moe else 0,
        d_expert=d_expert, d_shared_expert=raw.get("shared_expert_intermediate_size", 0) if moe else 0,
        router_aux_weight=float(raw.get("router_aux_loss_coef", 0.0)) if moe else 0.0,
    )


def _conv_dim(cfg: ModelConfig) -> int:
    return 2 * cfg.linear_k_heads * cfg.linear_k_head_dim + cfg.linear_v_heads * cfg.linear_v_head_dim


def expected_shapes(cfg: ModelConfig, fused_experts: bool = False) -> dict[str, tuple[int, ...]]:
    """HF tensor name -> shape for a checkpoint of `cfg` (the per-expert layout unless
    `fused_experts`)."""
    d, n, k, h = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    hv, dv = cfg.linear_v_heads, cfg.linear_v_head_dim
    shapes = {"model.embed_tokens.weight": (cfg.vocab_size, d), "model.norm.weight": (d,)}
    if not cfg.tie_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, d)
    for i in range(cfg.n_layers):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (d,)
        shapes[p + "post_attention_layernorm.weight"] = (d,)
        if cfg.layer_type(i) == "linear_attention":
            a = p + "linear_attn."
            shapes.update({
                a + "in_proj_qkv.weight": (_conv_dim(cfg), d), a + "in_proj_z.weight": (hv * dv, d),
                a + "in_proj_b.weight": (hv, d), a + "in_proj_a.weight": (hv, d),
                a + "conv1d.weight": (_conv_dim(cfg), 1, cfg.linear_conv_kernel),
                a + "A_log": (hv,), a + "dt_bias": (hv,), a + "norm.weight": (dv,),
                a + "out_proj.weight": (d, hv * dv)})
        else:
            a = p + "self_attn."
            shapes.update({
                a + "q_proj.weight": (2 * n * h, d), a + "k_proj.weight": (k * h, d),
                a + "v_proj.weight": (k * h, d), a + "o_proj.weight": (d, n * h),
                a + "q_norm.weight": (h,), a + "k_norm.weight": (h,)})
        m = p + "mlp."
        if not cfg.n_experts:
            shapes.update({m + "gate_proj.weight": (cfg.d_ff, d), m + "up_proj.weight": (cfg.d_ff, d),
                           m + "down_proj.weight": (d, cfg.d_ff)})
            continue
        e, f, fs = cfg.n_experts, cfg.d_expert, cfg.d_shared_expert
        shapes[m + "gate.weight"] = (e, d)
        if fused_experts:
            shapes[m + "experts.gate_up_proj"] = (e, 2 * f, d)
            shapes[m + "experts.down_proj"] = (e, d, f)
        else:
            for j in range(e):
                shapes.update({m + f"experts.{j}.gate_proj.weight": (f, d),
                               m + f"experts.{j}.up_proj.weight": (f, d),
                               m + f"experts.{j}.down_proj.weight": (d, f)})
        if fs:
            shapes.update({m + "shared_expert.gate_proj.weight": (fs, d),
                           m + "shared_expert.up_proj.weight": (fs, d),
                           m + "shared_expert.down_proj.weight": (d, fs),
                           m + "shared_expert_gate.weight": (1, d)})
    return shapes


def checked_reader(get, shapes: dict[str, tuple], source: str, missing_hint: str):
    """`fetch(name)`: `get(name)` as float32, checked present and of `shapes[name]`; an
    InputError naming the tensor otherwise. Every HF importer reads its tensors with it."""

    def fetch(name: str) -> np.ndarray:
        arr = get(name)
        if arr is None:
            raise InputError(f"{source}: missing tensor {name!r} ({missing_hint})")
        if tuple(arr.shape) != shapes[name]:
            raise InputError(f"{source}: tensor {name!r} has shape {tuple(arr.shape)}, expected "
                             f"{shapes[name]} from the checkpoint's config")
        return np.asarray(arr, np.float32)

    return fetch


def hf_to_pure(cfg: ModelConfig, get, source: str, fused_experts: bool = False) -> dict:
    """The hldstudy pure parameter dict from HF-named arrays (`get(name)` -> array | None)."""
    d, n, k, h = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    fetch = checked_reader(get, expected_shapes(cfg, fused_experts), source,
                           "checkpoint incomplete, or its config.json describes another model")

    def norm(name: str) -> dict:
        return {"scale": fetch(name)}

    blocks = {}
    for i in range(cfg.n_layers):
        p = f"model.layers.{i}."
        if cfg.layer_type(i) == "linear_attention":
            a = p + "linear_attn."
            mixer = {"in_qkv": fetch(a + "in_proj_qkv.weight").T,
                     "in_z": fetch(a + "in_proj_z.weight").T,
                     "in_b": fetch(a + "in_proj_b.weight").T,
                     "in_a": fetch(a + "in_proj_a.weight").T,
                     "conv": fetch(a + "conv1d.weight")[:, 0, :],
                     "A_log": fetch(a + "A_log"), "dt_bias": fetch(a + "dt_bias"),
                     "norm": {"weight": fetch(a + "norm.weight")},
                     "out": fetch(a + "out_proj.weight").T}
        else:
            a = p + "self_attn."
            q_and_gate = fetch(a + "q_proj.weight").reshape(n, 2, h, d)
            mixer = {"q": q_and_gate[:, 0].transpose(2, 0, 1),
                     "q_gate": q_and_gate[:, 1].transpose(2, 0, 1),
                     "k": fetch(a + "k_proj.weight").T.reshape(d, k, h),
                     "v": fetch(a + "v_proj.weight").T.reshape(d, k, h),
                     "o": fetch(a + "o_proj.weight").T.reshape(n, h, d),
                     "q_norm": norm(a + "q_norm.weight"), "k_norm": norm(a + "k_norm.weight")}
        m = p + "mlp."
        if not cfg.n_experts:
            mlp = {"gate": fetch(m + "gate_proj.weight").T, "up": fetch(m + "up_proj.weight").T,
                   "down": fetch(m + "down_proj.weight").T}
        else:
            f = cfg.d_expert
            if fused_experts:
                gate_up = fetch(m + "experts.gate_up_proj")
                gate, up = gate_up[:, :f].transpose(0, 2, 1), gate_up[:, f:].transpose(0, 2, 1)
                down = fetch(m + "experts.down_proj").transpose(0, 2, 1)
            else:
                ex = [m + f"experts.{j}." for j in range(cfg.n_experts)]
                gate = np.stack([fetch(x + "gate_proj.weight").T for x in ex])
                up = np.stack([fetch(x + "up_proj.weight").T for x in ex])
                down = np.stack([fetch(x + "down_proj.weight").T for x in ex])
            mlp = {"router": fetch(m + "gate.weight").T, "gate": gate, "up": up, "down": down}
            if cfg.d_shared_expert:
                s = m + "shared_expert."
                mlp.update({"shared_gate": fetch(s + "gate_proj.weight").T,
                            "shared_up": fetch(s + "up_proj.weight").T,
                            "shared_down": fetch(s + "down_proj.weight").T,
                            "shared_expert_gate": fetch(m + "shared_expert_gate.weight").T})
        blocks[i] = {"pre_attn_norm": norm(p + "input_layernorm.weight"), "mixer": mixer,
                     "pre_mlp_norm": norm(p + "post_attention_layernorm.weight"), "mlp": mlp}
    pure = {"embedding": fetch("model.embed_tokens.weight"), "blocks": blocks,
            "final_norm": norm("model.norm.weight")}
    if not cfg.tie_embeddings:
        pure["lm_head"] = fetch("lm_head.weight").T
    return pure


def pure_to_hf(cfg: ModelConfig, pure: dict) -> dict[str, np.ndarray]:
    """hldstudy parameters -> HF-named arrays in transformers' saved (per-expert) layout."""
    d, n, k, h = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    a_ = np.asarray
    out = {"model.embed_tokens.weight": a_(pure["embedding"]),
           "model.norm.weight": a_(pure["final_norm"]["scale"])}
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = a_(pure["lm_head"]).T
    for i in range(cfg.n_layers):
        b, p = pure["blocks"][i], f"model.layers.{i}."
        mx, mlp = b["mixer"], b["mlp"]
        out[p + "input_layernorm.weight"] = a_(b["pre_attn_norm"]["scale"])
        out[p + "post_attention_layernorm.weight"] = a_(b["pre_mlp_norm"]["scale"])
        if cfg.layer_type(i) == "linear_attention":
            a = p + "linear_attn."
            out.update({a + "in_proj_qkv.weight": a_(mx["in_qkv"]).T,
                        a + "in_proj_z.weight": a_(mx["in_z"]).T,
                        a + "in_proj_b.weight": a_(mx["in_b"]).T,
                        a + "in_proj_a.weight": a_(mx["in_a"]).T,
                        a + "conv1d.weight": a_(mx["conv"])[:, None, :],
                        a + "A_log": a_(mx["A_log"]), a + "dt_bias": a_(mx["dt_bias"]),
                        a + "norm.weight": a_(mx["norm"]["weight"]),
                        a + "out_proj.weight": a_(mx["out"]).T})
        else:
            a = p + "self_attn."
            q = np.stack([a_(mx["q"]).transpose(1, 2, 0), a_(mx["q_gate"]).transpose(1, 2, 0)],
                         axis=1)  # [N, 2, H, D]
            out.update({a + "q_proj.weight": q.reshape(2 * n * h, d),
                        a + "k_proj.weight": a_(mx["k"]).reshape(d, k * h).T,
                        a + "v_proj.weight": a_(mx["v"]).reshape(d, k * h).T,
                        a + "o_proj.weight": a_(mx["o"]).reshape(n * h, d).T,
                        a + "q_norm.weight": a_(mx["q_norm"]["scale"]),
                        a + "k_norm.weight": a_(mx["k_norm"]["scale"])})
        m = p + "mlp."
        if not cfg.n_experts:
            out.update({m + "gate_proj.weight": a_(mlp["gate"]).T,
                        m + "up_proj.weight": a_(mlp["up"]).T,
                        m + "down_proj.weight": a_(mlp["down"]).T})
            continue
        out[m + "gate.weight"] = a_(mlp["router"]).T
        for j in range(cfg.n_experts):
            x = m + f"experts.{j}."
            out.update({x + "gate_proj.weight": a_(mlp["gate"][j]).T,
                        x + "up_proj.weight": a_(mlp["up"][j]).T,
                        x + "down_proj.weight": a_(mlp["down"][j]).T})
        if cfg.d_shared_expert:
            s = m + "shared_expert."
            out.update({s + "gate_proj.weight": a_(mlp["shared_gate"]).T,
                        s + "up_proj.weight": a_(mlp["shared_up"]).T,
                        s + "down_proj.weight": a_(mlp["shared_down"]).T,
                        m + "shared_expert_gate.weight": a_(mlp["shared_expert_gate"]).T})
    return {name: np.ascontiguousarray(x) for name, x in out.items()}


def export_config(cfg: ModelConfig, dtype: str) -> dict:
    """config.json for transformers (>= 5.2) of a qwen3_5 hldstudy model."""
    moe = cfg.n_experts > 0
    config = {
        "architectures": ["Qwen3_5MoeForCausalLM" if moe else "Qwen3_5ForCausalLM"],
        "model_type": "qwen3_5_moe_text" if moe else "qwen3_5_text",
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model,
        "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim, "hidden_act": "silu",
        "max_position_embeddings": cfg.max_seq_len, "rms_norm_eps": cfg.norm_eps,
        "tie_word_embeddings": cfg.tie_embeddings, "attention_bias": False,
        "attention_dropout": 0.0, "initializer_range": 0.02,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_base_global,
                            "partial_rotary_factor": cfg.rotary_fraction},
        "layer_types": [cfg.layer_type(i) for i in range(cfg.n_layers)],
        "linear_conv_kernel_dim": cfg.linear_conv_kernel,
        "linear_key_head_dim": cfg.linear_k_head_dim or 128,
        "linear_value_head_dim": cfg.linear_v_head_dim or 128,
        "linear_num_key_heads": cfg.linear_k_heads or 16,
        "linear_num_value_heads": cfg.linear_v_heads or 32,
        "dtype": dtype,
    }
    if moe:
        config.update({"num_experts": cfg.n_experts, "num_experts_per_tok": cfg.experts_per_token,
                       "moe_intermediate_size": cfg.d_expert,
                       "shared_expert_intermediate_size": cfg.d_shared_expert,
                       "router_aux_loss_coef": cfg.router_aux_weight})
    else:
        config["intermediate_size"] = cfg.d_ff
    return config
