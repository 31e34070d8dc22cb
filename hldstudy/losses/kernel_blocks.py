"""Blocks and compiler limits of the fused KD kernels, sized for a target chip.

Design notes: `docs/losses.md`, under this file's name.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from hldstudy.chips import Chip

FAMILIES = ("mosaic", "triton")
TPU_TILE_ROWS, TPU_LANES = 8, 128  # a 32-bit VMEM tile; narrower dtypes pack more rows
# Share of the chip's VMEM a fused-KD kernel may take: the rest is headroom for the
# compiler's own scratch (Mosaic reserves some for internal use).
MOSAIC_BUDGET = 0.75
# [R, C] float32 values live at once per kernel (logits, exponentials, masks,
# the gradient tile), fitted to libtpu's reports (module doc).
MOSAIC_LIVE_TILES = {"stats": 8, "dh": 12, "dw": 12}
# float32 gradient kernels: libtpu 0.0.42 on v4 asks for a further ~0.5-1.3 KiB per unit
# of d_s + d_t whatever the blocks (the HIGHEST-precision dots' operand splits, we
# believe): 13.11M for dh at (128, 256), d 1152, 14.42M at (64, 128), d 2304.
MOSAIC_F32_GRAD_BYTES_PER_D = 1536
# (rows, cols) tried in order: larger first, more rows first.
MOSAIC_CANDIDATES = ((256, 512), (256, 256), (128, 512), (128, 256), (128, 128), (64, 128),
                     (32, 128), (16, 128))
TRITON_CANDIDATES = ((64, 128), (32, 128), (32, 64), (16, 64), (16, 32), (16, 16))
TRITON_D_BLOCK = 64
TRITON_WARPS, TRITON_STAGES = 4, 2


@dataclasses.dataclass(frozen=True)
class KernelBlocks:
    """What the fused KD kernels are built with on one target."""

    family: str                # "mosaic" | "triton"
    row_block: int
    vocab_block: int
    vmem_limit_bytes: int = 0  # Mosaic: the scoped-VMEM limit each kernel sets (0: none)
    num_warps: int = TRITON_WARPS
    num_stages: int = TRITON_STAGES
    chip: str = ""             # the chips.Chip row it was sized for ("" = none known)

    def __post_init__(self):
        if self.family not in FAMILIES:
            raise ValueError(f"family: expected one of {FAMILIES}, got {self.family!r}")
        for name in ("row_block", "vocab_block", "num_warps", "num_stages"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if self.vmem_limit_bytes < 0:
            raise ValueError(f"vmem_limit_bytes: must be >= 0, got {self.vmem_limit_bytes}")


def _itemsize(dtype) -> int:
    return jnp.dtype(dtype).itemsize


def _vmem_tile_bytes(rows: int, cols: int, itemsize: int) -> int:
    """Bytes of a [rows, cols] VMEM buffer padded to whole (8 * packing, 128) tiles."""
    sublanes = TPU_TILE_ROWS * max(1, 4 // itemsize)
    return (-(-rows // sublanes) * sublanes) * (-(-cols // TPU_LANES) * TPU_LANES) * itemsize


def mosaic_vmem_bytes(kernel: str, rows: int, cols: int, d_s: int, d_t: int, dtype) -> int:
    """Scoped VMEM one Mosaic kernel ("stats", "dh", "dw") asks for: double-buffered
    blocks plus MOSAIC_LIVE_TILES [rows, cols] float32 temporaries."""
    es = _itemsize(dtype)
    column = _vmem_tile_bytes(rows, 1, 4)  # a per-row [R, 1] operand (labels, stats)
    blocks = (_vmem_tile_bytes(rows, d_s, es) + _vmem_tile_bytes(rows, d_t, es)
              + _vmem_tile_bytes(d_s, cols, es) + _vmem_tile_bytes(d_t, cols, es))
    if kernel == "stats":
        blocks += column + 9 * column  # labels in, nine running statistics out
    elif kernel == "dh":
        blocks += 9 * column + _vmem_tile_bytes(rows, d_s, 4)  # labels, stats, coefs; dh out
    elif kernel == "dw":
        blocks += 9 * column + _vmem_tile_bytes(d_s, cols, 4)  # ...; dW out
    else:
        raise ValueError(f"kernel: expected stats, dh or dw, got {kernel!r}")
    f32_split = MOSAIC_F32_GRAD_BYTES_PER_D * (d_s + d_t) if es == 4 and kernel != "stats" else 0
    return 2 * blocks + MOSAIC_LIVE_TILES[kernel] * rows * cols * 4 + f32_split


def mosaic_peak_bytes(rows: int, cols: int, d_s: int, d_t: int, dtype) -> int:
    return max(mosaic_vmem_bytes(k, rows, cols, d_s, d_t, dtype) for k in MOSAIC_LIVE_TILES)


def triton_d_block(d: int) -> int:
    """The d slice of the Triton K-loop: a power of two, >= 16 (tl.dot), <= TRITON_D_BLOCK."""
    return max(16, min(TRITON_D_BLOCK, 1 << max(0, (d - 1).bit_length())))


def triton_smem_bytes(rows: int, cols: int, d: int, dtype, num_stages: int = TRITON_STAGES) -> int:
    """Shared memory of one Triton program: pipelined [R, k] and [k, C] dot operands."""
    k = triton_d_block(d)
    return num_stages * (rows * k + k * cols) * _itemsize(dtype)


def mosaic_fits(chip: Chip, rows: int, cols: int, d_s: int, d_t: int, dtype) -> bool:
    return mosaic_peak_bytes(rows, cols, d_s, d_t, dtype) <= mosaic_budget(chip)


def mosaic_budget(chip: Chip) -> int:
    """The scoped-VMEM limit the kernels set on `chip` (whole MiB)."""
    return int(chip.onchip_bytes * MOSAIC_BUDGET) // (1 << 20) * (1 << 20)


class BlocksDoNotFit(ValueError):
    """No Mosaic block of MOSAIC_CANDIDATES fits the chip's VMEM at this head shape."""


def for_target(chip: Chip | None, d: int, vocab: int, dtype, *, d_teacher: int | None = None,
               family: str | None = None) -> KernelBlocks:
    """Blocks and compiler limits for the fused KD kernels on `chip`.

    d / d_teacher: student / teacher hidden sizes (the teacher's defaults to d);
    vocab: the head's columns (blocks never exceed it rounded up to a tile);
    dtype: the heads' dtype. family: "mosaic" / "triton" (default: the chip's
    platform's). chip None (no known accelerator: interpret mode, an unknown
    device kind) gives the family's smallest-VMEM sizing (16 MiB) with no limit set.
    Raises BlocksDoNotFit when even the smallest Mosaic block does not fit (float32
    Gemma heads on v4's 16 MiB): the fused loss then takes its XLA path under `auto`.
    """
    d_t = d if d_teacher is None else d_teacher
    if family is None:
        family = "mosaic" if chip is None or chip.platform == "tpu" else "triton"
    if family not in FAMILIES:
        raise ValueError(f"family: expected one of {FAMILIES}, got {family!r}")
    if family == "mosaic":
        budget = mosaic_budget(chip) if chip is not None and chip.platform == "tpu" else 16 << 20
        col_cap = max(TPU_LANES, -(-vocab // TPU_LANES) * TPU_LANES)
        for rows, cols in MOSAIC_CANDIDATES:
            cols = min(cols, col_cap)
            if mosaic_peak_bytes(rows, cols, d, d_t, dtype) <= budget:
                break
        else:
            raise BlocksDoNotFit(
                f"the fused-KD Mosaic kernels do not fit {chip.name if chip else 'a 16 MiB'} "
                f"VMEM at d={d}/{d_t} {jnp.dtype(dtype).name} (smallest block {rows}x{cols} "
                f"needs {mosaic_peak_bytes(rows, cols, d, d_t, dtype) / 2**20:.1f} MiB of "
                f"{budget / 2**20:.0f}): use bfloat16 heads or distill.fused_backend=xla")
        limit = budget if chip is not None and chip.platform == "tpu" else 0
        return KernelBlocks("mosaic", rows, cols, vmem_limit_bytes=limit,
                            chip=chip.name if chip else "")
    smem = chip.onchip_bytes if chip is not None and chip.platform == "cuda" else 99 * 1024
    for rows, cols in TRITON_CANDIDATES:
        if triton_smem_bytes(rows, cols, max(d, d_t), dtype) <= smem:
            break
    return KernelBlocks("triton", rows, cols, chip=chip.name if chip else "")


# Elementwise work per logit (both heads' [R, C] tiles): masking, scaling, the online
# log-sum-exp updates (stats) or the softmax-difference gradient (grads), counted as
# VPU operations. Matmuls dominate (2 d per logit per head) at any real d.
_STATS_OPS_PER_LOGIT = 12
_GRAD_OPS_PER_LOGIT = 16


def kernel_cost(kernel: str, family: str, n_rows: int, vocab_padded: int, d_s: int, d_t: int,
                dtype, row_block: int, vocab_block: int, *, softcap: bool,
                temperature_is_one: bool) -> tuple[int, int, int]:
    """(flops, transcendentals, bytes accessed) of one fused-KD kernel call, closed form:
    what `pl.CostEstimate` declares so that the target's cost analysis counts the kernel.

    kernel: "stats", "dh", "dw" (Mosaic) or "grads" (Triton: dh and dW in one kernel).
    Bytes follow each family's grid: a block whose index does not change between
    consecutive steps is read once (Mosaic), a Triton program reads its own operands.
    """
    es = _itemsize(dtype)
    logits = n_rows * vocab_padded
    n_row_blocks, n_chunks = n_rows // row_block, vocab_padded // vocab_block
    heads = (d_s + d_t) * vocab_padded * es
    hidden = n_rows * (d_s + d_t) * es
    column = n_rows * 4  # a per-row float32 / int32 column
    caps = 2 * logits if softcap else 0
    if kernel == "stats":
        exps = (2 if temperature_is_one else 3) * logits + 3 * n_rows * n_chunks
        flops = 2 * logits * (d_s + d_t) + _STATS_OPS_PER_LOGIT * logits
        return flops, exps + caps, hidden + n_row_blocks * heads + 10 * column
    if kernel not in ("dh", "dw", "grads"):
        raise ValueError(f"kernel: expected stats, dh, dw or grads, got {kernel!r}")
    exps = (2 if temperature_is_one else 3) * logits
    products = 2 if kernel == "grads" else 1  # G @ W^T and/or h^T @ G
    flops = 2 * logits * (d_s + d_t) + products * 2 * logits * d_s + _GRAD_OPS_PER_LOGIT * logits
    columns = 9 * column  # labels, four row statistics, two coefficient columns (+2 spare)
    if kernel == "dh":  # grid (row block, chunk): h resident, heads streamed per row block
        moved = hidden + n_row_blocks * heads + columns + n_rows * d_s * 4
    elif kernel == "dw":  # grid (chunk, row block): the head chunk resident, h streamed
        moved = n_chunks * (hidden + columns) + heads + d_s * vocab_padded * 4
    else:  # Triton grads: every program reads its operands and read-modify-writes dh, dW
        moved = (n_chunks * (hidden + columns) + n_row_blocks * heads
                 + 2 * 4 * (n_chunks * n_rows * d_s + n_row_blocks * d_s * vocab_padded))
    return flops, exps + caps, moved
