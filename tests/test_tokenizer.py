"""SentencePiece training and the Tokenizer wrapper."""

from __future__ import annotations

import pytest
import sentencepiece as spm

from hldstudy.data.synthetic import generate_documents
from hldstudy.data.tokenizer import Tokenizer, train_tokenizer
from hldstudy.errors import InputError


@pytest.fixture(scope="module")
def texts():
    return generate_documents(800, seed=0)


@pytest.fixture(scope="module")
def tok(texts, tmp_path_factory):
    return train_tokenizer(texts, 400, tmp_path_factory.mktemp("tok") / "spm")


def test_special_ids_and_vocab(tok):
    assert (tok.pad_id, tok.eos_id, tok.bos_id, tok.unk_id) == (0, 1, 2, 3)
    assert tok.vocab_size == 400
    assert tok.id_to_piece(0) == "<pad>" and tok.id_to_piece(1) == "</s>"
    assert tok.model_path is not None and tok.model_path.name == "spm.model"
    assert tok.model_path.exists()


@pytest.mark.parametrize("text", [
    "Mara lives in Oslo. Where does Mara live? Mara lives in Oslo.",
    "Zürich, naïve café — 東京 🙂 and 1234 unseen symbols ~^%",
    "  leading and  double  spaces",
])
def test_roundtrip_with_byte_fallback(tok, text):
    ids = tok.encode(text)
    assert all(isinstance(i, int) for i in ids)
    assert tok.unk_id not in ids  # byte fallback covers unseen characters
    dec = tok.decode(ids)
    assert dec == " ".join(text.split()) or dec == text


def test_deterministic_training(texts, tmp_path, tok):
    a = train_tokenizer(texts, 400, tmp_path / "a")
    b = train_tokenizer(texts, 400, tmp_path / "a")
    assert a.model_path.read_bytes() == b.model_path.read_bytes()
    assert a.fingerprint() == tok.fingerprint()  # prefix-independent identity
    other = train_tokenizer(texts[:200], 360, tmp_path / "c")
    assert other.fingerprint() != tok.fingerprint()


def test_load_serialized_and_wrapped(tok):
    again = Tokenizer.load(tok.model_path)
    s = "Tom has three cats."
    assert again.encode(s) == tok.encode(s)
    ser = Tokenizer.from_serialized(tok.serialized())
    assert ser.encode(s) == tok.encode(s) and ser.model_path is None
    sp = spm.SentencePieceProcessor(model_file=str(tok.model_path))
    wrapped = Tokenizer(sp)
    assert wrapped.encode(s) == tok.encode(s) and wrapped.vocab_size == tok.vocab_size
    assert tok.encode_batch([s, s]) == [tok.encode(s)] * 2


def test_errors(tmp_path):
    with pytest.raises(InputError, match="does not exist"):
        Tokenizer.load(tmp_path / "missing.model")
    bad = tmp_path / "bad.model"
    bad.write_bytes(b"not a model")
    with pytest.raises(InputError):
        Tokenizer.load(bad)
    with pytest.raises(InputError, match="empty corpus"):
        train_tokenizer(["", "  \n"], 400, tmp_path / "e")
    with pytest.raises(InputError, match="tokenizer_vocab_size"):
        train_tokenizer(["hello world"], 100, tmp_path / "s")
    with pytest.raises(InputError, match="tokenizer_vocab_size.*SentencePiece"):
        train_tokenizer(["".join(chr(0x4E00 + i) for i in range(200))], 300, tmp_path / "t")


def test_a_tokenizer_mismatch_says_whether_size_or_pieces_differ():
    from hldstudy.data.tokenizer import mismatch

    assert mismatch(512, "aa", 512, "aa") is None
    assert mismatch(512, "aa", 384, "bb") == (
        "the student's tokenizer has 512 pieces, the teacher's 384 pieces")
    same_size = mismatch(512, "aa", 512, "bb")
    assert "both have 512 pieces but different ones" in same_size and "aa vs bb" in same_size
