"""Qwen3.5 dense and MoE: logit and per-layer hidden-state parity with transformers.

The default tier reads the committed fixtures (tests/fixtures/qwen35, made by
scripts/make_qwen35_fixtures.py with torch + transformers) and needs no torch. The
optional tier exports the imported models back to safetensors and has transformers reload
them (in the reference venv, /work/venv-ref, or this interpreter when it has torch).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from hldstudy.model.importers import export_hf, load_pretrained

FIXTURES = Path(__file__).parent / "fixtures" / "qwen35"
KINDS = ("dense", "moe")
TOL = 1e-4


def _reference(kind: str) -> dict:
    return dict(np.load(FIXTURES / kind / "reference.npz"))


@nnx.jit
def _forward(model, tokens):
    return model(tokens, hidden_layers=tuple(range(model.cfg.n_layers + 1)))


def _run(model, tokens):
    out = _forward(model, jnp.asarray(tokens))
    hidden = np.stack([np.asarray(out.hidden[i]) for i in range(model.cfg.n_layers + 1)])
    return np.asarray(out.logits), hidden


@pytest.mark.parametrize("chunk", [16, 64])
@pytest.mark.parametrize("kind", KINDS)
def test_logits_and_every_hidden_state_match_transformers(kind, chunk):
    model, _ = load_pretrained(FIXTURES / kind, deltanet_chunk=chunk)
    assert model.cfg.family == "qwen3_5"
    assert (model.cfg.n_experts > 0) == (kind == "moe")
    ref = _reference(kind)
    for j in (0, 1):
        tokens = ref[f"tokens_{j}"]
        assert tokens.shape[1] % chunk  # the last chunk is partial
        logits, hidden = _run(model, tokens)
        np.testing.assert_allclose(logits, ref[f"logits_{j}"], rtol=0, atol=TOL)
        assert hidden.shape == ref[f"hidden_{j}"].shape
        for layer in range(hidden.shape[0]):
            np.testing.assert_allclose(hidden[layer], ref[f"hidden_{j}"][layer], rtol=0, atol=TOL,
                                       err_msg=f"hidden state after layer {layer}")


def _reference_python() -> str | None:
    ref = Path(os.environ.get("HLDSTUDY_REF_VENV", "/work/venv-ref")) / "bin" / "python"
    if ref.exists():
        return str(ref)
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError:
        return None
    return sys.executable


_RELOAD = textwrap.dedent("""
    import sys, numpy as np, torch, transformers
    model = transformers.AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32)
    model.eval()
    tokens = np.load(sys.argv[2])
    with torch.no_grad():
        logits = model(torch.tensor(tokens)).logits.float().numpy()
    np.save(sys.argv[3], logits)
""")


@pytest.mark.optional
@pytest.mark.parametrize("kind", KINDS)
def test_export_reloads_in_transformers_with_the_same_logits(kind, tmp_path):
    python = _reference_python()
    if python is None:
        pytest.skip("needs torch + transformers (or the reference venv /work/venv-ref)")
    model, _ = load_pretrained(FIXTURES / kind)
    out = export_hf(model, tmp_path / "export")
    ref = _reference(kind)
    for j in (0, 1):
        np.save(tmp_path / "tokens.npy", ref[f"tokens_{j}"])
        subprocess.run([python, "-c", _RELOAD, str(out), str(tmp_path / "tokens.npy"),
                        str(tmp_path / "logits.npy")], check=True, capture_output=True)
        reloaded = np.load(tmp_path / "logits.npy")
        np.testing.assert_allclose(reloaded, ref[f"logits_{j}"], rtol=0, atol=TOL)
        ours, _ = _run(model, ref[f"tokens_{j}"])
        np.testing.assert_allclose(reloaded, ours, rtol=0, atol=TOL)


def test_export_then_import_is_the_identity(tmp_path):
    for kind in KINDS:
        model, _ = load_pretrained(FIXTURES / kind)
        again, _ = load_pretrained(export_hf(model, tmp_path / kind))
        assert again.cfg == model.cfg
        ref = _reference(kind)
        a, _ = _run(model, ref["tokens_0"])
        b, _ = _run(again, ref["tokens_0"])
        np.testing.assert_array_equal(a, b)
