"""Exact fused KD loss that never materializes the `[T, V]` logits.

Design notes: `docs/losses.md`, under this file's name.
"""

from __future__ import annotations

import functools
import logging

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from hldstudy import chips
from hldstudy.errors import ConfigError
from hldstudy.losses import kernel_blocks, pallas_kd
from hldstudy.losses.kd import flatten_tokens, validate_kd_args
from hldstudy.losses.kd_chunks import (
    KDConfig,
    bind,
    cap_and_mask,
    chunk_columns,
    chunk_layout,
    finalize_stats,
    init_stats,
    logit_grad,
    row_max,
    row_sum,
    temperature_is_one,
    update_stats,
)
from hldstudy.mesh_axes import axes_size, shard_mapped, traced_batch_axes
from hldstudy.numerics import softcap

log = logging.getLogger("hldstudy.losses")

FUSED_DIVERGENCES = ("forward_kl", "reverse_kl")
# "pallas" picks the kernel family by platform; the explicit ones are for tests.
BACKENDS = ("xla", "pallas", "pallas_triton", "pallas_mosaic")

# CPU defaults (see benchmarks/fused_kd.py): a window of 128 rows x the whole
# vocabulary keeps XLA's matmuls large and the temporaries at a few 128 x V floats
# (64 rows was ~1.5x slower at V = 262144, 256 no faster and twice the memory).
CPU_ROW_BLOCK = 128
CPU_VOCAB_BLOCK = 1 << 20  # >= any real vocabulary: one chunk (no recompute)


# ---------------------------------------------------------------------------
# XLA implementation.


def _xla_chunk_logits(cfg, h_s_RxD, h_t_RxE, w_s_DxC, w_t_ExC, valid_1xC):
    z_s = jnp.dot(h_s_RxD, w_s_DxC, preferred_element_type=jnp.float32)
    z_t = jnp.dot(h_t_RxE, w_t_ExC, preferred_element_type=jnp.float32)
    return cap_and_mask(cfg, z_s, z_t, valid_1xC)


def _xla_window_stats(cfg, h_s_RxD, h_t_RxE, labels_R, w_s, w_t):
    width, n_chunks = chunk_layout(cfg.vocab, cfg.vocab_block)

    def body(j, stats):
        start, valid, cols = chunk_columns(j, width, cfg.vocab)
        w_s_c = lax.dynamic_slice_in_dim(w_s, start, width, axis=1)
        w_t_c = lax.dynamic_slice_in_dim(w_t, start, width, axis=1)
        z_s, z_t, _ = _xla_chunk_logits(cfg, h_s_RxD, h_t_RxE, w_s_c, w_t_c, valid)
        is_label = (cols == labels_R[:, None]) & valid
        return update_stats(cfg, stats, z_s, z_t, valid, is_label)

    stats = lax.fori_loop(0, n_chunks, body, init_stats(h_s_RxD.shape[0]))
    return finalize_stats(cfg, stats)


def _xla_window_grads(cfg, h_s_RxD, h_t_RxE, labels_R, w_s, w_t, row_stats, coef_nll_R, coef_kl_R, dw_DxV):
    """Recomputes the window's chunks; returns (dh window, dW accumulator)."""
    width, n_chunks = chunk_layout(cfg.vocab, cfg.vocab_block)

    def body(j, carry):
        dh, dw = carry
        start, valid, cols = chunk_columns(j, width, cfg.vocab)
        w_s_c = lax.dynamic_slice_in_dim(w_s, start, width, axis=1)
        w_t_c = lax.dynamic_slice_in_dim(w_t, start, width, axis=1)
        z_s, z_t, cap_grad = _xla_chunk_logits(cfg, h_s_RxD, h_t_RxE, w_s_c, w_t_c, valid)
        is_label = (cols == labels_R[:, None]) & valid
        g = logit_grad(cfg, z_s, z_t, cap_grad, valid, is_label, row_stats, coef_nll_R, coef_kl_R)
        dh = dh + jnp.dot(g, w_s_c.T.astype(jnp.float32), preferred_element_type=jnp.float32)
        dw_c = jnp.dot(h_s_RxD.T.astype(jnp.float32), g, preferred_element_type=jnp.float32)
        dw = lax.dynamic_update_slice_in_dim(
            dw, lax.dynamic_slice_in_dim(dw, start, width, axis=1) + dw_c, start, axis=1
        )
        return dh, dw

    dh0 = jnp.zeros(h_s_RxD.shape, jnp.float32)
    return lax.fori_loop(0, n_chunks, body, (dh0, dw_DxV))


def _xla_window_stats_and_grads(cfg, h_s_RxD, h_t_RxE, labels_R, mask_R, w_s, w_t, inv_count, dw_DxV):
    """Single-chunk schedule: the window's logits are built once; stats and the
    gradient (for cotangent 1) come from the same exponentials.

    Same formulas as update_stats/finalize_stats/logit_grad with one chunk,
    written out so each softmax costs one exp pass over [R, V] instead of two.
    """
    z_s = jnp.dot(h_s_RxD, w_s, preferred_element_type=jnp.float32)
    z_t = jnp.dot(h_t_RxE, w_t, preferred_element_type=jnp.float32)
    cap_grad = None
    if cfg.softcap is not None:
        c = cfg.softcap
        z_s, z_t = softcap(z_s, c), softcap(z_t, c)
        cap_grad = 1.0 - jnp.square(z_s / c)
    inv_tau = 1.0 / cfg.temperature
    a, b = z_t * inv_tau, z_s * inv_tau

    def softmax_and_lse(x):
        m = row_max(x)
        e = jnp.exp(x - m)
        s = row_sum(e)
        return e / s, m + jnp.log(s)

    p_t, lse_a = softmax_and_lse(a)
    p_s, lse_b = softmax_and_lse(b)
    p_z, lse_z = (p_s, lse_b) if temperature_is_one(cfg) else softmax_and_lse(z_s)
    is_label = jnp.arange(cfg.vocab)[None, :] == labels_R[:, None]
    nll = lse_z - row_sum(jnp.where(is_label, z_s, 0.0))
    if cfg.divergence == "forward_kl":
        kl = row_sum(p_t * (a - b)) - lse_a + lse_b
    else:
        log_ratio = (b - a) - (lse_b - lse_a)
        kl = row_sum(p_s * log_ratio)

    coef_nll, coef_kl = _loss_coefs(cfg, mask_R, inv_count, 1.0)
    g_nll = p_z - is_label.astype(jnp.float32)
    if cfg.divergence == "forward_kl":
        g_kl = (p_s - p_t) * inv_tau
    else:
        g_kl = p_s * (log_ratio - kl) * inv_tau
    g = coef_nll * g_nll + coef_kl * g_kl
    if cap_grad is not None:
        g = g * cap_grad
    dh = jnp.dot(g, w_s.T.astype(jnp.float32), preferred_element_type=jnp.float32)
    dw_DxV = dw_DxV + jnp.dot(h_s_RxD.T.astype(jnp.float32), g, preferred_element_type=jnp.float32)
    return (kl, nll), dh, dw_DxV


def _loss_coefs(cfg, mask_R, inv_count, g_loss):
    """Per-row [R, 1] weights of dNLL and dKL in d(loss): masked mean, alpha, tau^2."""
    w = jnp.where(mask_R[:, None], inv_count * g_loss, 0.0).astype(jnp.float32)
    return cfg.alpha * w, (1.0 - cfg.alpha) * cfg.temperature**2 * w


def _windows(x, rows: int):
    """[Tp, ...] -> [Tp / rows, rows, ...]."""
    return x.reshape((x.shape[0] // rows, rows) + x.shape[1:])


def _xla_stats(cfg, h_s, w_s, h_t, w_t, labels):
    """Per-row (lse_a, lse_b, lse_z, kl, nll) over all (padded) rows."""
    R = cfg.row_block
    fn = lambda xs: _xla_window_stats(cfg, xs[0], xs[1], xs[2], w_s, w_t)
    out = lax.map(fn, (_windows(h_s, R), _windows(h_t, R), _windows(labels, R)))
    return tuple(o.reshape(-1, 1) for o in out)


def _xla_grads(cfg, h_s, w_s, h_t, w_t, labels, row_stats, coef_nll, coef_kl):
    R = cfg.row_block

    def step(dw, xs):
        h_s_w, h_t_w, labels_w, *st, cn, ck = xs
        dh, dw = _xla_window_grads(cfg, h_s_w, h_t_w, labels_w, w_s, w_t, tuple(st), cn, ck, dw)
        return dw, dh

    xs = tuple(_windows(x, R) for x in (h_s, h_t, labels, *row_stats, coef_nll, coef_kl))
    dw, dh = lax.scan(step, jnp.zeros(w_s.shape, jnp.float32), xs)
    return dh.reshape(h_s.shape), dw


def _xla_stats_and_grads(cfg, h_s, w_s, h_t, w_t, labels, mask, inv_count):
    R = cfg.row_block

    def step(dw, xs):
        h_s_w, h_t_w, labels_w, mask_w = xs
        (kl, nll), dh, dw = _xla_window_stats_and_grads(
            cfg, h_s_w, h_t_w, labels_w, mask_w, w_s, w_t, inv_count, dw
        )
        return dw, (kl, nll, dh)

    xs = tuple(_windows(x, R) for x in (h_s, h_t, labels, mask))
    dw, (kl, nll, dh) = lax.scan(step, jnp.zeros(w_s.shape, jnp.float32), xs)
    return kl.reshape(-1, 1), nll.reshape(-1, 1), dh.reshape(h_s.shape), dw


# ---------------------------------------------------------------------------
# Backend dispatch and the custom VJP.


def _stats(cfg, h_s, w_s, h_t, w_t, labels):
    if cfg.backend.startswith("pallas"):
        return pallas_kd.stats(cfg, h_s, w_s, h_t, w_t, labels)
    return _xla_stats(cfg, h_s, w_s, h_t, w_t, labels)


def _grads(cfg, h_s, w_s, h_t, w_t, labels, row_stats, coef_nll, coef_kl):
    if cfg.backend.startswith("pallas"):
        return pallas_kd.grads(cfg, h_s, w_s, h_t, w_t, labels, row_stats, coef_nll, coef_kl)
    return _xla_grads(cfg, h_s, w_s, h_t, w_t, labels, row_stats, coef_nll, coef_kl)


def _grads_in_forward(cfg) -> bool:
    return cfg.backend == "xla" and cfg.vocab_block >= cfg.vocab


def _reduce(cfg, kl_R, nll_R, mask_R, inv_count):
    kl = jnp.sum(jnp.where(mask_R[:, None], kl_R, 0.0)) * inv_count
    nll = jnp.sum(jnp.where(mask_R[:, None], nll_R, 0.0)) * inv_count
    loss = cfg.alpha * nll + (1.0 - cfg.alpha) * cfg.temperature**2 * kl
    return loss, nll, kl


def _bind(cfg, hp):
    """The static cfg, or (traced hyperparameters: hp = [temperature, alpha]) with them
    bound in. hp is an ordinary (non-differentiated) operand of the custom_vjp, so one
    compiled program serves every temperature and NLL weight."""
    return cfg if cfg.temperature is not None else bind(cfg, hp[0], hp[1])


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _fused(cfg, h_s, w_s, h_t, w_t, labels, mask, hp):
    cfg = _bind(cfg, hp)
    inv_count = 1.0 / jnp.maximum(jnp.sum(mask.astype(jnp.float32)), 1.0)
    _, _, _, kl_R, nll_R = _stats(cfg, h_s, w_s, h_t, w_t, labels)
    return _reduce(cfg, kl_R, nll_R, mask, inv_count)


def _fused_fwd(cfg, h_s, w_s, h_t, w_t, labels, mask, hp):
    cfg = _bind(cfg, hp)
    inv_count = 1.0 / jnp.maximum(jnp.sum(mask.astype(jnp.float32)), 1.0)
    if _grads_in_forward(cfg):
        kl_R, nll_R, dh, dw = _xla_stats_and_grads(cfg, h_s, w_s, h_t, w_t, labels, mask, inv_count)
        out = _reduce(cfg, kl_R, nll_R, mask, inv_count)
        # Zero-size arrays carry the input dtypes (residuals must be arrays).
        return out, (dh, dw, jnp.zeros((0,), h_s.dtype), jnp.zeros((0,), w_s.dtype), hp)
    lse_a, lse_b, lse_z, kl_R, nll_R = _stats(cfg, h_s, w_s, h_t, w_t, labels)
    out = _reduce(cfg, kl_R, nll_R, mask, inv_count)
    res = (h_s, w_s, h_t, w_t, labels, mask, inv_count, (lse_a, lse_b, lse_z, kl_R), hp)
    return out, res


def _fused_bwd(cfg, res, cotangents):
    # Metrics are returned under stop_gradient by the wrapper: only d(loss) matters.
    g_loss = cotangents[0]
    cfg = _bind(cfg, res[-1])
    if _grads_in_forward(cfg):
        dh, dw, h_like, w_like, _ = res
        dh_s = (dh * g_loss).astype(h_like.dtype)
        dw_s = (dw * g_loss).astype(w_like.dtype)
    else:
        h_s, w_s, h_t, w_t, labels, mask, inv_count, row_stats, _ = res
        coef_nll, coef_kl = _loss_coefs(cfg, mask, inv_count, g_loss)
        dh, dw = _grads(cfg, h_s, w_s, h_t, w_t, labels, row_stats, coef_nll, coef_kl)
        dh_s, dw_s = dh.astype(h_s.dtype), dw.astype(w_s.dtype)
    # Teacher, labels, mask and the hyperparameters get no gradient (None = symbolic zero).
    return dh_s, dw_s, None, None, None, None, None


_fused.defvjp(_fused_fwd, _fused_bwd)


@functools.lru_cache(maxsize=16)
def _notice_once(message: str) -> None:
    log.warning(message)


def resolve_backend(backend: str, platform: str | None = None) -> str:
    """The concrete backend for `backend` on `platform` ("tpu", "gpu", "cpu"; default:
    the backend being traced for, `chips.traced_target`): "auto" is Pallas on a GPU or
    TPU (Triton / Mosaic), XLA elsewhere; "pallas" picks its family the same way."""
    if backend not in BACKENDS + ("auto",):
        raise ValueError(f"backend: expected 'auto' or one of {BACKENDS}, got {backend!r}")
    if backend not in ("auto", "pallas"):
        return backend
    platform = platform or chips.traced_target()[0]
    if backend == "auto" and platform not in ("gpu", "tpu", "cuda", "rocm"):
        return "xla"
    return "pallas_mosaic" if pallas_kd.kernel_family("pallas", platform) == "mosaic" else "pallas_triton"


def _kernel_blocks(backend: str, chosen_here: bool, d_student: int, d_teacher: int,
                   vocab: int, dtype):
    """(kernel blocks or None, backend): the Pallas kernels' blocks and compiler limits
    for the chip this is traced for; where none fit, `auto` takes the XLA path (said
    once) and an explicit Pallas backend is refused."""
    if not backend.startswith("pallas"):
        return None, backend
    try:
        return kernel_blocks.for_target(chips.traced_target()[1], d_student, vocab, dtype,
                                        d_teacher=d_teacher,
                                        family=pallas_kd.kernel_family(backend)), backend
    except kernel_blocks.BlocksDoNotFit as e:
        if not chosen_here:
            raise ConfigError("distill.fused_backend", str(e)) from None
        _notice_once(f"fused KD: {e}; auto takes the XLA path")
        return None, "xla"


def fused_kd_loss(
    h_s,
    w_s,
    h_t,
    w_t,
    labels,
    mask=None,
    *,
    temperature: float | jax.Array = 1.0,
    alpha: float | jax.Array = 0.5,
    divergence: str = "forward_kl",
    softcap: float | None = None,
    row_block: int | None = None,
    vocab_block: int | None = None,
    backend: str = "auto",
    interpret: bool = False,
    **unused,
):
    """`alpha * NLL + (1 - alpha) * tau^2 * KL`, exact, without `[T, V]` logits.

    Drop-in for `materialized_kd_loss` (same arguments, returns
    `(loss, {"nll", "kl"})`). Gradients flow to `h_s` and `w_s` only.

    Args:
      row_block, vocab_block: window sizes; None picks the backend's default
        (CPU/XLA: 128 rows x whole vocabulary; Pallas: sized for the chip being
        traced for by `kernel_blocks.for_target`, which also sets the kernels'
        compiler limits).
      backend: "auto" (Pallas on GPU/TPU, XLA elsewhere), "xla", "pallas" (Triton
        kernels on GPU, Mosaic on TPU), or "pallas_triton" / "pallas_mosaic"; the
        platform is the one being traced for (`chips.traced_target`).
      interpret: run Pallas kernels in interpret mode (for CPU tests).
      temperature, alpha: Python numbers (static: folded into the program) or scalar
        arrays (traced, never differentiated: a cohort's students each pass their own
        and share one compiled step; Pallas kernels take the temperature as an operand).
    """
    if divergence == "jsd":
        raise ValueError(
            "divergence: 'jsd' is only implemented by materialized_kd_loss (its mixture "
            "log needs normalized p_s and p_t, i.e. a second vocabulary pass); use "
            "'forward_kl' or 'reverse_kl' with fused_kd_loss"
        )
    unused.pop("jsd_beta", None)
    if unused:
        raise TypeError(f"fused_kd_loss: unexpected keyword arguments {sorted(unused)}")
    validate_kd_args(temperature, alpha, divergence, FUSED_DIVERGENCES)
    chosen_here = backend in ("auto", "pallas")
    backend = resolve_backend(backend)
    h_s, h_t, labels, mask = flatten_tokens(h_s, h_t, labels, mask)
    vocab = w_s.shape[-1]
    if w_t.shape[-1] != vocab:
        raise ValueError(f"w_t: vocabulary {w_t.shape[-1]} differs from w_s's {vocab}")

    kernel, backend = _kernel_blocks(backend, chosen_here, h_s.shape[-1], h_t.shape[-1], vocab,
                                     w_s.dtype)
    if kernel is not None:
        default_rows, default_vocab = kernel.row_block, kernel.vocab_block
    else:
        default_rows, default_vocab = CPU_ROW_BLOCK, CPU_VOCAB_BLOCK
    mesh, axes = _batch_partition(h_s.shape[0])
    n_rows = h_s.shape[0] // axes_size(mesh, axes)  # rows each shard's loss sees
    row_block = int(row_block or default_rows)
    if backend == "xla":  # no point in windows taller than the input
        row_block = max(1, min(row_block, n_rows))
    vocab_block = int(vocab_block or default_vocab)
    static = isinstance(temperature, int | float) and isinstance(alpha, int | float)
    if static:
        hp = jnp.zeros((0,), jnp.float32)
    else:
        hp = jnp.stack([jnp.asarray(temperature, jnp.float32).reshape(()),
                        jnp.asarray(alpha, jnp.float32).reshape(())])
    cfg = KDConfig(
        temperature=float(temperature) if static else None,
        alpha=float(alpha) if static else None,
        divergence=divergence,
        softcap=None if softcap is None else float(softcap),
        row_block=row_block,
        vocab_block=min(vocab_block, vocab) if backend == "xla" else vocab_block,
        vocab=vocab,
        backend=backend,
        interpret=interpret,
        kernel=kernel,
    )
    labels = labels.astype(jnp.int32)
    h_t, w_t = lax.stop_gradient(h_t), lax.stop_gradient(w_t)
    args = (h_s, w_s, h_t, w_t, labels, mask, lax.stop_gradient(hp))
    if axes:
        loss, nll, kl = _sharded_rows_loss(cfg, mesh, axes, *args)
    else:
        loss, nll, kl = _rows_loss(cfg, *args)
    return loss, {"nll": lax.stop_gradient(nll), "kl": lax.stop_gradient(kl)}


# ---------------------------------------------------------------------------
# Partitioning over the batch.


def _batch_partition(n_tokens: int):
    """(mesh, axes): the mesh being traced under and its axes that shard the batch
    (sharding.BATCH_AXES, size > 1, not already manual), or (None, ()) when the loss
    runs whole. The tokens are flattened batch-major, so sharding the rows over these
    axes keeps each device's own examples (no communication)."""
    mesh, axes = traced_batch_axes()
    size = axes_size(mesh, axes)
    if size <= 1:
        return None, ()
    if n_tokens % size:
        _notice_once(f"fused KD: {n_tokens} tokens do not split over the {size} devices of "
                     f"mesh axes {axes}; the loss is computed whole on every device")
        return None, ()
    return mesh, axes


def _rows_loss(cfg, h_s, w_s, h_t, w_t, labels, mask, hp):
    """(loss, nll, kl) over these rows: padded to whole windows (padded rows are masked;
    h = 0 keeps them finite), then the custom_vjp."""
    n_pad = -h_s.shape[0] % cfg.row_block
    if n_pad:
        h_s = jnp.pad(h_s, ((0, n_pad), (0, 0)))
        h_t = jnp.pad(h_t, ((0, n_pad), (0, 0)))
        labels = jnp.pad(labels, (0, n_pad))
        mask = jnp.pad(mask, (0, n_pad))
    return _fused(cfg, h_s, w_s, h_t, w_t, labels, mask, hp)


def _sharded_rows_loss(cfg, mesh, axes, h_s, w_s, h_t, w_t, labels, mask, hp):
    """_rows_loss per shard of the batch (jax.shard_map): each device computes its own
    rows' loss (the Pallas kernels cannot be partitioned automatically, and XLA would
    otherwise gather every device's hidden states); the heads come in replicated (an
    FSDP-sharded head is gathered once, as a data-parallel loss needs). Each shard's
    masked mean is weighted by its share of the unmasked tokens and summed (psum), so
    the result is the whole batch's mean; the head's gradient is summed over shards by
    shard_map's transpose of the replicated input."""

    def per_shard(h_s, w_s, h_t, w_t, labels, mask, hp):
        count = jnp.sum(mask.astype(jnp.float32))
        share = count / jnp.maximum(lax.psum(count, axes), 1.0)
        out = _rows_loss(cfg, h_s, w_s, h_t, w_t, labels, mask, hp)
        return tuple(lax.psum(x * share, axes) for x in out)

    rows, whole = P(axes), P()
    # check_vma off (shard_mapped): the window scans carry a replicated-typed zero dW that
    # turns per-shard (varying) in the body; the psums above are written out explicitly and
    # tests/test_fused_sharded.py checks value and gradients against one device.
    return shard_mapped(per_shard, mesh, (rows, whole, rows, whole, rows, rows, whole),
                        (whole, whole, whole), h_s, w_s, h_t, w_t, labels, mask, hp)
