"""Attention paths (hldstudy.model.attention) equal the dense reference.

Chunked must match dense in values and gradients on shapes chosen to hit its
edge cases: T not a multiple of either block size, a window that divides
neither T nor the blocks, several packed documents per row, GQA / MQA,
soft-cap. The whole-model tests run the `tiny` preset (QK-norm, local:global)
with small blocks so that every layer spans several blocks.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from hldstudy.config import validate_model
from hldstudy.errors import ConfigError
from hldstudy.model import Transformer, preset
from hldstudy.model import attention as attn
from hldstudy.model.attention import chunked_attention, dense_attention, resolve_implementation

TOL = dict(atol=1e-5, rtol=1e-5)


def _qkv(rng, b, t, n, k, h, dtype=jnp.float32):
    q = jnp.asarray(rng.normal(size=(b, t, n, h)) * 0.7, dtype)
    kk = jnp.asarray(rng.normal(size=(b, t, k, h)) * 0.7, dtype)
    v = jnp.asarray(rng.normal(size=(b, t, k, h)), dtype)
    return q, kk, v


def _packed_segments(rng, b, t, n_docs):
    """[B, T] ids 1..n_docs in contiguous runs of random lengths (a packed batch)."""
    rows = []
    for _ in range(b):
        cuts = np.sort(rng.choice(np.arange(1, t), n_docs - 1, replace=False))
        rows.append(np.searchsorted(cuts, np.arange(t), side="right") + 1)
    return jnp.asarray(np.stack(rows), jnp.int32)


# (T, N, K, window, n_docs or None, softcap, block_q, block_k)
CASES = {
    "ragged-gqa-window-packed-softcap": (45, 4, 2, 7, 3, 2.0, 16, 8),
    "mha-global-unpacked-bq<bk": (37, 2, 2, None, None, None, 8, 16),
    "mqa-window20-packed": (64, 4, 1, 20, 4, None, 16, 16),
    "global-packed-softcap-one-block": (29, 2, 1, None, 2, 5.0, 64, 64),
}


@pytest.mark.parametrize("case", list(CASES))
def test_chunked_matches_dense_values_and_grads(case):
    t, n, k, window, n_docs, softcap, bq, bk = CASES[case]
    rng = np.random.default_rng(list(CASES).index(case))
    q, kk, v = _qkv(rng, 2, t, n, k, 8)
    seg = None if n_docs is None else _packed_segments(rng, 2, t, n_docs)
    cot = jnp.asarray(rng.normal(size=q.shape), jnp.float32)  # a generic output cotangent
    kw = dict(window=window, softcap=softcap)

    def run(fn):
        def loss(q, k, v):
            out = fn(q, k, v, seg, **kw)
            return jnp.sum(out * cot), out

        (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, kk, v)
        return out, grads

    out_d, grads_d = run(dense_attention)
    out_c, grads_c = run(lambda *a, **w: chunked_attention(*a, block_q=bq, block_k=bk, **w))
    np.testing.assert_allclose(out_c, out_d, **TOL)
    for name, gc, gd in zip("qkv", grads_c, grads_d, strict=True):
        np.testing.assert_allclose(gc, gd, **TOL, err_msg=f"d{name}")


def test_chunked_skips_blocks_outside_the_band():
    """Blocks outside the causal/window band are never computed, not computed-and-masked.

    NaN keys/values in key block 0 (and in the last key block) poison any query
    block that touches them: 0 * NaN = NaN even where the mask zeroes the
    probability. With window 8 and blocks of 8, query blocks >= 2 never read key
    block 0, and no query block but the last reads the last key block.
    """
    rng = np.random.default_rng(7)
    t, blk, window = 64, 8, 8
    q, k, v = _qkv(rng, 1, t, 2, 1, 8)
    k_bad = k.at[:, :blk].set(jnp.nan).at[:, -blk:].set(jnp.nan)
    v_bad = v.at[:, :blk].set(jnp.nan).at[:, -blk:].set(jnp.nan)

    def f(q, k, v):
        return chunked_attention(q, k, v, window=window, block_q=blk, block_k=blk)

    out = f(q, k_bad, v_bad)
    clean = slice(2 * blk, t - blk)
    assert np.isnan(np.asarray(out[:, :blk])).all()  # the poison is real
    np.testing.assert_allclose(out[:, clean], dense_attention(q, k, v, window=window)[:, clean],
                               **TOL)
    # Backward: key block 0 feeds dQ only of query blocks 0-1, the last key block only of
    # the last query block; a masked-but-computed block would spread NaN to every row.
    dq = jax.grad(lambda q: jnp.sum(f(q, k_bad, v_bad)[:, clean]))(q)
    assert np.isfinite(np.asarray(dq[:, clean])).all()
    assert np.isnan(np.asarray(dq[:, :blk])).all()


@pytest.mark.parametrize("t,window,bq,bk", [(45, 7, 16, 8), (64, 20, 16, 16), (37, None, 8, 16),
                                             (100, 33, 32, 8), (17, 4, 64, 64)])
def test_block_band_is_exact(t, window, bq, bk):
    """Forward and backward visit exactly the blocks holding at least one visible pair."""
    got = attn.evaluated_blocks(t, window, bq, bk)
    bq, bk = got["block_q"], got["block_k"]
    q_idx, k_idx = np.arange(t)[:, None], np.arange(t)[None, :]
    visible = (k_idx <= q_idx) & ((q_idx - k_idx < window) if window else True)
    needed = {(i, j) for i in range(-(-t // bq)) for j in range(-(-t // bk))
              if visible[i * bq:(i + 1) * bq, j * bk:(j + 1) * bk].any()}
    assert got["forward"] == needed
    assert got["backward"] == needed


def _tiny_pair(**overrides):
    cfg = dataclasses.replace(preset("tiny"), **overrides)
    dense = Transformer(dataclasses.replace(cfg, attention="dense"), rngs=nnx.Rngs(0))
    chunked = Transformer(dataclasses.replace(cfg, attention="chunked"), rngs=nnx.Rngs(0))
    return dense, chunked


# (attn_softcap, (block_q, block_k) or None for the defaults, T, packed)
MODEL_CASES = {
    "packed-softcap-small-blocks": (3.0, (16, 8), 75, True),  # 75 = 4 x 16 + 11: ragged
    "unpacked-default-blocks": (None, None, 300, False),  # 300 = 256 + 44; no segment ids
}


@pytest.mark.parametrize("case", list(MODEL_CASES))
def test_transformer_chunked_equals_dense(monkeypatch, case):
    """Whole `tiny` model (QK-norm, GQA, window 32 / global): logits and every param grad."""
    softcap, blocks, t, packed = MODEL_CASES[case]
    if blocks is not None:
        monkeypatch.setattr(attn, "DEFAULT_BLOCK_Q", blocks[0])
        monkeypatch.setattr(attn, "DEFAULT_BLOCK_K", blocks[1])
    dense, chunked = _tiny_pair(attn_softcap=softcap)
    assert dense.cfg.qk_norm and dense.cfg.n_kv_heads < dense.cfg.n_heads
    rng = np.random.default_rng(11)
    b = 2 if packed else 1
    tokens = jnp.asarray(rng.integers(0, dense.cfg.vocab_size, (b, t)), jnp.int32)
    seg = positions = None
    if packed:
        seg = _packed_segments(rng, b, t, 3)
        starts = np.maximum.accumulate(
            np.where(np.diff(np.asarray(seg), prepend=0, axis=1) != 0, np.arange(t), 0), axis=1)
        positions = jnp.asarray(np.arange(t) - starts, jnp.int32)

    def logits_and_grads(model):
        graphdef, params = nnx.split(model, nnx.Param)

        def loss(params):
            logits = nnx.merge(graphdef, params)(tokens, positions, seg).logits
            return jnp.mean(jax.nn.log_softmax(logits)[..., 0]), logits

        (_, logits), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(params)
        return logits, grads

    logits_d, grads_d = logits_and_grads(dense)
    logits_c, grads_c = logits_and_grads(chunked)
    np.testing.assert_allclose(logits_c, logits_d, **TOL)
    flat_d = jax.tree_util.tree_leaves_with_path(grads_d)
    flat_c = jax.tree_util.tree_leaves(grads_c)
    assert len(flat_d) == len(flat_c)
    for (path, gd), gc in zip(flat_d, flat_c, strict=True):
        np.testing.assert_allclose(gc, gd, **TOL, err_msg=jax.tree_util.keystr(path))


def test_cudnn_request_that_cannot_run_is_config_error():
    """On CPU: no GPU. On a GPU: this float32 model is not a cuDNN dtype. Both name the field."""
    cfg = dataclasses.replace(preset("tiny"), attention="cudnn")
    with pytest.raises(ConfigError) as e:
        Transformer(cfg, rngs=nnx.Rngs(0))
    assert e.value.field == "model.attention"
    assert "chunked" in str(e.value)  # the fix is named
    if jax.default_backend() == "cpu":
        assert "GPU" in str(e.value)


def test_unknown_attention_is_rejected_by_validation():
    with pytest.raises(ConfigError) as e:
        validate_model(dataclasses.replace(preset("tiny"), attention="flash"))
    assert e.value.field == "model.attention"
    validate_model(dataclasses.replace(preset("tiny"), attention="auto"))


def test_auto_policy():
    res = dict(head_dim=256, softcap=None)
    cpu_long = resolve_implementation("auto", dtype="float32", seq_len=attn.AUTO_CHUNKED_MIN_T,
                                      backend="cpu", **res)
    cpu_short = resolve_implementation("auto", dtype="float32",
                                       seq_len=attn.AUTO_CHUNKED_MIN_T - 1, backend="cpu", **res)
    assert (cpu_long, cpu_short) == ("chunked", "dense")
    assert resolve_implementation("auto", dtype="bfloat16", seq_len=64, backend="gpu", **res) == "cudnn"
    # What cuDNN cannot do goes to the chunked kernel on GPU, whatever T.
    assert resolve_implementation("auto", dtype="float32", seq_len=64, backend="gpu", **res) == "chunked"
    assert resolve_implementation("auto", dtype="bfloat16", seq_len=64, backend="gpu",
                                  head_dim=256, softcap=50.0) == "chunked"
    assert resolve_implementation("auto", dtype="bfloat16", seq_len=64, backend="gpu",
                                  head_dim=512, softcap=None) == "chunked"
    assert resolve_implementation("dense", dtype="bfloat16", seq_len=8192, backend="gpu", **res) == "dense"


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="cuDNN attention needs an NVIDIA GPU")
@pytest.mark.parametrize("window,packed", [(None, False), (64, False), (None, True), (48, True)])
def test_cudnn_matches_dense_bf16(window, packed):
    """bf16 inputs, cuDNN vs the dense reference computed in float32 from the same bf16 values.

    Tolerance 2e-2 absolute on outputs of unit scale and 5e-2 relative-to-max on
    gradients: bf16 has 8 mantissa bits (~4e-3 relative per rounding) and cuDNN
    rounds the probabilities to bf16 before PV.
    """
    rng = np.random.default_rng(3)
    t = 256
    q, k, v = _qkv(rng, 2, t, 4, 1, 64, jnp.bfloat16)
    q = q * 64 ** -0.5
    seg = _packed_segments(rng, 2, t, 3) if packed else None
    cot = jnp.asarray(rng.normal(size=q.shape), jnp.float32)

    def grads(fn, dtype):
        def loss(q, k, v):
            out = fn(q.astype(dtype), k.astype(dtype), v.astype(dtype), seg, window=window)
            return jnp.sum(out.astype(jnp.float32) * cot)
        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(q, k, v)[1]

    out_c = attn.cudnn_attention(q, k, v, seg, window=window).astype(jnp.float32)
    out_d = dense_attention(*(x.astype(jnp.float32) for x in (q, k, v)), seg, window=window)
    np.testing.assert_allclose(out_c, out_d, atol=2e-2)
    grads_c = grads(attn.cudnn_attention, jnp.bfloat16)
    grads_d = grads(dense_attention, jnp.float32)
    for gc, gd in zip(grads_c, grads_d, strict=True):
        gc, gd = np.asarray(gc, np.float32), np.asarray(gd, np.float32)
        assert np.max(np.abs(gc - gd)) <= 5e-2 * np.max(np.abs(gd))
