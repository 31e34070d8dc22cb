"""Token-level NLL and distillation divergences, and the materialized KD loss.

Design notes: `docs/losses.md`, under this file's name.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from hldstudy import numerics

DIVERGENCES = ("forward_kl", "reverse_kl", "jsd")


def _upcast(x: jax.Array) -> jax.Array:
    """At least float32 (bf16 -> f32; float64 stays float64 for x64 gradient checks)."""
    return x.astype(jnp.promote_types(x.dtype, jnp.float32))


def masked_mean(values_T: jax.Array, mask_T: jax.Array) -> jax.Array:
    """Mean of `values_T` over tokens where `mask_T` is true (0 if none are)."""
    values_T = _upcast(values_T)
    count = jnp.sum(mask_T.astype(values_T.dtype))
    # `where` (not multiply) so that NaN/inf in masked rows cannot leak through.
    total = jnp.sum(jnp.where(mask_T.astype(bool), values_T, 0.0))
    return total / jnp.maximum(count, 1.0)


def nll_per_token(logits_TxV: jax.Array, labels_T: jax.Array) -> jax.Array:
    """`lse(z) - z[y]` per token, in float32. Out-of-range labels are clipped (mask them)."""
    logits_TxV = _upcast(logits_TxV)
    vocab = logits_TxV.shape[-1]
    labels_T = jnp.clip(labels_T, 0, vocab - 1)
    target_T = jnp.take_along_axis(logits_TxV, labels_T[..., None], axis=-1)[..., 0]
    return jax.nn.logsumexp(logits_TxV, axis=-1) - target_T


def nll_from_logits(logits_TxV: jax.Array, labels_T: jax.Array, mask_T: jax.Array) -> jax.Array:
    """Mean next-token NLL over valid tokens."""
    return masked_mean(nll_per_token(logits_TxV, labels_T), mask_T)


def forward_kl_per_token(
    student_logits_TxV: jax.Array, teacher_logits_TxV: jax.Array, temperature: float = 1.0
) -> jax.Array:
    """`KL(p_t || p_s)` per token at temperature tau (unscaled; the objective adds tau^2).

    `KL = sum_v p_t(v) (a_v - b_v) - lse(a) + lse(b)` with `a = z_t/tau`, `b = z_s/tau`.
    """
    a = _upcast(teacher_logits_TxV) / temperature
    b = _upcast(student_logits_TxV) / temperature
    log_p_t = jax.nn.log_softmax(a, axis=-1)
    log_p_s = jax.nn.log_softmax(b, axis=-1)
    p_t = jnp.exp(log_p_t)
    # where(): entries with p_t == 0 (e.g. -inf logits) contribute 0, not 0 * inf.
    return jnp.sum(jnp.where(p_t > 0, p_t * (log_p_t - log_p_s), 0.0), axis=-1)


def reverse_kl_per_token(
    student_logits_TxV: jax.Array, teacher_logits_TxV: jax.Array, temperature: float = 1.0
) -> jax.Array:
    """`KL(p_s || p_t)` per token at temperature tau (unscaled; the objective adds tau^2).

    Mode-seeking (MiniLLM-style). Same temperature and tau^2 convention as
    forward KL, so the two are interchangeable in the objective.
    """
    return forward_kl_per_token(teacher_logits_TxV, student_logits_TxV, temperature)


def jsd_per_token(
    student_logits_TxV: jax.Array,
    teacher_logits_TxV: jax.Array,
    temperature: float = 1.0,
    beta: float = 0.5,
) -> jax.Array:
    """Generalized Jensen-Shannon divergence JSD(beta) per token (unscaled).

    Convention (Agarwal et al., GKD, 2024, with P = teacher, Q = student):

        M = beta * p_t + (1 - beta) * p_s
        JSD(beta) = beta * KL(p_t || M) + (1 - beta) * KL(p_s || M)

    `beta = 0.5` is the symmetric JSD. Both ends are degenerate: beta -> 0 and
    beta -> 1 give M = p_s resp. M = p_t, so JSD -> 0 (JSD/beta tends to forward
    KL(p_t||p_s) as beta -> 0 and JSD/(1-beta) to reverse KL(p_s||p_t) as
    beta -> 1). Note TRL's `generalized_jsd_loss` instead *defines* its end
    points as KL divergences; do not mix the two conventions.
    """
    a = _upcast(teacher_logits_TxV) / temperature
    b = _upcast(student_logits_TxV) / temperature
    log_p_t = jax.nn.log_softmax(a, axis=-1)
    log_p_s = jax.nn.log_softmax(b, axis=-1)
    if beta <= 0.0 or beta >= 1.0:
        return jnp.zeros(a.shape[:-1], a.dtype)
    log_m = jnp.logaddexp(jnp.log(beta) + log_p_t, jnp.log1p(-beta) + log_p_s)
    p_t, p_s = jnp.exp(log_p_t), jnp.exp(log_p_s)
    kl_t = jnp.sum(jnp.where(p_t > 0, p_t * (log_p_t - log_m), 0.0), axis=-1)
    kl_s = jnp.sum(jnp.where(p_s > 0, p_s * (log_p_s - log_m), 0.0), axis=-1)
    return beta * kl_t + (1.0 - beta) * kl_s


def divergence_per_token(
    divergence: str,
    student_logits_TxV: jax.Array,
    teacher_logits_TxV: jax.Array,
    temperature: float,
    jsd_beta: float = 0.5,
) -> jax.Array:
    if divergence == "forward_kl":
        return forward_kl_per_token(student_logits_TxV, teacher_logits_TxV, temperature)
    if divergence == "reverse_kl":
        return reverse_kl_per_token(student_logits_TxV, teacher_logits_TxV, temperature)
    if divergence == "jsd":
        return jsd_per_token(student_logits_TxV, teacher_logits_TxV, temperature, jsd_beta)
    raise ValueError(f"divergence: unknown {divergence!r} (expected one of {DIVERGENCES})")


def validate_kd_args(temperature: float, alpha: float, divergence: str, allowed=DIVERGENCES) -> None:
    """Raises ValueError naming the bad argument. Called by both loss paths. A scalar
    array (a traced per-member hyperparameter of a cohort) is checked for its shape only:
    its value is known when the program runs (the config validated it)."""
    if _is_scalar_array(temperature):
        pass
    elif not isinstance(temperature, int | float) or not temperature > 0:
        raise ValueError(f"temperature: must be > 0, got {temperature!r}")
    if _is_scalar_array(alpha):
        pass
    elif not isinstance(alpha, int | float) or not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha: the NLL weight must be in [0, 1], got {alpha!r}")
    if divergence not in allowed:
        raise ValueError(f"divergence: {divergence!r} is not supported here (expected one of {allowed})")


def _is_scalar_array(x) -> bool:
    return isinstance(x, jax.Array) and x.ndim == 0


def flatten_tokens(h_s, h_t, labels, mask):
    """Accepts `[T, d]` or `[..., T, d]` hiddens (labels/mask `[..., T]`) and flattens to tokens."""
    h_s = h_s.reshape(-1, h_s.shape[-1])
    h_t = h_t.reshape(-1, h_t.shape[-1])
    labels = labels.reshape(-1)
    mask = jnp.ones(labels.shape, bool) if mask is None else mask.reshape(-1).astype(bool)
    if not (h_s.shape[0] == h_t.shape[0] == labels.shape[0] == mask.shape[0]):
        raise ValueError(
            f"h_s/h_t/labels/mask: token counts differ ({h_s.shape[0]}, {h_t.shape[0]}, "
            f"{labels.shape[0]}, {mask.shape[0]})"
        )
    return h_s, h_t, labels, mask


def materialized_kd_loss(
    h_s,
    w_s,
    h_t,
    w_t,
    labels,
    mask=None,
    *,
    temperature: float = 1.0,
    alpha: float = 0.5,
    divergence: str = "forward_kl",
    softcap: float | None = None,
    jsd_beta: float = 0.5,
    **block_sizes,
):
    """`alpha * NLL + (1 - alpha) * tau^2 * D(p_t, p_s)` with full `[T, V]` logits.

    Args:
      h_s: student final hidden `[T, d_s]` or `[B, T, d_s]`.
      w_s: student LM head `[d_s, V]`.
      h_t, w_t: teacher hidden `[..., T, d_t]` and head `[d_t, V]`; no gradient flows to them.
      labels: next-token ids `[..., T]`; mask: `[..., T]` bool (None = all valid).
      divergence: "forward_kl" (Hinton), "reverse_kl" (mode seeking) or "jsd" (`jsd_beta`).
      block_sizes: accepted and ignored (`row_block`, `vocab_block`, `backend`), so
        this is a drop-in for `fused_kd_loss`.

    Returns:
      (loss, {"nll": mean NLL, "kl": mean unscaled divergence}).
    """
    del block_sizes
    validate_kd_args(temperature, alpha, divergence)
    h_s_TxD, h_t_TxD, labels_T, mask_T = flatten_tokens(h_s, h_t, labels, mask)
    h_t_TxD, w_t = jax.lax.stop_gradient(h_t_TxD), jax.lax.stop_gradient(w_t)
    logit_dtype = jnp.promote_types(h_s_TxD.dtype, jnp.float32)
    z_s_TxV = jnp.dot(h_s_TxD, w_s, preferred_element_type=logit_dtype)
    z_t_TxV = jnp.dot(h_t_TxD, w_t, preferred_element_type=logit_dtype)
    # (the `softcap` argument shadows the function here)
    z_s_TxV = numerics.softcap(z_s_TxV, softcap)
    z_t_TxV = numerics.softcap(z_t_TxV, softcap)
    nll = nll_from_logits(z_s_TxV, labels_T, mask_T)
    kl = masked_mean(
        divergence_per_token(divergence, z_s_TxV, z_t_TxV, temperature, jsd_beta), mask_T
    )
    loss = alpha * nll + (1.0 - alpha) * temperature**2 * kl
    return loss, {"nll": nll, "kl": kl}

