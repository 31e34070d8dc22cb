"""SentencePiece tokenizer rebuilt from GGUF metadata.

Design notes: `docs/model.md`, under this file's name.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from hldstudy.errors import InputError

__all__ = ["gguf_tokenizer", "sp_proto_from_gguf", "tokenizer_from_proto"]


def _field(reader, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def _array(reader, key: str, dtype) -> np.ndarray | None:
    f = reader.fields.get(key)
    if f is None:
        return None
    if not f.data:
        return np.zeros(0, dtype)
    return np.concatenate([np.asarray(f.parts[i]).reshape(-1) for i in f.data]).astype(dtype)


def sp_proto_from_gguf(reader, source: str = "") -> bytes:
    """Serialized SentencePiece ModelProto from a `gguf.GGUFReader`'s tokenizer metadata."""
    from sentencepiece import sentencepiece_model_pb2 as sp_pb2

    source = source or "GGUF"
    kind = _field(reader, "tokenizer.ggml.model")
    if kind != "llama":  # "llama" = SentencePiece; "gpt2" (byte-level BPE) etc. are not
        raise InputError(f"{source}: tokenizer.ggml.model={kind!r} is not a SentencePiece "
                         f"tokenizer ('llama')")
    f_tok = reader.fields.get("tokenizer.ggml.tokens")
    if f_tok is None:
        raise InputError(f"{source}: metadata has no tokenizer.ggml.tokens")
    tokens = [bytes(f_tok.parts[i]).decode("utf-8") for i in f_tok.data]
    n = len(tokens)
    scores = _array(reader, "tokenizer.ggml.scores", np.float32)
    types = _array(reader, "tokenizer.ggml.token_type", np.int32)
    scores = np.zeros(n, np.float32) if scores is None else scores
    types = np.ones(n, np.int32) if types is None else types
    if len(scores) != n or len(types) != n:
        raise InputError(f"{source}: tokenizer tokens/scores/token_type lengths differ "
                         f"({n}/{len(scores)}/{len(types)})")
    types = np.where((types >= 1) & (types <= 6), types, 1)

    m = sp_pb2.ModelProto()
    for piece, score, typ in zip(tokens, scores.tolist(), types.tolist(), strict=True):
        if typ == 4:
            # llama.cpp's converter "pre-normalizes" user-defined pieces ("▁▁" -> "  ")
            # because it matches them on raw text; SentencePiece matches them after
            # whitespace escaping, so put the "▁" back.
            piece = piece.replace(" ", "\u2581")
        p = m.pieces.add()
        p.piece, p.score, p.type = piece, score, typ
    ts = m.trainer_spec
    ts.model_type = sp_pb2.TrainerSpec.BPE
    ts.vocab_size = n
    ts.byte_fallback = bool((types == 6).any())
    for name, key in (("unk", "unknown"), ("bos", "bos"), ("eos", "eos"), ("pad", "padding")):
        tid = _field(reader, f"tokenizer.ggml.{key}_token_id")
        if tid is None and name == "unk":
            unk = np.flatnonzero(types == 2)
            tid = int(unk[0]) if unk.size else None
        if tid is None:
            if name == "unk":
                raise InputError(f"{source}: tokenizer has no unknown token")
            setattr(ts, f"{name}_id", -1)
            continue
        if not 0 <= int(tid) < n:
            raise InputError(f"{source}: tokenizer {key}_token_id {tid} out of range 0..{n - 1}")
        setattr(ts, f"{name}_id", int(tid))
        setattr(ts, f"{name}_piece", tokens[int(tid)])
    ns = m.normalizer_spec
    ns.name = "identity"
    ns.add_dummy_prefix = bool(_field(reader, "tokenizer.ggml.add_space_prefix", True))
    ns.remove_extra_whitespaces = False
    ns.escape_whitespaces = True
    ds = m.denormalizer_spec
    ds.name = "identity"
    ds.add_dummy_prefix = ds.remove_extra_whitespaces = ds.escape_whitespaces = False
    return m.SerializeToString()


def tokenizer_from_proto(proto: bytes, model_path: str | Path | None = None):
    """hldstudy's `Tokenizer` around a serialized SentencePiece model."""
    from hldstudy.data.tokenizer import Tokenizer

    return Tokenizer.from_serialized(proto, model_path=model_path)


def gguf_tokenizer(path: str | Path):
    """Only the tokenizer of a GGUF file (no tensors are read)."""
    import gguf

    path = Path(path)
    if not path.is_file():
        raise InputError(f"{path}: GGUF file not found")
    try:
        reader = gguf.GGUFReader(str(path), "r")
    except Exception as e:  # noqa: BLE001 - gguf raises assorted errors on junk
        raise InputError(f"{path}: not a readable GGUF file ({e})") from None
    return tokenizer_from_proto(sp_proto_from_gguf(reader, str(path)))
