"""Documents to token arrays: in chunks (one batched encode call each), and with workers
ahead of the packer in worker processes that fetch and encode their own chunks.

Design notes: `docs/data.md`, under this file's name.
"""

from __future__ import annotations

import itertools
import multiprocessing
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ProcessPoolExecutor

import numpy as np

from hldstudy.data.tokenizer import Tokenizer

CHUNK = 256  # documents per encode call (and per task of a worker)


def iter_encoded(tokenizer: Tokenizer, texts: Iterable[str], *, add_bos: bool = False,
                 chunk: int = 4096) -> Iterator[np.ndarray]:
    """Token arrays with EOS appended (and BOS prepended with add_bos), one tokenizer call
    per `chunk` documents, `texts` read as they are needed."""
    eos, bos = tokenizer.eos_id, tokenizer.bos_id
    texts = iter(texts)
    while batch := list(itertools.islice(texts, chunk)):
        for ids in tokenizer.encode_batch(batch):
            if add_bos:
                ids = [bos] + ids
            ids.append(eos)
            yield np.asarray(ids, np.int32)


def encode_documents(tokenizer: Tokenizer, texts: Sequence[str], *, add_bos: bool = False,
                     chunk: int = 4096) -> list[np.ndarray]:
    """`iter_encoded`, as a list."""
    return list(iter_encoded(tokenizer, texts, add_bos=add_bos, chunk=chunk))


# A worker process's documents and tokenizer (set once by `_init_worker`).
_WORKER: dict = {}


def _init_worker(open_documents: Callable, tokenizer_path: str, add_bos: bool) -> None:
    _WORKER.update(documents=open_documents(), tokenizer=Tokenizer.load(tokenizer_path),
                   add_bos=add_bos)


def _encode_range(start: int, stop: int) -> list[np.ndarray]:
    docs = _WORKER["documents"]
    return encode_documents(_WORKER["tokenizer"], [docs[i] for i in range(start, stop)],
                            add_bos=_WORKER["add_bos"])


class DocumentEncoder:
    """`get(i)`: the tokens of document i of `documents`, encoded `chunk` documents at a
    time. With `workers` > 0 the chunks after the one being read are fetched and encoded
    ahead in that many processes (each opens the documents itself with `open_documents`,
    a picklable callable, so no text crosses a pipe); reading in order then waits for
    nothing but the packer."""

    def __init__(self, documents, tokenizer: Tokenizer, *, add_bos: bool = False,
                 workers: int = 0, open_documents: Callable | None = None, chunk: int = CHUNK):
        self.documents, self.tokenizer, self.add_bos = documents, tokenizer, add_bos
        self.chunk = chunk
        self.workers = workers if open_documents is not None and tokenizer.model_path else 0
        self._open, self._pool = open_documents, None
        self._chunks: OrderedDict[int, list[np.ndarray]] = OrderedDict()
        self._ahead: dict[int, Future] = {}

    def get(self, i: int, limit: int | None = None) -> np.ndarray:
        c = i // self.chunk
        chunk = self._chunks.get(c)
        if chunk is None:
            chunk = self._load(c, limit)
        return chunk[i - c * self.chunk]

    def _range(self, c: int, limit: int | None) -> tuple[int, int]:
        stop = (c + 1) * self.chunk
        return c * self.chunk, stop if limit is None else min(stop, limit)

    def _load(self, c: int, limit: int | None) -> list[np.ndarray]:
        if self.workers:
            for k in list(self._ahead):  # a jump elsewhere: what was ahead is not needed
                if not c <= k <= c + 2 * self.workers:
                    self._ahead.pop(k).cancel()
            for k in range(c, c + 2 * self.workers + 1):
                start, stop = self._range(k, limit)
                if k not in self._ahead and start < stop:
                    self._ahead[k] = self._executor().submit(_encode_range, start, stop)
            chunk = self._ahead.pop(c).result()
        else:
            start, stop = self._range(c, limit)
            chunk = encode_documents(self.tokenizer,
                                     [self.documents[i] for i in range(start, stop)],
                                     add_bos=self.add_bos)
        self._chunks[c] = chunk
        while len(self._chunks) > 2:  # the packer reads forward; one chunk back at most
            self._chunks.popitem(last=False)
        return chunk

    def _executor(self) -> ProcessPoolExecutor:
        if self._pool is None:
            # spawn: the trainer's process holds JAX's threads, which a fork would copy
            self._pool = ProcessPoolExecutor(
                self.workers, mp_context=multiprocessing.get_context("spawn"),
                initializer=_init_worker,
                initargs=(self._open, str(self.tokenizer.model_path), self.add_bos))
        return self._pool

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None

    def __del__(self):
        self.close()
