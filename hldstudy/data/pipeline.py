"""`prepare_data`: a run's tokenizer and its train / validation batch streams
(`hldstudy.data.streams`), packed rows cached on disk; corpus statistics.

Design notes: `docs/data.md`, under this file's name.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from hldstudy.config import DataConfig
from hldstudy.data import packing, sources
from hldstudy.data.encoding import DocumentEncoder, encode_documents, iter_encoded
from hldstudy.data.packing import StreamPacker, empty_rows
from hldstudy.data.shards import ShardReader, read_manifest
from hldstudy.data.streams import (
    BatchStream,
    RowsBatchStream,
    ShardsBatchStream,
    StreamingBatchStream,
)
from hldstudy.data.tokenizer import Tokenizer, train_tokenizer
from hldstudy.errors import InputError, warn
from hldstudy.fileio import write_json_atomic

# Bump when packing/row format changes, so cached rows are rebuilt.
PACKING_VERSION = 1
# Documents used to train a tokenizer on a streaming (TFDS) source.
TOKENIZER_TRAIN_DOCS = 50_000


# --------------------------------------------------------------------------- #
# Building streams
# --------------------------------------------------------------------------- #


def _key(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:20]


def iter_rows(cfg: DataConfig, tokenizer: Tokenizer, texts: Iterable[str]):
    """The packed (tokens, segments) rows of a finite corpus, tokenized 4096 documents at a
    time: memory does not grow with the corpus."""
    documents = iter_encoded(tokenizer, texts, add_bos=cfg.add_bos)
    if cfg.packing:
        return packing.iter_first_fit(documents, cfg.seq_len, pad_id=tokenizer.pad_id)
    packer = StreamPacker(lambda i: next(documents, None), cfg.seq_len, cross_document=True,
                          pad_id=tokenizer.pad_id)
    return iter(packer.next_row, None)


def pack_corpus(cfg: DataConfig, tokenizer: Tokenizer, texts: Iterable[str]):
    """Tokenize + pack a finite corpus into (tokens, segments) rows, in memory."""
    rows = list(iter_rows(cfg, tokenizer, texts))
    if not rows:
        return empty_rows(0, cfg.seq_len)
    return np.stack([r[0] for r in rows]), np.stack([r[1] for r in rows])


def _write_rows(rows, tok_path: Path, seg_path: Path, width: int) -> int:
    """Streams rows into two .npy files (each written whole under a temporary name, then
    renamed); returns their number."""
    tmp = {p: p.with_name(f"{p.name}.{os.getpid()}.raw") for p in (tok_path, seg_path)}
    n = 0
    try:
        with open(tmp[tok_path], "wb") as ft, open(tmp[seg_path], "wb") as fs:
            for tok, seg in rows:
                ft.write(np.ascontiguousarray(tok, "<i4").tobytes())
                fs.write(np.ascontiguousarray(seg, "<i4").tobytes())
                n += 1
        for path, raw in tmp.items():
            out = path.with_name(f"{path.name}.{os.getpid()}.tmp")
            with open(out, "wb") as fh, open(raw, "rb") as src:
                np.lib.format.write_array_header_1_0(
                    fh, {"descr": "<i4", "fortran_order": False, "shape": (n, width)})
                shutil.copyfileobj(src, fh, 1 << 22)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(out, path)
    finally:
        for raw in tmp.values():
            raw.unlink(missing_ok=True)
    return n


class RowFile:
    """The rows of a 2-D .npy file read on demand with `os.pread`: page cache, never this
    process's memory (a memory map's touched pages count in its RSS and grow with the
    corpus over a long run). Indexing with a row or an array of rows gives arrays."""

    def __init__(self, path: str | Path):
        with open(path, "rb") as fh:
            version = np.lib.format.read_magic(fh)
            if version != (1, 0):
                raise ValueError(f"{path}: .npy version {version}, not 1.0")
            shape, fortran, dtype = np.lib.format.read_array_header_1_0(fh)
            self.offset = fh.tell()
        if len(shape) != 2 or fortran:
            raise ValueError(f"{path}: not a C-ordered 2-D array")
        self.path, self.shape, self.dtype = Path(path), tuple(shape), np.dtype(dtype)
        self.ndim = 2
        self.size = shape[0] * shape[1]
        self.row_bytes = shape[1] * self.dtype.itemsize
        self._fd = os.open(path, os.O_RDONLY)

    def __len__(self) -> int:
        return self.shape[0]

    def _row(self, i: int) -> np.ndarray:
        if not 0 <= i < self.shape[0]:
            raise IndexError(i)
        raw = os.pread(self._fd, self.row_bytes, self.offset + i * self.row_bytes)
        return np.frombuffer(raw, self.dtype)

    def __getitem__(self, idx):
        if isinstance(idx, slice):
            start, stop, step = idx.indices(self.shape[0])
            if step != 1:
                return self[np.arange(start, stop, step)]
            n = max(stop - start, 0)
            raw = os.pread(self._fd, n * self.row_bytes, self.offset + start * self.row_bytes)
            return np.frombuffer(raw, self.dtype).reshape(n, self.shape[1])
        if np.ndim(idx) == 0:
            return self._row(int(idx))
        idx = np.asarray(idx).reshape(-1)
        out = np.empty((len(idx), self.shape[1]), self.dtype)
        for j, i in enumerate(idx):
            out[j] = self._row(int(i))
        return out

    def __array__(self, dtype=None, copy=None):
        arr = np.fromfile(self.path, self.dtype, count=self.size, offset=self.offset)
        arr = arr.reshape(self.shape)
        return arr if dtype is None else arr.astype(dtype)

    def __del__(self):
        fd = getattr(self, "_fd", None)
        if fd is not None:
            os.close(fd)


def _cached_rows(cfg: DataConfig, tokenizer: Tokenizer, corpus: sources.Corpus,
                 workdir: Path | None, fingerprint: str, split: str):
    """Packed rows from the workdir cache (`RowFile`: read from disk as batches need
    them), or built there from the corpus read as a stream; in memory without a workdir."""
    cache = Path(workdir) / "data_cache" if workdir is not None else None
    if cache is not None:
        tok_path = cache / f"{fingerprint}.tokens.npy"
        seg_path = cache / f"{fingerprint}.segments.npy"
        if tok_path.exists() and seg_path.exists():
            try:
                return RowFile(tok_path), RowFile(seg_path)
            except (OSError, ValueError):
                pass  # a damaged cache is rebuilt
    if corpus.is_empty():
        field = "data.valid_path" if (split != cfg.train_split and cfg.valid_path) else "data.path"
        raise InputError(f"{field}: {corpus.description} has no documents for split {split!r}")
    if cache is None:
        return pack_corpus(cfg, tokenizer, corpus.iter())
    cache.mkdir(parents=True, exist_ok=True)
    rows = _write_rows(iter_rows(cfg, tokenizer, corpus.iter()), tok_path, seg_path,
                       cfg.seq_len + 1)
    write_json_atomic(cache / f"{fingerprint}.json", {
        "source": corpus.description, "corpus_key": corpus.key, "rows": rows,
        "seq_len": cfg.seq_len, "packing": cfg.packing, "add_bos": cfg.add_bos,
        "tokenizer": tokenizer.fingerprint()})
    return RowFile(tok_path), RowFile(seg_path)


def make_batches(cfg: DataConfig, tokenizer: Tokenizer, split: str,
                 workdir: str | Path | None = None, *, corpus: sources.Corpus | None = None,
                 rows: list[int] | None = None) -> BatchStream:
    """The batch stream of a split: shuffled and infinite for ``cfg.train_split``, in order
    and one pass for any other split. Raises InputError when the split has no documents.
    rows: the rows of every batch this process reads (prepared shards only; None: all)."""
    train = split == cfg.train_split
    common = {"seq_len": cfg.seq_len, "packing": cfg.packing, "add_bos": cfg.add_bos,
              "tokenizer": tokenizer.fingerprint(), "v": PACKING_VERSION}
    if cfg.source == "shards":
        manifest = read_manifest(cfg.path)
        name = "train" if train else "valid"
        part = manifest["splits"].get(name)
        if not part or not part["documents"]:
            raise InputError(f"data.path: the shards in {cfg.path} have no {name} documents")
        reader = ShardReader(cfg.path, part["shards"], skip_corrupt=cfg.skip_corrupt)
        if train and part["tokens"] < cfg.batch_size * cfg.seq_len:
            warn(f"the shards in {cfg.path} hold {part['tokens']} training tokens, fewer than "
                 f"one batch of {cfg.batch_size} x {cfg.seq_len}: every batch repeats "
                 "documents; give more data", "hldstudy.data")
        fp = _key([manifest["source"], name, common])
        return ShardsBatchStream(reader, batch_size=cfg.batch_size, seq_len=cfg.seq_len,
                                 seed=cfg.seed, shuffle=train, fingerprint=fp,
                                 pad_id=tokenizer.pad_id, cross_document=not cfg.packing,
                                 rows=rows if train else None)
    if cfg.source == "tfds":
        seed = cfg.seed if train else None
        docs = sources.tfds_documents(cfg, split, shuffle_seed=seed)
        fp = _key([sources.tfds_key(cfg, split), common])
        encoder = DocumentEncoder(docs, tokenizer, add_bos=cfg.add_bos, workers=cfg.workers,
                                  open_documents=functools.partial(
                                      sources.tfds_documents, cfg, split, shuffle_seed=seed))
        return StreamingBatchStream(docs, tokenizer, seq_len=cfg.seq_len,
                                    batch_size=cfg.batch_size, seed=cfg.seed, shuffle=train,
                                    fingerprint=fp, add_bos=cfg.add_bos,
                                    cross_document=not cfg.packing, encoder=encoder)
    if corpus is None:
        corpus = sources.load_corpus(cfg, split, workdir)
    fp = _key([corpus.key, common])
    tok, seg = _cached_rows(cfg, tokenizer, corpus, None if workdir is None else Path(workdir), fp,
                            split)
    if train and len(tok) < cfg.batch_size:
        warn(f"the training data packs into {len(tok)} rows of {cfg.seq_len} tokens, fewer "
             f"than one batch of data.batch_size={cfg.batch_size}: every batch repeats rows "
             f"(each about {cfg.batch_size / max(len(tok), 1):.0f} times); give more data",
             "hldstudy.data")
    return RowsBatchStream(tok, seg, batch_size=cfg.batch_size, seed=cfg.seed, shuffle=train,
                           fingerprint=fp, pad_id=tokenizer.pad_id)


@dataclass
class DataBundle:
    tokenizer: Tokenizer
    train: BatchStream
    # None when the source has no validation documents (e.g. valid_holdout_docs=0).
    valid: BatchStream | None
    _valid: dict = field(default_factory=dict, repr=False)  # n -> the first n batches

    def valid_batches(self, n: int | None = None) -> list[dict[str, np.ndarray]]:
        """The first n validation batches (fixed, unshuffled); [] without a validation split.
        Read (tokenized, packed) once per run: every evaluation reuses them."""
        if self.valid is None:
            return []
        if n not in self._valid:
            self._valid[n] = self.valid.valid_batches(n)
        return self._valid[n]


def _tokenizer_texts(cfg: DataConfig, corpus: sources.Corpus | None) -> Iterable[str]:
    if corpus is not None:
        return corpus.iter()
    docs = sources.tfds_documents(cfg, cfg.train_split)
    n = min(len(docs), TOKENIZER_TRAIN_DOCS)
    return (docs[i] for i in range(n))


def shards_tokenizer(cfg: DataConfig, manifest: dict) -> Tokenizer:
    """The tokenizer of prepared shards: `cfg.tokenizer` (which must be the one they were
    prepared with) or, unset, the manifest's copy beside them. Refuses a run whose
    tokenizer or BOS setting differs from the shards' in one line."""
    want = manifest["tokenizer"]
    if cfg.tokenizer:
        tokenizer = Tokenizer.load(cfg.tokenizer)
        if tokenizer.fingerprint() != want["fingerprint"]:
            raise InputError(f"data.tokenizer: {cfg.tokenizer} is not the tokenizer the shards "
                             f"in {cfg.path} were prepared with ({want['file']}, fingerprint "
                             f"{want['fingerprint']}); unset data.tokenizer to use theirs, or "
                             "prepare them again with this one")
    else:
        tokenizer = Tokenizer.load(Path(cfg.path) / want["file"])
        if tokenizer.fingerprint() != want["fingerprint"]:
            raise InputError(f"data.path: {Path(cfg.path) / want['file']} is not the tokenizer "
                             f"the shards in {cfg.path} were prepared with (fingerprint "
                             f"{want['fingerprint']}, this one {tokenizer.fingerprint()}); "
                             "prepare them again into a new directory")
    if bool(manifest["add_bos"]) != cfg.add_bos:
        raise InputError(f"data.add_bos: the shards in {cfg.path} were prepared with "
                         f"add_bos={manifest['add_bos']}; set data.add_bos="
                         f"{str(manifest['add_bos']).lower()} or prepare them again")
    return tokenizer


def run_tokenizer(cfg: DataConfig, workdir: Path, corpus: sources.Corpus | None) -> Tokenizer:
    """`cfg.tokenizer` when set; otherwise `workdir/tokenizer.model`, trained on the
    training split (first 50k docs for TFDS) unless one is already there."""
    if cfg.tokenizer:
        return Tokenizer.load(cfg.tokenizer)
    path = workdir / "tokenizer.model"
    meta_path = workdir / "tokenizer.json"
    ident = {"vocab_size": cfg.tokenizer_vocab_size,
             "corpus": corpus.key if corpus is not None else sources.tfds_key(cfg, cfg.train_split)}
    if path.exists():
        tokenizer = Tokenizer.load(path)
        if meta_path.exists():
            meta = json.loads(meta_path.read_text())
            if meta.get("vocab_size") != ident["vocab_size"]:
                raise InputError(
                    f"{path} was trained with vocab_size={meta.get('vocab_size')} but "
                    f"data.tokenizer_vocab_size={cfg.tokenizer_vocab_size}; delete it or set "
                    "data.tokenizer")
        return tokenizer
    if corpus is not None and corpus.is_empty():
        raise InputError(f"data.path: {corpus.description} has no documents")
    tokenizer = train_tokenizer(_tokenizer_texts(cfg, corpus), cfg.tokenizer_vocab_size,
                                workdir / "tokenizer")
    meta_path.write_text(json.dumps(ident, indent=2) + "\n")
    return tokenizer


def _keep_tokenizer(tokenizer: Tokenizer, workdir: Path) -> None:
    """A copy of the shards' SentencePiece model in the run directory, where evaluation
    and distillation from this run look for it (the shards may move or go)."""
    src, dest = tokenizer.model_path, workdir / "tokenizer.model"
    if src is None or Path(src).suffix != ".model" or dest.exists():
        return
    tmp = dest.with_name(f".{dest.name}.{os.getpid()}.tmp")
    shutil.copyfile(src, tmp)
    os.replace(tmp, dest)


def prepare_data(cfg: DataConfig, workdir: str | Path, *, rows: list[int] | None = None
                 ) -> DataBundle:
    """Tokenizer + train/valid streams for a run directory (`run_tokenizer`, or the
    prepared shards' `shards_tokenizer`). Packed rows of finite sources are cached under
    `workdir/data_cache/`. rows: the rows of each training batch this process reads
    (prepared shards; None: all)."""
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    corpus = None
    if cfg.source == "shards":
        tokenizer = shards_tokenizer(cfg, read_manifest(cfg.path))
        _keep_tokenizer(tokenizer, workdir)
    else:
        if cfg.source != "tfds":
            corpus = sources.load_corpus(cfg, cfg.train_split, workdir)
        tokenizer = run_tokenizer(cfg, workdir, corpus)
    train = make_batches(cfg, tokenizer, cfg.train_split, workdir, corpus=corpus, rows=rows)
    try:
        valid = make_batches(cfg, tokenizer, cfg.valid_split, workdir)
    except InputError:
        if cfg.source in ("tfds", "shards") or cfg.valid_path:
            raise
        valid = None  # no held-out documents
    return DataBundle(tokenizer=tokenizer, train=train, valid=valid)


# --------------------------------------------------------------------------- #
# Statistics
# --------------------------------------------------------------------------- #


def _flat_tokens(x: Any) -> np.ndarray:
    if isinstance(x, dict):
        t = np.asarray(x["targets"])
        m = np.asarray(x["mask"]) > 0 if "mask" in x else np.ones(t.shape, bool)
        return t[m].ravel()
    if isinstance(x, RowsBatchStream):
        return np.asarray(x.rows)[:, 1:][
            (np.asarray(x.segments)[:, 1:] == np.asarray(x.segments)[:, :-1])
            & (np.asarray(x.segments)[:, :-1] != 0)]
    if isinstance(x, (list, tuple)) and x and (isinstance(x[0], (dict, list, tuple, np.ndarray))):
        parts = [_flat_tokens(p) for p in x]
        return np.concatenate(parts) if parts else np.zeros(0, np.int64)
    a = np.asarray(x).ravel()
    return a[a >= 0]


def unigram_entropy(rows_or_tokens: Any, vocab_size: int) -> float:
    """Plug-in entropy (nats/token) of the empirical unigram distribution.

    Accepts a batch dict or list of batch dicts (counts the masked targets — the
    tokens a model is scored on), a `RowsBatchStream` (all its trained targets),
    or any array / list of token ids (all entries >= 0). A model that ignores
    context cannot get a lower cross-entropy on the same tokens.
    """
    toks = _flat_tokens(rows_or_tokens).astype(np.int64)
    if toks.size == 0:
        raise ValueError("no tokens")
    counts = np.bincount(toks, minlength=vocab_size).astype(np.float64)
    p = counts[counts > 0] / toks.size
    return float(-(p * np.log(p)).sum())


def bigram_conditional_entropy(docs: Iterable[Sequence[int]]) -> float:
    """Plug-in H(x_t | x_{t-1}) in nats over within-document transitions."""
    prev, nxt = [], []
    for d in docs:
        d = np.asarray(d, np.int64)
        if len(d) >= 2:
            prev.append(d[:-1])
            nxt.append(d[1:])
    if not prev:
        raise ValueError("no transitions")
    a, b = np.concatenate(prev), np.concatenate(nxt)
    V = int(max(a.max(), b.max())) + 1
    pair = np.bincount(a * V + b, minlength=V * V).astype(np.float64)
    ctx = np.bincount(a, minlength=V).astype(np.float64)
    nz = pair > 0
    p_pair = pair[nz] / a.size
    p_cond = pair[nz] / ctx[np.nonzero(nz)[0] // V]
    return float(-(p_pair * np.log(p_cond)).sum())


__all__ = [
    "DataBundle", "make_batches", "prepare_data", "encode_documents", "pack_corpus",
    "unigram_entropy", "bigram_conditional_entropy", "packing",
]
