"""Losses: NLL, KD divergences, hidden alignment, and the fused exact KD loss.

`materialized_kd_loss` (reference, builds [T, V] logits) and `fused_kd_loss`
(never does; XLA on CPU, Pallas on GPU/TPU) share one signature:
`(h_s, w_s, h_t, w_t, labels, mask, *, temperature, alpha, divergence,
softcap, ...) -> (loss, {"nll", "kl"})`.
"""

from hldstudy.losses.fused import fused_kd_loss
from hldstudy.losses.hidden import Regressor, hidden_alignment_loss, normalized_mse
from hldstudy.losses.kd import (
    forward_kl_per_token,
    jsd_per_token,
    masked_mean,
    materialized_kd_loss,
    nll_from_logits,
    nll_per_token,
    reverse_kl_per_token,
)
from hldstudy.numerics import softcap

__all__ = [
    "Regressor",
    "forward_kl_per_token",
    "fused_kd_loss",
    "hidden_alignment_loss",
    "jsd_per_token",
    "masked_mean",
    "materialized_kd_loss",
    "nll_from_logits",
    "nll_per_token",
    "normalized_mse",
    "reverse_kl_per_token",
    "softcap",
]
