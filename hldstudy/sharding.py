"""Device mesh and shardings: a (data, fsdp, expert) mesh over all devices (below the
trainer and the teacher, which both place arrays on it).

Design notes: `docs/infrastructure.md`, under this file's name.
"""

from __future__ import annotations

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from hldstudy import distributed
from hldstudy.config import TrainConfig, check_expert_axis
from hldstudy.errors import ConfigError
from hldstudy.mesh_axes import BATCH_AXES, MESH_AXES  # noqa: F401 - re-exported

# Variable metadata naming the dimension of a parameter that indexes experts.
EXPERT_DIM = "expert_dim"


def expert_dim_metadata(dim: int) -> dict:
    """`nnx.Param(value, **expert_dim_metadata(0))`: `value`'s dimension `dim` indexes
    experts, so it is split over the mesh's expert axis (and so are its optimizer moments,
    which carry the same metadata)."""
    return {EXPERT_DIM: dim}


def distributed_requested() -> bool:
    """Whether the environment asks for a multi-process job (see the module docstring)."""
    return distributed.requested()


def maybe_initialize_distributed() -> None:
    """Joins a multi-process job when the launcher says so (hldstudy.distributed: a
    partial setting is refused, an unreachable coordinator ends in one line); a no-op
    otherwise, and when already joined. Must run before anything uses a JAX device."""
    distributed.initialize()


def is_primary() -> bool:
    """Process 0: the one that writes a run's files (config, metrics, results)."""
    return jax.process_index() == 0


def sync(name: str) -> None:
    """Waits for every process to reach `name` (a no-op in a single-process job)."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


def make_mesh(cfg: TrainConfig, devices=None) -> Mesh:
    """data x fsdp x expert over `devices` (all of them by default); the expert axis is the
    innermost, so an expert group is a run of neighbouring devices."""
    devices = list(devices if devices is not None else jax.devices())
    n = len(devices)
    data, fsdp, expert = cfg.mesh_data, cfg.mesh_fsdp, cfg.mesh_expert
    if data < 0:
        data = n // (fsdp * expert)
    if fsdp < 0:
        fsdp = n // (data * expert)
    if data * fsdp * expert != n:
        raise ConfigError("train.mesh_data",
                          f"mesh {data}x{fsdp}x{expert} does not cover the {n} available devices",
                          "set train.mesh_data/mesh_fsdp/mesh_expert so their product is the "
                          "device count")
    return Mesh(np.array(devices).reshape(data, fsdp, expert), MESH_AXES)


def param_spec(shape: tuple[int, ...], fsdp_size: int, expert_size: int = 1,
               expert_dim: int | None = None) -> P:
    """FSDP: the largest dimension divisible by `fsdp_size` over "fsdp" (vectors and scalars
    replicated). With `expert_dim` (an expert weight) that dimension goes over "expert"
    first (`expert_size` must divide it: ConfigError naming train.mesh_expert) and FSDP
    picks among the others."""
    spec: list[str | None] = [None] * len(shape)
    if expert_dim is not None and expert_size > 1:
        check_expert_axis(shape[expert_dim], expert_size, f"an expert weight of shape {shape}")
        spec[expert_dim] = "expert"
    if fsdp_size > 1 and len(shape) >= 2:
        free = [a for a in range(len(shape)) if spec[a] is None]
        for axis in sorted(free, key=lambda a: -shape[a]):
            if shape[axis] % fsdp_size == 0:
                spec[axis] = "fsdp"
                break
    return P(*spec) if any(spec) else P()


def tree_shardings(mesh: Mesh, tree):
    """NamedShardings for a pytree of arrays (params, optimizer state); a leaf inside a
    Variable carrying `EXPERT_DIM` metadata is an expert weight (see `param_spec`)."""
    fsdp, expert = mesh.shape["fsdp"], mesh.shape["expert"]

    def leaf(x, expert_dim=None):
        return NamedSharding(mesh, param_spec(tuple(getattr(x, "shape", ())), fsdp, expert,
                                              expert_dim))

    def node(x):
        if isinstance(x, nnx.Variable):
            dim = x.get_metadata().get(EXPERT_DIM)
            return jax.tree_util.tree_map(lambda a: leaf(a, dim), x)
        return leaf(x)

    return jax.tree_util.tree_map(node, tree, is_leaf=lambda x: isinstance(x, nnx.Variable))


def batch_sharding(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P(BATCH_AXES))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def check_batch_divisible(batch_size: int, mesh: Mesh) -> None:
    n = mesh.devices.size
    if batch_size % n:
        raise ConfigError("data.batch_size", f"{batch_size} is not divisible by the {n} devices",
                          f"use a multiple of {n}")


def put_batch(batch: dict, mesh: Mesh, batch_size: int | None = None) -> dict:
    """Places a host-side batch onto the mesh: the global batch (numpy, identical on every
    process; each process transfers only the rows of its own devices), or, when it holds
    fewer than `batch_size` rows, only this process's rows of it (`process_rows`)."""
    sharding = batch_sharding(mesh)
    out = {}
    for key, value in batch.items():
        value = np.asarray(value)
        if batch_size is not None and len(value) != batch_size:
            out[key] = jax.make_array_from_process_local_data(
                sharding, value, (batch_size, *value.shape[1:]))
        else:
            out[key] = jax.make_array_from_callback(value.shape, sharding,
                                                    lambda idx, v=value: v[idx])
    return out


def process_rows(mesh: Mesh, batch_size: int) -> list[int] | None:
    """The rows of a global batch this process's devices hold; None in a single-process
    job (all of them)."""
    if jax.process_count() == 1:
        return None
    index = batch_sharding(mesh).addressable_devices_indices_map((batch_size,))
    return sorted({r for idx in index.values() for r in range(*idx[0].indices(batch_size))})


def gather_cursor(rows: list[int], local: list, batch_size: int) -> list:
    """The whole batch's per-row data cursor ([doc, offset] per row) from every process's
    own rows (`rows`, `local`): one all-gather of small integers."""
    from jax.experimental import multihost_utils

    mine = np.zeros((batch_size, 2), np.int32)
    mine[rows] = np.asarray(local, np.int32).reshape(len(rows), 2)
    return np.asarray(multihost_utils.process_allgather(mine)).max(axis=0).tolist()


def put_tree(tree, shardings):
    """`jax.device_put(tree, shardings)` that also serves a mesh spanning several processes,
    where every process holds the whole tree (on the host, or on its own device: a loaded
    teacher): each process transfers only its own devices' shards (no cross-process
    comparison or copy). An array already placed so is returned as it is."""
    if jax.process_count() == 1:
        return jax.device_put(tree, shardings)

    def put(x, s):
        if isinstance(x, jax.Array) and x.sharding == s:
            return x
        host = np.asarray(x)
        return jax.make_array_from_callback(host.shape, s, lambda idx: host[idx])

    return jax.tree_util.tree_map(put, tree, shardings)
