"""Data pipeline: packing invariants, determinism, resume, sources and errors."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hldstudy.config import DataConfig
from hldstudy.data import packing, sources
from hldstudy.data.pipeline import (
    RowFile,
    RowsBatchStream,
    StreamingBatchStream,
    encode_documents,
    make_batches,
    prepare_data,
    unigram_entropy,
)
from hldstudy.data.synthetic import generate_documents
from hldstudy.data.tfds_corpus import build_tfds
from hldstudy.data.tokenizer import train_tokenizer
from hldstudy.errors import ConfigError, InputError

# --------------------------------------------------------------------------- #
# Helpers
# --------------------------------------------------------------------------- #


def check_batch(b: dict, B: int, T: int) -> None:
    assert set(b) == set(packing.BATCH_KEYS)
    for k in ("tokens", "targets", "positions", "segment_ids"):
        assert b[k].shape == (B, T) and b[k].dtype == np.int32, k
    assert b["mask"].shape == (B, T) and b["mask"].dtype == np.float32
    seg, pos, m = b["segment_ids"], b["positions"], b["mask"]
    for r in range(B):
        s = seg[r]
        nz = s[s != 0]
        # Segment ids are 1, 2, 3... in order; padding only at the end of a row.
        if nz.size:
            assert nz[0] == 1 and np.all(np.diff(nz) >= 0) and np.all(np.diff(nz) <= 1)
            assert np.all(s[: nz.size] != 0) and np.all(s[nz.size:] == 0)
        for t in range(T):
            if s[t] == 0:
                assert pos[r, t] == 0 and m[r, t] == 0
            elif t == 0 or s[t - 1] != s[t]:
                assert pos[r, t] == 0
            else:
                assert pos[r, t] == pos[r, t - 1] + 1
        # Targets are the inputs shifted by one within a row.
        assert np.array_equal(b["targets"][r, :-1], b["tokens"][r, 1:])
        # Mask = same-segment successor; a segment's last input has mask 0.
        expect = (s[:-1] != 0) & (s[1:] == s[:-1])
        assert np.array_equal(m[r, :-1] > 0, expect)


def transitions(b: dict) -> list[tuple[int, int]]:
    sel = b["mask"] > 0
    return list(zip(b["tokens"][sel].tolist(), b["targets"][sel].tolist(), strict=False))


def doc_transitions(docs) -> Counter:
    c = Counter()
    for d in docs:
        d = list(d)
        c.update(zip(d[:-1], d[1:], strict=False))
    return c


def same(a: dict, b: dict) -> bool:
    return all(np.array_equal(a[k], b[k]) for k in packing.BATCH_KEYS)


# --------------------------------------------------------------------------- #
# Packing
# --------------------------------------------------------------------------- #

docs_strategy = st.lists(st.lists(st.integers(4, 60), min_size=0, max_size=40), min_size=1,
                         max_size=30)


@settings(max_examples=40, deadline=None)
@given(docs=docs_strategy, seq_len=st.integers(1, 24), open_rows=st.integers(1, 4))
def test_first_fit_packing_invariants(docs, seq_len, open_rows):
    docs = [d + [1] for d in docs]  # EOS
    tok, seg = packing.pack_first_fit(docs, seq_len, open_rows=open_rows)
    if tok.shape[0] == 0:
        assert all(len(d) < 2 for d in docs)
        return
    b = packing.rows_to_batch(tok, seg)
    check_batch(b, tok.shape[0], seq_len)
    # Every within-document transition is trained exactly once (incl. "-> EOS"),
    # and no cross-document transition is.
    assert Counter(transitions(b)) == doc_transitions(docs)
    # Documents that fit in a row are never split.
    n_segments = int(sum(len(np.unique(s[s != 0])) for s in seg))
    n_splits = sum(max(0, -(-(len(d) - 1) // seq_len) - 1) for d in docs if len(d) >= 2)
    assert n_segments == sum(len(d) >= 2 for d in docs) + n_splits


@settings(max_examples=40, deadline=None)
@given(docs=docs_strategy, seq_len=st.integers(1, 24), cross=st.booleans())
def test_stream_packer_invariants(docs, seq_len, cross):
    docs = [d + [1] for d in docs]
    p = packing.StreamPacker(lambda i: docs[i] if i < len(docs) else None, seq_len,
                             cross_document=cross)
    rows = []
    while (r := p.next_row()) is not None:
        rows.append(r)
    if not rows:
        return
    b = packing.rows_to_batch(np.stack([r[0] for r in rows]), np.stack([r[1] for r in rows]))
    check_batch(b, len(rows), seq_len)
    if cross:  # one token stream: every transition, in order
        flat = [t for d in docs for t in d]
        assert transitions(b) == list(zip(flat[:-1], flat[1:], strict=False))
        assert np.all(b["segment_ids"][:, 0] == 1)
    else:
        assert transitions(b) == [t for d in docs for t in zip(d[:-1], d[1:], strict=False)]


def test_packing_example():
    docs = [[5, 6, 7, 1], [8, 9, 1], [10, 11, 12, 13, 14, 15, 16, 1]]
    tok, seg = packing.pack_first_fit(docs, seq_len=7)
    b = packing.rows_to_batch(tok, seg)
    # Row 0: doc0 + doc1 (7 tokens) + pad; row 1: doc2 (8 tokens, full).
    assert tok[0].tolist() == [5, 6, 7, 1, 8, 9, 1, 0]
    assert b["tokens"][0].tolist() == [5, 6, 7, 1, 8, 9, 1]
    assert b["targets"][0].tolist() == [6, 7, 1, 8, 9, 1, 0]
    assert b["segment_ids"][0].tolist() == [1, 1, 1, 1, 2, 2, 2]
    assert b["positions"][0].tolist() == [0, 1, 2, 3, 0, 1, 2]
    assert b["mask"][0].tolist() == [1, 1, 1, 0, 1, 1, 0]
    assert b["mask"][1].tolist() == [1] * 7
    # A long document continues in the next row, overlapping by one token,
    # positions restarting at 0.
    tok, seg = packing.pack_first_fit([list(range(10, 22)) + [1]], seq_len=7)
    b = packing.rows_to_batch(tok, seg)
    assert tok[0].tolist() == list(range(10, 18))
    assert tok[1][:6].tolist() == [17, 18, 19, 20, 21, 1]
    assert b["positions"][1].tolist() == [0, 1, 2, 3, 4, 5, 0]


# --------------------------------------------------------------------------- #
# Synthetic end to end: determinism, resume, caching
# --------------------------------------------------------------------------- #


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return train_tokenizer(generate_documents(600, seed=0), 360,
                           tmp_path_factory.mktemp("tok") / "spm")


def small_cfg(tokenizer=None, **kw) -> DataConfig:
    base = dict(source="synthetic", synthetic_docs=400, synthetic_valid_docs=50, seq_len=48,
                batch_size=4, tokenizer_vocab_size=360, seed=0)
    if tokenizer is not None:
        base["tokenizer"] = str(tokenizer.model_path)
    base.update(kw)
    return DataConfig(**base)


def test_prepare_data_synthetic(tmp_path):
    cfg = small_cfg()
    bundle = prepare_data(cfg, tmp_path)
    assert (tmp_path / "tokenizer.model").exists()
    assert bundle.tokenizer.vocab_size == 360
    assert isinstance(bundle.train, RowsBatchStream)
    b = next(bundle.train)
    check_batch(b, 4, 48)
    assert b["mask"].sum() > 0.7 * b["mask"].size
    # Decoded rows are real text.
    assert "live" in " ".join(bundle.tokenizer.decode(r) for r in bundle.train.rows[:20])
    # Validation: fixed order, one pass, last batch padded with empty rows.
    vb = bundle.valid_batches()
    assert len(vb) == bundle.valid.num_batches == -(-bundle.valid.num_rows // 4)
    assert all(same(x, y) for x, y in zip(vb, bundle.valid_batches(3), strict=False))
    check_batch(vb[-1], 4, 48)
    # Every validation transition appears exactly once.
    vdocs = encode_documents(bundle.tokenizer, generate_documents(50, 0, split="validation"))
    assert Counter(t for x in vb for t in transitions(x)) == doc_transitions(vdocs)
    # Reuse: the tokenizer and packed rows come from the workdir the second time.
    mtime = (tmp_path / "tokenizer.model").stat().st_mtime_ns
    again = prepare_data(cfg, tmp_path)
    assert (tmp_path / "tokenizer.model").stat().st_mtime_ns == mtime
    assert isinstance(again.train.rows, RowFile)  # read from disk, row by row
    assert same(again.train.batch_at(5), bundle.train.batch_at(5))
    assert len(list((tmp_path / "synthetic").glob("*.jsonl"))) == 2


def test_determinism_across_processes_and_seeds(tmp_path, tokenizer):
    a = prepare_data(small_cfg(tokenizer), tmp_path / "a").train
    b = prepare_data(small_cfg(tokenizer), tmp_path / "b").train
    for i in (0, 1, 7, 50, 3):
        assert same(a.batch_at(i), b.batch_at(i))
    c = prepare_data(small_cfg(tokenizer, seed=1), tmp_path / "c").train
    assert not same(a.batch_at(0), c.batch_at(0))
    # The data seed only shuffles: the corpus (rows) is the same.
    assert np.array_equal(np.asarray(a.rows), np.asarray(c.rows))
    d = prepare_data(small_cfg(tokenizer, synthetic_seed=1), tmp_path / "d").train
    assert not np.array_equal(np.asarray(a.rows[:5]), np.asarray(d.rows[:5]))


def test_epochs_cover_every_row_once(tokenizer):
    s = make_batches(small_cfg(tokenizer, batch_size=3), tokenizer, "train")
    N = s.num_rows
    steps = -(-2 * N // 3)
    idx = np.concatenate([s.row_indices(i) for i in range(steps)])
    assert sorted(idx[:N].tolist()) == list(range(N))
    assert sorted(idx[N:2 * N].tolist()) == list(range(N))
    assert not np.array_equal(idx[:N], idx[N:2 * N])  # reshuffled per epoch


def test_resume_rows_stream(tokenizer):
    cfg = small_cfg(tokenizer)
    ref = make_batches(cfg, tokenizer, "train")
    expected = [next(ref) for _ in range(40)]
    s = make_batches(cfg, tokenizer, "train")
    for _ in range(17):
        next(s)
    state = json.loads(json.dumps(s.get_state()))
    resumed = make_batches(cfg, tokenizer, "train")
    resumed.set_state(state)
    for i in range(17, 40):
        assert same(next(resumed), expected[i])
    assert resumed.get_state()["step"] == 40
    other = make_batches(replace(cfg, seq_len=32), tokenizer, "train")
    with pytest.raises(InputError, match="seq_len"):
        other.set_state(state)
    with pytest.raises(InputError, match="seed"):
        make_batches(replace(cfg, seed=9), tokenizer, "train").set_state(state)


def test_no_packing_mode(tokenizer):
    s = make_batches(small_cfg(tokenizer, packing=False), tokenizer, "validation")
    vb = s.valid_batches()
    b = vb[0]
    check_batch(b, 4, 48)
    assert np.all(b["segment_ids"] == 1) and np.all(b["mask"] == 1)
    assert np.array_equal(b["positions"][0], np.arange(48))
    docs = encode_documents(tokenizer, generate_documents(50, 0, split="validation"))
    flat = [t for d in docs for t in d.tolist()]
    assert [t for x in vb for t in transitions(x)] == list(zip(flat[:-1], flat[1:], strict=False))


def test_add_bos(tokenizer):
    s = make_batches(small_cfg(tokenizer, add_bos=True), tokenizer, "validation")
    vb = s.valid_batches()
    tokens = np.concatenate([b["tokens"] for b in vb])
    positions = np.concatenate([b["positions"] for b in vb])
    segs = np.concatenate([b["segment_ids"] for b in vb])
    bos = (tokens == tokenizer.bos_id) & (segs > 0)
    assert bos.sum() == 50  # one per document, each at a document start
    assert np.all(positions[bos] == 0)


def test_unigram_entropy(tokenizer):
    V = 16
    assert unigram_entropy(np.arange(V).repeat(10), V) == pytest.approx(np.log(V))
    assert unigram_entropy([3, 3, 3], V) == 0.0
    s = make_batches(small_cfg(tokenizer), tokenizer, "validation")
    h_batches = unigram_entropy(s.valid_batches(), tokenizer.vocab_size)
    h_stream = unigram_entropy(s, tokenizer.vocab_size)
    assert h_batches == pytest.approx(h_stream)
    assert 2.0 < h_batches < np.log(tokenizer.vocab_size)


# --------------------------------------------------------------------------- #
# Local sources
# --------------------------------------------------------------------------- #


def test_text_source(tmp_path, tokenizer):
    d = tmp_path / "texts"
    d.mkdir()
    (d / "a.txt").write_text("First doc line one.\nStill first doc.\n\nSecond doc.\n  \n\nThird.")
    (d / "b.txt").write_text("Fourth doc in another file.")
    (d / "ignored.md").write_text("not read")
    cfg = DataConfig(source="text", path=str(d), valid_holdout_docs=1, seq_len=16, batch_size=2,
                     tokenizer=str(tokenizer.model_path))
    train = sources.load_corpus(cfg, "train")
    assert train.texts == ["First doc line one.\nStill first doc.", "Second doc.", "Third."]
    assert sources.load_corpus(cfg, "validation").texts == ["Fourth doc in another file."]
    # Globs and single files; the validation split can be a separate path.
    g = replace(cfg, path=str(d / "*.txt"), valid_path=str(d / "b.txt"))
    assert len(sources.load_corpus(g, "train")) == 4
    check_batch(make_batches(g, tokenizer, "train").batch_at(0), 2, 16)
    with pytest.raises(InputError, match="data.path"):
        sources.load_corpus(replace(cfg, path=str(tmp_path / "nope")), "train")
    with pytest.raises(InputError, match="matches no files"):
        sources.load_corpus(replace(cfg, path=str(tmp_path / "*.none")), "train")
    (tmp_path / "empty.txt").write_text("\n\n   \n")
    with pytest.raises(InputError, match="no documents"):
        prepare_data(replace(cfg, path=str(tmp_path / "empty.txt")), tmp_path / "run")


def test_jsonl_source(tmp_path, tokenizer, monkeypatch):
    f = tmp_path / "data.jsonl"
    rows = [{"text": t, "id": i} for i, t in enumerate(generate_documents(30, seed=5))]
    f.write_text("".join(json.dumps(r) + "\n" for r in rows) + "\n")
    cfg = DataConfig(source="jsonl", path=str(f), seq_len=32, batch_size=2,
                     tokenizer=str(tokenizer.model_path), valid_holdout_docs=5)
    train, valid = sources.load_corpus(cfg, "train"), sources.load_corpus(cfg, "validation")
    assert train.texts + valid.texts == [r["text"] for r in rows]
    assert len(valid) == 3  # at most 10% held out
    bundle = prepare_data(cfg, tmp_path / "run")
    check_batch(next(bundle.train), 2, 32)
    # With packed rows cached, a restart does not read the corpus again.
    with monkeypatch.context() as m:
        m.setattr(sources, "iter_jsonl_files", lambda *a: pytest.fail("corpus re-read"))
        again = prepare_data(cfg, tmp_path / "run")
        assert same(again.train.batch_at(3), bundle.train.batch_at(3))
    assert sources.load_corpus(replace(cfg, max_docs=10), "train").texts == [
        r["text"] for r in rows[:9]]
    with pytest.raises(ConfigError, match="data.text_field") as e:
        sources.load_corpus(replace(cfg, text_field="body"), "train")
    assert "data.jsonl:1" in str(e.value) and "id, text" in str(e.value)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{not json\n')
    with pytest.raises(InputError, match="bad.jsonl:2"):
        len(sources.load_corpus(replace(cfg, path=str(bad)), "train"))
    with pytest.raises(InputError, match="data.path.*does not exist"):
        prepare_data(replace(cfg, path=str(tmp_path / "missing.jsonl")), tmp_path / "run2")


def test_hf_source(tmp_path, tokenizer):
    import datasets

    texts = generate_documents(40, seed=7)
    dd = datasets.DatasetDict({
        "train": datasets.Dataset.from_dict({"content": texts[:30], "n": list(range(30))}),
        "validation": datasets.Dataset.from_dict({"content": texts[30:], "n": list(range(10))}),
    })
    dd.save_to_disk(str(tmp_path / "dd"))
    cfg = DataConfig(source="hf", path=str(tmp_path / "dd"), text_field="content", seq_len=32,
                     batch_size=2, tokenizer=str(tokenizer.model_path))
    assert sources.load_corpus(cfg, "train", tmp_path).texts == texts[:30]
    assert sources.load_corpus(cfg, "validation", tmp_path).texts == texts[30:]
    bundle = prepare_data(cfg, tmp_path / "run")
    check_batch(next(bundle.train), 2, 32)
    # A single saved Dataset: validation is held out from it.
    dd["train"].save_to_disk(str(tmp_path / "single"))
    single = replace(cfg, path=str(tmp_path / "single"), valid_holdout_docs=2)
    assert sources.load_corpus(single, "validation", tmp_path).texts == texts[28:30]
    # Local parquet / jsonl files through datasets.load_dataset.
    dd["train"].to_parquet(str(tmp_path / "part.parquet"))
    pq = replace(cfg, path=str(tmp_path / "part.parquet"))
    assert sources.load_corpus(pq, "train", tmp_path).texts == texts[:27]
    with pytest.raises(ConfigError, match="data.text_field.*content, n|data.text_field"):
        sources.load_corpus(replace(cfg, text_field="text"), "train", tmp_path)
    with pytest.raises(InputError, match="data.path"):
        sources.load_corpus(replace(cfg, path=str(tmp_path / "missing")), "train", tmp_path)


# --------------------------------------------------------------------------- #
# TFDS (array_record) through grain
# --------------------------------------------------------------------------- #

@pytest.fixture(scope="module")
def tfds_dir(tmp_path_factory):
    return build_tfds(tmp_path_factory.mktemp("tfds"))


def tfds_cfg(tfds_dir, tokenizer, **kw) -> DataConfig:
    base = dict(source="tfds", path=str(tfds_dir), tfds_name="hld_tiny_c4/en", seq_len=40,
                batch_size=3, tokenizer=str(tokenizer.model_path), seed=0)
    base.update(kw)
    return DataConfig(**base)


def test_tfds_source_reads_records(tfds_dir, tokenizer):
    cfg = tfds_cfg(tfds_dir, tokenizer)
    docs = sources.tfds_documents(cfg, "validation")
    assert len(docs) == 12
    assert sorted(docs[i] for i in range(12)) == sorted(
        generate_documents(12, seed=11, split="validation"))
    shuffled = sources.tfds_documents(cfg, "train", shuffle_seed=0)
    epoch0 = [shuffled[i] for i in range(120)]
    epoch1 = [shuffled[i] for i in range(120, 240)]
    assert sorted(epoch0) == sorted(epoch1) == sorted(generate_documents(120, 11))
    assert epoch0 != epoch1


def test_tfds_stream_determinism_and_resume(tfds_dir, tokenizer, tmp_path):
    cfg = tfds_cfg(tfds_dir, tokenizer)
    bundle = prepare_data(cfg, tmp_path)
    assert isinstance(bundle.train, StreamingBatchStream)
    ref = [next(bundle.train) for _ in range(30)]
    for b in ref[:5]:
        check_batch(b, 3, 40)
    # An independent stream (e.g. a disaggregated teacher) sees the same batches,
    # in any access order.
    other = make_batches(cfg, tokenizer, "train")
    for i in (7, 2, 29, 3):
        assert same(other.batch_at(i), ref[i])
    # Resume from a JSON state after 11 batches.
    s = make_batches(cfg, tokenizer, "train")
    for _ in range(11):
        next(s)
    state = json.loads(json.dumps(s.get_state()))
    assert state["cursor"][0] > 0
    r = make_batches(cfg, tokenizer, "train")
    r.set_state(state)
    assert r.packer.cursor == tuple(state["cursor"])  # restored directly, nothing replayed
    for i in range(11, 30):
        assert same(next(r), ref[i])
    assert not same(make_batches(replace(cfg, seed=1), tokenizer, "train").batch_at(0), ref[0])
    # Validation: in order, finite, every transition once.
    vb = bundle.valid_batches()
    assert len(vb) == bundle.valid.num_batches and len(bundle.valid_batches(100)) == len(vb)
    vdocs = encode_documents(tokenizer, [sources.tfds_documents(cfg, "validation")[i]
                                         for i in range(12)])
    assert [t for x in vb for t in transitions(x)] == [
        t for d in vdocs for t in zip(d[:-1].tolist(), d[1:].tolist(), strict=False)]


def test_tfds_trains_tokenizer_and_errors(tfds_dir, tokenizer, tmp_path):
    cfg = replace(tfds_cfg(tfds_dir, tokenizer), tokenizer=None, tokenizer_vocab_size=320)
    bundle = prepare_data(cfg, tmp_path)
    assert (tmp_path / "tokenizer.model").exists() and bundle.tokenizer.vocab_size == 320
    with pytest.raises(InputError, match="data.path.*does not exist"):
        sources.tfds_documents(replace(cfg, path=str(tmp_path / "nope")), "train")
    with pytest.raises(InputError, match="data.path.*c4/en"):
        sources.tfds_documents(replace(cfg, tfds_name="c4/en"), "train")
    with pytest.raises(ConfigError, match="data.text_field.*text, url"):
        sources.tfds_documents(replace(cfg, text_field="body"), "train")
