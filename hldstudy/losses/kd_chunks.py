"""Per-chunk math of the fused KD loss, shared by its XLA path (`fused`) and its Pallas
kernels (`pallas_kd`): soft-cap and -inf masking of a chunk's logits, the online
log-sum-exp statistics, their per-row finalization and the chunk's logit gradient
(formulas in `hldstudy.losses.fused`). Both implementations import this module;
neither imports the other's internals, and the dispatcher (`fused`) imports both.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from hldstudy.numerics import softcap


@dataclasses.dataclass(frozen=True)
class KDConfig:
    """Static (hashable) description of one fused KD loss computation.

    temperature / alpha: Python floats (static, folded into the program), or None in
    the static description when they are traced values (a cohort's per-member
    hyperparameters): `fused` binds the traced values back in (`bind`) inside the
    custom_vjp, and the Pallas kernels read the temperature from a [1, 1] operand.
    """

    temperature: float | None
    alpha: float | None
    divergence: str
    softcap: float | None
    row_block: int
    vocab_block: int
    vocab: int
    backend: str  # one of BACKENDS
    interpret: bool = False  # Pallas interpret mode (CPU testing)
    # kernel_blocks.KernelBlocks: the Pallas kernels' compiler limits (None: defaults)
    kernel: object = None


def bind(cfg: KDConfig, temperature, alpha) -> KDConfig:
    """`cfg` with traced temperature / alpha (unhashable: never a static argument)."""
    return dataclasses.replace(cfg, temperature=temperature, alpha=alpha)


def temperature_is_one(cfg: KDConfig) -> bool:
    """Statically known tau = 1: the NLL's softmax is the tempered student softmax. A
    traced temperature is never assumed to be 1 (the separate softmax gives the same
    values at tau = 1: b = z_s * (1 / 1) is z_s exactly)."""
    return isinstance(cfg.temperature, int | float) and cfg.temperature == 1.0


def cap_and_mask(cfg: KDConfig, z_s_RxC, z_t_RxC, valid_1xC):
    """Soft-caps raw chunk logits and sets invalid columns to -inf (never 0).

    Returns (z_s, z_t, cap_grad) with cap_grad = d capped / d raw (None if no cap).
    """
    cap_grad = None
    if cfg.softcap is not None:
        c = cfg.softcap
        z_s_RxC, z_t_RxC = softcap(z_s_RxC, c), softcap(z_t_RxC, c)
        cap_grad = 1.0 - jnp.square(z_s_RxC / c)
    neg_inf = jnp.float32(-jnp.inf)
    z_s_RxC = jnp.where(valid_1xC, z_s_RxC, neg_inf)
    z_t_RxC = jnp.where(valid_1xC, z_t_RxC, neg_inf)
    return z_s_RxC, z_t_RxC, cap_grad


# Per-row statistics are kept as [R, 1] columns (keepdims) everywhere, so the
# same code runs in XLA and inside Pallas kernels (2-D tiles only).
N_STATS = 9  # m_a, S_a, U_f, m_b, S_b, U_r, m_z, S_z, z_y


def init_stats(rows: int):
    neg_inf = jnp.full((rows, 1), -jnp.inf, jnp.float32)
    zero = jnp.zeros((rows, 1), jnp.float32)
    return (neg_inf, zero, zero, neg_inf, zero, zero, neg_inf, zero, zero)


def row_max(x):
    return jnp.max(x, axis=-1, keepdims=True)


def row_sum(x):
    return jnp.sum(x, axis=-1, keepdims=True)


def update_stats(cfg: KDConfig, stats, z_s, z_t, valid_1xC, is_label_RxC):
    """One online log-sum-exp step over a chunk of (capped, masked) logits."""
    m_a, s_a, u_f, m_b, s_b, u_r, m_z, s_z, z_y = stats
    inv_tau = 1.0 / cfg.temperature
    a, b = z_t * inv_tau, z_s * inv_tau
    # a - b is nan on masked columns (-inf - -inf): select, never multiply.
    a_minus_b = jnp.where(valid_1xC, a - b, 0.0)

    m_a_new = jnp.maximum(m_a, row_max(a))
    e_a = jnp.exp(a - m_a_new)
    scale_a = jnp.exp(m_a - m_a_new)
    s_a = s_a * scale_a + row_sum(e_a)
    m_b_new = jnp.maximum(m_b, row_max(b))
    e_b = jnp.exp(b - m_b_new)
    scale_b = jnp.exp(m_b - m_b_new)
    s_b = s_b * scale_b + row_sum(e_b)
    if cfg.divergence == "forward_kl":
        u_f = u_f * scale_a + row_sum(e_a * a_minus_b)
    else:
        u_r = u_r * scale_b - row_sum(e_b * a_minus_b)
    if temperature_is_one(cfg):  # NLL logits are the tempered student logits
        m_z_new, s_z = m_b_new, s_b
    else:
        m_z_new = jnp.maximum(m_z, row_max(z_s))
        s_z = s_z * jnp.exp(m_z - m_z_new) + row_sum(jnp.exp(z_s - m_z_new))
    z_y = z_y + row_sum(jnp.where(is_label_RxC, z_s, 0.0))
    return (m_a_new, s_a, u_f, m_b_new, s_b, u_r, m_z_new, s_z, z_y)


def finalize_stats(cfg: KDConfig, stats):
    """Per-row (lse_a, lse_b, lse_z, kl, nll) from the running sums."""
    m_a, s_a, u_f, m_b, s_b, u_r, m_z, s_z, z_y = stats
    lse_a = m_a + jnp.log(s_a)
    lse_b = m_b + jnp.log(s_b)
    lse_z = m_z + jnp.log(s_z)
    if cfg.divergence == "forward_kl":
        kl = u_f / s_a - lse_a + lse_b
    else:
        kl = u_r / s_b - lse_b + lse_a
    nll = lse_z - z_y
    return lse_a, lse_b, lse_z, kl, nll


def logit_grad(cfg: KDConfig, z_s, z_t, cap_grad, valid_1xC, is_label_RxC, row_stats, coef_nll, coef_kl):
    """dLoss/dz_raw for one chunk: coef_nll * dNLL + coef_kl * dKL (per-row [R, 1] coefs)."""
    lse_a, lse_b, lse_z, kl = row_stats
    inv_tau = 1.0 / cfg.temperature
    a, b = z_t * inv_tau, z_s * inv_tau
    p_s = jnp.exp(b - lse_b)
    p_z = p_s if temperature_is_one(cfg) else jnp.exp(z_s - lse_z)
    g_nll = p_z - is_label_RxC.astype(jnp.float32)
    if cfg.divergence == "forward_kl":
        g_kl = (p_s - jnp.exp(a - lse_a)) * inv_tau
    else:
        # log(p_s / p_t) = (b - a) - lse_b + lse_a; masked columns have p_s = 0.
        log_ratio = jnp.where(valid_1xC, b - a, 0.0) - (lse_b - lse_a)
        g_kl = p_s * (log_ratio - kl) * inv_tau
    g = coef_nll * g_nll + coef_kl * g_kl
    g = jnp.where(valid_1xC, g, 0.0)
    if cap_grad is not None:
        g = g * cap_grad
    return g


def chunk_layout(vocab: int, vocab_block: int):
    """(chunk width, number of chunks) with the width clamped to the vocabulary."""
    width = min(vocab_block, vocab)
    return width, -(-vocab // width)


def chunk_columns(j, width: int, vocab: int):
    """Clamped start of chunk j, its validity mask and global column ids."""
    nominal = j * width
    start = jnp.minimum(nominal, vocab - width)
    cols_1xC = start + jnp.arange(width)[None, :]
    return start, cols_1xC >= nominal, cols_1xC
