"""Facts about the accelerators the study targets: one table, one owner.

Design notes: `docs/infrastructure.md`, under this file's name.
"""

from __future__ import annotations

import dataclasses

import jax

from hldstudy.errors import ConfigError

KiB = 1024
MiB = 1024 * KiB
GiB = 1024 * MiB


# The name scope under which a kernel whose compiler keeps no cost of it (Mosaic GPU drops
# `pl.CostEstimate`) declares its FLOPs, f"{KERNEL_FLOPS_SCOPE}{flops}":
# hldstudy.model.grouped_matmul writes it, hldstudy.flops.hlo_count reads it off the op_name.
KERNEL_FLOPS_SCOPE = "declared_flops_"


@dataclasses.dataclass(frozen=True)
class Chip:
    name: str                  # our name: v5e, h100, ...
    platform: str              # "tpu" | "cuda"
    device_memory_bytes: int   # what one device has for a program's buffers (docstring)
    onchip_bytes: int          # VMEM (TPU) or shared memory per block (GPU)
    scoped_default_bytes: int  # TPU scoped-VMEM default per kernel; 0 on GPU
    fp8_matmul: bool           # native FP8 dot on the matrix units
    # Public figures per device (sources in docs/infrastructure.md); 0 where not recorded.
    bf16_tflops: float = 0.0   # dense bf16 peak
    devices_per_node: int = 0  # devices of one host / node (what "two nodes" doubles)
    scale_up_gbps: float = 0.0   # inbound per device inside a slice / node: ICI, NVLink
    scale_out_gbps: float = 0.0  # inbound per device between nodes: DCN, InfiniBand NIC
    hbm_gbytes_per_s: float = 0.0  # HBM bandwidth (GB/s): the roofline's memory bound
    # An sm_90 GPU (warpgroup MMA): JAX's Mosaic GPU grouped matmuls run there
    # (hldstudy.model.grouped_matmul).
    hopper: bool = False


CHIPS: dict[str, Chip] = {c.name: c for c in (
    Chip("v4", "tpu", int(15.25 * GiB), 16 * MiB, 16 * MiB, False),
    Chip("v5e", "tpu", int(15.75 * GiB), 128 * MiB, 16 * MiB, False),
    Chip("v5p", "tpu", int(95.74 * GiB), 64 * MiB, 16 * MiB, False, bf16_tflops=459.0,
         devices_per_node=4, scale_up_gbps=4800.0, scale_out_gbps=50.0,
         hbm_gbytes_per_s=2765.0),
    Chip("v6e", "tpu", int(31.25 * GiB), 128 * MiB, 32 * MiB, False),
    Chip("a100", "cuda", 40960 * MiB, 163 * KiB, 0, False),
    Chip("h100", "cuda", 81559 * MiB, 227 * KiB, 0, True, bf16_tflops=989.0,
         devices_per_node=8, scale_up_gbps=3600.0, scale_out_gbps=400.0, hopper=True,
         hbm_gbytes_per_s=3350.0),
    Chip("h200", "cuda", 143771 * MiB, 227 * KiB, 0, True, bf16_tflops=989.0,
         devices_per_node=8, scale_up_gbps=3600.0, scale_out_gbps=400.0, hopper=True,
         hbm_gbytes_per_s=4800.0),
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
