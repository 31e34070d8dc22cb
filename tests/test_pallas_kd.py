"""Pallas kernels (Triton and Mosaic flavours, interpret mode on CPU) == the XLA path."""

import jax.numpy as jnp
import numpy as np
import pytest
from test_fused_kd import assert_close, loss_and_grads, make_inputs

from hldstudy.losses import fused_kd_loss

FAMILIES = ["pallas_triton", "pallas_mosaic"]


def compare_with_xla(inputs, backend, rtol=1e-5, **kw):
    blocks = dict(row_block=16, vocab_block=32)
    ref_loss, (ref_dh, ref_dw) = loss_and_grads(fused_kd_loss, inputs, backend="xla", **blocks, **kw)
    loss, (dh, dw) = loss_and_grads(fused_kd_loss, inputs, backend=backend, interpret=True, **blocks, **kw)
    assert_close(loss, ref_loss, rtol)
    assert_close(dh, ref_dh, rtol)
    assert_close(dw, ref_dw, rtol)
    return loss, dh, dw


@pytest.mark.parametrize("backend", FAMILIES)
@pytest.mark.parametrize(
    "divergence, softcap, temperature",
    [("forward_kl", None, 1.0), ("forward_kl", 3.0, 2.0), ("reverse_kl", 3.0, 0.7)],
)
def test_kernels_match_xla(backend, divergence, softcap, temperature):
    # T = 37 and V = 101 divide neither block; d_t = 24 is not a power of two
    # (the Triton K-loop pads it to 32).
    inputs = make_inputs(0, 37, 16, 24, 101)
    compare_with_xla(inputs, backend, divergence=divergence, softcap=softcap,
                     temperature=temperature, alpha=0.3)


@pytest.mark.parametrize("backend", FAMILIES)
def test_kernels_bf16(backend):
    inputs = make_inputs(1, 20, 16, 16, 64, dtype=jnp.bfloat16)
    loss, dh, dw = compare_with_xla(inputs, backend, rtol=2e-2, temperature=2.0)
    assert dh.dtype == jnp.bfloat16 and dw.dtype == jnp.bfloat16 and np.isfinite(loss)


def test_triton_rejects_non_power_of_two_tiles():
    inputs = make_inputs(2, 8, 16, 16, 40)
    with pytest.raises(ValueError, match="vocab_block"):
        fused_kd_loss(*inputs, backend="pallas_triton", interpret=True, row_block=16, vocab_block=24)
