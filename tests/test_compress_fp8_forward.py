"""The FP8 forward of a compressed model: the simulated fallback gives the pipeline's
numbers, the real FP8 dot (emulated by XLA on CPU) stays within FP8 rounding of them,
and the model lowers for CUDA with FP8 dots in it."""

from __future__ import annotations

from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from hldstudy.compress import fp8
from hldstudy.compress.fp8_forward import FP8Weight, fp8_model
from hldstudy.compress.layout import targets
from hldstudy.compress.pipeline import quantize_model
from hldstudy.model import Transformer, preset


def _quantized(name: str, seed: int = 0):
    model = Transformer(preset(name), rngs=nnx.Rngs(seed))
    quantized = quantize_model(model, tuple({t.name for t in targets(model)}), "e4m3",
                               "channel")
    return model, quantized


@pytest.mark.parametrize("name", ["tiny", "tiny-qwen",
                                  pytest.param("tiny-qwen-moe", marks=pytest.mark.slow)])
def test_simulated_fp8_forward_is_the_dequantized_model(name):
    model, quantized = _quantized(name)
    tokens = np.random.default_rng(0).integers(0, 512, (2, 16))
    ref = np.asarray(model(tokens).logits)
    sim = fp8_model(model, quantized, real=False)
    n_fp8 = sum(isinstance(v.get_value(), FP8Weight) for _, v in nnx.iter_graph(sim)
                if isinstance(v, nnx.Param))
    assert n_fp8 == sum(1 for k in quantized if k.count(".") == 3)  # experts stay dense
    got = np.asarray(nnx.jit(lambda m, t: m(t).logits)(sim, tokens))
    # float32 reassociation only (the 2-D view's dot vs the module's reshape)
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())
    if jax.devices()[0].platform == "cpu":  # no FP8 units: the default is the simulation
        assert not fp8.backend_has_fp8_matmul()
        auto = np.asarray(fp8_model(model, quantized)(tokens).logits)
        np.testing.assert_allclose(auto, got, rtol=1e-5, atol=1e-5 * np.abs(ref).max())


def test_real_fp8_forward_within_fp8_rounding_of_the_simulation():
    """Each real FP8 dot differs from the simulated one by the activations' FP8
    rounding (per-tensor e4m3: at most 2^-4 relative, plus the subnormal step):
    checked per linear through the model's own forward, then end to end."""
    model, quantized = _quantized("tiny")
    tokens = np.random.default_rng(1).integers(0, 512, (2, 16))
    seen = []

    class Checked(FP8Weight):
        def __rmatmul__(self, x):
            real = fp8.fp8_dot(x, self.q, self.scale, real=True)
            sim = fp8.fp8_dot(x, self.q, self.scale, real=False)
            x_scale = float(jnp.max(jnp.abs(x))) / 448.0
            step = np.maximum(np.abs(np.asarray(x)) * 2.0 ** -4, x_scale * 2.0 ** -10)
            bound = step @ np.abs(np.asarray(fp8.dequantize_fp8(self.q, self.scale)))
            assert (np.abs(np.asarray(real) - np.asarray(sim)) <= bound * 1.01 + 1e-6).all()
            seen.append(self.q.shape)
            return real.astype(x.dtype)

    checked = fp8_model(model, quantized, real=True)
    for _, v in nnx.iter_graph(checked):
        if isinstance(v, nnx.Param) and isinstance(v.get_value(), FP8Weight):
            w = v.get_value()
            v.set_value(Checked(w.q, w.scale, True))
    out = np.asarray(checked(tokens).logits)
    assert len(seen) == len(quantized)
    ref = np.asarray(model(tokens).logits)
    real = np.asarray(fp8_model(model, quantized, real=True)(tokens).logits)
    np.testing.assert_allclose(real, out, rtol=1e-5, atol=1e-5)
    assert np.linalg.norm(real - ref) <= 0.2 * np.linalg.norm(ref)  # W8A8 on a random model


def test_fp8_forward_lowers_for_cuda_with_fp8_dots():
    model, quantized = _quantized("tiny-qwen")
    real = fp8_model(model, quantized, real=True)
    graphdef, state = nnx.split(real)
    tokens = jnp.zeros((1, 16), jnp.int32)
    fn = jax.jit(lambda st, t: nnx.merge(graphdef, st)(t).logits)
    text = fn.trace(state, tokens).lower(lowering_platforms=("cuda",)).as_text()
    dots = [ln for ln in text.splitlines() if "dot_general" in ln and "f8E4M3FN" in ln]
    assert len(dots) == len(quantized)


def test_chip_table_decides_fp8_hardware():
    assert fp8.chip_of(SimpleNamespace(platform="gpu", device_kind="NVIDIA H100 80GB HBM3")) \
        == "h100"
    assert fp8.chip_of(SimpleNamespace(platform="tpu", device_kind="TPU v5 lite")) == "v5e"
    assert fp8.chip_of(SimpleNamespace(platform="cpu", device_kind="cpu")) is None
