"""A teacher replica's forward in micro-batches, and how many sequences each one holds.

Design notes: `docs/teacher.md`, under this file's name.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh

from hldstudy import chips
from hldstudy.config import ModelConfig
from hldstudy.errors import ConfigError
from hldstudy.mesh_axes import MESH_AXES
from hldstudy.model.attention import resolve_implementation
from hldstudy.plan import fits_device, peak_habits, predict_teacher_forward_memory, xla_memory


def replica_devices(requested: int, devices) -> list:
    """The devices a replica's forward runs over: `teacher.replica_devices` of `devices`
    (0: all of them). Over several, its weights are split over them (FSDP: a layer's
    gathered as it runs) and every micro-batch's sequences too."""
    devices = list(devices)
    n = len(devices) if requested == 0 else requested
    if n > len(devices):
        raise ConfigError("teacher.replica_devices", f"{n} devices asked, the replica's host "
                          f"has {len(devices)}", "give at most that many, or 0 (all of them)")
    return devices[:n]


def replica_mesh(devices) -> Mesh:
    """A replica's mesh: its devices on the FSDP axis (`hldstudy.sharding` then splits the
    weights over them and the batch too). One device: the mesh `chips.traced_target`
    reads the target chip from while tracing, as the replica's own default device does."""
    return Mesh(np.asarray(list(devices)).reshape(1, len(devices), 1), MESH_AXES)


def micro_batched(forward, n: int):
    """`forward(params, batch) -> outputs` (arrays with the batch leading) as `n`
    micro-batches looped inside one program; n = 1: `forward` itself. Sequence r goes to
    micro-batch r mod n: where the batch is split over devices in contiguous blocks, every
    micro-batch is then split over all of them."""
    if n == 1:
        return forward

    def run(params, batch):
        def split(x):
            if x.shape[0] % n:
                raise ConfigError("teacher.replica_batch", f"a batch of {x.shape[0]} "
                                  f"sequences does not split into {n} micro-batches")
            return jax.numpy.swapaxes(x.reshape(x.shape[0] // n, n, *x.shape[1:]), 0, 1)

        out = jax.lax.map(lambda b: forward(params, b), jax.tree_util.tree_map(split, batch))
        return jax.tree_util.tree_map(
            lambda y: jax.numpy.swapaxes(y, 0, 1).reshape(-1, *y.shape[2:]), out)

    return run


def device_memory(device) -> int | None:
    """Bytes one replica's device gives its programs: the allocator's limit where JAX
    reports one (`memory_stats()['bytes_limit']`: GPU, TPU), else our chip table's row
    for the device kind; None on a CPU (no limit to plan against: the whole batch)."""
    if device.platform == "cpu":
        return None
    try:
        limit = (device.memory_stats() or {}).get("bytes_limit")
    except Exception:  # noqa: BLE001 - a backend without memory statistics
        limit = None
    if limit:
        return int(limit)
    row = chips.for_device_kind(device.device_kind)
    return row.device_memory_bytes if row is not None else None


def replica_forward_memory(teacher_model: ModelConfig, batch_size: int, micro: int,
                          seq_len: int, *, layers: tuple[int, ...], head: bool, dtype: str,
                          backend: str, shards: int = 1) -> dict[str, float]:
    """The planner's `memory_analysis()` of a replica's forward of `batch_size` sequences
    run as micro-batches of `micro`, as `backend`'s compiler schedules it (its row of
    `hldstudy.plan.compilers`), per device of `shards`: params, the whole batch's inputs
    and outputs, one micro-batch's working set; over several devices each holds its share
    of all of them, and one layer's weights gathered whole."""
    impl = resolve_implementation(teacher_model.attention, dtype=dtype,
                                  softcap=teacher_model.attn_softcap,
                                  head_dim=teacher_model.head_dim, seq_len=seq_len,
                                  backend=backend)
    # The planner models the dense path and the memory-efficient ones (chunked, cuDNN,
    # splash: no [T, T] scores kept) as "flash".
    kw = dict(layers=layers, head=head, dtype=dtype, compiler=backend,
              attention="dense" if impl == "dense" else "flash")
    whole = predict_teacher_forward_memory(teacher_model, batch_size, seq_len, **kw)
    per_device = max(micro // shards, 1)
    one = whole if per_device == batch_size else \
        predict_teacher_forward_memory(teacher_model, per_device, seq_len, **kw)
    out = dict(whole, temp_bytes=one["temp_bytes"])
    if shards > 1:
        layer = whole["argument_bytes"] / max(teacher_model.n_layers, 1)  # one layer gathered
        # A compiler that copies the sharded weights into the micro-batch loop (XLA GPU).
        copy = peak_habits(backend).sharded_loop_weight_copy if micro < batch_size else 0.0
        out.update(argument_bytes=whole["argument_bytes"] / shards,
                   output_bytes=whole["output_bytes"] / shards,
                   temp_bytes=one["temp_bytes"] + layer
                   + copy * whole["argument_bytes"] / shards)
    out["total_bytes"] = out["argument_bytes"] + out["output_bytes"] + out["temp_bytes"]
    return out


def forward_bytes(teacher_model: ModelConfig, batch_size: int, micro: int, seq_len: int, *,
                  layers: tuple[int, ...], head: bool, dtype: str, backend: str,
                  shards: int = 1) -> float:
    """`replica_forward_memory`'s total: what `pick_replica_batch` holds to the device."""
    return replica_forward_memory(teacher_model, batch_size, micro, seq_len, layers=layers,
                                  head=head, dtype=dtype, backend=backend,
                                  shards=shards)["total_bytes"]


def pick_replica_batch(requested: int, teacher_model: ModelConfig, batch_size: int,
                       seq_len: int, *, layers: tuple[int, ...], head: bool, dtype: str,
                       backend: str, memory_bytes: int | None, shards: int = 1) -> int:
    """Sequences per micro-batch: `requested` (teacher.replica_batch) when set; else the
    largest divisor of `batch_size` (a multiple of the replica's `shards` devices, each
    taking its share) whose forward fits `memory_bytes` per device by the planner (the
    whole batch where the memory is unknown, the smallest candidate where nothing fits:
    the compiler then says by how much)."""
    if requested:
        if requested < 0 or batch_size % requested or requested % shards:
            raise ConfigError("teacher.replica_batch", f"{requested} does not divide the "
                              f"batch of {batch_size} into micro-batches that split over "
                              f"the replica's {shards} device(s)",
                              "give a divisor of data.batch_size that is a multiple of "
                              "teacher.replica_devices, or 0 (auto)")
        return requested
    if batch_size % shards:
        raise ConfigError("teacher.replica_devices", f"the batch of {batch_size} sequences "
                          f"does not split over {shards} devices",
                          "give a divisor of data.batch_size")
    if memory_bytes is None:
        return batch_size
    divisors = divisors_from(batch_size, batch_size, shards)
    return next((b for b in divisors
                 if forward_bytes(teacher_model, batch_size, b, seq_len, layers=layers,
                                  head=head, dtype=dtype, backend=backend,
                                  shards=shards) <= memory_bytes),
                divisors[-1])


def replica_candidates(requested: int, teacher_model: ModelConfig, batch_size: int,
                       seq_len: int, *, layers: tuple[int, ...], head: bool, dtype: str,
                       backend: str, memory_bytes: int | None,
                       shards: int = 1) -> list[int]:
    """The micro-batches a replica tries, largest first (`compiler_checked`): the one
    asked for, or the whole batch where the device's memory is unknown (nothing to check
    against); else the planner's pick and every smaller divisor (multiples of `shards`),
    so the compiler has the last word. The one rule for the server and for
    `hldstudy.aot`."""
    micro = pick_replica_batch(requested, teacher_model, batch_size, seq_len, layers=layers,
                               head=head, dtype=dtype, backend=backend,
                               memory_bytes=memory_bytes, shards=shards)
    if requested or memory_bytes is None:
        return [micro]
    return divisors_from(batch_size, micro, shards)


def served(forward):
    """A replica's program from a teacher forward (`teacher_forward_fn`): the tensors it
    serves, (final hidden states, hidden states by layer), and the [B] share of each row's
    expert slots its MoE dropped (None for a dense teacher), which the replica logs."""

    def run(params, batch):
        out = forward(params, batch)
        return out.final_hidden, out.hidden, out.expert_drop_rate

    return run


def divisors_from(batch_size: int, start: int, multiple_of: int = 1) -> list[int]:
    """The divisors of `batch_size` from `start` down that are multiples of `multiple_of`,
    largest first."""
    return [b for b in range(start, 0, -1) if batch_size % b == 0 and b % multiple_of == 0]


def compiled_fits(compiled, memory_bytes: int) -> bool:
    """Whether a program compiled for this process's backend fits `memory_bytes`, by the
    one rule (`hldstudy.plan.fits_device`)."""
    return fits_device(xla_memory(compiled), jax.default_backend(), memory_bytes)


def compiler_checked(micro_batches, compile_micro, fits):
    """(micro, compiled) of the first of `micro_batches` (largest first) whose program
    `compile_micro(micro)` the compiler says `fits`; the last one where none does (what
    it needs is then the compiler's to say)."""
    micro = compiled = None
    for micro in micro_batches:
        compiled = compile_micro(micro)
        if fits(compiled):
            break
    return micro, compiled
