"""Facts about the accelerators the study targets: one table, one owner.

The kernels size their blocks from a chip's on-chip memory, the ahead-of-time
compiler (`hldstudy.aot`) names its targets and their device memory, and the
planner checks a step against that memory: all three read these rows instead
of keeping numbers of their own.

Numbers are per device (a TPU chip's TensorCore as JAX addresses it, one GPU).
`onchip_bytes` is the memory a kernel's blocks live in (TPU VMEM; GPU shared
memory per thread block, opt-in maximum); `scoped_default_bytes` is what the
TPU compiler lets one Mosaic kernel use unless the kernel raises its
`vmem_limit_bytes` (GPUs have no such limit: 0).

On-chip figures as the compilers report them (libtpu 0.0.42, compile-only
topologies; JAX's `pltpu.get_tpu_info()` agrees): v4 has 16 MiB of VMEM per
device ("Used 28.32M of 16.00M vmem. Exceeded vmem capacity"; JAX addresses each
v4 TensorCore as a device); the scoped default is 16 MiB on v4, v5e and v5p
("Scoped allocation with size 22.50M and limit 16.00M") and 32 MiB on v6e (a
24.4 MiB kernel compiles without a limit). GPU shared memory per block is the
opt-in maximum (sm_80: 163 KiB, sm_90: 227 KiB).

`device_memory_bytes` is the memory one device has for a program's buffers, what the
ahead-of-time compiler's `memory_analysis()` total is held against. TPU: what libtpu's
compiler (0.0.42) says is available per device when a program does not fit ("exceeds
available HBM (15.75G)"; `hldstudy.aot` compile-only topologies): v5e 15.75 GiB of its
16, v5p 95.74 GiB, v6e 31.25 GiB of 32, v4 15.25 GiB (its compile-only topology
addresses each of a chip's two TensorCores as a device). GPU: the memory as the
driver reports it (nvidia-smi's total: H100 80GB HBM3 81559 MiB, H200 143771 MiB,
A100-SXM4-40GB 40960 MiB); the GPU target configs `hldstudy.aot` ships carry the same
figure (`device_memory_size`; tests/test_aot.py holds them equal).
"""

from __future__ import annotations

import dataclasses

import jax

from hldstudy.errors import ConfigError

KiB = 1024
MiB = 1024 * KiB
GiB = 1024 * MiB


@dataclasses.dataclass(frozen=True)
class Chip:
    name: str                  # our name: v5e, h100, ...
    platform: str              # "tpu" | "cuda"
    device_memory_bytes: int   # what one device has for a program's buffers (docstring)
    onchip_bytes: int          # VMEM (TPU) or shared memory per block (GPU)
    scoped_default_bytes: int  # TPU scoped-VMEM default per kernel; 0 on GPU
    fp8_matmul: bool           # native FP8 dot on the matrix units


CHIPS: dict[str, Chip] = {c.name: c for c in (
    Chip("v4", "tpu", int(15.25 * GiB), 16 * MiB, 16 * MiB, False),
    Chip("v5e", "tpu", int(15.75 * GiB), 128 * MiB, 16 * MiB, False),
    Chip("v5p", "tpu", int(95.74 * GiB), 64 * MiB, 16 * MiB, False),
    Chip("v6e", "tpu", int(31.25 * GiB), 128 * MiB, 32 * MiB, False),
    Chip("a100", "cuda", 40960 * MiB, 163 * KiB, 0, False),
    Chip("h100", "cuda", 81559 * MiB, 227 * KiB, 0, True),
    Chip("h200", "cuda", 143771 * MiB, 227 * KiB, 0, True),
)}


def chip(name: str) -> Chip:
    """The row for `name` (case-insensitive), or a ConfigError naming the choices."""
    key = name.lower()
    if key not in CHIPS:
        raise ConfigError("target", f"unknown chip {name!r}", f"choose one of {', '.join(CHIPS)}")
    return CHIPS[key]


# What JAX reports as `device.device_kind` (libtpu, the CUDA plugin) -> our chip name.
# TPUs by exact name; GPUs by model number inside the name ("NVIDIA H100 80GB HBM3").
TPU_DEVICE_KINDS = {"TPU v4": "v4", "TPU v5 lite": "v5e", "TPU v5e": "v5e", "TPU v5": "v5p",
                    "TPU v5p": "v5p", "TPU v6 lite": "v6e", "TPU v6e": "v6e"}
GPU_MODELS = ("h200", "h100", "a100")


def for_device_kind(device_kind: str) -> Chip | None:
    """Our row for a JAX device kind, or None (a CPU, a chip not in the table)."""
    if device_kind in TPU_DEVICE_KINDS:
        return CHIPS[TPU_DEVICE_KINDS[device_kind]]
    kind = device_kind.lower()
    return next((CHIPS[m] for m in GPU_MODELS if m in kind), None)


def traced_target() -> tuple[str, Chip | None]:
    """(backend, chip) that the code being traced now will run on.

    backend is jax.default_backend()'s spelling ("tpu", "gpu", "cpu"). The device is
    the current abstract mesh's (`jax.set_mesh(mesh)` over a target's compile-only
    devices, or `jax.sharding.use_abstract_mesh` with an AbstractDevice: how
    `hldstudy.aot` traces for a chip it does not have), else the default device's.
    Every `auto` choice (fused-KD kernel family and blocks, attention path) reads this.
    """
    device = jax.sharding.get_abstract_mesh().abstract_device
    if device is None:
        device = jax.devices()[0]
    backend = "gpu" if device.platform in ("gpu", "cuda", "rocm") else device.platform
    return backend, for_device_kind(device.device_kind)
