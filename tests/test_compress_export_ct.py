"""--export compressed-tensors: transformers loads the directory and gives our logits, the
routed experts of a Qwen3.5 MoE included (FP8 per expert, in their own config group)."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
from flax import nnx

from hldstudy.compress import hf_export, prune
from hldstudy.compress.layout import targets
from hldstudy.compress.pipeline import quantize_model
from hldstudy.model import Transformer, preset

pytestmark = pytest.mark.optional


@pytest.mark.parametrize("name, granularity", [("tiny", "channel"), ("tiny-qwen", "channel"),
                                                ("tiny-qwen", "tensor"),
                                                ("tiny-qwen-moe", "channel"),
                                                ("tiny-qwen-moe", "tensor")])
def test_compressed_tensors_export_loads_in_transformers(tmp_path, name, granularity):
    torch = pytest.importorskip("torch")
    pytest.importorskip("compressed_tensors")
    transformers = pytest.importorskip("transformers")
    cfg = preset(name, **({"attn_softcap": None} if name == "tiny" else {}))
    model = Transformer(cfg, rngs=nnx.Rngs(7))
    masks = prune.prune_model(model, "magnitude", progress=False)
    names = tuple(sorted({t.name for t in targets(model)}))
    quantized = quantize_model(model, names, "e4m3", granularity)
    out = tmp_path / "ct"
    summary = hf_export.write(model, None, quantized, tuple(masks), (2, 4), out)

    config = json.loads((out / "config.json").read_text())
    q = config["quantization_config"]
    assert q["quant_method"] == "compressed-tensors" and q["format"] == "float-quantized"
    assert q["config_groups"]["group_0"]["weights"]["type"] == "float"
    from safetensors import safe_open

    moe = bool(cfg.n_experts)
    # groups: the dense linears weight-only; the experts (MoE) their own group (module doc)
    assert sorted(q["config_groups"]) == (["group_0", "group_1"] if moe else ["group_0"])
    assert q["config_groups"]["group_0"]["input_activations"] is None
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
        proj = "model.layers.0.mlp." + ("experts.3.down_proj" if moe else "down_proj")
        assert f.get_tensor(proj + ".weight").dtype == torch.float8_e4m3fn
        assert f.get_tensor(proj + ".weight_scale").shape[1] == 1
    # every FP8 module is one of our linears; the head / router stay dense
    assert summary["fp8_modules"] == sum(k.endswith(".weight_scale") for k in keys) > 0
    expert_scales = [k for k in keys if ".mlp.experts." in k and k.endswith(".weight_scale")]
    assert len(expert_scales) == cfg.n_layers * cfg.n_experts * 3 * moe
    assert not any(".experts." in name for name in q["ignore"])
    if moe:
        experts = q["config_groups"]["group_1"]
        assert experts["targets"] == [hf_export.EXPERTS_TARGET]
        assert experts["weights"] == q["config_groups"]["group_0"]["weights"]
        assert all(re.fullmatch(hf_export.EXPERTS_TARGET[3:], k[: -len(".weight_scale")])
                   for k in expert_scales)
    sparsity = json.loads((out / "hldstudy_sparsity.json").read_text())
    assert sparsity["sparse"] == sorted(masks)

    hf = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    hf.eval()
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 24))
    ours = np.asarray(model(tokens).logits)
    with torch.no_grad():
        theirs = hf(torch.from_numpy(tokens)).logits.float().numpy()
    assert np.abs(ours - theirs).max() <= 1e-2
    state = hf.state_dict()
    if not moe:
        # the 2:4 zeros survive the FP8 file as zeros
        w = state[f"{proj}.weight"].float().numpy()  # [out, in]
        assert ((w.reshape(w.shape[0], -1, 4) != 0).sum(-1) <= 2).all()
        return
    # transformers fuses the experts ([E, 2F, D] gate|up, [E, D, F] down), dequantized at
    # load: exactly our FP8 grid values, and the 2:4 zeros along each expert's input
    mlp = model.blocks[0].mlp
    gate_up = state["model.layers.0.mlp.experts.gate_up_proj"].float().numpy()
    down = state["model.layers.0.mlp.experts.down_proj"].float().numpy()
    ours_gate_up = np.concatenate([np.asarray(mlp.gate[...]), np.asarray(mlp.up[...])], -1)
    np.testing.assert_array_equal(gate_up, ours_gate_up.transpose(0, 2, 1))
    np.testing.assert_array_equal(down, np.asarray(mlp.down[...]).transpose(0, 2, 1))
    for w in (gate_up, down):
        assert ((w.reshape(*w.shape[:2], -1, 4) != 0).sum(-1) <= 2).all()
