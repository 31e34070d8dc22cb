"""Each fused-KD Pallas kernel as a function of abstract arguments, for lowering and
compiling without the device (tests/test_lowering_kernels.py lowers them for `cuda`
and `tpu`; the compile tier and benchmarks/aot_kernels.py compile them for named
targets). These are the production kernels (`pallas_kd.stats` / `pallas_kd.grads`)
with the blocks and compiler limits of a `kernel_blocks.KernelBlocks`, nothing else.
"""

from __future__ import annotations

import re
import time

import jax
import jax.numpy as jnp

from hldstudy.losses import fused, pallas_kd
from hldstudy.losses.kd_chunks import KDConfig
from hldstudy.losses.kernel_blocks import KernelBlocks

KERNELS = {"mosaic": ("stats", "dh", "dw"), "triton": ("stats", "grads")}


def _config(blocks: KernelBlocks, vocab: int, softcap: float | None, divergence: str) -> KDConfig:
    return KDConfig(temperature=2.0, alpha=0.5, divergence=divergence, softcap=softcap,
                    row_block=blocks.row_block, vocab_block=blocks.vocab_block, vocab=vocab,
                    backend=f"pallas_{blocks.family}", kernel=blocks)


def _head_specs(n_rows, d_s, d_t, vocab, dtype, sharding=None):
    sds = lambda shape, dt: jax.ShapeDtypeStruct(shape, dt, sharding=sharding)
    return [sds((n_rows, d_s), dtype), sds((d_s, vocab), dtype), sds((n_rows, d_t), dtype),
            sds((d_t, vocab), dtype), sds((n_rows,), jnp.int32)]


def kernel_case(kernel: str, blocks: KernelBlocks, *, d_s: int, d_t: int, vocab: int, dtype,
                n_rows: int, softcap: float | None = None, divergence: str = "forward_kl",
                sharding=None):
    """(fn, arg specs) running the one kernel `kernel` of KERNELS[blocks.family].

    n_rows must be a multiple of blocks.row_block (fused_kd_loss pads to that).
    sharding: placed on every spec (a target's compile-only device), or None.
    """
    if kernel not in KERNELS[blocks.family]:
        raise ValueError(f"kernel: {blocks.family} has {KERNELS[blocks.family]}, got {kernel!r}")
    if n_rows % blocks.row_block:
        raise ValueError(f"n_rows: {n_rows} is not a multiple of row_block {blocks.row_block}")
    cfg = _config(blocks, vocab, softcap, divergence)
    specs = _head_specs(n_rows, d_s, d_t, vocab, dtype, sharding)
    if kernel == "stats":
        return (lambda h_s, w_s, h_t, w_t, y: pallas_kd.stats(cfg, h_s, w_s, h_t, w_t, y)), specs
    column = jax.ShapeDtypeStruct((n_rows, 1), jnp.float32, sharding=sharding)
    only = None if kernel == "grads" else kernel

    def grads(h_s, w_s, h_t, w_t, y, *cols):
        dh, dw = pallas_kd.grads(cfg, h_s, w_s, h_t, w_t, y, cols[:4], cols[4], cols[5], only=only)
        return dh if kernel == "dh" else dw if kernel == "dw" else (dh, dw)

    return grads, specs + [column] * 6


def loss_case(family: str, *, d_s: int, d_t: int, vocab: int, dtype, n_rows: int,
              row_block: int | None = None, vocab_block: int | None = None,
              softcap: float | None = None, divergence: str = "forward_kl", sharding=None):
    """(fn, arg specs): value and gradient of `fused_kd_loss` on the `family` kernels,
    the forward and backward a train step runs. Blocks None: the loss's own choice for
    the target being traced for (`chips.traced_target`)."""
    def loss(h_s, w_s, h_t, w_t, y):
        return fused.fused_kd_loss(h_s, w_s, h_t, w_t, y, temperature=2.0, alpha=0.5,
                                   divergence=divergence, softcap=softcap, row_block=row_block,
                                   vocab_block=vocab_block, backend=f"pallas_{family}")[0]

    return jax.value_and_grad(loss, argnums=(0, 1)), _head_specs(n_rows, d_s, d_t, vocab, dtype,
                                                                 sharding)


def compile_case(fn, specs) -> tuple[bool, str, float]:
    """(compiled, the compiler's first line of refusal or "", seconds): `fn` lowered
    and compiled for the device its specs are placed on (a target's compile-only
    device: the target's own compiler, on-chip memory limits included)."""
    start = time.perf_counter()
    try:
        jax.jit(fn).trace(*specs).lower().compile()
    except Exception as e:  # noqa: BLE001 - the compilers refuse with their own error types
        return False, refusal(e), time.perf_counter() - start
    return True, "", time.perf_counter() - start


def refusal(exc: BaseException) -> str:
    """The line of a compiler error that says why: libtpu's scoped-VMEM verdict, Triton's
    shared-memory one, else the first non-empty line."""
    text = str(exc)
    for pattern in (r"Scoped allocation with size \S+ and limit \S+",
                    r"Used \S+ of \S+ vmem", r"[^\n]*[Ss]hared memory[^\n]*"):
        m = re.search(pattern, text)
        if m:
            return m.group(0).strip()[:300]
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return (lines[0] if lines else type(exc).__name__)[:300]
