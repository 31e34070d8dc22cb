"""Deterministic, resumable batch streams: packed rows held in memory or on disk, prepared
shards read by a cursor, and a streaming source packed as it is read.

Design notes: `docs/data.md`, under this file's name.
"""

from __future__ import annotations

import json
import math
import threading
from typing import Any

import numpy as np

from hldstudy.data.encoding import DocumentEncoder
from hldstudy.data.packing import StreamPacker, empty_rows, rows_to_batch
from hldstudy.data.shards import LanePacker, ShardReader
from hldstudy.data.tokenizer import Tokenizer
from hldstudy.errors import ConfigError, InputError

STATE_VERSION = 1

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


__all__ = ["BatchStream", "RowsBatchStream", "CursorBatchStream", "ShardsBatchStream",
           "StreamingBatchStream"]
