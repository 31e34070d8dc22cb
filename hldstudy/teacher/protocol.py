"""Wire format of the disaggregated teacher (gRPC, generic handlers, no codegen).

Service `hldstudy.teacher.v1.Teacher`, four methods. Every message is one
frame: a 4-byte big-endian header length, a UTF-8 JSON header, then raw bytes
(tensor data, little-endian, C order). No logits ever cross the wire.

- `Info` (unary): `{}` -> the replica's identity: checkpoint fingerprint,
  teacher model config, compute/stream dtype, served layers, tokenizer
  fingerprint, the data it reproduces (seq_len, batch size, seed, train
  stream fingerprint). The client checks it before anything streams.
- `Head` (server streaming): `{}` -> the tied embedding `[V, D]` in the stream
  dtype, in chunks; the trainer rebuilds teacher logits from it (it never
  loads the teacher's blocks).
- `Stream` (bidirectional): the first request opens the stream
  `{"open": {"layers": [...], "final": bool, "dtype", "fingerprint"}}`; each
  further request `{"step": s}` is one credit: the replica computes the
  teacher over `batch_at(s)` and answers with the step's frames
  `{"step", "digest", "tensors": [{"name", "shape", "dtype"}], "chunk", "chunks"}`
  whose payloads, concatenated, are the tensors' bytes in order ("final",
  then "layer:<i>" ascending). Credits are the backpressure: a replica never
  computes a step nobody asked for, so the trainer's ring bounds how far
  teachers run ahead. `digest` hashes the step's tokens and segment ids so the
  trainer proves both sides saw the same batch.
- `Stats` (unary): counters (steps served, tensor payload bytes, frame bytes).
"""

from __future__ import annotations

import hashlib
import json
import struct

import jax.numpy as jnp
import numpy as np

from hldstudy.config import fields_where

SERVICE = "hldstudy.teacher.v1.Teacher"
INFO, HEAD, STREAM, STATS = "Info", "Head", "Stream", "Stats"
PROTOCOL_VERSION = 1
CHUNK_BYTES = 4 << 20
MAX_MESSAGE_BYTES = 64 << 20
CHANNEL_OPTIONS = [("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                   ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)]

_LEN = struct.Struct(">I")


def encode(header: dict, payload: bytes | memoryview = b"") -> bytes:
    head = json.dumps(header, separators=(",", ":")).encode()
    return b"".join((_LEN.pack(len(head)), head, payload))


def decode(frame: bytes) -> tuple[dict, memoryview]:
    view = memoryview(frame)
    (n,) = _LEN.unpack(view[:4])
    return json.loads(bytes(view[4:4 + n])), view[4 + n:]


def method(name: str) -> str:
    return f"/{SERVICE}/{name}"


def batch_digest(tokens, segment_ids) -> str:
    h = hashlib.blake2b(digest_size=8)
    h.update(np.ascontiguousarray(np.asarray(tokens), dtype=np.int32).tobytes())
    h.update(np.ascontiguousarray(np.asarray(segment_ids), dtype=np.int32).tobytes())
    return h.hexdigest()


def data_identity(cfg_data, train_stream=None) -> dict:
    """What must agree between trainer and replica for `batch_at(step)` to be the same batch
    (the `data` entry of `Info`): the data fields tagged `data_identity` in the config."""
    keys = sorted(f.partition(".")[2] for f in fields_where("data_identity")
                  if f.startswith("data."))
    out = {k: getattr(cfg_data, k) for k in keys}
    if train_stream is not None:
        out["stream_fingerprint"] = getattr(train_stream, "fingerprint", None)
    return out


def tensor_names(layers, final: bool) -> list[str]:
    return (["final"] if final else []) + [f"layer:{i}" for i in sorted(layers)]


def np_dtype(name: str) -> np.dtype:
    return np.dtype(jnp.dtype(name))


def step_frames(step: int, digest: str, tensors: list[tuple[str, np.ndarray]],
                chunk_bytes: int = CHUNK_BYTES):
    """Frames of one step: (frame, tensor payload bytes in it)."""
    meta = [{"name": n, "shape": list(a.shape), "dtype": str(a.dtype)} for n, a in tensors]
    blob = b"".join(np.ascontiguousarray(a).reshape(-1).view(np.uint8) for _, a in tensors)
    chunks = max(1, -(-len(blob) // chunk_bytes))
    view = memoryview(blob)
    for c in range(chunks):
        part = view[c * chunk_bytes:(c + 1) * chunk_bytes]
        header = {"step": step, "chunk": c, "chunks": chunks}
        if c == 0:
            header.update(digest=digest, tensors=meta)
        yield encode(header, part), len(part)


class StepAssembler:
    """Rebuilds a step's tensors from its frames (frames of one step arrive in order)."""

    def __init__(self):
        self.header = None
        self.buf = None
        self.filled = 0
        self.next_chunk = 0

    def add(self, header: dict, payload: memoryview):
        """Returns (step, digest, {name: array}) once the step's last frame is in, else None."""
        if header["chunk"] == 0:
            self.header, self.filled, self.next_chunk = header, 0, 0
            total = sum(int(np.prod(t["shape"], dtype=np.int64)) * np_dtype(t["dtype"]).itemsize
                        for t in header["tensors"])
            self.buf = np.empty(total, np.uint8)  # one copy: frames land in place
        elif self.header is None or header["step"] != self.header["step"] \
                or header["chunk"] != self.next_chunk:
            raise ValueError(f"out-of-order frame for step {header['step']}")
        n = len(payload)
        if self.filled + n > len(self.buf):
            raise ValueError(f"step {header['step']}: more bytes than its tensors hold")
        self.buf[self.filled:self.filled + n] = np.frombuffer(payload, np.uint8)
        self.filled += n
        self.next_chunk += 1
        if header["chunk"] + 1 < header["chunks"]:
            return None
        if self.filled != len(self.buf):
            raise ValueError(f"step {header['step']}: {self.filled} bytes for {len(self.buf)}")
        out, offset = {}, 0
        for t in self.header["tensors"]:
            dt = np_dtype(t["dtype"])
            n = int(np.prod(t["shape"], dtype=np.int64)) * dt.itemsize
            out[t["name"]] = self.buf[offset:offset + n].view(dt).reshape(t["shape"])
            offset += n
        header0, self.header, self.buf = self.header, None, None
        return header0["step"], header0["digest"], out
