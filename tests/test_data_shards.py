"""Prepared token shards: `hldstudy data prepare` (workers, kill -9 and rerun, manifest),
the lane-packed loader (determinism, per-process rows, the cursor), and bad input: a
corrupt record, another tokenizer, an empty corpus, documents longer than seq_len,
invalid UTF-8."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from array_record.python.array_record_module import ArrayRecordWriter
from helpers.runs import data_config

from hldstudy.data import prepare_data
from hldstudy.data.encoding import encode_documents
from hldstudy.data.prepare import prepare
from hldstudy.data.shards import MANIFEST, ShardReader, encode_record, read_manifest
from hldstudy.data.sources import load_corpus
from hldstudy.data.streams import ShardsBatchStream
from hldstudy.data.tokenizer import Tokenizer
from hldstudy.errors import ConfigError, InputError

ROOT = Path(__file__).resolve().parent.parent


def _shards_cfg(path, **kw):
    return data_config(source="shards", path=str(path), **kw)


@pytest.fixture(scope="module")
def shards(tmp_path_factory, tokenizer_path):
    """The shared synthetic corpus prepared with the shared tokenizer, 100 docs a shard."""
    out = tmp_path_factory.mktemp("shards") / "c4like"
    prepare(data_config(tokenizer_path), out, workers=2, docs_per_shard=100, progress=False)
    return out


def _all_records(directory: Path) -> dict[str, list[list[int]]]:
    m = read_manifest(directory)
    out = {}
    for name, part in m["splits"].items():
        r = ShardReader(directory, part["shards"])
        out[name] = [r[i].tolist() for i in range(len(r))]
    return out


def test_prepare_writes_every_document_once_with_a_manifest(shards, tokenizer_path):
    cfg = data_config(tokenizer_path)
    tok = Tokenizer.load(tokenizer_path)
    m = json.loads((shards / MANIFEST).read_text())
    assert m["tokenizer"]["fingerprint"] == tok.fingerprint()
    records = _all_records(shards)
    for name, split in (("train", "train"), ("valid", "validation")):
        want = encode_documents(tok, load_corpus(cfg, split).texts)
        assert records[name] == [d.tolist() for d in want]  # in order, document boundaries kept
        assert m["splits"][name]["documents"] == len(want)
        assert m["splits"][name]["tokens"] == sum(len(d) for d in want)
    assert len(m["splits"]["train"]["shards"]) == 6  # 600 documents, 100 a shard


def test_training_reads_the_shards_tokenizer_and_refuses_another(shards, tmp_path):
    bundle = prepare_data(_shards_cfg(shards), tmp_path)  # data.tokenizer unset: theirs
    assert bundle.tokenizer.fingerprint() == read_manifest(shards)["tokenizer"]["fingerprint"]
    # the run directory keeps a copy, where evaluation and distillation look for it
    kept = tmp_path / "tokenizer.model"
    assert kept.read_bytes() == (shards / read_manifest(shards)["tokenizer"]["file"]).read_bytes()
    other = tmp_path / "other"
    prepare_data(data_config(tokenizer_vocab_size=400), other)
    with pytest.raises(InputError, match=r"data.tokenizer: .* is not the tokenizer the shards"):
        prepare_data(_shards_cfg(shards, tokenizer=str(other / "tokenizer.model")), tmp_path)
    with pytest.raises(InputError, match="data.add_bos"):
        prepare_data(_shards_cfg(shards, add_bos=True), tmp_path)
    with pytest.raises(InputError, match=f"data.path: {tmp_path} has no manifest.json"):
        prepare_data(_shards_cfg(tmp_path), tmp_path / "run")


def test_lane_batches_are_deterministic_resumable_and_process_invariant(shards, tmp_path):
    cfg = _shards_cfg(shards)
    train = prepare_data(cfg, tmp_path).train
    ref = [train.batch_at(i) for i in range(12)]
    # Every row holds tokens; documents are whole within a lane (segment ids restart).
    assert all(b["mask"].mean() > 0.9 for b in ref)
    fresh = prepare_data(cfg, tmp_path).train
    state = json.loads(json.dumps(train.state_at(7)))
    assert fresh.restore(state) == 7
    for i in range(7, 12):
        got = fresh.batch_at(i)
        assert all(np.array_equal(got[k], ref[i][k]) for k in ref[i])
    assert fresh.replayed == 0
    # Two "processes" of 4 rows each: disjoint rows, the same global batch.
    halves = [prepare_data(cfg, tmp_path / f"p{p}", rows=list(range(4 * p, 4 * p + 4))).train
              for p in range(2)]
    assert [h.local_rows for h in halves] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    for i in (0, 5, 11):
        both = [h.batch_at(i) for h in halves]
        for k in ref[i]:
            assert np.array_equal(np.concatenate([b[k] for b in both]), ref[i][k])
    # A process restores its rows of the whole batch's cursor.
    half = prepare_data(cfg, tmp_path / "p1", rows=[4, 5, 6, 7]).train
    half.restore(state)
    assert np.array_equal(half.batch_at(7)["tokens"], ref[7]["tokens"][4:])
    assert half.replayed == 0
    # Another seed, another order.
    other = prepare_data(dataclasses.replace(cfg, seed=1), tmp_path / "s1").train
    assert not np.array_equal(other.batch_at(0)["tokens"], ref[0]["tokens"])


def _transitions(batches) -> list[tuple[int, int]]:
    out = []
    for b in batches:
        m = b["mask"] > 0
        out += list(zip(b["tokens"][m].tolist(), b["targets"][m].tolist(), strict=True))
    return out


def test_validation_is_one_pass_over_every_transition_once(shards, tmp_path, tokenizer_path):
    bundle = prepare_data(_shards_cfg(shards), tmp_path)
    vb = bundle.valid_batches()
    assert bundle.valid_batches() is vb  # read once per run, not per evaluation
    tok = Tokenizer.load(tokenizer_path)
    docs = encode_documents(tok, load_corpus(data_config(tokenizer_path), "validation").texts)
    want = [t for d in docs for t in zip(d[:-1].tolist(), d[1:].tolist(), strict=True)]
    assert sorted(_transitions(vb)) == sorted(want)


def test_documents_longer_than_a_row_are_split_across_rows(tmp_path, tokenizer_path):
    long_doc = " ".join(f"word{i}" for i in range(400))
    (tmp_path / "c.jsonl").write_text(json.dumps({"text": long_doc}) + "\n" + "".join(
        json.dumps({"text": f"short document number {i}"}) + "\n" for i in range(20)))
    cfg = data_config(tokenizer_path, source="jsonl", path=str(tmp_path / "c.jsonl"),
                      valid_holdout_docs=2, seq_len=16, batch_size=2)
    prepare(cfg, tmp_path / "out", progress=False)
    stream = prepare_data(_shards_cfg(tmp_path / "out", seq_len=16, batch_size=2),
                          tmp_path / "run").train
    n = len(Tokenizer.load(tokenizer_path).encode(long_doc)) + 1
    trained = 0
    for i in range(200):
        b = stream.batch_at(i)
        trained += int(b["mask"].sum())
    assert n > 16 and trained > n  # the long document is cut into rows, not dropped


def test_a_corrupt_record_is_named_refused_or_skipped_with_a_log(shards, tmp_path, capsys):
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(shards, bad)
    m = read_manifest(bad)
    reader = ShardReader(bad, m["splits"]["train"]["shards"])
    # Shard 2 written again with a bit flipped inside record 7 (its stored checksum kept).
    raws = [encode_record(reader[200 + i]) for i in range(100)]
    raws[7] = raws[7][:5] + bytes([raws[7][5] ^ 0xFF]) + raws[7][6:]
    writer = ArrayRecordWriter(str(bad / "train-00002.array_record"), "group_size:1")
    for r in raws:
        writer.write(r)
    writer.close()
    strict = ShardReader(bad, m["splits"]["train"]["shards"])
    with pytest.raises(InputError, match=r"corrupt token shard: .*train-00002.array_record "
                                         r"record 7: its checksum does not match"):
        strict[207]
    lenient = ShardReader(bad, m["splits"]["train"]["shards"], skip_corrupt=True)
    assert lenient[207].size == 0 and lenient[208].size > 0
    assert "skipped a corrupt record" in capsys.readouterr().err
    # Through the training stream: refused by default, skipped with the knob.
    cfg = _shards_cfg(bad)
    stream = prepare_data(cfg, tmp_path / "run").train
    with pytest.raises(InputError, match="train-00002.array_record record 7"):
        for i in range(400):
            stream.batch_at(i)
    skipping = prepare_data(dataclasses.replace(cfg, skip_corrupt=True), tmp_path / "run2").train
    for i in range(400):
        skipping.batch_at(i)
    assert skipping.reader.skipped == {207}
    # A damaged file (cut short): refused naming the shard.
    cut = bad / "train-00004.array_record"
    cut.write_bytes(cut.read_bytes()[: cut.stat().st_size // 2])
    with pytest.raises(InputError, match=r"corrupt token shard: .*train-00004.array_record"):
        ShardReader(bad, m["splits"]["train"]["shards"])[450]


def test_prepare_refuses_bad_input_in_one_line_writing_nothing(tmp_path, tokenizer_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    cfg = data_config(tokenizer_path, source="jsonl", path=str(empty))
    with pytest.raises(InputError, match="no documents; nothing prepared"):
        prepare(cfg, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()
    latin = tmp_path / "latin.txt"
    latin.write_bytes(b"caf\xe9 au lait\n\nsecond document here\n")
    cfg = data_config(tokenizer_path, source="text", path=str(latin))
    with pytest.raises(InputError, match="latin.txt: cannot read as UTF-8 text"):
        prepare(cfg, tmp_path / "out2", progress=False)
    assert not (tmp_path / "out2").exists()
    with pytest.raises(ConfigError, match="data.source"):
        prepare(_shards_cfg(tmp_path), tmp_path / "out3", progress=False)


def _experiment(path: Path, data) -> Path:
    """An experiment file whose config has the data section `data`."""
    path.write_text("from hldstudy.config import Config, DataConfig\n"
                    f"def get_config():\n    return Config(data=DataConfig(**{dataclasses.asdict(data)!r}))\n")
    return path


def test_prepare_cli_one_line_errors(tmp_path, tokenizer_path):
    exp = _experiment(tmp_path / "exp.py", data_config(tokenizer_path, source="jsonl",
                                                       path=str(tmp_path / "missing.jsonl")))
    out = subprocess.run([sys.executable, "-m", "hldstudy", "data", "prepare", "--config",
                          str(exp), "--out", str(tmp_path / "o")], capture_output=True,
                         text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 2
    assert out.stderr.strip().count("\n") == 0, out.stderr
    assert "missing.jsonl does not exist" in out.stderr
    assert not (tmp_path / "o").exists()


_PREPARE = [sys.executable, "-m", "hldstudy", "data", "prepare", "--no-progress",
            "--docs-per-shard", "40", "--workers", "1"]


def test_prepare_killed_midway_and_rerun_equals_one_shot(tmp_path, tokenizer_path):
    exp = _experiment(tmp_path / "exp.py", data_config(tokenizer_path, synthetic_docs=4000))
    once, twice = tmp_path / "once", tmp_path / "twice"
    args = ["--config", str(exp)]
    subprocess.run(_PREPARE + args + ["--out", str(once)], check=True, cwd=ROOT, timeout=300)
    proc = subprocess.Popen(_PREPARE + args + ["--out", str(twice)], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while time.time() < deadline and len(list(twice.glob("train-*.array_record"))) < 3:
        time.sleep(0.005)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    written = len(list(twice.glob("train-*.array_record")))
    assert not (twice / MANIFEST).exists() and 3 <= written < 100, written
    with pytest.raises(InputError, match="has no manifest.json .a prepare that has not"):
        read_manifest(twice)
    subprocess.run(_PREPARE + args + ["--out", str(twice)], check=True, cwd=ROOT, timeout=300)
    a, b = read_manifest(once), read_manifest(twice)
    assert a["splits"] == b["splits"]  # documents and token sums, shard by shard
    assert _all_records(once) == _all_records(twice)
    assert not list(twice.glob(".*.tmp"))
    # Rerun into a directory prepared from another corpus: refused.
    _experiment(exp, data_config(tokenizer_path, synthetic_docs=300))
    out = subprocess.run(_PREPARE + args + ["--out", str(twice)], cwd=ROOT, timeout=300,
                         capture_output=True, text=True)
    assert out.returncode == 2 and "was prepared with another corpus" in out.stderr


def test_shards_stream_type(shards, tmp_path):
    assert isinstance(prepare_data(_shards_cfg(shards), tmp_path).train, ShardsBatchStream)


def test_prepare_reads_a_tfds_corpus(tmp_path, tokenizer_path):
    from hldstudy.data import sources
    from hldstudy.data.tfds_corpus import NAME, build_tfds

    tfds_dir = build_tfds(tmp_path / "tfds")
    cfg = data_config(tokenizer_path, source="tfds", path=str(tfds_dir), tfds_name=NAME)
    m = prepare(cfg, tmp_path / "out", workers=2, docs_per_shard=50, progress=False)
    assert m["splits"]["train"]["documents"] == 120 and m["splits"]["valid"]["documents"] == 12
    tok = Tokenizer.load(tokenizer_path)
    docs = sources.tfds_documents(cfg, "validation")
    want = encode_documents(tok, [docs[i] for i in range(12)])
    assert _all_records(tmp_path / "out")["valid"] == [d.tolist() for d in want]
