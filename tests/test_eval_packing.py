"""The scorer's shared contexts: continuations of one context scored as branches of one
model row (`hldstudy.eval.packing.branch_rows`, masked apart by
`hldstudy.model.attention.BranchSegments`) give each request the log-probabilities of its
own plain row, on the dense and chunked attention paths and inside a sliding window."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hldstudy.eval import packing
from hldstudy.eval.adapter import Scorer
from hldstudy.eval.testing import init_model, tiny_config
from hldstudy.model.attention import BranchSegments, attention_mask


def test_branch_rows_lay_the_context_once_and_each_branch_after_it():
    ctx = [1, 2, 3]
    rows = [(ctx + [7, 8], 2), (ctx + [9], 1), (ctx + [4, 5, 6], 3), ([5, 5, 7], 1)]
    packed = packing.branch_rows(rows, limit=64, max_scored=64)
    assert len(packed) == 2
    p = packed[0]
    assert p.tokens == [1, 2, 3, 7, 4, 5]  # branch inputs: all but each one's last token
    assert p.positions == [0, 1, 2, 3, 3, 4]
    assert p.bits == [0b111] * 3 + [0b001] + [0b100] * 2
    assert p.index == [2, 3, 2, 2, 4, 5]  # first token of each branch at the context's end
    assert p.targets == [7, 8, 9, 4, 5, 6] and p.where == [0, 1, 2, 3, 4, 5]
    assert p.requests == 3 and packed[1].tokens == [5, 5] and packed[1].where == [6]
    # a second branch only while the row stays within the limit; at most MAX_BRANCHES
    assert [len(q.tokens) for q in packing.branch_rows(rows[:3], limit=5, max_scored=64)] \
        == [4, 5]
    many = [(ctx + [t], 1) for t in range(40)]
    assert [q.requests for q in packing.branch_rows(many, limit=64, max_scored=64)] == [31, 9]


def test_branch_segments_mask_branches_apart_and_share_the_context():
    bits = BranchSegments(jnp.asarray([[0b11, 0b11, 0b01, 0b10, 0]]))
    m = np.asarray(attention_mask(bits, None))[0].astype(int)
    assert m.tolist() == [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0],
                          [1, 1, 0, 1, 0], [0, 0, 0, 0, 0]]


def _plain_logprobs(model, seq):
    logits = model(jnp.asarray([seq[:-1]])).logits[0]
    lp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return np.asarray(lp)[np.arange(len(seq) - 1), seq[1:]]


@pytest.mark.parametrize("attention,window", [("dense", None), ("chunked", None),
                                              ("dense", 12)])
def test_branches_score_what_their_plain_rows_score(attention, window):
    over = {"attention": attention, "sliding_window": window, "global_every": 2}
    model = init_model(tiny_config(**over).model, 3)
    scorer = Scorer(model, batch_size=2, max_length=64)
    assert scorer.branch_limit == (window or 64)
    rng = np.random.default_rng(0)
    rows = []
    for c in (5, 9, 20):
        ctx = list(rng.integers(3, 300, c))
        for n in (1, 3, 6, 2):
            rows.append((ctx + list(rng.integers(3, 300, n)), n))
    if attention == "chunked":
        import hldstudy.model.attention as att

        att_blocks = (att.DEFAULT_BLOCK_Q, att.DEFAULT_BLOCK_K)
        att.DEFAULT_BLOCK_Q = att.DEFAULT_BLOCK_K = 8  # several blocks per row
    try:
        got = scorer.score_rows(rows)
    finally:
        if attention == "chunked":
            att.DEFAULT_BLOCK_Q, att.DEFAULT_BLOCK_K = att_blocks
    assert len(scorer.pack(rows)) < len(rows)  # contexts were shared
    for (seq, n), (lp, _) in zip(rows, got, strict=True):
        want = _plain_logprobs(model, seq)[-n:].sum()
        np.testing.assert_allclose(lp, want, rtol=1e-5, atol=2e-5)


def test_a_model_with_recurrent_layers_shares_prefixes_only():
    from hldstudy.model.presets import preset

    cfg = tiny_config().model
    qwen = preset("tiny-qwen", vocab_size=cfg.vocab_size, max_seq_len=64)
    scorer = Scorer(init_model(qwen, 0), batch_size=2, max_length=64)
    assert scorer.branch_limit == 0
    rows = [([1, 2, 3, 4], 1), ([1, 2, 3, 5], 1), ([1, 2, 3, 6, 7], 2)]
    assert all(p.bits is None for p in scorer.pack(rows))
