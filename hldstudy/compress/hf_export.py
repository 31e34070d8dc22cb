"""`--export compressed-tensors`: the compressed model as a Hugging Face directory that
transformers and vLLM load (the `compressed-tensors` format llm-compressor writes).

Design notes: `docs/compression.md`, under this file's name.
"""

from __future__ import annotations

import json
import re
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors.numpy import load_file

from hldstudy.compress.layout import Target
from hldstudy.errors import ConfigError
from hldstudy.fileio import write_json_atomic
from hldstudy.model.importers import export_hf

FORMAT_NAME = "compressed-tensors"
# A routed expert's projection in the HF per-expert layout, and the config group target
# that names them (a `re:` target mentioning "experts": how transformers tells the
# experts' group from the dense one, integrations/compressed_tensors.get_experts_scheme).
EXPERT_MODULE = re.compile(r".*\.mlp\.experts\.\d+\.(gate|up|down)_proj")
EXPERTS_TARGET = r"re:.*mlp\.experts\.\d+\.(gate|up|down)_proj$"


def check_available() -> None:
    """ConfigError (one line, exit 2) when torch or compressed-tensors is missing."""
    try:
        import compressed_tensors  # noqa: F401
        import torch  # noqa: F401
    except ImportError as e:
        raise ConfigError("compress.export", f"compressed-tensors export needs torch and "
                          f"compressed-tensors ({e.name} is not installed)",
                          "pip install 'hldstudy[export]'") from None


def _scale_image(model, quantized: dict):
    """A copy of `model` whose quantized targets hold their scale at every input row and
    every other parameter 0 (so its HF export says which HF rows carry which scale)."""
    graphdef, state = nnx.split(model)
    image = nnx.merge(graphdef, jax.tree_util.tree_map(jnp.zeros_like, state))
    for key, (q, scale) in quantized.items():
        t = Target.from_key(key)
        n_in, n_out = np.asarray(q).shape
        s = np.broadcast_to(np.asarray(scale, np.float32).reshape(-1), (n_out,))
        t.set2d(image, np.broadcast_to(s, (n_in, n_out)))
    return image


def _hf_scales(model, quantized: dict, work: Path) -> dict[str, np.ndarray]:
    """{HF weight name: scale [out, 1]} of every HF linear that is FP8 as a whole."""
    export_hf(_scale_image(model, quantized), work)
    out = {}
    for name, img in load_file(str(work / "model.safetensors")).items():
        if img.ndim != 2 or not name.endswith(".weight") or "embed_tokens" in name:
            continue
        if not (img > 0).all():
            continue  # dense, or only partly FP8 in this HF tensor
        if not (img == img[:, :1]).all():
            raise AssertionError(f"{name}: scales vary along the input axis")
        out[name] = img[:, :1].astype(np.float32)
    return out


def write(model, tokenizer, quantized: dict, sparse_keys, nm: tuple[int, int],
          out: Path) -> dict:
    """Writes the directory (see the module doc); returns its summary for the report."""
    check_available()
    import torch
    from compressed_tensors.compressors import FloatQuantizationCompressor, ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationConfig,
        QuantizationScheme,
    )
    from safetensors.torch import save_file

    out.mkdir(parents=True)
    export_hf(model, out, tokenizer=tokenizer, dtype="float32")
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        scales = _hf_scales(model, quantized, Path(tmp))
    dense = load_file(str(out / "model.safetensors"))
    args = QuantizationArgs(num_bits=8, type="float", strategy="channel", symmetric=True,
                            dynamic=False)
    scheme = QuantizationScheme(targets=["Linear"], weights=args, format="float-quantized")
    groups = {"group_0": scheme}
    tensors = {}
    for name, w in dense.items():
        if name in scales:
            state = FloatQuantizationCompressor.compress(
                {"weight": torch.from_numpy(np.ascontiguousarray(w)),
                 "weight_scale": torch.from_numpy(scales[name])}, scheme)
            tensors[name] = state["weight"].contiguous()
            tensors[name[: -len("weight")] + "weight_scale"] = state["weight_scale"].contiguous()
        else:
            tensors[name] = torch.from_numpy(np.ascontiguousarray(w))
    linears = sorted(n[: -len(".weight")] for n, w in dense.items()
                     if w.ndim == 2 and n.endswith(".weight") and "embed_tokens" not in n)
    fp8_modules = {n[: -len(".weight")] for n in scales}
    if any(EXPERT_MODULE.fullmatch(n) for n in fp8_modules):
        groups["group_1"] = QuantizationScheme(
            targets=[EXPERTS_TARGET], weights=args, format="float-quantized",
            input_activations=QuantizationArgs(num_bits=8, type="float", strategy="token",
                                               symmetric=True, dynamic=True))
    ignore = [n for n in linears if n not in fp8_modules]
    if "lm_head" not in ignore and model.cfg.tie_embeddings:
        ignore.append("lm_head")  # the tied head is the (dense) embedding
    qconfig = QuantizationConfig(config_groups=groups, format="float-quantized",
                                 quantization_status="compressed", ignore=ignore)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    ModelCompressor(quantization_config=qconfig).update_config(str(out))
    sparsity = {"format": "hldstudy-2:4-masks-v1",
                "pattern": f"{nm[0]}:{nm[1]} along the input dimension (each group of "
                           f"{nm[1]} consecutive input weights of an output row keeps at "
                           f"most {nm[0]}); zeros stored densely",
                "sparse": sorted(sparse_keys), "fp8_modules": sorted(fp8_modules)}
    write_json_atomic(out / "hldstudy_sparsity.json", sparsity)
    return {"dir": str(out), "fp8_modules": len(fp8_modules), "dense_linears": len(ignore)}


def read_config(path: Path) -> dict:
    return json.loads((Path(path) / "config.json").read_text())
