"""Pallas kernels for the fused exact KD loss (GPU: Triton, TPU: Mosaic).

Design notes: `docs/losses.md`, under this file's name.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as plgpu

from hldstudy import chips
from hldstudy.losses import kd_chunks, kernel_blocks


def kernel_family(backend: str, platform: str | None = None) -> str:
    """"pallas" picks by platform (Mosaic on TPU, Triton elsewhere); platform defaults to
    the backend being traced for (`chips.traced_target`)."""
    if backend == "pallas_triton":
        return "triton"
    if backend == "pallas_mosaic":
        return "mosaic"
    platform = platform or chips.traced_target()[0]
    return "mosaic" if platform == "tpu" else "triton"


def _dot(x, y, contract=((1,), (0,))):
    """float32-accumulating dot in the operands' dtype; full precision for f32
    operands (GPU/TPU would otherwise use TF32 / bf16 passes)."""
    y = y.astype(x.dtype)
    precision = lax.Precision.HIGHEST if x.dtype == jnp.float32 else None
    return lax.dot_general(x, y, (contract, ((), ())), precision=precision,
                           preferred_element_type=jnp.float32)


def _cost(cfg, kernel: str, family: str, h_s, h_t, w_s):
    """The kernel's pl.CostEstimate (closed forms in kernel_blocks.kernel_cost)."""
    flops, transcendentals, moved = kernel_blocks.kernel_cost(
        kernel, family, h_s.shape[0], w_s.shape[1], h_s.shape[1], h_t.shape[1], w_s.dtype,
        cfg.row_block, cfg.vocab_block, softcap=cfg.softcap is not None,
        temperature_is_one=kd_chunks.temperature_is_one(cfg))
    return pl.CostEstimate(flops=flops, transcendentals=transcendentals, bytes_accessed=moved)


def _pad_to(x, axis: int, multiple: int):
    pad = -x.shape[axis] % multiple
    if not pad:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, pad)
    return jnp.pad(x, widths)


def _check_triton_tiles(cfg):
    for name, size in (("row_block", cfg.row_block), ("vocab_block", cfg.vocab_block)):
        if size < 16 or size & (size - 1):
            raise ValueError(f"{name}: the Triton kernels need a power of two >= 16, got {size}")


def _traced_temperature(cfg):
    """(static cfg, extra operands): a traced temperature (a cohort member's) enters the
    kernels as a [1, 1] float32 operand after all the others, never closed over."""
    if cfg.temperature is None or isinstance(cfg.temperature, int | float):
        return cfg, ()
    tau = jnp.reshape(cfg.temperature, (1, 1)).astype(jnp.float32)
    return dataclasses.replace(cfg, temperature=None, alpha=None), (tau,)


def _kernel(fn, cfg, extra, n_in: int, *static):
    """`fn(cfg, *static, *refs)` as a pallas kernel; with a traced temperature (`extra`),
    its ref (the last of the `n_in` inputs) is read and bound into cfg in the kernel."""
    if not extra:
        return functools.partial(fn, cfg, *static)

    def kernel(*refs):
        tau_ref = refs[n_in - 1]
        bound = dataclasses.replace(cfg, temperature=tau_ref[...])
        return fn(bound, *static, *refs[:n_in - 1], *refs[n_in:])

    return kernel


def _tile_columns(j, width: int, vocab: int):
    cols_1xC = j * width + lax.broadcasted_iota(jnp.int32, (1, width), 1)
    return cols_1xC, cols_1xC < vocab


# ---------------------------------------------------------------------------
# Triton (GPU) kernels.


def _triton_dot_kloop(h_ref, w_ref, col0, width: int, d_block: int):
    """[R, C] float32 tile of h @ W[:, col0:col0+C], walking d in power-of-2 slices."""
    rows, d = h_ref.shape
    col_slice = pl.ds(pl.multiple_of(col0, width), width)

    def body(k, acc):
        k0 = pl.multiple_of(k * d_block, d_block)
        h = h_ref[:, pl.ds(k0, d_block)]
        w = w_ref[pl.ds(k0, d_block), col_slice]
        return acc + _dot(h, w)

    return lax.fori_loop(0, d // d_block, body, jnp.zeros((rows, width), jnp.float32))


def _triton_stats_kernel(cfg, d_block, n_chunks, h_s_ref, h_t_ref, labels_ref, w_s_ref, w_t_ref, *stat_refs):
    width = cfg.vocab_block
    labels = labels_ref[...]

    def chunk(j, stats):
        cols, valid = _tile_columns(j, width, cfg.vocab)
        z_s = _triton_dot_kloop(h_s_ref, w_s_ref, j * width, width, d_block)
        z_t = _triton_dot_kloop(h_t_ref, w_t_ref, j * width, width, d_block)
        z_s, z_t, _ = kd_chunks.cap_and_mask(cfg, z_s, z_t, valid)
        is_label = (cols == labels) & valid
        return kd_chunks.update_stats(cfg, stats, z_s, z_t, valid, is_label)

    stats = lax.fori_loop(0, n_chunks, chunk, kd_chunks.init_stats(h_s_ref.shape[0]))
    for ref, value in zip(stat_refs, stats, strict=True):
        ref[...] = value


def _triton_grads_kernel(cfg, d_block, h_s_ref, h_t_ref, labels_ref, lse_a_ref, lse_b_ref, lse_z_ref,
                         kl_ref, coef_nll_ref, coef_kl_ref, w_s_ref, w_t_ref, dh_in_ref, dw_in_ref,
                         dh_ref, dw_ref):
    del dh_in_ref, dw_in_ref  # aliased to dh_ref / dw_ref (zero-initialized accumulators)
    rows, width = cfg.row_block, cfg.vocab_block
    i, j = pl.program_id(0), pl.program_id(1)
    col0 = j * width
    cols, valid = _tile_columns(j, width, cfg.vocab)
    z_s = _triton_dot_kloop(h_s_ref, w_s_ref, col0, width, d_block)
    z_t = _triton_dot_kloop(h_t_ref, w_t_ref, col0, width, d_block)
    z_s, z_t, cap_grad = kd_chunks.cap_and_mask(cfg, z_s, z_t, valid)
    is_label = (cols == labels_ref[...]) & valid
    row_stats = (lse_a_ref[...], lse_b_ref[...], lse_z_ref[...], kl_ref[...])
    g = kd_chunks.logit_grad(cfg, z_s, z_t, cap_grad, valid, is_label, row_stats,
                         coef_nll_ref[...], coef_kl_ref[...])
    row_slice = pl.ds(pl.multiple_of(i * rows, rows), rows)
    col_slice = pl.ds(pl.multiple_of(col0, width), width)

    def d_slice(k, carry):
        k0 = pl.multiple_of(k * d_block, d_block)
        w_kc = w_s_ref[pl.ds(k0, d_block), col_slice]
        h_rk = h_s_ref[:, pl.ds(k0, d_block)]
        # G in the weights' dtype (bf16 tensor cores), as XLA's autodiff of the reference does.
        dh_part = _dot(g.astype(w_kc.dtype), w_kc, ((1,), (1,)))  # G @ W^T  [R, k]
        dw_part = _dot(h_rk, g, ((0,), (0,)))  # h^T @ G  [k, C]
        _atomic_add(dh_ref, (row_slice, pl.ds(k0, d_block)), dh_part)
        _atomic_add(dw_ref, (pl.ds(k0, d_block), col_slice), dw_part)
        return carry

    lax.fori_loop(0, h_s_ref.shape[1] // d_block, d_slice, 0)


def _atomic_add(ref, idx, value):
    plgpu.atomic_add(ref, idx, value)


def _triton_compiler_params(cfg):
    if cfg.interpret:
        return None
    kb = cfg.kernel or kernel_blocks.KernelBlocks("triton", cfg.row_block, cfg.vocab_block)
    return plgpu.CompilerParams(num_warps=kb.num_warps, num_stages=kb.num_stages)


def _triton_stats(cfg, h_s, w_s, h_t, w_t, labels_Tx1):
    _check_triton_tiles(cfg)
    cfg_in, extra = _traced_temperature(cfg)
    d_block = kernel_blocks.triton_d_block(max(h_s.shape[1], h_t.shape[1]))
    h_s, w_s = _pad_to(h_s, 1, d_block), _pad_to(_pad_to(w_s, 0, d_block), 1, cfg.vocab_block)
    h_t, w_t = _pad_to(h_t, 1, d_block), _pad_to(_pad_to(w_t, 0, d_block), 1, cfg.vocab_block)
    n_rows, rows = h_s.shape[0], cfg.row_block
    n_chunks = w_s.shape[1] // cfg.vocab_block
    row_spec = lambda width: pl.BlockSpec((rows, width), lambda i: (i, 0))
    full_spec = lambda x: pl.BlockSpec(x.shape, lambda i: (0, 0))
    stat_shape = jax.ShapeDtypeStruct((n_rows, 1), jnp.float32)
    stats = pl.pallas_call(
        _kernel(_triton_stats_kernel, cfg_in, extra, 5 + len(extra), d_block, n_chunks),
        grid=(n_rows // rows,),
        in_specs=[row_spec(h_s.shape[1]), row_spec(h_t.shape[1]), row_spec(1), full_spec(w_s), full_spec(w_t)]
        + [full_spec(x) for x in extra],
        out_specs=[row_spec(1)] * kd_chunks.N_STATS,
        out_shape=[stat_shape] * kd_chunks.N_STATS,
        interpret=cfg.interpret,
        compiler_params=_triton_compiler_params(cfg),
        cost_estimate=_cost(cfg, "stats", "triton", h_s, h_t, w_s),
        name="fused_kd_stats_triton",
    )(h_s, h_t, labels_Tx1, w_s, w_t, *extra)
    return kd_chunks.finalize_stats(cfg, tuple(stats))


def _triton_grads(cfg, h_s, w_s, h_t, w_t, labels_Tx1, row_stats, coef_nll, coef_kl):
    _check_triton_tiles(cfg)
    cfg_in, extra = _traced_temperature(cfg)
    d_s, vocab = w_s.shape
    d_block = kernel_blocks.triton_d_block(max(h_s.shape[1], h_t.shape[1]))
    h_s, w_s = _pad_to(h_s, 1, d_block), _pad_to(_pad_to(w_s, 0, d_block), 1, cfg.vocab_block)
    h_t, w_t = _pad_to(h_t, 1, d_block), _pad_to(_pad_to(w_t, 0, d_block), 1, cfg.vocab_block)
    n_rows, rows = h_s.shape[0], cfg.row_block
    n_chunks = w_s.shape[1] // cfg.vocab_block
    row_spec = lambda width: pl.BlockSpec((rows, width), lambda i, j: (i, 0))
    full_spec = lambda x: pl.BlockSpec(x.shape, lambda i, j: (0, 0))
    dh0 = jnp.zeros(h_s.shape, jnp.float32)
    dw0 = jnp.zeros(w_s.shape, jnp.float32)
    dh, dw = pl.pallas_call(
        _kernel(_triton_grads_kernel, cfg_in, extra, 13 + len(extra), d_block),
        grid=(n_rows // rows, n_chunks),
        in_specs=[row_spec(h_s.shape[1]), row_spec(h_t.shape[1]), row_spec(1)]
        + [row_spec(1)] * 6
        + [full_spec(w_s), full_spec(w_t), full_spec(dh0), full_spec(dw0)]
        + [full_spec(x) for x in extra],
        out_specs=[full_spec(dh0), full_spec(dw0)],
        out_shape=[jax.ShapeDtypeStruct(dh0.shape, jnp.float32), jax.ShapeDtypeStruct(dw0.shape, jnp.float32)],
        input_output_aliases={11: 0, 12: 1},
        interpret=cfg.interpret,
        compiler_params=_triton_compiler_params(cfg),
        cost_estimate=_cost(cfg, "grads", "triton", h_s, h_t, w_s),
        name="fused_kd_grads_triton",
    )(h_s, h_t, labels_Tx1, *row_stats, coef_nll, coef_kl, w_s, w_t, dh0, dw0, *extra)
    return dh[:, :d_s], dw[:d_s, :vocab]


# ---------------------------------------------------------------------------
# Mosaic (TPU) kernels.


def _mosaic_compiler_params(cfg, semantics):
    if cfg.interpret:
        return None
    limit = cfg.kernel.vmem_limit_bytes if cfg.kernel is not None else 0
    return pltpu.CompilerParams(dimension_semantics=semantics, vmem_limit_bytes=limit or None)


def _mosaic_tile_logits(cfg, h_s_ref, h_t_ref, w_s_ref, w_t_ref, j):
    cols, valid = _tile_columns(j, cfg.vocab_block, cfg.vocab)
    z_s = _dot(h_s_ref[...], w_s_ref[...])
    z_t = _dot(h_t_ref[...], w_t_ref[...])
    z_s, z_t, cap_grad = kd_chunks.cap_and_mask(cfg, z_s, z_t, valid)
    return z_s, z_t, cap_grad, cols, valid


def _mosaic_stats_kernel(cfg, h_s_ref, h_t_ref, labels_ref, w_s_ref, w_t_ref, *stat_refs):
    j = pl.program_id(1)

    @pl.when(j == 0)
    def _init():
        for ref, value in zip(stat_refs, kd_chunks.init_stats(h_s_ref.shape[0]), strict=True):
            ref[...] = value

    z_s, z_t, _, cols, valid = _mosaic_tile_logits(cfg, h_s_ref, h_t_ref, w_s_ref, w_t_ref, j)
    is_label = (cols == labels_ref[...]) & valid
    stats = kd_chunks.update_stats(cfg, tuple(r[...] for r in stat_refs), z_s, z_t, valid, is_label)
    for ref, value in zip(stat_refs, stats, strict=True):
        ref[...] = value


def _mosaic_grad_tile(cfg, j, h_s_ref, h_t_ref, labels_ref, lse_a_ref, lse_b_ref, lse_z_ref, kl_ref,
                      coef_nll_ref, coef_kl_ref, w_s_ref, w_t_ref):
    z_s, z_t, cap_grad, cols, valid = _mosaic_tile_logits(cfg, h_s_ref, h_t_ref, w_s_ref, w_t_ref, j)
    is_label = (cols == labels_ref[...]) & valid
    row_stats = (lse_a_ref[...], lse_b_ref[...], lse_z_ref[...], kl_ref[...])
    return kd_chunks.logit_grad(cfg, z_s, z_t, cap_grad, valid, is_label, row_stats,
                            coef_nll_ref[...], coef_kl_ref[...])


def _mosaic_dh_kernel(cfg, *refs):
    *in_refs, dh_ref = refs
    j = pl.program_id(1)

    @pl.when(j == 0)
    def _init():
        dh_ref[...] = jnp.zeros(dh_ref.shape, jnp.float32)

    g = _mosaic_grad_tile(cfg, j, *in_refs)
    w_s = in_refs[9][...]
    dh_ref[...] += _dot(g.astype(w_s.dtype), w_s, ((1,), (1,)))


def _mosaic_dw_kernel(cfg, *refs):
    *in_refs, dw_ref = refs
    j, i = pl.program_id(0), pl.program_id(1)

    @pl.when(i == 0)
    def _init():
        dw_ref[...] = jnp.zeros(dw_ref.shape, jnp.float32)

    g = _mosaic_grad_tile(cfg, j, *in_refs)
    h_s = in_refs[0][...]
    dw_ref[...] += _dot(h_s, g, ((0,), (0,)))


def _mosaic_stats(cfg, h_s, w_s, h_t, w_t, labels_Tx1):
    cfg_in, extra = _traced_temperature(cfg)
    w_s, w_t = _pad_to(w_s, 1, cfg.vocab_block), _pad_to(w_t, 1, cfg.vocab_block)
    n_rows, rows, width = h_s.shape[0], cfg.row_block, cfg.vocab_block
    row_spec = lambda d: pl.BlockSpec((rows, d), lambda i, j: (i, 0))
    col_spec = lambda d: pl.BlockSpec((d, width), lambda i, j: (0, j))
    stat_shape = jax.ShapeDtypeStruct((n_rows, 1), jnp.float32)
    stats = pl.pallas_call(
        _kernel(_mosaic_stats_kernel, cfg_in, extra, 5 + len(extra)),
        grid=(n_rows // rows, w_s.shape[1] // width),
        in_specs=[row_spec(h_s.shape[1]), row_spec(h_t.shape[1]), row_spec(1),
                  col_spec(w_s.shape[0]), col_spec(w_t.shape[0])]
        + [pl.BlockSpec((1, 1), lambda i, j: (0, 0)) for _ in extra],
        out_specs=[row_spec(1)] * kd_chunks.N_STATS,
        out_shape=[stat_shape] * kd_chunks.N_STATS,
        interpret=cfg.interpret,
        compiler_params=_mosaic_compiler_params(cfg, ("parallel", "arbitrary")),
        cost_estimate=_cost(cfg, "stats", "mosaic", h_s, h_t, w_s),
        name="fused_kd_stats_mosaic",
    )(h_s, h_t, labels_Tx1, w_s, w_t, *extra)
    return kd_chunks.finalize_stats(cfg, tuple(stats))


def _mosaic_grads(cfg, h_s, w_s, h_t, w_t, labels_Tx1, row_stats, coef_nll, coef_kl, only):
    d_s, vocab = w_s.shape
    cfg_in, extra = _traced_temperature(cfg)
    w_s, w_t = _pad_to(w_s, 1, cfg.vocab_block), _pad_to(w_t, 1, cfg.vocab_block)
    n_rows, rows, width = h_s.shape[0], cfg.row_block, cfg.vocab_block
    n_row_blocks, n_chunks = n_rows // rows, w_s.shape[1] // width
    operands = (h_s, h_t, labels_Tx1, *row_stats, coef_nll, coef_kl, w_s, w_t, *extra)

    def specs(index):  # index(r, c) -> grid indices, r = row block, c = chunk
        row_spec = lambda d: pl.BlockSpec((rows, d), lambda *g: (index(*g)[0], 0))
        col_spec = lambda d: pl.BlockSpec((d, width), lambda *g: (0, index(*g)[1]))
        return ([row_spec(h_s.shape[1]), row_spec(h_t.shape[1]), row_spec(1)] + [row_spec(1)] * 6
                + [col_spec(w_s.shape[0]), col_spec(w_t.shape[0])]
                + [pl.BlockSpec((1, 1), lambda *g: (0, 0)) for _ in extra])

    dh = None
    if only != "dw":
        dh = pl.pallas_call(
            _kernel(_mosaic_dh_kernel, cfg_in, extra, len(operands)),
            grid=(n_row_blocks, n_chunks),
            in_specs=specs(lambda i, j: (i, j)),
            out_specs=pl.BlockSpec((rows, h_s.shape[1]), lambda i, j: (i, 0)),
            out_shape=jax.ShapeDtypeStruct(h_s.shape, jnp.float32),
            interpret=cfg.interpret,
            compiler_params=_mosaic_compiler_params(cfg, ("parallel", "arbitrary")),
            cost_estimate=_cost(cfg, "dh", "mosaic", h_s, h_t, w_s),
            name="fused_kd_dh_mosaic",
        )(*operands)
    if only == "dh":
        return dh, None
    # The dW kernel's grid is (chunk, row block): its output block stays resident over rows.
    dw = pl.pallas_call(
        _kernel(_mosaic_dw_kernel, cfg_in, extra, len(operands)),
        grid=(n_chunks, n_row_blocks),
        in_specs=specs(lambda j, i: (i, j)),
        out_specs=pl.BlockSpec((w_s.shape[0], width), lambda j, i: (0, j)),
        out_shape=jax.ShapeDtypeStruct(w_s.shape, jnp.float32),
        interpret=cfg.interpret,
        compiler_params=_mosaic_compiler_params(cfg, ("parallel", "arbitrary")),
        cost_estimate=_cost(cfg, "dw", "mosaic", h_s, h_t, w_s),
        name="fused_kd_dw_mosaic",
    )(*operands)
    return dh, dw[:d_s, :vocab]


# ---------------------------------------------------------------------------
# Entry points used by fused.py's custom_vjp.


def stats(cfg, h_s, w_s, h_t, w_t, labels):
    """Per-row `[T, 1]` (lse_a, lse_b, lse_z, kl, nll)."""
    labels_Tx1 = labels.reshape(-1, 1).astype(jnp.int32)
    if kernel_family(cfg.backend) == "mosaic":
        return _mosaic_stats(cfg, h_s, w_s, h_t, w_t, labels_Tx1)
    return _triton_stats(cfg, h_s, w_s, h_t, w_t, labels_Tx1)


def grads(cfg, h_s, w_s, h_t, w_t, labels, row_stats, coef_nll, coef_kl, only=None):
    """(dh_s [T, d_s], dW_s [d_s, V]) in float32 for per-row coefficient columns.

    only: "dh" / "dw" runs just that Mosaic kernel (the other is None), so the compile
    tier can compile and measure each kernel alone; the Triton kernel forms both.
    """
    labels_Tx1 = labels.reshape(-1, 1).astype(jnp.int32)
    if kernel_family(cfg.backend) == "mosaic":
        return _mosaic_grads(cfg, h_s, w_s, h_t, w_t, labels_Tx1, row_stats, coef_nll, coef_kl,
                             only)
    return _triton_grads(cfg, h_s, w_s, h_t, w_t, labels_Tx1, row_stats, coef_nll, coef_kl)
