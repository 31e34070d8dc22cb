"""Prepared token shards: array_record files of documents' token ids (`hldstudy data
prepare` writes them), their manifest, and the batch stream that packs them in lanes.

Design notes: `docs/data.md`, under this file's name.
"""

from __future__ import annotations

import json
import struct
import zlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from hldstudy.data.packing import StreamPacker
from hldstudy.errors import InputError, warn

FORMAT = "hldstudy-token-shards"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
SPLITS = ("train", "valid")
_CRC = struct.Struct("<I")


def encode_record(ids: np.ndarray) -> bytes:
    """One document: a CRC-32 of its token bytes, then the tokens (int32, little-endian)."""
    body = np.asarray(ids, "<i4").tobytes()
    return _CRC.pack(zlib.crc32(body)) + body


def decode_record(raw: bytes) -> np.ndarray:
    """The tokens of one record; ValueError when its length or checksum is wrong."""
    if len(raw) < _CRC.size or (len(raw) - _CRC.size) % 4:
        raise ValueError(f"a record of {len(raw)} bytes (not 4 + 4 per token)")
    body = raw[_CRC.size:]
    if _CRC.unpack_from(raw)[0] != zlib.crc32(body):
        raise ValueError("its checksum does not match its tokens")
    return np.frombuffer(body, "<i4").astype(np.int32)


def read_manifest(directory: str | Path, field: str = "data.path") -> dict[str, Any]:
    """The manifest of a prepared directory, checked for format and complete shards."""
    directory = Path(directory)
    path = directory / MANIFEST
    if not path.exists():
        why = ("a prepare that has not finished: run it again to complete it"
               if (directory / "prepare.json").exists() else "no prepared shards")
        raise InputError(f"{field}: {directory} has no {MANIFEST} ({why}; make one with "
                         "hldstudy data prepare --config CONFIG --out DIR)")
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise InputError(f"{field}: cannot read {path} ({e})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise InputError(f"{field}: {path} is not an hldstudy token-shards manifest")
    if manifest.get("version") != FORMAT_VERSION:
        raise InputError(f"{field}: {path} has format version {manifest.get('version')}; this "
                         f"hldstudy reads version {FORMAT_VERSION} (prepare it again)")
    for split in manifest["splits"].values():
        for shard in split["shards"]:
            if not (directory / shard["file"]).exists():
                raise InputError(f"{field}: {directory} is missing the shard {shard['file']} "
                                 "its manifest lists")
    return manifest


class ShardReader:
    """Random access to the documents of one split's shards (grain's ArrayRecordDataSource),
    each record checked. A corrupt record is refused naming its shard and record, or, with
    `skip_corrupt`, logged and read as an empty document."""

    def __init__(self, directory: str | Path, shards: Sequence[dict], *,
                 skip_corrupt: bool = False):
        import grain

        self.directory = Path(directory)
        self.files = [str(self.directory / s["file"]) for s in shards]
        self.starts = np.cumsum([0] + [int(s["documents"]) for s in shards])
        self.skip_corrupt = skip_corrupt
        self.skipped: set[int] = set()
        # Record counts from the manifest: no file is opened (or found damaged) before a read.
        self._source = grain.sources.ArrayRecordDataSource(
            [f"{f}[0:{int(s['documents'])}]" for f, s in zip(self.files, shards, strict=True)]
        ) if self.files else None

    def __len__(self) -> int:
        return int(self.starts[-1])

    def where(self, i: int) -> str:
        k = int(np.searchsorted(self.starts, i, side="right")) - 1
        return f"{self.files[k]} record {i - int(self.starts[k])}"

    def __getitem__(self, i: int) -> np.ndarray:
        try:
            return decode_record(self._source[int(i)])
        except Exception as e:  # noqa: BLE001 - array_record's read errors name no type
            why = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
            if not self.skip_corrupt:
                raise InputError(f"corrupt token shard: {self.where(i)}: {why} (prepare it "
                                 "again, or skip such records with data.skip_corrupt=true)"
                                 ) from None
            if i not in self.skipped:
                self.skipped.add(i)
                warn(f"skipped a corrupt record: {self.where(i)}: {why}", "hldstudy.data")
            return np.zeros(0, np.int32)


class LanePacker:
    """The rows `rows` of every batch, row r packed from its own lane of documents: the
    documents at positions r, r + B, r + 2B, ... of the (shuffled) order. A row's content
    depends on r alone, so each process packs only its own rows and the global batch is
    the same whatever the number of processes. The cursor: (document, offset) per lane."""

    def __init__(self, reader: ShardReader, order, rows: Sequence[int], batch_size: int,
                 seq_len: int, *, cross_document: bool, pad_id: int, finite: bool):
        self.reader, self.order, self.B = reader, order, batch_size
        self.n = len(reader)
        self.rows = [int(r) for r in rows]
        self.finite = finite
        self.lanes = [StreamPacker(lambda j, r=r: self._doc(r, j), seq_len,
                                   cross_document=cross_document, pad_id=pad_id)
                      for r in self.rows]

    def _doc(self, lane: int, j: int):
        pos = lane + j * self.B
        if self.finite and pos >= self.n:
            return None
        return self.reader[self.order[pos] if self.order is not None else pos]

    @property
    def cursor(self) -> tuple:
        return tuple(p.cursor for p in self.lanes)

    @cursor.setter
    def cursor(self, c) -> None:
        for p, lane_cursor in zip(self.lanes, c, strict=True):
            p.cursor = lane_cursor

    def next_rows(self) -> list | None:
        """One row per lane (None for a lane at the end of a finite split); None when every
        lane has ended."""
        out = [p.next_row() for p in self.lanes]
        return None if all(r is None for r in out) else out
