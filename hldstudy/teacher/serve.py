"""python -m hldstudy.teacher.serve --checkpoint TEACHER --config STUDENT [--layers final,9] --port P

One teacher replica of a disaggregated run: it loads the teacher, rebuilds
the student's deterministic batch sequence (the student's data config, seed
and step numbering: `batch_at(step)`), runs the teacher's forward exactly as
the colocated teacher does (`ColocatedTeacher.forward_fn`, same params, same
compute dtype) and streams the requested hidden states over gRPC, never
logits. The trainer (`teacher.checkpoint=remote://host:port,...`) decides
which steps each replica computes; start one process per replica.

  --checkpoint   teacher: hldstudy run dir, .gguf or HF dir (default: the
                 student config's teacher.checkpoint)
  --config       the student's experiment file, config.json or run directory
  --layers       layers served: "final" and/or block indices, e.g. final,9
                 (default: every layer the student's method needs)
  --dtype        compute = stream dtype (default: the config's teacher.dtype)
  --port         0 picks a free port; the bound address is printed
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import logging
import os
import queue
import sys
import tempfile
import threading
from concurrent import futures
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from hldstudy.cli_common import quiet_libraries
from hldstudy.config import apply_overrides, load_experiment, read_config
from hldstudy.data import prepare_data
from hldstudy.distill.base import make_strategy
from hldstudy.errors import ConfigError, InputError, user_errors
from hldstudy.model.loading import load_model
from hldstudy.teacher import protocol as proto
from hldstudy.teacher.base import check_layers, method_needs, stage_needs
from hldstudy.teacher.colocated import ColocatedTeacher
from hldstudy.teacher.load import with_teacher_tokenizer

log = logging.getLogger("hldstudy.teacher.serve")


def parse_layers(text: str) -> tuple[bool, tuple[int, ...]]:
    final, layers = False, []
    for part in (p.strip() for p in text.split(",") if p.strip()):
        if part == "final":
            final = True
        else:
            try:
                layers.append(int(part))
            except ValueError:
                raise ConfigError("--layers", f"{part!r} is neither 'final' nor a layer index",
                                  "write e.g. final,9") from None
    return final, tuple(sorted(set(layers)))


def format_layers(final: bool, layers) -> str:
    return ",".join((["final"] if final else []) + [str(i) for i in sorted(layers)])


def params_fingerprint(model_cfg, params) -> str:
    h = hashlib.sha256(json.dumps(dataclasses.asdict(model_cfg), sort_keys=True).encode())
    for path, leaf in sorted(jax.tree_util.tree_leaves_with_path(params),
                             key=lambda kv: jax.tree_util.keystr(kv[0])):
        h.update(jax.tree_util.keystr(path).encode())
        h.update(np.ascontiguousarray(np.asarray(leaf)).tobytes())
    return h.hexdigest()[:16]


class TeacherServer:
    """A teacher replica: model + data + gRPC service. `start()` binds, `stop()` ends."""

    def __init__(self, cfg, checkpoint: str, *, layers: str | None = None,
                 dtype: str | None = None, step: int | None = None,
                 workdir: str | Path | None = None):
        dtype = dtype or cfg.teacher.dtype
        cfg = dataclasses.replace(cfg, teacher=dataclasses.replace(
            cfg.teacher, checkpoint=checkpoint, dtype=dtype))
        cfg = with_teacher_tokenizer(cfg)
        self.cfg, self.dtype, self.checkpoint = cfg, dtype, checkpoint
        if not Path(checkpoint).exists():
            raise ConfigError("--checkpoint", f"{checkpoint} does not exist",
                              "give an hldstudy run directory, a .gguf file or an HF directory")
        loaded = load_model(checkpoint, step)
        self.teacher = ColocatedTeacher(loaded.model, loaded.tokenizer, dtype=dtype,
                                        source=checkpoint)
        self.model_cfg = self.teacher.model_cfg
        self.workdir = Path(workdir or tempfile.mkdtemp(prefix="hldstudy-teacher-"))
        self.data = prepare_data(cfg.data, self.workdir)
        self.teacher.check_tokenizer(self.data.tokenizer)
        if layers:
            self.final, self.layers = parse_layers(layers)
        else:
            needs = method_needs(make_strategy(cfg, cfg.model, self.model_cfg), self.model_cfg)
            self.final, self.layers = needs.final, needs.layers
        check_layers(self.layers, self.model_cfg.n_layers, "--layers", first=0,
                     what="teacher layer")
        self.fingerprint = params_fingerprint(self.model_cfg, self.teacher.params)
        self.params = jax.device_put(self.teacher.params)
        self._jits: dict = {}
        self._lock = threading.Lock()
        self._stats_lock = threading.Lock()
        self.stats = {"steps": 0, "payload_bytes": 0, "frame_bytes": 0, "head_bytes": 0,
                      "streams": 0}
        self._server = None
        self.port = None

    # ------------------------------------------------------------- compute

    def info(self) -> dict:
        return {"protocol": proto.PROTOCOL_VERSION, "fingerprint": self.fingerprint,
                "checkpoint": self.checkpoint, "dtype": self.dtype,
                "model": dataclasses.asdict(self.model_cfg),
                "final": self.final, "layers": list(self.layers),
                "tokenizer": {"fingerprint": self.data.tokenizer.fingerprint(),
                              "vocab_size": self.data.tokenizer.vocab_size},
                "data": proto.data_identity(self.cfg.data, self.data.train),
                "pid": os.getpid()}

    def _forward(self, final: bool, layers: tuple[int, ...]):
        key = (final, layers)
        if key not in self._jits:
            fn = self.teacher.forward_fn(layers, final)

            def run(params, batch):
                out = fn(params, batch)
                return out.final_hidden, out.hidden

            self._jits[key] = jax.jit(run)
        return self._jits[key]

    def compute(self, step: int, final: bool, layers: tuple[int, ...]):
        """(digest, [(name, array)]) of one step, in protocol order."""
        batch = self.data.train.batch_at(step)
        digest = proto.batch_digest(batch["tokens"], batch["segment_ids"])
        inputs = {k: jnp.asarray(batch[k]) for k in ("tokens", "positions", "segment_ids")}
        with self._lock:
            final_h, hidden = self._forward(final, layers)(self.params, inputs)
            tensors = ([("final", np.asarray(final_h))] if final else []) + \
                [(f"layer:{i}", np.asarray(hidden[i])) for i in sorted(layers)]
        return digest, tensors

    def head(self) -> np.ndarray:
        return np.asarray(self.teacher.params["embedding"][...])

    # ------------------------------------------------------------- service

    def _info(self, request: bytes, context) -> bytes:
        return proto.encode(self.info())

    def _stats(self, request: bytes, context) -> bytes:
        with self._stats_lock:
            return proto.encode(dict(self.stats))

    def _head(self, request: bytes, context):
        emb = np.ascontiguousarray(self.head())
        blob = memoryview(emb.tobytes())
        n = max(1, -(-len(blob) // proto.CHUNK_BYTES))
        for c in range(n):
            part = blob[c * proto.CHUNK_BYTES:(c + 1) * proto.CHUNK_BYTES]
            with self._stats_lock:
                self.stats["head_bytes"] += len(part)
            yield proto.encode({"chunk": c, "chunks": n, "shape": list(emb.shape),
                                "dtype": str(emb.dtype), "fingerprint": self.fingerprint}, part)

    def check_open(self, spec: dict) -> str | None:
        """Why a stream request cannot be served (None if it can)."""
        if spec.get("fingerprint") not in (None, self.fingerprint):
            return (f"this replica serves checkpoint {self.fingerprint} ({self.checkpoint}), "
                    f"the trainer expects {spec['fingerprint']}")
        if spec.get("dtype") not in (None, self.dtype):
            return f"this replica computes in {self.dtype}, the trainer wants {spec['dtype']}"
        want_final, want = bool(spec.get("final")), set(spec.get("layers", []))
        if (want_final and not self.final) or not want <= set(self.layers):
            return (f"this replica serves layers {format_layers(self.final, self.layers)}, the "
                    f"trainer wants {format_layers(want_final, want)}")
        return None

    def _stream(self, request_iterator, context):
        import grpc

        try:
            first = next(request_iterator)
        except StopIteration:
            return
        spec = proto.decode(first)[0].get("open", {})
        problem = self.check_open(spec)
        if problem:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, problem)
        final, layers = bool(spec.get("final")), tuple(sorted(spec.get("layers", [])))
        with self._stats_lock:
            self.stats["streams"] += 1
        steps: queue.Queue = queue.Queue()

        def read():
            try:
                for req in request_iterator:
                    steps.put(int(proto.decode(req)[0]["step"]))
            except Exception:  # noqa: BLE001 - the client went away
                pass
            steps.put(None)

        threading.Thread(target=read, daemon=True).start()
        while True:
            step = steps.get()
            if step is None or not context.is_active():
                return
            digest, tensors = self.compute(step, final, layers)
            payload = frame_bytes = 0
            for frame, n in proto.step_frames(step, digest, tensors):
                payload += n
                frame_bytes += len(frame)
                yield frame
            with self._stats_lock:
                self.stats["steps"] += 1
                self.stats["payload_bytes"] += payload
                self.stats["frame_bytes"] += frame_bytes

    def start(self, port: int = 0, host: str = "127.0.0.1", workers: int = 16) -> int:
        import grpc

        handlers = {
            proto.INFO: grpc.unary_unary_rpc_method_handler(self._info),
            proto.STATS: grpc.unary_unary_rpc_method_handler(self._stats),
            proto.HEAD: grpc.unary_stream_rpc_method_handler(self._head),
            proto.STREAM: grpc.stream_stream_rpc_method_handler(self._stream),
        }
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=workers),
                                   options=proto.CHANNEL_OPTIONS)
        self._server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(proto.SERVICE, handlers),))
        self.port = self._server.add_insecure_port(f"{host}:{port}")
        if not self.port:
            raise InputError(f"--port: cannot bind {host}:{port}")
        self._server.start()
        return self.port

    def warmup(self) -> None:
        """Compiles the forward of every layer set the student's stages ask for (and of the
        served set), so no first request runs into the trainer's teacher.timeout_s."""
        sets = {(self.final, self.layers)}
        try:
            strategy = make_strategy(self.cfg, self.cfg.model, self.model_cfg)
            for stage in strategy.stages():
                needs = stage_needs(strategy, stage, self.model_cfg)
                if (needs.final or needs.layers) and self.check_open(
                        {"final": needs.final, "layers": list(needs.layers)}) is None:
                    sets.add((needs.final, needs.layers))
        except Exception:  # noqa: BLE001 - a config the trainer will refuse anyway
            pass
        for final, layers in sorted(sets):
            self.compute(0, final, layers)

    def stop(self, grace: float | None = None) -> None:
        if self._server is not None:
            self._server.stop(grace)

    def wait(self) -> None:
        self._server.wait_for_termination()


class SyntheticTeacherServer(TeacherServer):
    """Transport-only replica for benchmarks: serves fixed arrays of a given shape, no model.

    Same service and frames as a real replica (so the wire path is the same);
    `Info` describes the synthetic payload, which no trainer handshake accepts.
    """

    def __init__(self, shape: tuple[int, int, int], dtype: str = "bfloat16", n_layers: int = 1):
        self.dtype, self.checkpoint, self.fingerprint = dtype, "synthetic", "synthetic"
        self.final, self.layers = True, tuple(range(1, n_layers))
        rng = np.random.default_rng(0)
        self._array = rng.standard_normal(shape).astype(proto.np_dtype(dtype))
        self._stats_lock = threading.Lock()
        self.stats = {"steps": 0, "payload_bytes": 0, "frame_bytes": 0, "head_bytes": 0,
                      "streams": 0}
        self._server = None
        self.port = None

    def info(self) -> dict:
        return {"protocol": proto.PROTOCOL_VERSION, "fingerprint": self.fingerprint,
                "checkpoint": self.checkpoint, "dtype": self.dtype, "final": self.final,
                "layers": list(self.layers), "shape": list(self._array.shape)}

    def compute(self, step: int, final: bool, layers: tuple[int, ...]):
        tensors = ([("final", self._array)] if final else []) + \
            [(f"layer:{i}", self._array) for i in sorted(layers)]
        return f"synthetic{step}", tensors

    def head(self) -> np.ndarray:
        return self._array[0]


def load_student_config(spec: str, overrides: list[str]):
    path = Path(spec)
    if path.is_dir():
        cfg = read_config(path / "config.json")
    elif path.suffix == ".json":
        cfg = read_config(path)
    else:
        cfg = load_experiment(path)
    return apply_overrides(cfg, overrides)


def main(argv: list[str] | None = None, server_cls: type[TeacherServer] = TeacherServer,
         **server_kwargs) -> int:
    """The command line; `server_cls(cfg, checkpoint, ..., **server_kwargs)` is the replica
    (a subclass may change how it serves)."""
    parser = argparse.ArgumentParser(prog="python -m hldstudy.teacher.serve", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", default=None, help="teacher checkpoint (local path)")
    parser.add_argument("--step", type=int, default=None, help="checkpoint step of a run dir")
    parser.add_argument("--config", required=True,
                        help="the student's experiment file, config.json or run directory")
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        metavar="KEY=VALUE", help="override a field of the student config")
    parser.add_argument("--layers", default=None, help="served layers, e.g. final,9")
    parser.add_argument("--dtype", default=None, help="compute/stream dtype (float32, bfloat16)")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--workdir", default=None, help="data cache directory (default: temp)")
    parser.add_argument("--no-warmup", action="store_true", help="compile on the first request")
    parser.add_argument("--debug", action="store_true")
    args = parser.parse_args(argv)
    quiet_libraries()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    with user_errors(args.debug, prog="hldstudy.teacher.serve"):
        cfg = load_student_config(args.config, args.overrides)
        checkpoint = args.checkpoint or cfg.teacher.checkpoint
        if not checkpoint or checkpoint.startswith("remote://"):
            raise ConfigError("--checkpoint", "no local teacher checkpoint given",
                              "pass --checkpoint RUN_DIR (or a .gguf / HF directory)")
        server = server_cls(cfg, checkpoint, layers=args.layers, dtype=args.dtype,
                            step=args.step, workdir=args.workdir, **server_kwargs)
        if not args.no_warmup:
            server.warmup()
        port = server.start(args.port, args.host)
    print(f"serving teacher {server.fingerprint} ({checkpoint}, {server.dtype}, layers "
          f"{format_layers(server.final, server.layers)}) on {args.host}:{port}", flush=True)
    try:
        server.wait()
    except KeyboardInterrupt:
        server.stop(0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
