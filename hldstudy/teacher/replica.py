"""A teacher replica: the model, the data it reads and its forward compiled in
micro-batches that fit its device; no transport (`hldstudy.teacher.serve` serves one).

Design notes: `docs/teacher.md`, under `hldstudy/teacher/serve.py`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import shutil
import tempfile
import threading
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from hldstudy import sharding
from hldstudy.data import prepare_data
from hldstudy.distill.base import make_strategy
from hldstudy.errors import ConfigError, HLDError, InputError
from hldstudy.model.loading import load_model
from hldstudy.teacher import protocol as proto
from hldstudy.teacher.base import check_layers, method_needs
from hldstudy.teacher.colocated import ColocatedTeacher
from hldstudy.teacher.load import with_teacher_tokenizer
from hldstudy.teacher.microbatch import (
    compiled_fits,
    compiler_checked,
    device_memory,
    micro_batched,
    replica_candidates,
    replica_devices,
    replica_mesh,
    served,
)

LOG = logging.getLogger("hldstudy.teacher")


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


def check_dtype(dtype: str) -> str:
    if dtype not in proto.STREAM_DTYPES:
        raise ConfigError("--dtype", f"a replica computes in {', '.join(proto.STREAM_DTYPES)}, "
                          f"not {dtype!r}", "pass --dtype float32 or bfloat16")
    return dtype


@contextlib.contextmanager
def _quiet(*loggers: str):
    """Only CRITICAL records of these loggers while the block runs."""
    saved = [(lg, lg.level) for lg in map(logging.getLogger, loggers)]
    for lg, _ in saved:
        lg.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for lg, level in saved:
            lg.setLevel(level)


def format_layers(final: bool, layers) -> str:
    return ",".join((["final"] if final else []) + [str(i) for i in sorted(layers)])


def params_fingerprint(model_cfg, params) -> str:
    h = hashlib.sha256(json.dumps(dataclasses.asdict(model_cfg), sort_keys=True).encode())
    for path, leaf in sorted(jax.tree_util.tree_leaves_with_path(params),
                             key=lambda kv: jax.tree_util.keystr(kv[0])):
        h.update(jax.tree_util.keystr(path).encode())
        h.update(np.ascontiguousarray(np.asarray(leaf)).tobytes())
    return h.hexdigest()[:16]


def serves_problem(spec: dict, fingerprint: str, checkpoint: str, dtype: str, final: bool,
                   layers) -> str | None:
    """Why a replica of this identity cannot serve a stream request (None if it can)."""
    if spec.get("fingerprint") not in (None, fingerprint):
        return (f"this replica serves checkpoint {fingerprint} "
                f"({Path(checkpoint).name}), the trainer expects {spec['fingerprint']}")
    if spec.get("dtype") not in (None, dtype):
        return f"this replica computes in {dtype}, the trainer wants {spec['dtype']}"
    want_final, want = bool(spec.get("final")), set(spec.get("layers", []))
    if (want_final and not final) or not want <= set(layers):
        return (f"this replica serves layers {format_layers(final, layers)}, the "
                f"trainer wants {format_layers(want_final, want)}")
    return None


class Replica:
    """The teacher of one replica process: its model (`ColocatedTeacher`), the student's
    data (every step's batch by its number), the served layers, and `compute(step, ...)`."""

    def __init__(self, cfg, checkpoint: str, *,
                 layers: str | tuple[bool, tuple[int, ...]] | None = None, flag: str = "--layers",
                 dtype: str | None = None, step: int | None = None,
                 workdir: str | Path | None = None):
        dtype = check_dtype(dtype or cfg.teacher.dtype)
        cfg = dataclasses.replace(cfg, teacher=dataclasses.replace(
            cfg.teacher, checkpoint=checkpoint, dtype=dtype))
        cfg = with_teacher_tokenizer(cfg)
        self.cfg, self.dtype, self.checkpoint = cfg, dtype, checkpoint
        if not Path(checkpoint).exists():
            raise ConfigError("--checkpoint", f"{checkpoint} does not exist",
                              "give an hldstudy run directory, a .gguf file or an HF directory")
        try:
            with _quiet("absl", "orbax"):  # a damaged checkpoint is reported in one line below
                loaded = load_model(checkpoint, step)
        except HLDError:
            raise
        except (OSError, ValueError, KeyError, TypeError) as e:  # a damaged checkpoint
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise InputError(f"--checkpoint: cannot load {checkpoint}: {first[:300]}") from e
        self.teacher = ColocatedTeacher(loaded.model, loaded.tokenizer, teacher=cfg.teacher,
                                        source=checkpoint)
        self.model_cfg = self.teacher.model_cfg
        # The served layers are checked before anything is made (the data cache below),
        # against the flag they came from.
        if isinstance(layers, tuple):
            self.final, self.layers = layers
        elif layers:
            self.final, self.layers = parse_layers(layers)
        else:
            needs = method_needs(make_strategy(cfg, cfg.model, self.model_cfg), self.model_cfg)
            self.final, self.layers = needs.final, needs.layers
        check_layers(self.layers, self.model_cfg.n_layers, flag, first=0, what="teacher layer")
        self._own_workdir = workdir is None  # a temporary one: removed by cleanup()
        self.workdir = Path(workdir or tempfile.mkdtemp(prefix="hldstudy-teacher-"))
        try:
            self.data = prepare_data(cfg.data, self.workdir)
            self.teacher.check_tokenizer(self.data.tokenizer)
        except BaseException:
            self.cleanup()
            raise
        self.fingerprint = params_fingerprint(self.model_cfg, self.teacher.params)
        self.devices = replica_devices(cfg.teacher.replica_devices, jax.local_devices())
        if len(self.devices) > 1:  # weights and each micro-batch split over the devices
            self.mesh = replica_mesh(self.devices)
            self.params = sharding.put_tree(
                self.teacher.params, sharding.tree_shardings(self.mesh, self.teacher.params))
        else:
            self.mesh = None
            self.params = jax.device_put(self.teacher.params)
        self._jits: dict = {}
        self._lock = threading.Lock()

    def info(self) -> dict:
        # The checkpoint's name only: no absolute path, no pid leaves the machine.
        return {"protocol": proto.PROTOCOL_VERSION, "fingerprint": self.fingerprint,
                "checkpoint": Path(self.checkpoint).name, "dtype": self.dtype,
                "model": dataclasses.asdict(self.model_cfg),
                "final": self.final, "layers": list(self.layers),
                "tokenizer": {"fingerprint": self.data.tokenizer.fingerprint(),
                              "vocab_size": self.data.tokenizer.vocab_size},
                "data": proto.data_identity(self.cfg.data, self.data.train)}

    def replica_batch(self, final: bool, layers: tuple[int, ...]) -> int:
        """Sequences per micro-batch of the forward serving (final, layers)."""
        return self._forward(final, layers)[1]

    def _forward(self, final: bool, layers: tuple[int, ...]):
        """(forward, sequences per micro-batch) for (final, layers): teacher.replica_batch,
        or the largest divisor of the batch that fits this device by the planner and by
        the compiler (`replica_candidates`, `compiler_checked`: compiled ahead for the
        step's shapes where the device's memory is known)."""
        key = (final, layers)
        if key not in self._jits:
            run = served(self.teacher.forward_fn(layers, final))
            d = self.cfg.data
            b, memory = d.batch_size, device_memory(self.devices[0])
            candidates = replica_candidates(
                self.cfg.teacher.replica_batch, self.model_cfg, b, d.seq_len, layers=layers,
                head=final, dtype=self.dtype, backend=jax.default_backend(), memory_bytes=memory,
                shards=len(self.devices))
            if len(candidates) == 1 and self.mesh is None:  # compiled at the first call
                self._jits[key] = jax.jit(micro_batched(run, b // candidates[0])), candidates[0]
            else:
                inputs = self._inputs(self.data.train.batch_at(0))
                abstract = jax.tree_util.tree_map(
                    lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(
                        x, "sharding", None)), (self.params, inputs))
                micro, compiled = compiler_checked(
                    candidates, lambda m: self._compile(micro_batched(run, b // m), abstract),
                    lambda c: memory is None or compiled_fits(c, memory))
                self._jits[key] = compiled, micro
        return self._jits[key]

    def _compile(self, fn, abstract):
        # Over several devices, traced under their mesh (what chips.traced_target reads).
        with contextlib.nullcontext() if self.mesh is None else jax.set_mesh(self.mesh):
            return jax.jit(fn).lower(*abstract).compile()

    def _inputs(self, batch) -> dict:
        inputs = {k: np.asarray(batch[k]) for k in ("tokens", "positions", "segment_ids")}
        if self.mesh is None:
            return {k: jnp.asarray(v) for k, v in inputs.items()}
        return sharding.put_batch(inputs, self.mesh)  # each device its rows

    def compute(self, step: int, final: bool, layers: tuple[int, ...]):
        """(digest, [(name, array)]) of one step, in protocol order (IndexError: a step
        outside the data)."""
        if step < 0:
            raise IndexError(step)
        batch = self.data.train.batch_at(step)
        digest = proto.batch_digest(batch["tokens"], batch["segment_ids"])
        inputs = self._inputs(batch)
        with self._lock:
            final_h, hidden, dropped = self._forward(final, layers)[0](self.params, inputs)
            tensors = ([("final", np.asarray(final_h))] if final else []) + \
                [(f"layer:{i}", np.asarray(hidden[i])) for i in sorted(layers)]
        if dropped is not None and float(np.max(dropped)) > 0:  # capacity dispatch: say so
            LOG.warning("step %d: the teacher's experts dropped %.4f%% of routed slots "
                        "(teacher.moe_capacity_factor=%s)", step,
                        100 * float(np.mean(dropped)), self.model_cfg.moe_capacity_factor)
        return digest, tensors

    def head(self) -> np.ndarray:
        return np.asarray(self.teacher.head_vxd())

    def cleanup(self) -> None:
        """Removes the temporary work directory (never one the user gave)."""
        if getattr(self, "_own_workdir", False):
            shutil.rmtree(self.workdir, ignore_errors=True)
