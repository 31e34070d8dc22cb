"""lm-eval adapter math: loglikelihood, rolling windows, uniform perplexity, greedy decoding."""

import math
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from hldstudy.errors import InputError
from hldstudy.eval.adapter import HLDStudyLM, compiled_scorers, length_buckets
from hldstudy.eval.perplexity import corpus_perplexity
from hldstudy.eval.testing import init_model, tiny_config, tiny_tokenizer

MAXLEN = 64


def _req(*args):
    return SimpleNamespace(args=tuple(args))


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return tiny_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def lm(tokenizer):
    model = init_model(tiny_config().model, 1)
    return HLDStudyLM(model=model, tokenizer=tokenizer, max_length=MAXLEN, batch_size=4,
                      progress=False)


@nnx.jit
def _logits(model, tokens):
    return model(tokens).logits


def _model_logits(model, ids):
    """The model's own logits for ids, run right-padded to MAXLEN (causal: padding after
    the last token changes nothing) so the reference compiles once."""
    assert len(ids) <= MAXLEN
    x = np.zeros((1, MAXLEN), np.int32)
    x[0, :len(ids)] = ids
    return _logits(model, jnp.asarray(x))[0, :len(ids)]


def _direct_logprobs(model, seq):
    """Per-token log p(seq[t+1] | seq[:t+1]) and greedy flags from the model's own logits."""
    logits = _model_logits(model, seq[:-1])
    logp = jax.nn.log_softmax(logits, axis=-1)
    tgt = np.asarray(seq[1:])
    lp = np.asarray(logp)[np.arange(len(tgt)), tgt].astype(np.float64)
    greedy = np.asarray(jnp.argmax(logits, -1)) == tgt
    return lp, greedy


def test_loglikelihood_matches_the_model(lm):
    long_ctx = " ".join(["Mara lives in Oslo and has two cats."] * 12)  # > 64 tokens
    reqs = [("Mara lives in", " Oslo."), ("", "Tom has three dogs."),
            ("What is Tom's favorite color? His favorite color is ", "blue."),
            (long_ctx, " She likes soup."), ("The dogs near the old bridge", " are happy.")]
    got = lm.loglikelihood([_req(c, x) for c, x in reqs])
    for (ctx, cont), (lp, greedy) in zip(reqs, got, strict=True):
        ctx_ids, cont_ids = lm.encode_pair(ctx, cont)
        if not ctx:
            assert ctx_ids == [lm.tokenizer.eos_id]  # empty context -> EOS prefix
        full = (ctx_ids + cont_ids)[-(MAXLEN + 1):]  # context truncated from the left
        want, want_greedy = _direct_logprobs(lm.model, full)
        n = len(cont_ids)
        np.testing.assert_allclose(lp, want[-n:].sum(), rtol=1e-5, atol=1e-4)
        assert greedy == bool(want_greedy[-n:].all())
    # Trailing context spaces move to the continuation (lm-eval's convention).
    assert lm.encode_pair("Mara lives in ", "Oslo.") == lm.encode_pair("Mara lives in", " Oslo.")


def test_is_greedy_and_token_level(lm):
    ctx = lm.encode_context("Where does Mara live? Mara lives in")
    seq = list(ctx)
    for _ in range(3):  # the model's own greedy continuation
        logits = _model_logits(lm.model, seq)[-1]
        seq.append(int(jnp.argmax(logits)))
    cont = seq[len(ctx):]
    (lp_g, g), (lp_ng, ng) = lm.loglikelihood_tokens(
        [(ctx, cont), (ctx, cont[:2] + [(cont[2] + 1) % lm.scorer.vocab_size])])
    assert g is True and ng is False
    want, _ = _direct_logprobs(lm.model, seq)
    np.testing.assert_allclose(lp_g, want[-3:].sum(), rtol=1e-5, atol=1e-4)


def test_fixed_padded_shapes_no_recompile_per_request(lm):
    assert length_buckets(64) == [32, 48, 64] and length_buckets(2048)[-3:] == [1024, 1536, 2048]
    assert length_buckets(1000) == [32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1000]
    words = "a b c d e f g h i j k l m n o p q r s t u v w x y z".split()
    reqs = [_req(" ".join(words[:k]), " " + words[k % 26]) for k in range(1, 26)]
    lengths = {len(lm._row(*lm.encode_pair(*r.args))[0]) for r in reqs}
    assert len(lengths) >= 10
    before = compiled_scorers()
    lm.loglikelihood(reqs)
    lm.loglikelihood(reqs[::-1][:7])
    assert compiled_scorers() - before <= len(lm.scorer.buckets) * len(lm.scorer.scored)


def test_rolling_equals_sum_over_windows(lm):
    text = " ".join(f"Mara has {w} apples and Tom has {w} cats." for w in
                    ("two", "three", "four", "five", "six", "seven", "eight", "nine", "ten"))
    ids = lm.tokenizer.encode(text)
    assert len(ids) > 2 * MAXLEN
    (got,) = lm.loglikelihood_rolling([_req(text)])
    windows = lm.rolling_windows(ids)
    assert len(windows) >= 3
    # Every token is predicted exactly once, the first from the prefix token.
    assert [t for _, cont in windows for t in cont] == list(ids)
    assert windows[0][0] == [lm.prefix_token_id]
    total = 0.0
    for ctx, cont in windows:
        seq = list(ctx) + list(cont)
        assert len(seq) - 1 <= MAXLEN
        if ctx is not windows[0][0]:
            assert len(ctx) >= lm.rolling_context - 1  # documented context per window
        lp, _ = _direct_logprobs(lm.model, seq)
        total += lp[-len(cont):].sum()
    np.testing.assert_allclose(got, total, rtol=1e-5)
    # lm-eval's disjoint chunks are rolling_context=1.
    lm1 = HLDStudyLM(model=lm.model, tokenizer=lm.tokenizer, max_length=MAXLEN, batch_size=4,
                     rolling_context=1, progress=False)
    assert len(lm1.rolling_windows(ids)) == math.ceil(len(ids) / MAXLEN)


def test_uniform_model_has_perplexity_vocab_size(tokenizer):
    cfg = tiny_config()
    model = init_model(cfg.model, 0)
    model.embedding[...] = jnp.zeros_like(model.embedding[...])  # tied head -> logits all 0
    lm = HLDStudyLM(model=model, tokenizer=tokenizer, max_length=MAXLEN, batch_size=4,
                    progress=False)
    V = cfg.model.vocab_size
    text = "Mara lives in Oslo. " * 20
    n = len(tokenizer.encode(text))
    (ll,) = lm.loglikelihood_rolling([_req(text)])
    np.testing.assert_allclose(math.exp(-ll / n), V, rtol=1e-4)
    ppl = corpus_perplexity(lm, "synthetic_ppl", limit=8, progress=False)
    np.testing.assert_allclose(ppl["perplexity"], V, rtol=1e-4)
    assert ppl["tokens"] > 100


def test_generate_until_greedy_with_stop_sequences(lm):
    ctx = "Where does Mara live? Mara lives in"
    (free,) = lm.generate_until([_req(ctx, {"until": [], "max_gen_toks": 8})])
    ids = lm.encode_context(ctx)
    seq = list(ids)
    for _ in range(8):
        t = int(jnp.argmax(_model_logits(lm.model, seq)[-1]))
        if t == lm.tokenizer.eos_id:
            break
        seq.append(t)
    assert free == lm.tokenizer.decode(seq[len(ids):])
    assert len(free.strip()) >= 2  # fixed random weights: a deterministic continuation
    stop = free.strip()[1]
    cut, also = lm.generate_until([_req(ctx, {"until": [stop], "max_gen_toks": 8}),
                                  _req(ctx, {"until": "\n\n", "max_gen_toks": 8})])
    assert cut == free[:free.index(stop)]
    assert also == free.split("\n\n")[0]


def test_too_long_continuation_is_a_clear_error(lm):
    cont = " " + " ".join(["apples"] * 200)
    with pytest.raises(InputError, match="loglikelihood_rolling"):
        lm.loglikelihood([_req("Mara has", cont)])


def test_registered_and_imported_gemma_checkpoint(lm, tmp_path):
    from lm_eval.api.registry import get_model

    from hldstudy.model.importers import export_hf

    assert get_model("hldstudy") is HLDStudyLM
    export_hf(lm.model, tmp_path / "hf", tokenizer=lm.tokenizer)
    imported = get_model("hldstudy").create_from_arg_string(
        f"checkpoint={tmp_path / 'hf'},batch_size=4,max_length={MAXLEN},progress=False")
    assert imported.kind == "import" and imported.add_bos  # Gemma documents start with BOS
    assert imported.prefix_token_id == lm.tokenizer.bos_id
    reqs = [_req("Mara lives in", " Oslo."), _req("", "Tom has two cats.")]
    got = imported.loglikelihood(reqs)
    for r, (lp, _) in zip(reqs, got, strict=True):
        ctx, cont = imported.encode_pair(*r.args)
        assert ctx[0] == lm.tokenizer.bos_id
        want, _ = _direct_logprobs(lm.model, ctx + cont)
        np.testing.assert_allclose(lp, want[-len(cont):].sum(), rtol=1e-5, atol=1e-4)


def test_shared_prefixes_are_scored_in_one_row(lm):
    ctx = lm.encode_context("Mara lives in Oslo and has two cats. Her favourite letter is")
    cont = lm.encode_context("Mara Tom")[-2:]  # some token ids
    pairs = [(ctx, [cont[0]]), (ctx, [cont[1]]), (ctx, [cont[0]]),  # one-token choices
             (ctx, cont), (ctx[:5], ctx[5:7]), (ctx[:-3], [cont[1]])]
    rows = [lm._row(c, x) for c, x in pairs]
    groups = lm.scorer.share_prefixes(rows)
    # Every row's inputs are a prefix of row 3's (ctx + cont[0]): one forward row.
    assert len(groups) == 1 and groups[0][0] == 3 and sorted(groups[0]) == list(range(6))
    got = lm.loglikelihood_tokens(pairs)
    for (c, x), (lp, greedy) in zip(pairs, got, strict=True):
        want, want_greedy = _direct_logprobs(lm.model, c + x)
        np.testing.assert_allclose(lp, want[-len(x):].sum(), rtol=1e-5, atol=1e-4)
        assert greedy == bool(want_greedy[-len(x):].all())
    assert got[0] == got[2]
    # Unrelated rows stay apart.
    assert len(lm.scorer.share_prefixes([lm._row(ctx, [cont[0]]), lm._row(cont, ctx[:3])])) == 2


def test_a_diverged_models_perplexity_is_infinite_and_written_as_null():
    """exp overflows past ~709 nats a token: the perplexity is inf, not an OverflowError;
    the results file stays strict JSON (null) with a note."""
    import json as _json
    import math as _math

    from hldstudy.eval.perplexity import perplexity
    from hldstudy.eval.runner import json_safe

    assert perplexity(2.0) == _math.exp(2.0)
    assert perplexity(800.0) == _math.inf and perplexity(1e308) == _math.inf
    safe = json_safe({"valid_ppl": {"perplexity": _math.inf, "nll": 800.0, "tokens": 10.0}})
    text = _json.dumps(safe, allow_nan=False)  # refuses inf / nan: strict JSON
    assert _json.loads(text)["valid_ppl"] == {"perplexity": None, "nll": 800.0, "tokens": 10.0,
                                               "note": "perplexity is inf (written as null)"}
