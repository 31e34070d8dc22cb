"""Wire format of the disaggregated teacher (gRPC, generic handlers, no codegen).

Design notes: `docs/teacher.md`, under this file's name.
"""

from __future__ import annotations

import hashlib
import json
import logging
import struct
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from hldstudy.config import fields_where
from hldstudy.errors import ConfigError

log = logging.getLogger(__name__)
SERVICE = "hldstudy.teacher.v1.Teacher"
INFO, HEAD, STREAM, STATS = "Info", "Head", "Stream", "Stats"
PROTOCOL_VERSION = 1
CHUNK_BYTES = 4 << 20
MAX_MESSAGE_BYTES = 64 << 20
# Requests are credits and open specs (a few hundred bytes): the server refuses more.
MAX_REQUEST_BYTES = 64 << 10
CHANNEL_OPTIONS = [("grpc.max_send_message_length", MAX_REQUEST_BYTES),
                   ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)]
# so_reuseport off: a second replica on a busy port fails to bind instead of
# silently sharing the port (and half of the connections) with the first.
SERVER_OPTIONS = [("grpc.so_reuseport", 0),
                  ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                  ("grpc.max_receive_message_length", MAX_REQUEST_BYTES)]
TOKEN_KEY = "x-hldstudy-token"
STREAM_DTYPES = ("float32", "bfloat16", "float16")
MAX_TOKEN_BYTES = 4096


class ProtocolError(ValueError):
    """A frame that does not match what the handshake announced (a buggy or hostile peer)."""


def read_token(path: str | Path, field: str) -> str:
    """The shared secret in `path` (surrounding whitespace stripped); ConfigError(field) when
    the file is missing, empty, too long or not printable ASCII (gRPC metadata is ASCII)."""
    try:
        raw = Path(path).read_bytes()
    except OSError as e:
        raise ConfigError(field, f"cannot read the token file {path}: {e.strerror or e}",
                          "write a secret into it, e.g. openssl rand -hex 32 > FILE") from None
    try:
        if Path(path).stat().st_mode & 0o077:
            log.warning("%s (%s) is readable by other users of this machine; chmod 600 it",
                        path, field)
    except OSError:
        pass
    token = raw.strip()
    if not token:
        raise ConfigError(field, f"the token file {path} is empty",
                          "write a secret into it, e.g. openssl rand -hex 32 > FILE")
    if len(token) > MAX_TOKEN_BYTES or not all(33 <= b < 127 for b in token):
        raise ConfigError(field, f"the token in {path} must be at most {MAX_TOKEN_BYTES} "
                          "printable ASCII characters without spaces",
                          "e.g. openssl rand -hex 32 > FILE")
    return token.decode()


def read_pem(path: str | Path, field: str, what: str) -> bytes:
    """A PEM file's bytes; ConfigError(field) when missing or not PEM."""
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise ConfigError(field, f"cannot read the {what} {path}: {e.strerror or e}") from None
    if b"-----BEGIN" not in data:
        raise ConfigError(field, f"{path} is not a PEM {what}",
                          "give a PEM file (-----BEGIN ...)")
    return data


def auth_metadata(token: str | None) -> tuple:
    return ((TOKEN_KEY, token),) if token else ()

_LEN = struct.Struct(">I")


def encode(header: dict, payload: bytes | memoryview = b"") -> bytes:
    head = json.dumps(header, separators=(",", ":")).encode()
    return b"".join((_LEN.pack(len(head)), head, payload))


def decode(frame: bytes) -> tuple[dict, memoryview]:
    """(header, payload); ProtocolError when the frame is not one."""
    view = memoryview(frame)
    if len(view) < 4:
        raise ProtocolError(f"a frame of {len(view)} bytes has no header")
    (n,) = _LEN.unpack(view[:4])
    if 4 + n > len(view):
        raise ProtocolError(f"a frame announces a {n}-byte header in {len(view)} bytes")
    try:
        header = json.loads(bytes(view[4:4 + n]))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ProtocolError(f"a frame header is not JSON ({e})") from None
    if not isinstance(header, dict):
        raise ProtocolError("a frame header is not a JSON object")
    return header, view[4 + n:]


def is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


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


def expected_tensors(names: list[str], shape, dtype: str) -> list[dict]:
    """The `tensors` entry a step's first frame must carry (every tensor `[B, T, D]`)."""
    return [{"name": n, "shape": [int(d) for d in shape], "dtype": str(dtype)} for n in names]


def _nbytes(shape, dtype: str) -> int:
    return int(np.prod(shape, dtype=np.int64)) * np_dtype(dtype).itemsize


def _check_chunking(header: dict, what: str) -> None:
    c, n = header.get("chunk"), header.get("chunks")
    if not (is_int(c) and is_int(n) and 0 <= c < n):
        raise ProtocolError(f"{what}: a frame with chunk {c!r} of {n!r}")


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
    """Rebuilds a step's tensors from its frames (frames of one step arrive in order).

    `expect` (the `tensors` list of `expected_tensors`) is what the handshake promised:
    a first frame announcing other names, shapes or dtypes is refused before anything is
    allocated (ProtocolError), as is any frame out of order or with more bytes than announced.
    """

    def __init__(self, expect: list[dict] | None = None):
        self.expect = expect
        self.header = None
        self.buf = None
        self.filled = 0
        self.next_chunk = 0

    def _check_first(self, header: dict) -> int:
        step, tensors = header.get("step"), header.get("tensors")
        if not is_int(step) or not isinstance(header.get("digest"), str):
            raise ProtocolError(f"a first frame without an integer step and a digest: {step!r}")
        if self.expect is not None and tensors != self.expect:
            raise ProtocolError(f"step {step}: the replica sends {tensors!r}, the handshake "
                                f"promised {self.expect!r}")
        if not isinstance(tensors, list) or not tensors:
            raise ProtocolError(f"step {step}: no tensor list")
        total = 0
        for t in tensors:
            shape = t.get("shape") if isinstance(t, dict) else None
            if not (isinstance(shape, list) and all(is_int(d) and d >= 0 for d in shape)
                    and t.get("dtype") in STREAM_DTYPES and isinstance(t.get("name"), str)):
                raise ProtocolError(f"step {step}: a malformed tensor entry {t!r}")
            total += _nbytes(shape, t["dtype"])
        return total

    def add(self, header: dict, payload: memoryview):
        """Returns (step, digest, {name: array}) once the step's last frame is in, else None."""
        _check_chunking(header, "stream")
        if header["chunk"] == 0:
            total = self._check_first(header)
            self.header, self.filled, self.next_chunk = header, 0, 0
            self.buf = np.empty(total, np.uint8)  # one copy: frames land in place
        elif self.header is None or header.get("step") != self.header["step"] \
                or header["chunk"] != self.next_chunk \
                or header["chunks"] != self.header["chunks"]:
            raise ProtocolError(f"out-of-order frame for step {header.get('step')!r}")
        n = len(payload)
        if self.filled + n > len(self.buf):
            raise ProtocolError(f"step {header['step']}: more bytes than its tensors hold")
        self.buf[self.filled:self.filled + n] = np.frombuffer(payload, np.uint8)
        self.filled += n
        self.next_chunk += 1
        if header["chunk"] + 1 < header["chunks"]:
            return None
        if self.filled != len(self.buf):
            raise ProtocolError(f"step {header['step']}: {self.filled} bytes for {len(self.buf)}")
        out, offset = {}, 0
        for t in self.header["tensors"]:
            dt = np_dtype(t["dtype"])
            n = _nbytes(t["shape"], t["dtype"])
            out[t["name"]] = self.buf[offset:offset + n].view(dt).reshape(t["shape"])
            offset += n
        header0, self.header, self.buf = self.header, None, None
        return header0["step"], header0["digest"], out


class HeadAssembler:
    """Rebuilds the head `[V, D]` from `Head` frames, checked against the handshake's
    shape and dtype (ProtocolError on any other layout, order or byte count)."""

    def __init__(self, shape, dtype: str):
        self.shape, self.dtype = [int(d) for d in shape], str(dtype)
        self.buf = np.empty(_nbytes(self.shape, self.dtype), np.uint8)
        self.filled = 0
        self.next_chunk = 0
        self.chunks = None

    def add(self, header: dict, payload: memoryview) -> np.ndarray | None:
        _check_chunking(header, "head")
        if header.get("shape") != self.shape or header.get("dtype") != self.dtype:
            raise ProtocolError(f"head: the replica sends {header.get('shape')!r} "
                                f"{header.get('dtype')!r}, the handshake promised "
                                f"{self.shape} {self.dtype}")
        if header["chunk"] != self.next_chunk or self.chunks not in (None, header["chunks"]):
            raise ProtocolError(f"head: out-of-order chunk {header['chunk']}")
        self.chunks = header["chunks"]
        n = len(payload)
        if self.filled + n > len(self.buf):
            raise ProtocolError("head: more bytes than [V, D] holds")
        self.buf[self.filled:self.filled + n] = np.frombuffer(payload, np.uint8)
        self.filled += n
        self.next_chunk += 1
        if self.next_chunk < self.chunks:
            return None
        if self.filled != len(self.buf):
            raise ProtocolError(f"head: {self.filled} bytes for {len(self.buf)}")
        return self.buf.view(np_dtype(self.dtype)).reshape(self.shape)
