"""Tokenizers: SentencePiece (training and a thin wrapper) and Hugging Face `tokenizer.json`.

Design notes: `docs/data.md`, under this file's name.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path

import sentencepiece as spm

from hldstudy.errors import InputError

PAD_ID, EOS_ID, BOS_ID, UNK_ID = 0, 1, 2, 3


class Tokenizer:
    """Wraps a `SentencePieceProcessor`. Build with `Tokenizer.load(path)`,
    `Tokenizer.from_serialized(proto_bytes)` or `Tokenizer(processor)`."""

    def __init__(self, processor: spm.SentencePieceProcessor, model_path: str | Path | None = None):
        self.sp = processor
        self.model_path = None if model_path is None else Path(model_path)

    @classmethod
    def load(cls, path: str | Path) -> Tokenizer | JsonTokenizer:
        """A SentencePiece model file, or a Hugging Face tokenizer.json (`JsonTokenizer`)."""
        path = Path(path)
        if path.suffix == ".json":
            return JsonTokenizer.load(path)
        if not path.is_file():
            raise InputError(f"data.tokenizer: SentencePiece model {path} does not exist")
        sp = spm.SentencePieceProcessor()
        try:
            sp.Load(str(path))
        except (OSError, RuntimeError) as e:
            raise InputError(f"data.tokenizer: {path} is not a SentencePiece model ({e})") from e
        return cls(sp, model_path=path)

    @classmethod
    def from_serialized(cls, proto: bytes, model_path: str | Path | None = None) -> Tokenizer:
        sp = spm.SentencePieceProcessor()
        try:
            sp.LoadFromSerializedProto(proto)
        except (OSError, RuntimeError) as e:
            raise InputError(f"serialized SentencePiece model is invalid ({e})") from e
        return cls(sp, model_path=model_path)

    def serialized(self) -> bytes:
        return self.sp.serialized_model_proto()

    @property
    def vocab_size(self) -> int:
        return int(self.sp.GetPieceSize())

    @property
    def pad_id(self) -> int:
        """Pad id; 0 when the model defines none (padding is masked anyway)."""
        i = int(self.sp.pad_id())
        return i if i >= 0 else 0

    @property
    def eos_id(self) -> int:
        return int(self.sp.eos_id())

    @property
    def bos_id(self) -> int:
        return int(self.sp.bos_id())

    @property
    def unk_id(self) -> int:
        return int(self.sp.unk_id())

    def encode(self, text: str) -> list[int]:
        return self.sp.EncodeAsIds(text)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return self.sp.Encode(list(texts), out_type=int)

    def decode(self, ids: Iterable[int]) -> str:
        return self.sp.DecodeIds([int(i) for i in ids])

    def id_to_piece(self, i: int) -> str:
        return self.sp.IdToPiece(int(i))

    def fingerprint(self) -> str:
        """Hash of the model proto without its training-time file prefix (cache keys)."""
        import hashlib

        if getattr(self, "_fingerprint", None) is None:
            self._fingerprint = hashlib.sha256(_set_prefix(self.serialized(), "")).hexdigest()[:16]
        return self._fingerprint

    def __repr__(self) -> str:
        return f"Tokenizer(vocab_size={self.vocab_size}, model_path={self.model_path})"


# Special tokens looked up, in order, when tokenizer_config.json does not name them.
_EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>")
_BOS_CANDIDATES = ("<s>", "<bos>", "<|begin_of_text|>")
_PAD_CANDIDATES = ("<pad>", "<|pad|>")


class JsonTokenizer:
    """A Hugging Face `tokenizer.json` behind `Tokenizer`'s interface.

    Special ids come from a `tokenizer_config.json` beside the file (`eos_token`,
    `bos_token`, `pad_token`), else from the usual token spellings; -1 when absent
    (SentencePiece's convention; pad falls back to 0, as it is always masked).
    """

    def __init__(self, tokenizer, model_path: Path, specials: dict[str, str | None]):
        self.hf = tokenizer
        self.model_path = model_path
        self._json = model_path.read_bytes()
        self._ids = {}
        for role, candidates in (("eos", _EOS_CANDIDATES), ("bos", _BOS_CANDIDATES),
                                 ("pad", _PAD_CANDIDATES)):
            names = [specials[role]] if specials.get(role) else list(candidates)
            ids = [tokenizer.token_to_id(n) for n in names]
            self._ids[role] = next((i for i in ids if i is not None), -1)

    @classmethod
    def load(cls, path: str | Path) -> JsonTokenizer:
        import json

        try:
            from tokenizers import Tokenizer as HFTokenizer
        except ImportError:
            raise InputError(f"data.tokenizer: {path} needs the `tokenizers` package "
                             "(pip install tokenizers)") from None
        path = Path(path)
        if not path.is_file():
            raise InputError(f"data.tokenizer: tokenizer file {path} does not exist")
        try:
            tok = HFTokenizer.from_file(str(path))
        except Exception as e:  # noqa: BLE001 - tokenizers raises a bare Exception on bad JSON
            raise InputError(f"data.tokenizer: {path} is not a Hugging Face tokenizer.json "
                             f"({str(e).splitlines()[0] if str(e) else type(e).__name__})") from None
        specials: dict[str, str | None] = {}
        side = path.parent / "tokenizer_config.json"
        if side.is_file():
            try:
                raw = json.loads(side.read_text())
            except ValueError as e:
                raise InputError(f"{side}: invalid JSON ({e})") from None
            for role in ("eos", "bos", "pad"):
                value = raw.get(f"{role}_token")
                specials[role] = value.get("content") if isinstance(value, dict) else value
        return cls(tok, path, specials)

    def serialized(self) -> bytes:
        return self._json

    @property
    def vocab_size(self) -> int:
        return int(self.hf.get_vocab_size(with_added_tokens=True))

    @property
    def pad_id(self) -> int:
        return self._ids["pad"] if self._ids["pad"] >= 0 else 0

    @property
    def eos_id(self) -> int:
        return self._ids["eos"]

    @property
    def bos_id(self) -> int:
        return self._ids["bos"]

    @property
    def unk_id(self) -> int:
        return -1

    def encode(self, text: str) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=False).ids)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [list(e.ids) for e in self.hf.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        return self.hf.decode([int(i) for i in ids], skip_special_tokens=False)

    def id_to_piece(self, i: int) -> str:
        return self.hf.id_to_token(int(i))

    def fingerprint(self) -> str:
        """Hash of the tokenizer.json bytes (cache keys, teacher/student agreement)."""
        import hashlib

        return hashlib.sha256(self._json).hexdigest()[:16]

    def __repr__(self) -> str:
        return f"JsonTokenizer(vocab_size={self.vocab_size}, model_path={self.model_path})"


def mismatch(student_size: int, student_fp: str, teacher_size: int, teacher_fp: str) -> str | None:
    """How the student's tokenizer differs from the teacher's, or None when they agree.
    Two tokenizers of one size can still differ (other pieces, other order): the
    message says which of the two it is, so nobody goes looking for a size mismatch."""
    if student_size != teacher_size:
        return (f"the student's tokenizer has {student_size} pieces, the teacher's "
                f"{teacher_size} pieces")
    if student_fp != teacher_fp:
        return (f"the student's and the teacher's tokenizers both have {student_size} pieces "
                f"but different ones (fingerprints {student_fp} vs {teacher_fp})")
    return None


def _set_prefix(proto: bytes, prefix: str) -> bytes:
    try:
        from sentencepiece import sentencepiece_model_pb2 as pb
    except ImportError:  # protobuf missing: leave the proto as it is
        return proto
    m = pb.ModelProto()
    m.ParseFromString(proto)
    m.trainer_spec.model_prefix = prefix
    return m.SerializeToString()


def _lines(texts: Iterable[str], max_sentences: int) -> Iterator[str]:
    """Feeds documents line by line (sentencepiece caps sentence length)."""
    n = 0
    for t in texts:
        for line in t.split("\n"):
            line = line.strip()
            if not line:
                continue
            yield line
            n += 1
            if n >= max_sentences:
                return


def train_tokenizer(texts: Iterable[str], vocab_size: int, model_prefix: str | Path, *,
                    model_type: str = "unigram", max_sentences: int = 300_000,
                    character_coverage: float = 0.9995) -> Tokenizer:
    """Trains a SentencePiece model into `{model_prefix}.model` (+ `.vocab`).

    Special ids are fixed: pad=0, eos=1, bos=2, unk=3; byte fallback is on
    (256 byte pieces are part of `vocab_size`, so it must exceed ~300).
    Deterministic: one thread, no input shuffling, the first `max_sentences`
    lines only. The model is written to a temporary name and renamed, so a
    concurrent reader never sees a partial file.
    """
    if model_type not in ("unigram", "bpe"):
        raise ValueError(f"model_type must be 'unigram' or 'bpe', got {model_type!r}")
    min_vocab = 256 + 4 + 8
    if vocab_size < min_vocab:
        raise InputError(f"data.tokenizer_vocab_size: {vocab_size} is too small for a byte-fallback "
                         f"tokenizer (needs >= {min_vocab}: 256 bytes + 4 specials + pieces)")
    lines = list(_lines(texts, max_sentences))
    if not lines:
        raise InputError("cannot train a tokenizer on an empty corpus (no non-empty text)")
    model_prefix = Path(model_prefix)
    model_prefix.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=model_prefix.parent) as tmp:
        tmp_prefix = Path(tmp) / "spm"
        try:
            spm.SentencePieceTrainer.Train(
                sentence_iterator=iter(lines),
                model_prefix=str(tmp_prefix),
                model_type=model_type,
                vocab_size=vocab_size,
                hard_vocab_limit=False,
                byte_fallback=True,
                character_coverage=character_coverage,
                pad_id=PAD_ID, eos_id=EOS_ID, bos_id=BOS_ID, unk_id=UNK_ID,
                pad_piece="<pad>", eos_piece="</s>", bos_piece="<s>", unk_piece="<unk>",
                num_threads=1,
                shuffle_input_sentence=False,
                input_sentence_size=0,
                split_digits=True,
                max_sentence_length=1 << 16,
                minloglevel=2,
            )
        except RuntimeError as e:
            msg = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
            raise InputError(f"data.tokenizer_vocab_size: SentencePiece training failed with "
                             f"vocab_size={vocab_size}: {msg}") from None
        # The proto records the (temporary) model prefix; store the final one so the
        # same texts at the same prefix give byte-identical model files.
        proto = _set_prefix(Path(f"{tmp_prefix}.model").read_bytes(), str(model_prefix))
        Path(f"{tmp_prefix}.model").write_bytes(proto)
        for ext in (".model", ".vocab"):
            os.replace(f"{tmp_prefix}{ext}", f"{model_prefix}{ext}")
    return Tokenizer.load(f"{model_prefix}.model")
