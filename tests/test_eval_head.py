"""The fused head + log-softmax over vocabulary chunks equals the materialized one."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers.jaxpr_shapes import shapes

from hldstudy.eval.head import target_logprobs


@pytest.mark.parametrize("cap,vocab_block,row_block,direct", [
    (None, 64, 1024, 0), (30.0, 96, 7, 0), (None, 1000, 5, 0),  # chunked
    (None, 64, 1024, 1 << 25), (30.0, 96, 7, 1 << 25)])  # small enough for one matmul
def test_matches_materialized_log_softmax(cap, vocab_block, row_block, direct):
    rng = np.random.default_rng(0)
    n, d, vocab = 23, 16, 333  # neither a multiple of the blocks: clamped last chunk, row padding
    h = jnp.asarray(rng.standard_normal((n, d)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((d, vocab)) * 2, jnp.float32)
    z = h @ w
    if cap is not None:
        z = cap * jnp.tanh(z / cap)
    targets = rng.integers(0, vocab, n)
    targets[:4] = np.asarray(jnp.argmax(z[:4], -1))  # some rows whose target is the argmax
    targets[4] = vocab - 1  # the last column (inside the clamped overlap)
    want = np.asarray(jax.nn.log_softmax(z, -1))[np.arange(n), targets]
    for weight, vocab_major in ((w, False), (w.T, True)):  # [D, V], or a tied [V, D]
        logp, greedy = target_logprobs(h, weight, jnp.asarray(targets), cap=cap,
                                       vocab_block=vocab_block, row_block=row_block,
                                       direct_logits=direct, vocab_major=vocab_major)
        np.testing.assert_allclose(np.asarray(logp), want, rtol=1e-5, atol=1e-5)
        np.testing.assert_array_equal(np.asarray(greedy),
                                      np.asarray(jnp.argmax(z, -1)) == targets)
        assert np.asarray(greedy)[:4].all() and logp.shape == (n,)


def test_ties_pick_the_first_column_like_argmax():
    h = jnp.ones((2, 1), jnp.float32)
    w = jnp.zeros((1, 10), jnp.float32).at[0, 3].set(1.0).at[0, 8].set(1.0)  # tie in two chunks
    for direct in (0, 1 << 25):
        logp, greedy = target_logprobs(h, w, jnp.asarray([3, 8]), vocab_block=4,
                                       direct_logits=direct)
        assert np.asarray(greedy).tolist() == [True, False]
        np.testing.assert_allclose(np.asarray(logp),
                                   np.asarray(jax.nn.log_softmax(h @ w, -1))[:, 3], rtol=1e-6)


def test_the_scorer_never_builds_positions_by_vocab():
    """Only gathered rows ever meet the vocabulary, never the B x T context: the body's
    program computes nothing vocabulary-wide, and the head's at most HEAD_ROWS rows."""
    from flax import nnx

    from hldstudy.eval.adapter import HEAD_ROWS, _head_at, _hidden_at
    from hldstudy.eval.testing import init_model, tiny_config

    cfg = tiny_config(vocab_size=384).model
    graphdef, state = nnx.split(init_model(cfg, 0))
    b, t, k = 4, 256, 8
    body = jax.make_jaxpr(_hidden_at, static_argnums=0)(
        graphdef, state, jnp.zeros((b, t), jnp.int32), jnp.zeros((b, k), jnp.int32)).jaxpr
    assert [s for s in shapes(body) if cfg.vocab_size in s] == []  # the table is an input
    head = jax.make_jaxpr(_head_at, static_argnums=0)(
        graphdef, state, jnp.zeros((HEAD_ROWS, cfg.d_model)), jnp.zeros(HEAD_ROWS, jnp.int32)
    ).jaxpr
    with_vocab = [s for s in shapes(head) if cfg.vocab_size in s]
    assert with_vocab  # the head is in there
    rows = [int(np.prod(s)) // cfg.vocab_size for s in with_vocab]
    assert max(r for r in rows if r != cfg.d_model) <= HEAD_ROWS < b * t, with_vocab
