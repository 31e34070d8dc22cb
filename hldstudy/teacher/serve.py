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
import time
from concurrent import futures
from pathlib import Path

import numpy as np

from hldstudy.errors import ConfigError, InputError, user_errors
from hldstudy.teacher import protocol as proto

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


def needed_layers(cfg, teacher_model_cfg) -> tuple[bool, tuple[int, ...]]:
    """(final needed, union of block layers) over every stage of the student's method."""
    from hldstudy.distill import make_strategy

    strategy = make_strategy(cfg, cfg.model, teacher_model_cfg)
    final, layers = False, set()
    for stage in strategy.stages():
        final |= bool(strategy.teacher_needs_head(stage))
        layers |= set(strategy.teacher_layers(stage))
    return final, tuple(sorted(layers))


def data_identity(cfg_data, train_stream) -> dict:
    """What must agree between trainer and replica for `batch_at(step)` to be the same batch."""
    keys = ("source", "seq_len", "batch_size", "seed", "packing", "add_bos", "synthetic_docs",
            "synthetic_seed", "max_docs", "train_split", "tfds_name", "text_field")
    out = {k: getattr(cfg_data, k) for k in keys}
    if train_stream is not None:
        out["stream_fingerprint"] = getattr(train_stream, "fingerprint", None)
    return out


def params_fingerprint(model_cfg, params) -> str:
    import jax

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
                 workdir: str | Path | None = None, exit_after_steps: int = 0,
                 hang_after_steps: int = 0, delay_s: float = 0.0):
        import jax

        from hldstudy.data import prepare_data
        from hldstudy.teacher.colocated import ColocatedTeacher, with_teacher_tokenizer

        dtype = dtype or cfg.teacher.dtype
        cfg = dataclasses.replace(cfg, teacher=dataclasses.replace(
            cfg.teacher, checkpoint=checkpoint, dtype=dtype))
        cfg = with_teacher_tokenizer(cfg)
        self.cfg, self.dtype, self.checkpoint = cfg, dtype, checkpoint
        model, tokenizer = _load_model(checkpoint, step)
        self.teacher = ColocatedTeacher(model, tokenizer, dtype=dtype, source=checkpoint)
        self.model_cfg = self.teacher.model_cfg
        self.workdir = Path(workdir or tempfile.mkdtemp(prefix="hldstudy-teacher-"))
        self.data = prepare_data(cfg.data, self.workdir)
        self.teacher.check_tokenizer(self.data.tokenizer)
        if layers:
            self.final, self.layers = parse_layers(layers)
        else:
            self.final, self.layers = needed_layers(cfg, self.model_cfg)
        for layer in self.layers:
            if not 0 <= layer <= self.model_cfg.n_layers:
                raise ConfigError("--layers", f"layer {layer} is out of range "
                                  f"0..{self.model_cfg.n_layers} of the teacher")
        self.fingerprint = params_fingerprint(self.model_cfg, self.teacher.params)
        self.params = jax.device_put(self.teacher.params)
        self._jits: dict = {}
        self._lock = threading.Lock()
        self._stats_lock = threading.Lock()
        self.stats = {"steps": 0, "payload_bytes": 0, "frame_bytes": 0, "head_bytes": 0,
                      "streams": 0}
        self.exit_after_steps, self.hang_after_steps = exit_after_steps, hang_after_steps
        self.delay_s = delay_s
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
                "data": data_identity(self.cfg.data, self.data.train), "pid": os.getpid()}

    def _forward(self, final: bool, layers: tuple[int, ...]):
        import jax

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
        import jax.numpy as jnp

        batch = self.data.train.batch_at(step)
        digest = proto.batch_digest(batch["tokens"], batch["segment_ids"])
        inputs = {k: jnp.asarray(batch[k]) for k in ("tokens", "positions", "segment_ids")}
        with self._lock:
            final_h, hidden = self._forward(final, layers)(self.params, inputs)
            tensors = ([("final", np.asarray(final_h))] if final else []) + \
                [(f"layer:{i}", np.asarray(hidden[i])) for i in sorted(layers)]
        if self.delay_s:
            time.sleep(self.delay_s)
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
            with self._stats_lock:
                done = self.stats["steps"]
            if self.exit_after_steps and done >= self.exit_after_steps:
                log.warning("exiting on purpose (--exit-after-steps %d) before step %d",
                            self.exit_after_steps, step)
                os._exit(3)
            if self.hang_after_steps and done >= self.hang_after_steps:
                log.warning("hanging on purpose (--hang-after-steps %d) at step %d",
                            self.hang_after_steps, step)
                while context.is_active():
                    time.sleep(0.1)
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
            from hldstudy.distill import make_strategy

            strategy = make_strategy(self.cfg, self.cfg.model, self.model_cfg)
            for stage in strategy.stages():
                final = bool(strategy.teacher_needs_head(stage))
                layers = tuple(sorted(strategy.teacher_layers(stage)))
                if (final or layers) and self.check_open(
                        {"final": final, "layers": list(layers)}) is None:
                    sets.add((final, layers))
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
        self.exit_after_steps = self.hang_after_steps = 0
        self.delay_s = 0.0
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


def _load_model(checkpoint: str, step: int | None):
    from hldstudy.teacher.colocated import _is_run_dir, teacher_tokenizer_path

    path = Path(checkpoint)
    if not path.exists():
        raise ConfigError("--checkpoint", f"{checkpoint} does not exist",
                          "give an hldstudy run directory, a .gguf file or an HF directory")
    if _is_run_dir(path):
        from hldstudy.data.tokenizer import Tokenizer
        from hldstudy.train.checkpoint import load_run_model

        _, model = load_run_model(path, step)
        tok = teacher_tokenizer_path(checkpoint)
        return model, (Tokenizer.load(tok) if tok else None)
    from hldstudy.model.importers import load_pretrained

    return load_pretrained(path)


def load_student_config(spec: str, overrides: list[str]):
    from hldstudy.config import apply_overrides, load_experiment, read_config

    path = Path(spec)
    if path.is_dir():
        cfg = read_config(path / "config.json")
    elif path.suffix == ".json":
        cfg = read_config(path)
    else:
        cfg = load_experiment(path)
    return apply_overrides(cfg, overrides)


def main(argv: list[str] | None = None) -> int:
    from hldstudy.cli_common import quiet_libraries

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
    parser.add_argument("--exit-after-steps", type=int, default=0,
                        help="fault injection: die (exit 3) when asked for one step more")
    parser.add_argument("--hang-after-steps", type=int, default=0,
                        help="fault injection: stop answering after this many steps")
    parser.add_argument("--delay-s", type=float, default=0.0,
                        help="extra seconds per step (benchmarks: a slower teacher)")
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
        server = TeacherServer(cfg, checkpoint, layers=args.layers, dtype=args.dtype,
                               step=args.step, workdir=args.workdir,
                               exit_after_steps=args.exit_after_steps,
                               hang_after_steps=args.hang_after_steps, delay_s=args.delay_s)
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
