"""Checkpoint import: GGUF and HF safetensors roundtrips on tiny random models, errors.

The GGUF file is written here with `gguf.GGUFWriter` following llama.cpp's
conventions for gemma3 (independent of the importer): `[out, in]` matrices,
norm weights stored with +1 folded in, no local rope base / window pattern in
the metadata, a SentencePiece vocabulary in `tokenizer.ggml.*`.
"""

from __future__ import annotations

import dataclasses
import json

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

from hldstudy.errors import InputError
from hldstudy.model import Transformer, preset
from hldstudy.model.importers import (
    export_hf,
    gguf_model_config,
    hf_model_config,
    load_gguf,
    load_hf,
    load_pretrained,
)

CFG = dataclasses.replace(preset("tiny"), max_seq_len=64)  # GQA 4q/2kv, local:global 1:1, window 32


def _random_model(cfg=CFG, seed=0) -> Transformer:
    """Random weights everywhere, norms included (multiples of 2^-10, so +1/-1 is exact)."""
    model = Transformer(cfg, rngs=nnx.Rngs(seed))
    state = nnx.state(model, nnx.Param)
    leaves, treedef = jax.tree_util.tree_flatten(state)
    keys = jax.random.split(jax.random.key(seed + 1), len(leaves))
    new = []
    for k, x in zip(keys, leaves, strict=True):
        if x.ndim == 1:  # norm scale
            x = jnp.round(0.3 * jax.random.normal(k, x.shape) * 1024) / 1024
        new.append(x)
    nnx.update(model, jax.tree_util.tree_unflatten(treedef, new))
    return model


def _pure(state) -> dict:
    return jax.tree_util.tree_map(np.asarray, state.to_pure_dict() if hasattr(state, "to_pure_dict")
                                  else state)


def _assert_same_params(model: Transformer, state) -> None:
    want = _pure(nnx.state(model, nnx.Param))
    got = _pure(state)
    assert jax.tree_util.tree_structure(want) == jax.tree_util.tree_structure(got)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(want),
                            jax.tree_util.tree_leaves(got), strict=True):
        np.testing.assert_array_equal(a, b, err_msg=jax.tree_util.keystr(path))


# ---- a tiny SentencePiece vocabulary in GGUF form -----------------------------------------

SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>"]
WORDS = ["hello", "world", "▁hello", "▁world"]


def _tiny_vocab(size: int):
    tokens = list(SPECIALS) + [f"<0x{b:02X}>" for b in range(256)]
    types = [3, 3, 3, 2] + [6] * 256
    # llama.cpp writes user-defined whitespace pieces with literal spaces ("▁▁" -> "  ").
    tokens += ["  ", "\n", "<start_of_turn>"]
    types += [4, 4, 3]
    scores = [0.0] * len(tokens)
    normal = list("abcdefghijklmnopqrstuvwxyz▁")
    for w in WORDS:  # every prefix, so BPE can build each word by merges
        normal += [w[:i] for i in range(2, len(w) + 1)]
    normal = list(dict.fromkeys(normal))
    for i, p in enumerate(normal):
        tokens.append(p)
        types.append(1)
        scores.append(-float(i))
    while len(tokens) < size:
        tokens.append(f"<unused{len(tokens)}>")
        types.append(5)
        scores.append(0.0)
    return tokens, scores, types


def write_gemma3_gguf(model: Transformer, path, *, arch="gemma3", skip=(), extra_kv=None,
                      with_tokenizer=True) -> None:
    cfg = model.cfg
    p = _pure(nnx.state(model, nnx.Param))
    d, n, k, h = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    w = gguf.GGUFWriter(str(path), arch)
    w.add_context_length(cfg.max_seq_len)
    w.add_embedding_length(d)
    w.add_block_count(cfg.n_layers)
    w.add_feed_forward_length(cfg.d_ff)
    w.add_head_count(n)
    w.add_head_count_kv(k)
    w.add_key_length(h)
    w.add_value_length(h)
    w.add_layer_norm_rms_eps(cfg.norm_eps)
    w.add_rope_freq_base(cfg.rope_base_global)
    w.add_sliding_window(cfg.sliding_window)
    for key, val in (extra_kv or {}).items():
        (w.add_uint32 if isinstance(val, int) else w.add_float32)(key, val)
    if with_tokenizer:
        tokens, scores, types = _tiny_vocab(cfg.vocab_size)
        w.add_tokenizer_model("llama")
        w.add_token_list(tokens)
        w.add_token_scores(scores)
        w.add_token_types(types)
        w.add_bos_token_id(2)
        w.add_eos_token_id(1)
        w.add_unk_token_id(3)
        w.add_pad_token_id(0)
        w.add_add_bos_token(True)
        w.add_add_space_prefix(False)

    tensors = {"token_embd.weight": p["embedding"],
               "output_norm.weight": p["final_norm"]["scale"] + 1}
    for i in range(cfg.n_layers):
        b = p["blocks"][i]
        a = b["attn"]
        tensors.update({
            f"blk.{i}.attn_q.weight": a["q"].reshape(d, n * h).T,
            f"blk.{i}.attn_k.weight": a["k"].reshape(d, k * h).T,
            f"blk.{i}.attn_v.weight": a["v"].reshape(d, k * h).T,
            f"blk.{i}.attn_output.weight": a["o"].reshape(n * h, d).T,
            f"blk.{i}.attn_q_norm.weight": a["q_norm"]["scale"] + 1,
            f"blk.{i}.attn_k_norm.weight": a["k_norm"]["scale"] + 1,
            f"blk.{i}.attn_norm.weight": b["pre_attn_norm"]["scale"] + 1,
            f"blk.{i}.post_attention_norm.weight": b["post_attn_norm"]["scale"] + 1,
            f"blk.{i}.ffn_norm.weight": b["pre_mlp_norm"]["scale"] + 1,
            f"blk.{i}.post_ffw_norm.weight": b["post_mlp_norm"]["scale"] + 1,
            f"blk.{i}.ffn_gate.weight": b["mlp"]["gate"].T,
            f"blk.{i}.ffn_up.weight": b["mlp"]["up"].T,
            f"blk.{i}.ffn_down.weight": b["mlp"]["down"].T,
        })
    for name, arr in tensors.items():
        if name not in skip:
            w.add_tensor(name, np.ascontiguousarray(arr, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def tiny_model():
    return _random_model()


@pytest.fixture(scope="module")
def tiny_gguf(tiny_model, tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    write_gemma3_gguf(tiny_model, path)
    return path


# ---- GGUF ---------------------------------------------------------------------------------


def test_gguf_roundtrip_exact(tiny_model, tiny_gguf):
    cfg, state, tok = load_gguf(tiny_gguf)
    # Metadata has no local rope base or window pattern: llama.cpp's gemma3 defaults apply.
    assert cfg == dataclasses.replace(CFG, global_every=6, rope_base_local=10_000.0,
                                      query_pre_attn_scalar=float(CFG.head_dim))
    _assert_same_params(tiny_model, state)
    assert tok.vocab_size == CFG.vocab_size


def test_gguf_config_keys(tiny_model, tmp_path):
    path = tmp_path / "t.gguf"
    write_gemma3_gguf(tiny_model, path, extra_kv={
        "gemma3.attention.sliding_window_pattern": CFG.global_every,
        "gemma3.rope.freq_base_swa": CFG.rope_base_local,
    })
    model, _ = load_pretrained(path)
    assert model.cfg == dataclasses.replace(CFG, query_pre_attn_scalar=float(CFG.head_dim))
    assert gguf_model_config(path) == model.cfg  # from the header alone
    _assert_same_params(tiny_model, nnx.state(model, nnx.Param))


def test_gguf_tokenizer(tiny_gguf):
    from hldstudy.model.gguf_tokenizer import gguf_tokenizer

    tok = gguf_tokenizer(tiny_gguf)
    assert (tok.pad_id, tok.eos_id, tok.bos_id, tok.unk_id) == (0, 1, 2, 3)
    ids = tok.encode("hello world")
    assert [tok.id_to_piece(i) for i in ids] == ["hello", "▁world"]  # no dummy prefix
    for text in ("hello world", "abc xyz", "héllo ✓ 42"):  # byte fallback for the rest
        assert tok.decode(tok.encode(text)) == text
    assert "<0xC3>" in [tok.id_to_piece(i) for i in tok.encode("é")]
    two_spaces = len(SPECIALS) + 256
    assert tok.encode("a  b\n") == [tok.sp.piece_to_id("a"), two_spaces,
                                     tok.sp.piece_to_id("b"), two_spaces + 1]
    assert tok.decode(tok.encode("a  b\n")) == "a  b\n"
    assert two_spaces + 2 not in tok.encode("<start_of_turn>")  # control: never from text


def test_gguf_overrides(tiny_gguf):
    cfg, state, _ = load_gguf(tiny_gguf, dtype="bfloat16", max_seq_len=128)
    assert cfg.dtype == "bfloat16" and cfg.max_seq_len == 128
    with pytest.raises(InputError, match="shape field"):
        load_gguf(tiny_gguf, d_model=32)


def test_gguf_errors(tiny_model, tmp_path):
    with pytest.raises(InputError, match="not found"):
        load_gguf(tmp_path / "nope.gguf")
    with pytest.raises(InputError, match="not found"):
        load_pretrained(tmp_path / "nope.gguf")
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"GGUF" + b"\0" * 10)
    with pytest.raises(InputError, match="GGUF"):
        load_gguf(junk)

    llama = tmp_path / "llama.gguf"
    write_gemma3_gguf(tiny_model, llama, arch="llama", with_tokenizer=False)
    with pytest.raises(InputError, match="architecture 'llama'"):
        load_gguf(llama)

    no_tok = tmp_path / "no_tok.gguf"
    write_gemma3_gguf(tiny_model, no_tok, with_tokenizer=False)
    assert load_gguf(no_tok)[2] is None

    missing = tmp_path / "missing.gguf"
    write_gemma3_gguf(tiny_model, missing, skip=("blk.1.ffn_up.weight",))
    with pytest.raises(InputError, match="mlp.up_proj"):
        load_pretrained(missing)


# ---- HF safetensors -----------------------------------------------------------------------


def test_exported_safetensors_file(tiny_model, tmp_path):
    """export_hf writes a file transformers reads (the safetensors package, format "pt"); a
    file that is not safetensors is an InputError naming it."""
    from safetensors import safe_open

    export_hf(tiny_model, tmp_path, dtype="bfloat16")
    with safe_open(tmp_path / "model.safetensors", "np") as f:
        assert f.metadata() == {"format": "pt"}
        assert str(f.get_tensor("model.embed_tokens.weight").dtype) == "bfloat16"
    assert hf_model_config(tmp_path) == hf_model_config(tmp_path / "config.json")
    assert hf_model_config(tmp_path).n_layers == CFG.n_layers
    (tmp_path / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(InputError, match="model.safetensors: not a readable safetensors"):
        load_hf(tmp_path)


def test_hf_roundtrip_exact(tiny_model, tiny_gguf, tmp_path):
    _, _, tok = load_gguf(tiny_gguf)
    export_hf(tiny_model, tmp_path, tokenizer=tok)
    raw = json.loads((tmp_path / "config.json").read_text())
    assert raw["model_type"] == "gemma3_text" and raw["layer_types"][:2] == [
        "sliding_attention", "full_attention"]
    cfg, state, tok2 = load_hf(tmp_path)
    assert cfg == dataclasses.replace(CFG, query_pre_attn_scalar=float(CFG.head_dim))
    _assert_same_params(tiny_model, state)
    assert tok2.encode("hello world") == tok.encode("hello world")
    model, _ = load_pretrained(tmp_path / "config.json")
    tokens = jax.random.randint(jax.random.key(1), (1, 40), 0, CFG.vocab_size)
    np.testing.assert_array_equal(np.asarray(model(tokens).logits),
                                  np.asarray(tiny_model(tokens).logits))


def test_hf_bf16_and_variants(tmp_path):
    cfg = dataclasses.replace(CFG, sliding_window=None, global_every=1, final_softcap=30.0,
                              query_pre_attn_scalar=24.0)
    model = _random_model(cfg, seed=3)
    export_hf(model, tmp_path, dtype="bfloat16")
    got_cfg, state, tok = load_hf(tmp_path)
    assert got_cfg == cfg and tok is None
    want = jax.tree_util.tree_map(
        lambda x: np.asarray(jnp.asarray(x, jnp.bfloat16), np.float32),
        _pure(nnx.state(model, nnx.Param)))
    for a, b in zip(jax.tree_util.tree_leaves(want), jax.tree_util.tree_leaves(_pure(state)),
                    strict=True):
        np.testing.assert_array_equal(a, b)


def test_hf_config_formats(tiny_model, tmp_path):
    """transformers >= 5 `rope_parameters` and the multimodal `text_config` nesting."""
    export_hf(tiny_model, tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    for key in ("rope_theta", "rope_local_base_freq", "layer_types"):
        raw.pop(key)
    raw["sliding_window_pattern"] = 2
    raw["rope_parameters"] = {
        "full_attention": {"rope_type": "default", "rope_theta": 123.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 45.0}}
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gemma3",
                                                      "text_config": raw}))
    weights = load_file(tmp_path / "model.safetensors")
    save_file({k.replace("model.", "model.language_model.", 1): np.array(v)
               for k, v in weights.items()}, tmp_path / "model.safetensors")
    cfg, state, _ = load_hf(tmp_path)
    assert (cfg.rope_base_global, cfg.rope_base_local, cfg.global_every) == (123.0, 45.0, 2)
    _assert_same_params(tiny_model, state)


def test_hf_errors(tiny_model, tmp_path):
    from hldstudy.errors import ConfigError

    gemma2ish = Transformer(dataclasses.replace(CFG, attn_softcap=50.0), rngs=nnx.Rngs(0))
    with pytest.raises(ConfigError, match="attn_softcap"):
        export_hf(gemma2ish, tmp_path / "g2")
    with pytest.raises(InputError, match="not found"):
        load_hf(tmp_path / "nope")
    with pytest.raises(InputError, match="config.json"):
        load_hf(tmp_path)
    export_hf(tiny_model, tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())

    (tmp_path / "config.json").write_text(json.dumps({**raw, "model_type": "llama"}))
    with pytest.raises(InputError, match="model_type 'llama'"):
        load_hf(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(
        {**raw, "rope_scaling": {"rope_type": "linear", "factor": 8.0}}))
    with pytest.raises(InputError, match="rope scaling"):
        load_hf(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(raw))

    weights = load_file(tmp_path / "model.safetensors")
    save_file({k: np.array(v) for k, v in weights.items()
               if k != "model.layers.2.self_attn.k_norm.weight"}, tmp_path / "model.safetensors")
    with pytest.raises(InputError, match="layers.2.self_attn.k_norm"):
        load_hf(tmp_path)
    weights = {k: np.array(v) for k, v in weights.items()}
    weights["model.layers.0.mlp.up_proj.weight"] = weights["model.layers.0.mlp.up_proj.weight"][:-1]
    save_file(weights, tmp_path / "model.safetensors")
    with pytest.raises(InputError, match="shape"):
        load_pretrained(tmp_path)


# ---- one loader: run directory, GGUF, HF ---------------------------------------------------


def test_load_model_and_model_config_of_every_kind(tiny_model, tiny_gguf, tmp_path):
    from hldstudy.eval.testing import tiny_config, tiny_run_dir
    from hldstudy.model.loading import load_model, model_config_of

    run = tiny_run_dir(tmp_path / "run", tiny_config(vocab_size=CFG.vocab_size))
    hf = export_hf(tiny_model, tmp_path / "hf")
    tokens = jax.random.randint(jax.random.key(2), (1, 24), 0, CFG.vocab_size)
    for path, kind in ((run, "run"), (tiny_gguf, "gguf"), (hf, "hf")):
        loaded = load_model(path)
        assert loaded.kind == kind and loaded.source == str(path)
        assert model_config_of(path) == loaded.model.cfg
        assert (loaded.config is not None) == (kind == "run")
        assert loaded.model(tokens).logits.shape == (1, 24, CFG.vocab_size)
    assert load_model(run).tokenizer is not None and load_model(hf).tokenizer is None
    assert model_config_of(None) is None and model_config_of("remote://h:1") is None
    assert model_config_of(tmp_path / "not-yet-trained") is None
    untrained = tmp_path / "untrained"
    untrained.mkdir()
    (untrained / "config.json").write_text((run / "config.json").read_text())
    assert model_config_of(untrained) == load_model(run).model.cfg
    with pytest.raises(InputError, match="has no checkpoints/"):
        load_model(untrained)
    with pytest.raises(InputError, match="does not exist"):
        load_model(tmp_path / "nope")


def test_checkpoint_of_another_shape_is_one_clear_error(tmp_path):
    """A run whose config.json describes another model than its checkpoint holds."""
    import json

    from hldstudy.errors import InputError
    from hldstudy.eval.testing import tiny_run_dir
    from hldstudy.model.loading import load_model

    run = tiny_run_dir(tmp_path / "run", tokenizer=False)
    cfg = json.loads((run / "config.json").read_text())
    cfg["model"]["d_ff"] = cfg["model"]["d_ff"] * 2
    (run / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(InputError, match=r"checkpoints cannot be restored into the model its config.json describes \(step 1") as e:
        load_model(run)
    assert "config.json" in str(e.value) and "\n" not in str(e.value)
