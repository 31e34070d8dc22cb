"""Writing and reading a compressed model.

Design notes: `docs/compression.md`, under this file's name.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx
from safetensors import deserialize, safe_open
from safetensors.numpy import save_file

from hldstudy.checkpoint import Checkpointer
from hldstudy.compress.fp8 import dequantize_fp8
from hldstudy.compress.layout import Target, out_shape, to2d
from hldstudy.config import ModelConfig, save_config
from hldstudy.errors import InputError
from hldstudy.model import Transformer

FORMAT = "hldstudy-compressed-v1"
_F8 = {"F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2}
_NP = {"F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16, "F64": np.float64,
       "I32": np.int32, "U8": np.uint8, **_F8}


def _param_items(model) -> dict[str, jax.Array]:
    """{dotted path: array} of every nnx.Param of the model."""
    _, state = nnx.split(model, nnx.Param)
    out = {}
    for path, leaf in jax.tree_util.tree_leaves_with_path(state):
        keys = [getattr(k, "key", getattr(k, "idx", getattr(k, "name", None))) for k in path]
        keys = [str(k) for k in keys if k != "value"]
        out[".".join(keys)] = leaf
    return out


def _stacked_quantized(key: str, quantized: dict) -> tuple[np.ndarray, np.ndarray] | None:
    """(q, scale) of a parameter from the per-target FP8 values: the target's own, or
    every expert's stacked on a leading axis; None when the parameter is not quantized."""
    if key in quantized:
        return quantized[key]
    experts = sorted((Target.from_key(k).expert, v) for k, v in quantized.items()
                     if k.startswith(key + ".") and Target.from_key(k).param_key == key)
    if not experts:
        return None
    return (np.stack([np.asarray(q) for _, (q, _) in experts]),
            np.stack([np.asarray(s, np.float32) for _, (_, s) in experts]))


def save_safetensors(model, path: str | Path, *, quantized: dict | None = None,
                     sparse_keys: tuple[str, ...] = (), nm: tuple[int, int] = (2, 4),
                     fp8_format: str | None = None, granularity: str | None = None,
                     extra: dict | None = None) -> Path:
    """quantized: {key: (q [in, out] FP8, scale)} from the pipeline's FP8 stage."""
    quantized = quantized or {}
    tensors = {}
    for key, value in _param_items(model).items():
        if (qs := _stacked_quantized(key, quantized)) is not None:
            q, scale = qs
            tensors[key] = np.asarray(q).reshape(value.shape)
            s = np.asarray(scale, np.float32)
            if granularity != "tensor":
                s = s.reshape(out_shape(key, value.shape))
            tensors[f"{key}.scale"] = s
        else:
            tensors[key] = np.asarray(value)
    meta = {"format": FORMAT,
            "model_config": json.dumps(dataclasses.asdict(model.cfg)),
            "sparse": json.dumps(sorted(sparse_keys)),
            "sparsity_pattern": f"{nm[0]}:{nm[1]} along the input dimension (the leading "
                                "axes: q/k/v/gate/up/down axis 0, o axes 0-1 flattened); "
                                "masks are implied by zeros",
            "quantized": json.dumps(sorted(quantized)),
            "fp8_format": fp8_format or "",
            "fp8_granularity": granularity or "",
            "scale_convention": "weight = fp8_value * scale (scale per output channel "
                                "or per tensor)",
            **{k: (v if isinstance(v, str) else json.dumps(v)) for k, v in (extra or {}).items()}}
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path), metadata=meta)
    return path


def read_safetensors(path: str | Path) -> tuple[dict[str, np.ndarray], dict]:
    """(tensors, metadata). FP8 tensors come back in their ml_dtypes FP8 dtype (the
    package's numpy reader has no FP8 type, so raw views are mapped here)."""
    path = Path(path)
    if not path.is_file():
        raise InputError(f"{path} does not exist")
    with safe_open(str(path), framework="numpy") as f:
        meta = f.metadata() or {}
    tensors = {}
    for name, view in deserialize(path.read_bytes()):
        dtype = _NP.get(view["dtype"])
        if dtype is None:
            raise InputError(f"{path}: tensor {name} has unsupported dtype {view['dtype']}")
        tensors[name] = np.frombuffer(view["data"], dtype=dtype).reshape(view["shape"])
    return tensors, meta


def load_safetensors(path: str | Path):
    """(Transformer, metadata) from `save_safetensors`' file, FP8 weights dequantized."""
    tensors, meta = read_safetensors(path)
    if meta.get("format") != FORMAT:
        raise InputError(f"{path}: not an hldstudy compressed export (format "
                         f"{meta.get('format')!r})")
    cfg = ModelConfig(**json.loads(meta["model_config"]))
    model = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(model, nnx.Param)

    def fill(path, leaf):
        keys = [getattr(k, "key", getattr(k, "idx", getattr(k, "name", None))) for k in path]
        key = ".".join(str(k) for k in keys if k != "value")
        w = tensors[key]
        if f"{key}.scale" in tensors:
            return dequantize_param(key, w, tensors[f"{key}.scale"]).astype(leaf.dtype)
        return jnp.asarray(w, leaf.dtype)

    state = jax.tree_util.tree_map_with_path(fill, state)
    return nnx.merge(graphdef, state), meta


def dequantize_param(key: str, q, scale) -> jax.Array:
    """float32 weights of one stored FP8 parameter: q times its scale, per output channel
    (shaped like the output axes, with a leading expert axis for stacked experts), one per
    expert, or one per tensor."""
    q, scale = jnp.asarray(q), jnp.asarray(scale, jnp.float32)
    name = key.rsplit(".", 1)[1]
    if scale.ndim and q.ndim == 3 and name in ("gate", "up", "down") and \
            scale.shape[0] == q.shape[0] and len(out_shape(key, q.shape)) == 2:
        # stacked experts: each expert's 2-D view times its own scales
        return jax.vmap(lambda w, s: jnp.reshape(dequantize_fp8(to2d(name, w), s.reshape(-1)),
                                                 w.shape))(q, scale)
    s = scale.reshape(-1) if scale.ndim else scale
    return jnp.reshape(dequantize_fp8(to2d(name, q), s), q.shape)


def _checkpointer(directory: Path):
    # The trainer's own checkpoint writer, so an export is read back by the same code
    # as a trained run.
    return Checkpointer(directory, 1)


def save_run_dir(model, run_cfg, out_dir: str | Path, *, tokenizer_file: str | Path | None,
                 meta: dict | None = None, step: int = 1) -> Path:
    """A run directory holding `model` as its student (config.json + checkpoints/)."""
    out = Path(out_dir)
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    data = dataclasses.replace(run_cfg.data, tokenizer=None)
    if tokenizer_file is not None and Path(tokenizer_file).suffix == ".json":
        # a run directory holds only a SentencePiece tokenizer.model: a Hugging Face
        # tokenizer.json is named by its (absolute) path instead, and copied beside it
        shutil.copyfile(tokenizer_file, out / "tokenizer.json")
        data = dataclasses.replace(data, tokenizer=str(Path(tokenizer_file).absolute()))
        tokenizer_file = None
    cfg = dataclasses.replace(run_cfg, model=model.cfg, data=data)
    if tokenizer_file is not None:
        shutil.copyfile(tokenizer_file, out / "tokenizer.model")
    save_config(cfg, out / "config.json")
    _, params = nnx.split(model, nnx.Param)
    ck = _checkpointer(out / "checkpoints")
    try:
        ck.save(step, {"params": {"student": params}}, {"stage": "compressed", "step": step,
                                                        **(meta or {})})
    finally:
        ck.close()
    return out
