"""Device mesh and shardings: a (data, fsdp) mesh over all devices (below the trainer and
the teacher, which both place arrays on it).

Parameters are sharded FSDP-style: each array's largest dimension that
divides the fsdp axis size is split over "fsdp"; the rest is replicated.
Batches are split along their first axis over both axes together. On one
device every spec degenerates to replication, so the same code runs
everywhere. Multi-host: call `maybe_initialize_distributed()` first.
"""

from __future__ import annotations

import os

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from hldstudy.config import TrainConfig
from hldstudy.errors import ConfigError

BATCH_AXES = ("data", "fsdp")


def maybe_initialize_distributed() -> None:
    """Joins a multi-host job when the launcher says so (JAX_COORDINATOR_ADDRESS or SLURM)."""
    if jax.process_count() > 1:
        return
    if os.environ.get("JAX_COORDINATOR_ADDRESS") or os.environ.get("HLDSTUDY_DISTRIBUTED") == "1":
        jax.distributed.initialize()


def make_mesh(cfg: TrainConfig, devices=None) -> Mesh:
    devices = list(devices if devices is not None else jax.devices())
    n = len(devices)
    data, fsdp = cfg.mesh_data, cfg.mesh_fsdp
    if data < 0:
        data = n // fsdp
    if fsdp < 0:
        fsdp = n // data
    if data * fsdp != n:
        raise ConfigError("train.mesh_data",
                          f"mesh {data}x{fsdp} does not cover the {n} available devices",
                          "set train.mesh_data/train.mesh_fsdp so their product is the device count")
    return Mesh(np.array(devices).reshape(data, fsdp), BATCH_AXES)


def param_spec(shape: tuple[int, ...], fsdp_size: int) -> P:
    if fsdp_size <= 1 or len(shape) < 2:
        return P()
    for axis in sorted(range(len(shape)), key=lambda a: -shape[a]):
        if shape[axis] % fsdp_size == 0:
            spec = [None] * len(shape)
            spec[axis] = "fsdp"
            return P(*spec)
    return P()


def tree_shardings(mesh: Mesh, tree):
    """NamedShardings for a pytree of arrays (params, optimizer state)."""
    fsdp = mesh.shape["fsdp"]
    return jax.tree_util.tree_map(
        lambda x: NamedSharding(mesh, param_spec(tuple(getattr(x, "shape", ())), fsdp)), tree)


def batch_sharding(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P(BATCH_AXES))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def check_batch_divisible(batch_size: int, mesh: Mesh) -> None:
    n = mesh.devices.size
    if batch_size % n:
        raise ConfigError("data.batch_size", f"{batch_size} is not divisible by the {n} devices",
                          f"use a multiple of {n}")


def put_batch(batch: dict, mesh: Mesh) -> dict:
    """Places a host-side global batch (numpy, identical on every process) onto the mesh."""
    sharding = batch_sharding(mesh)
    out = {}
    for key, value in batch.items():
        value = np.asarray(value)
        out[key] = jax.make_array_from_callback(value.shape, sharding, lambda idx, v=value: v[idx])
    return out
