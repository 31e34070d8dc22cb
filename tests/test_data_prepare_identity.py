"""Prepared data carries its identity end to end: a prepare into a prepared directory is
decided from its plan (corpus, tokenizer, shard size) before anything is made, copied or
trained, and a refused one leaves every file byte-identical; training refuses shards whose
tokenizer is not the one they were prepared with; a rerun rewrites a damaged shard."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from helpers.runs import data_config

from hldstudy.data import prepare_data
from hldstudy.data.prepare import prepare
from hldstudy.data.shards import MANIFEST, ShardReader, read_manifest
from hldstudy.errors import InputError


def _files(d: Path) -> dict:
    return {p.relative_to(d): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def _records(d: Path) -> list:
    part = read_manifest(d)["splits"]["train"]
    r = ShardReader(d, part["shards"])
    return [r[i].tolist() for i in range(len(r))]


@pytest.fixture()
def own(tmp_path):
    """A directory prepared with a tokenizer trained into it (no data.tokenizer)."""
    out = tmp_path / "own"
    prepare(data_config(None), out, docs_per_shard=100, progress=False)
    return out


@pytest.fixture()
def other_tokenizer(tmp_path) -> Path:
    """A genuinely different tokenizer (360 pieces; the shared corpus' own is 384)."""
    out = tmp_path / "other"
    prepare(data_config(None, tokenizer_vocab_size=360), out, docs_per_shard=1000,
            progress=False)
    return out / "tokenizer.model"


def test_another_vocabulary_then_a_deleted_tokenizer_are_refused_before_training(own):
    before = _files(own)
    other_vocab = data_config(None, tokenizer_vocab_size=360)
    with pytest.raises(InputError, match="data.tokenizer_vocab_size: .* prepared with a "
                                         "tokenizer of 384 pieces, not 360"):
        prepare(other_vocab, own, docs_per_shard=100, progress=False)
    assert _files(own) == before
    # The advice "delete it" taken for the tokenizer alone: refused, nothing trained.
    (own / "tokenizer.model").unlink()
    left = _files(own)
    with pytest.raises(InputError, match="no longer there; a new one would not match"):
        prepare(other_vocab, own, docs_per_shard=100, progress=False)
    assert _files(own) == left


def test_a_different_tokenizer_named_for_a_prepared_directory_is_refused(own, other_tokenizer):
    before = _files(own)
    with pytest.raises(InputError, match="data.tokenizer: .* is not the tokenizer .* was "
                                         "prepared with"):
        prepare(data_config(other_tokenizer), own, docs_per_shard=100, progress=False)
    assert _files(own) == before
    # The same corpus and tokenizer again: nothing rewritten.
    prepare(data_config(None), own, docs_per_shard=100, progress=False)
    assert _files(own) == before


def test_training_refuses_shards_whose_tokenizer_was_replaced(own, other_tokenizer, tmp_path):
    shutil.copyfile(other_tokenizer, own / "tokenizer.model")
    cfg = data_config(None, source="shards", path=str(own))
    with pytest.raises(InputError, match="data.path: .*tokenizer.model is not the tokenizer "
                                         "the shards"):
        prepare_data(cfg, tmp_path / "run")


def test_a_truncated_shard_is_written_again_by_a_rerun(own):
    records = _records(own)
    manifest = (own / MANIFEST).read_bytes()
    shard = own / "train-00001.array_record"
    whole = shard.read_bytes()
    shard.write_bytes(whole[: len(whole) // 2])
    prepare(data_config(None), own, docs_per_shard=100, progress=False)
    assert shard.read_bytes() == whole and _records(own) == records
    assert (own / MANIFEST).read_bytes() == manifest
