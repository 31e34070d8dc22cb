"""Grouped matmuls (`jax.lax.ragged_dot`'s contract: rows sorted by group, each group's rows
times its own weight) as each target runs them well. On a Hopper GPU (H100, H200) these
are JAX's Mosaic GPU kernels -- `ragged_dot_mgpu` for the product and the rows' gradient,
`transposed_ragged_dot_mgpu` for the weights' -- with the VJP wired here; elsewhere
`jax.lax.ragged_dot` (a native grouped matmul on TPU, the reference on CPU).

Design notes: `docs/model.md`, under this file's name.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from hldstudy.chips import KERNEL_FLOPS_SCOPE, traced_target
from hldstudy.errors import ConfigError

__all__ = ["grouped_matmul", "hopper_kernels_run", "hopper_ragged_dot",
           "hopper_unfit"]

_KERNEL_DTYPES = (jnp.bfloat16, jnp.float16)
_BLOCKS = (128, 64, 32, 16)


def _hopper_kernels():
    """(ragged_dot, transposed_ragged_dot) of JAX's Mosaic GPU ops (imported on use: they
    pull in the Mosaic GPU toolchain)."""
    from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu, transposed_ragged_dot_mgpu

    return ragged_dot_mgpu.ragged_dot, transposed_ragged_dot_mgpu.transposed_ragged_dot


def hopper_kernels_run() -> bool:
    """Whether the code being traced runs on a Hopper GPU (`chips.traced_target`)."""
    backend, chip = traced_target()
    return backend == "gpu" and chip is not None and chip.hopper


def _block(dim: int, choices=_BLOCKS) -> int | None:
    return next((b for b in choices if dim % b == 0), None)


def hopper_unfit(d_in: int, d_out: int, dtype) -> str | None:
    """Why the Hopper kernels cannot multiply rows [M, d_in] by weights [G, d_in, d_out]
    and back (None: they can). Both dimensions are tiled (the product contracts d_in, its
    rows' gradient d_out, the weights' gradient tiles both)."""
    if jnp.dtype(dtype) not in _KERNEL_DTYPES:
        return f"the kernels take bfloat16 or float16 operands, not {jnp.dtype(dtype).name}"
    for name, dim in (("input", d_in), ("output", d_out)):
        if _block(dim) is None:
            return f"the {name} dimension {dim} is not a multiple of {_BLOCKS[-1]}"
    return None


def _declared(flops: int):
    """A Mosaic GPU kernel declares no cost to XLA (its lowering drops `pl.CostEstimate`):
    its call runs under a name scope carrying its FLOPs, which `hldstudy.flops.hlo_count`
    reads from the custom call's op_name."""
    return jax.named_scope(f"{KERNEL_FLOPS_SCOPE}{int(flops)}")


def _product(lhs_MxK, w, sizes_G, transpose_rhs: bool = False):
    """rows [M, K] x w [G, K, N] (or w [G, N, K] read transposed) -> [M, N]."""
    ragged_dot, _ = _hopper_kernels()
    m, k = lhs_MxK.shape
    n = w.shape[1] if transpose_rhs else w.shape[2]
    block_k = _block(k, (64, 32, 16))
    # At least 2 steps in flight: the kernel's pipeline releases its buffers one step late.
    with _declared(2 * m * k * n):
        return ragged_dot(lhs_MxK, w, group_sizes=sizes_G, block_m=64, block_n=_block(n),
                          block_k=block_k, max_concurrent_steps=max(2, min(4, k // block_k)),
                          grid_block_n=1, transpose_rhs=transpose_rhs)


def _process_has_gpu() -> bool:
    return jax.default_backend() == "gpu"


def _weight_grad(lhs_MxK, d_out_MxN, sizes_G):
    """Each group's rows' outer product: [G, K, N] = lhs_g^T d_out_g."""
    if not _process_has_gpu():
        # transposed_ragged_dot_mgpu sizes its grid from jax.devices()[0].core_count.
        raise ConfigError(
            "model.moe_dispatch", "ragged dispatch trains through JAX's Hopper kernels, whose "
            "weight gradient (transposed_ragged_dot_mgpu) reads the SM count of this "
            "process's GPU, and this process has none: compile an MoE's training step for a "
            "Hopper GPU on a GPU host", "or set model.moe_dispatch=capacity")
    _, transposed = _hopper_kernels()
    m, k = lhs_MxK.shape
    n = d_out_MxN.shape[1]
    with _declared(2 * m * k * n):
        return transposed(lhs_MxK, d_out_MxN, group_sizes=sizes_G, block_m=_block(k),
                          block_n=_block(n), block_k=64, max_concurrent_steps=2,
                          grid_block_n=1)


@jax.custom_vjp
def hopper_ragged_dot(lhs_MxK, w_GxKxN, sizes_G):
    """`jax.lax.ragged_dot(lhs, w, sizes)` by the Hopper kernels, differentiable in lhs and
    w. `sizes` must sum to M (the kernel leaves rows past the groups unwritten)."""
    return _product(lhs_MxK, w_GxKxN, sizes_G)


def _hopper_ragged_dot_fwd(lhs_MxK, w_GxKxN, sizes_G):
    return _product(lhs_MxK, w_GxKxN, sizes_G), (lhs_MxK, w_GxKxN, sizes_G)


def _hopper_ragged_dot_bwd(residuals, d_out_MxN):
    lhs_MxK, w_GxKxN, sizes_G = residuals
    d_out_MxN = d_out_MxN.astype(lhs_MxK.dtype)
    d_lhs = _product(d_out_MxN, w_GxKxN, sizes_G, transpose_rhs=True)
    d_w = _weight_grad(lhs_MxK, d_out_MxN, sizes_G).astype(w_GxKxN.dtype)
    return d_lhs, d_w, None


hopper_ragged_dot.defvjp(_hopper_ragged_dot_fwd, _hopper_ragged_dot_bwd)


def grouped_matmul(rows_MxK, w_GxKxN, sizes_G) -> jax.Array:
    """rows [M, K] (sorted by group, `sizes` rows each, summing to M) x w [G, K, N] ->
    [M, N]: the Hopper kernels where the traced-for chip is one, else `jax.lax.ragged_dot`."""
    if not hopper_kernels_run():
        return jax.lax.ragged_dot(rows_MxK, w_GxKxN, sizes_G)
    why = hopper_unfit(w_GxKxN.shape[1], w_GxKxN.shape[2], rows_MxK.dtype)
    if why:
        raise ConfigError("model.moe_dispatch", f"ragged dispatch on a Hopper GPU runs JAX's "
                          f"Mosaic GPU grouped matmul, and {why}",
                          "set model.moe_dispatch=capacity (teacher.moe_dispatch for a "
                          "teacher), or auto")
    return hopper_ragged_dot(rows_MxK, w_GxKxN.astype(rows_MxK.dtype), sizes_G)
