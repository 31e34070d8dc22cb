"""Deterministic, resumable batch streams and the `prepare_data` entry point.

Design notes: `docs/data.md`, under this file's name.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import os
import shutil
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from hldstudy.config import DataConfig
from hldstudy.data import packing, sources
from hldstudy.data.encoding import DocumentEncoder, encode_documents, iter_encoded
from hldstudy.data.packing import StreamPacker, empty_rows, rows_to_batch
from hldstudy.data.shards import LanePacker, ShardReader, read_manifest
from hldstudy.data.tokenizer import Tokenizer, train_tokenizer
from hldstudy.errors import ConfigError, InputError, warn
from hldstudy.fileio import write_json_atomic

# Bump when packing/row format changes, so cached rows are rebuilt.
PACKING_VERSION = 1
STATE_VERSION = 1
# Documents used to train a tokenizer on a streaming (TFDS) source.
TOKENIZER_TRAIN_DOCS = 50_000


# --------------------------------------------------------------------------- #
# Streams
# --------------------------------------------------------------------------- #


class BatchStream:
    """Iterator of batch dicts (see `hldstudy.data.packing`) with resumable state."""

    kind = "base"
    # The rows of every batch this stream produces (None: all); `hldstudy.sharding.put_batch`
    # places such a process-local batch.
    local_rows: list[int] | None = None
    # Batches produced only to reach a later one (a stream without a cursor for a step
    # replays from the nearest one before it); a resume from a checkpoint's cursor adds 0.
    replayed = 0

    def __init__(self, *, batch_size: int, seq_len: int, seed: int, shuffle: bool,
                 fingerprint: str, pad_id: int = 0):
        if batch_size <= 0:
            raise ConfigError("data.batch_size", f"must be > 0, got {batch_size}")
        self.batch_size = int(batch_size)
        self.seq_len = int(seq_len)
        self.seed = int(seed)
        self.shuffle = bool(shuffle)
        self.fingerprint = fingerprint
        self.pad_id = pad_id
        self.step = 0

    @property
    def finite(self) -> bool:
        """Training streams (shuffled) repeat forever; the others make one pass."""
        return not self.shuffle

    # -- to implement ------------------------------------------------------ #
    @property
    def num_batches(self) -> int | None:
        """Batches in one pass for a finite stream; None for an infinite one."""
        raise NotImplementedError

    def batch_at(self, step: int) -> dict[str, np.ndarray]:
        raise NotImplementedError

    # -- shared ------------------------------------------------------------ #
    def __iter__(self):
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        n = self.num_batches
        if n is not None and self.step >= n:
            raise StopIteration
        try:
            b = self.batch_at(self.step)
        except IndexError:
            raise StopIteration from None
        self.step += 1
        return b

    # -- the data cursor (saved in every checkpoint) ----------------------- #
    IDENTITY = ("kind", "seed", "batch_size", "seq_len", "shuffle", "fingerprint")

    def state_at(self, step: int) -> dict[str, Any]:
        """The data cursor of batch `step`, JSON-able: what `restore` needs to produce batch
        `step` next without reading any batch before it."""
        return {"version": STATE_VERSION, "step": int(step),
                **{k: getattr(self, k) for k in self.IDENTITY}}

    def restore(self, state: dict[str, Any]) -> int:
        """Positions the stream at the cursor `state` (from `state_at`, e.g. a checkpoint's):
        its batch is then produced without replaying the ones before it. Returns its step;
        InputError when the cursor belongs to another stream (data config or tokenizer)."""
        if isinstance(state, (str, bytes)):
            state = json.loads(state)
        if not isinstance(state, dict) or not isinstance(state.get("step"), int):
            raise InputError(f"the data cursor {str(state)[:120]!r} has no integer step")
        for k in self.IDENTITY:
            mine = getattr(self, k)
            if k in state and state[k] != mine:
                raise InputError(f"the data cursor was recorded with {k}={state[k]!r} but this "
                                 f"stream has {k}={mine!r}; resume with the same data config and "
                                 "tokenizer")
        if state["step"] < 0:
            raise InputError(f"the data cursor has a negative step {state['step']}")
        self._restore(state)
        return state["step"]

    def _restore(self, state: dict[str, Any]) -> None:
        """Records the cursor (streams whose position is more than the step)."""

    def get_state(self) -> dict[str, Any]:
        """The cursor of the iterator's next batch."""
        return self.state_at(self.step)

    def set_state(self, state: dict[str, Any]) -> None:
        self.step = self.restore(state)

    def valid_batches(self, n: int | None = None) -> list[dict[str, np.ndarray]]:
        """The first n batches (all of a finite stream when n is None), in order."""
        if n is None and not self.finite:
            raise ValueError("an infinite (training) stream needs n")
        out = []
        i = 0
        while n is None or i < n:
            try:
                out.append(self.batch_at(i))
            except IndexError:
                break
            i += 1
        return out

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(batch_size={self.batch_size}, seq_len={self.seq_len}, "
                f"shuffle={self.shuffle}, num_batches={self.num_batches}, step={self.step})")


class RowsBatchStream(BatchStream):
    """Batches over a fixed array of packed rows (finite sources)."""

    kind = "rows"

    def __init__(self, tokens: np.ndarray, segments: np.ndarray, *, batch_size: int, seed: int,
                 shuffle: bool, fingerprint: str, pad_id: int = 0):
        if tokens.shape != segments.shape or tokens.ndim != 2:
            raise ValueError("tokens and segments must be [N, seq_len + 1] arrays of one shape")
        super().__init__(batch_size=batch_size, seq_len=tokens.shape[1] - 1, seed=seed,
                         shuffle=shuffle, fingerprint=fingerprint, pad_id=pad_id)
        if len(tokens) == 0:
            raise InputError("the corpus packs into zero rows (no document has 2+ tokens)")
        self.rows = tokens
        self.segments = segments
        self._perms: dict[int, np.ndarray] = {}
        self._lock = threading.Lock()

    @property
    def num_rows(self) -> int:
        return len(self.rows)

    @property
    def num_batches(self) -> int | None:
        if self.shuffle:
            return None
        return math.ceil(self.num_rows / self.batch_size)

    @property
    def steps_per_epoch(self) -> float:
        return self.num_rows / self.batch_size

    def _perm(self, epoch: int) -> np.ndarray:
        """The row order of an epoch: a numpy permutation seeded by (seed, epoch)."""
        with self._lock:
            p = self._perms.get(epoch)
            if p is None:
                rng = np.random.default_rng([self.seed % 2**63, epoch, 0x9E3779B9])
                p = rng.permutation(self.num_rows)
                if len(self._perms) >= 4:
                    self._perms.pop(min(self._perms))
                self._perms[epoch] = p
            return p

    def row_indices(self, step: int) -> np.ndarray:
        """Row indices of batch `step` (-1 = an empty padding row)."""
        if step < 0:
            raise IndexError(step)
        B, N = self.batch_size, self.num_rows
        if not self.shuffle:
            if step >= self.num_batches:
                raise IndexError(step)
            idx = np.arange(step * B, (step + 1) * B)
            return np.where(idx < N, idx, -1)
        pos = np.arange(step * B, (step + 1) * B, dtype=np.int64)
        epochs, within = np.divmod(pos, N)
        out = np.empty(B, np.int64)
        for e in np.unique(epochs):
            sel = epochs == e
            out[sel] = self._perm(int(e))[within[sel]]
        return out

    def batch_at(self, step: int) -> dict[str, np.ndarray]:
        idx = self.row_indices(step)
        real = idx >= 0
        tok, seg = empty_rows(len(idx), self.seq_len, self.pad_id)
        tok[real] = self.rows[idx[real]]
        seg[real] = self.segments[idx[real]]
        return rows_to_batch(tok, seg)

    def stats(self) -> dict[str, float]:
        real = int((np.asarray(self.segments) != 0).sum())
        return {"rows": self.num_rows, "tokens": real,
                "padding_fraction": 1.0 - real / self.segments.size}


class CursorBatchStream(BatchStream):
    """Batches packed on the fly by `packer` (an object with a JSON-able `cursor` and
    `next_rows()`), which only moves forward: batch `step` is produced from the cursor
    recorded at or before it (every 16 steps, where the packer stands, and any restored
    one), replaying the batches in between (counted in `replayed`)."""

    kind = "cursor"
    CHECKPOINT_EVERY = 16
    MAX_CHECKPOINTS = 256

    def __init__(self, packer, *, batch_size: int, seq_len: int, seed: int, shuffle: bool,
                 fingerprint: str, pad_id: int):
        super().__init__(batch_size=batch_size, seq_len=seq_len, seed=seed, shuffle=shuffle,
                         fingerprint=fingerprint, pad_id=pad_id)
        self.packer = packer
        self._lock = threading.RLock()  # batch_at moves one shared packer
        self._ckpt: dict[int, Any] = {0: packer.cursor}
        self._pos = 0  # the step whose rows the packer produces next
        self._end: int | None = None  # first step past a finite stream's end

    @property
    def num_batches(self) -> int | None:
        return None if self.shuffle else self._end

    def _seek(self, step: int) -> None:
        """Moves the packer to the start of `step`: directly from the nearest recorded
        cursor at or before it (or the current position), replaying forward from there."""
        if step == self._pos:
            return
        start = max(k for k in self._ckpt if k <= step)
        if not (start <= self._pos <= step):
            self.packer.cursor = self._ckpt[start]
            self._pos = start
        while self._pos < step:
            self._produce()
            self.replayed += 1

    def _remember(self, step: int, cursor) -> None:
        self._ckpt[step] = cursor
        if len(self._ckpt) > self.MAX_CHECKPOINTS:  # keep step 0 and the most recent ones
            del self._ckpt[min(k for k in self._ckpt if k != 0)]

    def _produce(self) -> dict[str, np.ndarray]:
        if self._end is not None and self._pos >= self._end:
            raise IndexError(self._pos)
        rows = self.packer.next_rows()
        if rows is None:
            self._end = self._pos
            raise IndexError(self._pos)
        tok, seg = empty_rows(len(rows), self.seq_len, self.pad_id)
        for j, r in enumerate(rows):
            if r is not None:
                tok[j], seg[j] = r
        self._pos += 1
        if self._pos % self.CHECKPOINT_EVERY == 0:
            self._remember(self._pos, self.packer.cursor)
        return rows_to_batch(tok, seg)

    def batch_at(self, step: int) -> dict[str, np.ndarray]:
        """Batch `step`: O(1) when steps are read in order or after `restore`."""
        if step < 0:
            raise IndexError(step)
        with self._lock:
            if self._end is not None and step >= self._end:
                raise IndexError(step)
            self._seek(step)
            return self._produce()

    def cursor_at(self, step: int):
        with self._lock:
            if step in self._ckpt:
                return self._ckpt[step]
            self._seek(step)
            return self.packer.cursor

    def state_at(self, step: int) -> dict[str, Any]:
        """The cursor of batch `step`: recorded, or where the packer stands (right after
        batch `step - 1`, which is when the loop saves), else reached by replaying."""
        return {**super().state_at(step), "cursor": _as_lists(self.cursor_at(step))}

    def _restore(self, state: dict[str, Any]) -> None:
        cursor = _as_tuples(state.get("cursor"))
        if not _same_structure(cursor, self.packer.cursor):
            raise InputError(f"the data cursor {str(state.get('cursor'))[:120]} does not fit "
                             f"this {self.kind} stream")
        with self._lock:
            self._remember(state["step"], cursor)
            self.packer.cursor = cursor
            self._pos = state["step"]


class ShardsBatchStream(CursorBatchStream):
    """Batches packed from prepared token shards (`hldstudy.data.shards`), each row from
    its own lane of documents (`LanePacker`). Built for some `rows` of the batch (a
    process's own), it reads and returns those rows only (`local_rows`); its cursor is
    still the whole batch's, gathered by `gather_cursor` (set by a multi-process trainer)."""

    kind = "shards"

    def __init__(self, reader: ShardReader, *, batch_size: int, seq_len: int, seed: int,
                 shuffle: bool, fingerprint: str, pad_id: int, cross_document: bool,
                 rows: list[int] | None = None):
        import grain

        order = (grain.MapDataset.range(len(reader)).shuffle(seed=int(seed) % 2**32)
                 if shuffle else None)
        self.rows = list(range(batch_size)) if rows is None else sorted(int(r) for r in rows)
        self.local_rows = None if self.rows == list(range(batch_size)) else self.rows
        self.gather_cursor = None
        self.reader = reader
        super().__init__(LanePacker(reader, order, self.rows, batch_size, seq_len,
                                    cross_document=cross_document, pad_id=pad_id,
                                    finite=not shuffle),
                         batch_size=batch_size, seq_len=seq_len, seed=seed, shuffle=shuffle,
                         fingerprint=fingerprint, pad_id=pad_id)

    def state_at(self, step: int) -> dict[str, Any]:
        state = super().state_at(step)
        if self.local_rows is not None:
            state["cursor"] = _as_lists(self.gather_cursor(self.rows, state["cursor"]))
        return state

    def _restore(self, state: dict[str, Any]) -> None:
        c = state.get("cursor")
        if self.local_rows is not None and isinstance(c, list) and len(c) == self.batch_size:
            state = {**state, "cursor": [c[r] for r in self.rows]}
        super()._restore(state)


def _as_lists(x):
    return [_as_lists(v) for v in x] if isinstance(x, (tuple, list)) else int(x)


def _as_tuples(x):
    return tuple(_as_tuples(v) for v in x) if isinstance(x, (tuple, list)) else x


def _same_structure(a, b) -> bool:
    if isinstance(b, tuple):
        return isinstance(a, tuple) and len(a) == len(b) and all(
            _same_structure(x, y) for x, y in zip(a, b, strict=True))
    return isinstance(a, int) and not isinstance(a, bool) and a >= 0


class _BatchOfOnePacker:
    """`batch_size` consecutive rows of one `StreamPacker` per batch."""

    def __init__(self, packer: StreamPacker, batch_size: int):
        self.packer, self.batch_size = packer, batch_size

    @property
    def cursor(self):
        return self.packer.cursor

    @cursor.setter
    def cursor(self, c) -> None:
        self.packer.cursor = c

    def next_rows(self):
        rows = []
        for _ in range(self.batch_size):
            r = self.packer.next_row()
            if r is None:
                break
            rows.append(r)
        return (rows + [None] * (self.batch_size - len(rows))) if rows else None


class StreamingBatchStream(CursorBatchStream):
    """Batches packed on the fly from an indexable document stream (TFDS via grain),
    documents encoded in chunks (`DocumentEncoder`: in worker processes with workers)."""

    kind = "streaming"

    def __init__(self, documents, tokenizer: Tokenizer, *, seq_len: int, batch_size: int,
                 seed: int, shuffle: bool, fingerprint: str, add_bos: bool = False,
                 cross_document: bool = False, encoder=None):
        self.documents = documents  # grain.MapDataset of str (or any sequence)
        self.tokenizer = tokenizer
        self.add_bos = add_bos
        self._finite_len = None if shuffle else len(documents)
        self.encoder = encoder or DocumentEncoder(documents, tokenizer, add_bos=add_bos)
        packer = StreamPacker(self._get_doc, seq_len, cross_document=cross_document,
                              pad_id=tokenizer.pad_id)
        super().__init__(_BatchOfOnePacker(packer, batch_size), batch_size=batch_size,
                         seq_len=seq_len, seed=seed, shuffle=shuffle, fingerprint=fingerprint,
                         pad_id=tokenizer.pad_id)

    def _get_doc(self, i: int):
        if self._finite_len is not None and i >= self._finite_len:
            return None
        return self.encoder.get(i, self._finite_len)


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
    "BatchStream", "RowsBatchStream", "StreamingBatchStream", "DataBundle", "make_batches",
    "prepare_data", "encode_documents", "pack_corpus", "unigram_entropy",
    "bigram_conditional_entropy", "packing",
]
