"""Packing tokenized documents into fixed-length training rows.

Design notes: `docs/data.md`, under this file's name.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence

import numpy as np

BATCH_KEYS = ("tokens", "targets", "positions", "segment_ids", "mask")


def pack_first_fit(docs: Iterable[Sequence[int]], seq_len: int, *, open_rows: int = 8,
                   pad_id: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Packs token lists (EOS already appended) into rows.

    Returns ``(tokens [N, seq_len + 1] int32, segments [N, seq_len + 1] int32)``.
    Documents with fewer than two tokens carry no transition and are skipped.
    """
    rows = list(iter_first_fit(docs, seq_len, open_rows=open_rows, pad_id=pad_id))
    if not rows:
        return np.zeros((0, seq_len + 1), np.int32), np.zeros((0, seq_len + 1), np.int32)
    return np.stack([r[0] for r in rows]), np.stack([r[1] for r in rows])


def iter_first_fit(docs: Iterable[Sequence[int]], seq_len: int, *, open_rows: int = 8,
                   pad_id: int = 0) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """`pack_first_fit`'s rows, each (tokens, segments) as soon as it is closed: memory is
    the open rows' whatever the number of documents."""
    L = seq_len + 1
    if L < 2:
        raise ValueError("seq_len must be >= 1")
    T = L - 1
    done: list[tuple[np.ndarray, np.ndarray]] = []
    # Open rows: [list of chunks, used length]
    rows: list[list] = []

    def close(row) -> None:
        tok = np.full(L, pad_id, np.int32)
        seg = np.zeros(L, np.int32)
        p = 0
        for s, chunk in enumerate(row[0], start=1):
            tok[p:p + len(chunk)] = chunk
            seg[p:p + len(chunk)] = s
            p += len(chunk)
        done.append((tok, seg))

    def place(chunk) -> None:
        n = len(chunk)
        for k, row in enumerate(rows):
            if L - row[1] >= n:
                row[0].append(chunk)
                row[1] += n
                if row[1] >= L - 1:  # full, or a single slot left that no chunk can use
                    del rows[k]
                    close(row)
                return
        row = [[chunk], n]
        if n >= L - 1:
            close(row)
            return
        rows.append(row)
        if len(rows) > open_rows:
            k = max(range(len(rows)), key=lambda j: rows[j][1])
            close(rows.pop(k))

    for doc in docs:
        doc = np.asarray(doc, np.int32)
        n = len(doc)
        if n < 2:
            continue
        start = 0
        while n - start > L:  # full rows, overlapping by one token
            place(doc[start:start + L])
            start += T
        if n - start >= 2:
            place(doc[start:])
        yield from done
        done.clear()
    for row in list(rows):
        close(row)
    yield from done


class StreamPacker:
    """Concatenate-then-split packer over an indexable document stream.

    ``get_doc(i)`` returns the token list (EOS appended) of document i, or None
    past the end of a finite stream. The cursor ``(doc, offset)`` fully
    determines all following rows.
    """

    def __init__(self, get_doc: Callable[[int], Sequence[int] | None], seq_len: int, *,
                 cross_document: bool = False, pad_id: int = 0):
        self.get_doc = get_doc
        self.L = seq_len + 1
        self.cross_document = cross_document
        self.pad_id = pad_id
        self.doc = 0
        self.offset = 0
        self._cache: tuple[int, np.ndarray | None] | None = None

    @property
    def cursor(self) -> tuple[int, int]:
        return (self.doc, self.offset)

    @cursor.setter
    def cursor(self, c: Sequence[int]) -> None:
        self.doc, self.offset = int(c[0]), int(c[1])

    def _fetch(self, i: int) -> np.ndarray | None:
        if self._cache is not None and self._cache[0] == i:
            return self._cache[1]
        d = self.get_doc(i)
        arr = None if d is None else np.asarray(d, np.int32)
        self._cache = (i, arr)
        return arr

    def next_row(self) -> tuple[np.ndarray, np.ndarray] | None:
        """The next row, or None when a finite stream is exhausted."""
        L = self.L
        tok = np.full(L, self.pad_id, np.int32)
        seg = np.zeros(L, np.int32)
        p = 0
        s = 0
        while L - p >= 2 or (self.cross_document and p < L):
            doc = self._fetch(self.doc)
            if doc is None:
                break
            rest = doc[self.offset:]
            if len(rest) < 2 and not (self.cross_document and len(rest) == 1):
                self.doc, self.offset = self.doc + 1, 0
                continue
            if not (self.cross_document and s > 0):
                s += 1  # a new segment (or the single segment of a cross-document row)
            room = L - p
            if len(rest) <= room:
                tok[p:p + len(rest)] = rest
                seg[p:p + len(rest)] = s
                p += len(rest)
                if self.cross_document and p == L:
                    # The row ends exactly at this document's last token: the next
                    # row starts with it again, so "EOS -> next document" is trained.
                    self.offset = len(doc) - 1
                else:
                    self.doc, self.offset = self.doc + 1, 0
            else:
                tok[p:] = rest[:room]
                seg[p:] = s
                p = L
                self.offset += room - 1  # overlap by one token
        if p < 2:
            return None
        return tok, seg


def rows_to_batch(tokens: np.ndarray, segments: np.ndarray) -> dict[str, np.ndarray]:
    """[B, T+1] rows -> the batch dict described in the module docstring."""
    tokens = np.asarray(tokens, np.int32)
    segments = np.asarray(segments, np.int32)
    seg_in = segments[:, :-1]
    B, T = seg_in.shape
    start = np.ones((B, T), bool)
    start[:, 1:] = seg_in[:, 1:] != seg_in[:, :-1]
    idx = np.broadcast_to(np.arange(T, dtype=np.int32), (B, T))
    last_start = np.maximum.accumulate(np.where(start, idx, 0), axis=1)
    positions = np.where(seg_in != 0, idx - last_start, 0).astype(np.int32)
    mask = ((seg_in != 0) & (segments[:, 1:] == seg_in)).astype(np.float32)
    return {
        "tokens": np.ascontiguousarray(tokens[:, :-1]),
        "targets": np.ascontiguousarray(tokens[:, 1:]),
        "positions": positions,
        "segment_ids": np.ascontiguousarray(seg_in),
        "mask": mask,
    }


def empty_rows(n: int, seq_len: int, pad_id: int = 0) -> tuple[np.ndarray, np.ndarray]:
    return (np.full((n, seq_len + 1), pad_id, np.int32), np.zeros((n, seq_len + 1), np.int32))
