"""The FP8 forward of a compressed model: the simulated fallback gives the pipeline's
numbers, the real FP8 dot and the real FP8 grouped matmul of the experts (emulated by
XLA on CPU) stay within FP8 rounding of them, and the model lowers for CUDA with FP8
dots and FP8 ragged dots in it (compiled for the H100 by the CUDA plugin: marker aot)."""

from __future__ import annotations

import importlib.util
import os
import re
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from hldstudy.compress import fp8
from hldstudy.compress.fp8_forward import FP8Experts, FP8Weight, fp8_model
from hldstudy.compress.layout import Target, targets
from hldstudy.compress.pipeline import quantize_model
from hldstudy.model import Transformer, preset


def _quantized(name: str, seed: int = 0):
    model = Transformer(preset(name), rngs=nnx.Rngs(seed))
    quantized = quantize_model(model, tuple({t.name for t in targets(model)}), "e4m3",
                               "channel")
    return model, quantized


def _wrap_params(model, kind, checked):
    """`model` with every parameter of type `kind` replaced by its `checked` twin
    (same q and scale, real FP8 dot), which checks each product as the forward runs."""
    for _, v in nnx.iter_graph(model):
        if isinstance(v, nnx.Param) and isinstance(v.get_value(), kind):
            w = v.get_value()
            v.set_value(checked(w.q, w.scale, True))
    return model


@pytest.mark.parametrize("name", ["tiny", "tiny-qwen",
                                  pytest.param("tiny-qwen-moe", marks=pytest.mark.slow)])
def test_simulated_fp8_forward_is_the_dequantized_model(name):
    model, quantized = _quantized(name)
    tokens = np.random.default_rng(0).integers(0, 512, (2, 16))
    logits = nnx.jit(lambda m, t: m(t).logits)
    ref = np.asarray(logits(model, tokens))
    sim = fp8_model(model, quantized, real=False)
    n_fp8 = sum(isinstance(v.get_value(), FP8Weight) for _, v in nnx.iter_graph(sim)
                if isinstance(v, nnx.Param))
    # every quantized parameter: a linear, or an MoE weight stacking its experts' targets
    assert n_fp8 == len({Target.from_key(k).param_key for k in quantized})
    got = np.asarray(logits(sim, tokens))
    # float32 reassociation only (the 2-D view's dot vs the module's reshape; the
    # experts' ragged_dot sees the same dequantized values)
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())
    if jax.devices()[0].platform == "cpu":  # no FP8 units: the default is the simulation
        assert not fp8.backend_has_fp8_matmul()
        auto = np.asarray(logits(fp8_model(model, quantized), tokens))
        np.testing.assert_array_equal(auto, got)


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

    checked = _wrap_params(fp8_model(model, quantized, real=True), FP8Weight, Checked)
    out = np.asarray(checked(tokens).logits)
    assert len(seen) == len(quantized)
    ref = np.asarray(model(tokens).logits)
    real = np.asarray(fp8_model(model, quantized, real=True)(tokens).logits)
    np.testing.assert_allclose(real, out, rtol=1e-5, atol=1e-5)
    assert np.linalg.norm(real - ref) <= 0.2 * np.linalg.norm(ref)  # W8A8 on a random model


@pytest.mark.parametrize("name", ["tiny-qwen",
                                  pytest.param("tiny-qwen-moe", marks=pytest.mark.slow)])
def test_fp8_forward_lowers_for_cuda_with_fp8_dots(name):
    model, quantized = _quantized(name)
    real = fp8_model(model, quantized, real=True)
    graphdef, state = nnx.split(real)
    tokens = jnp.zeros((1, 16), jnp.int32)
    fn = jax.jit(lambda st, t: nnx.merge(graphdef, st)(t).logits)
    text = fn.trace(state, tokens).lower(lowering_platforms=("cuda",)).as_text()
    dots = [ln for ln in text.splitlines() if "dot_general" in ln and "f8E4M3FN" in ln]
    ragged = [ln for ln in text.splitlines() if "ragged_dot" in ln and "f8E4M3FN" in ln]
    linears = [k for k in quantized if Target.from_key(k).expert is None]
    stacked = {Target.from_key(k).param_key for k in quantized} - set(linears)
    assert len(dots) == len(linears)
    assert len(ragged) == len(stacked) == (12 if name == "tiny-qwen-moe" else 0)  # 4 x 3
    assert all("tensor<8x" in ln and "xf8E4M3FN>" in ln for ln in ragged)  # [E, in, out] FP8


def _experts(seed: int = 0, n_experts: int = 4, d_in: int = 32, d_out: int = 16,
             granularity: str = "channel"):
    rng = np.random.default_rng(seed)
    w = rng.normal(size=(n_experts, d_in, d_out)).astype(np.float32)
    qs = [fp8.quantize_fp8(w[e], "e4m3", granularity) for e in range(n_experts)]
    return jnp.stack([q for q, _ in qs]), jnp.stack([s for _, s in qs])


@pytest.mark.parametrize("granularity", ["channel", "tensor"])
def test_fp8_grouped_matmul_simulated_is_each_experts_dequantized_matmul(granularity):
    q, s = _experts(granularity=granularity)
    x = np.random.default_rng(1).normal(size=(24, 32)).astype(np.float32)
    sizes = jnp.array([5, 0, 12, 7], jnp.int32)  # an expert with no rows
    sim = np.asarray(fp8.fp8_ragged_dot(x, q, s, sizes, real=False))
    w = [np.asarray(fp8.dequantize_fp8(q[e], s[e])) for e in range(4)]
    ref = np.concatenate([x[:5] @ w[0], x[5:17] @ w[2], x[17:] @ w[3]])
    np.testing.assert_allclose(sim, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("granularity", ["channel", "tensor"])
def test_real_fp8_grouped_matmul_within_fp8_rounding_of_the_simulation(granularity):
    """FP8 operands in ragged_dot, float32 accumulation, each row's expert's scales after:
    the difference to the simulation is the activations' per-tensor e4m3 rounding only,
    row by row against that row's expert's weights."""
    q, s = _experts(granularity=granularity)
    x = np.random.default_rng(2).normal(size=(24, 32)).astype(np.float32) * 3
    sizes = jnp.array([5, 0, 12, 7], jnp.int32)
    real = np.asarray(fp8.fp8_ragged_dot(x, q, s, sizes, real=True))
    sim = np.asarray(fp8.fp8_ragged_dot(x, q, s, sizes, real=False))
    step = np.maximum(np.abs(x) * 2.0 ** -4, np.abs(x).max() / 448.0 * 2.0 ** -10)
    expert_of_row = np.repeat(np.arange(4), np.asarray(sizes))
    w_abs = np.abs(np.asarray(fp8.dequantize_fp8(q, fp8.expert_scales(s, 4)[:, None, :])))
    bound = np.einsum("mi,mio->mo", step, w_abs[expert_of_row])
    assert (np.abs(real - sim) <= bound * 1.01 + 1e-6).all()
    assert np.abs(real - sim).max() > 0  # the activations really went through FP8


@pytest.mark.slow
def test_real_fp8_moe_forward_runs_every_expert_weight_in_fp8():
    """Through the MoE model's own forward: every stacked expert weight's grouped matmul
    is the FP8 one, within FP8 rounding of the simulation; the logits finite."""
    model, quantized = _quantized("tiny-qwen-moe")
    tokens = np.random.default_rng(3).integers(0, 512, (2, 16))
    seen = []

    class Checked(FP8Experts):
        def grouped_matmul(self, rows, group_sizes):
            real = fp8.fp8_ragged_dot(rows, self.q, self.scale, group_sizes, real=True)
            sim = fp8.fp8_ragged_dot(rows, self.q, self.scale, group_sizes, real=False)
            x = np.asarray(rows, np.float32)
            step = np.maximum(np.abs(x) * 2.0 ** -4, np.abs(x).max() / 448.0 * 2.0 ** -10)
            n_experts = self.q.shape[0]
            expert_of_row = np.repeat(np.arange(n_experts), np.asarray(group_sizes))
            w_abs = np.abs(np.asarray(fp8.dequantize_fp8(
                self.q, fp8.expert_scales(self.scale, n_experts)[:, None, :])))
            bound = np.einsum("mi,mio->mo", step, w_abs[expert_of_row])
            assert (np.abs(np.asarray(real) - np.asarray(sim)) <= bound * 1.01 + 1e-6).all()
            seen.append(self.q.shape)
            return real.astype(rows.dtype)

    checked = _wrap_params(fp8_model(model, quantized, real=True), FP8Experts, Checked)
    out = np.asarray(checked(tokens).logits)
    assert len(seen) == 12 and np.isfinite(out).all()  # 4 MoE layers x gate, up, down
    real = np.asarray(nnx.jit(lambda m, t: m(t).logits)(
        fp8_model(model, quantized, real=True), tokens))
    np.testing.assert_allclose(real, out, rtol=1e-4, atol=1e-4 * np.abs(out).max())


_HAVE_CUDA_PLUGIN = (importlib.util.find_spec("jax_plugins") is not None
                     and importlib.util.find_spec("jax_plugins.xla_cuda12") is not None)


@pytest.mark.aot
@pytest.mark.skipif(not _HAVE_CUDA_PLUGIN, reason="needs the aot extra (pip install -e '.[aot]')")
@pytest.mark.skipif(os.environ.get("JAX_PLATFORMS") != "cpu",
                    reason="run with JAX_PLATFORMS=cpu (make test-aot)")
def test_fp8_grouped_matmul_compiles_for_the_h100_with_fp8_operands_in_the_gemm():
    """The CUDA plugin's compiler keeps the FP8 operands up to the GEMM (f8e4m3fn x
    f8e4m3fn -> f32); it expands ragged_dot densely over the experts (fp8.py's doc)."""
    from jax.sharding import SingleDeviceSharding

    from hldstudy.aot.targets import devices, parse_target

    sharding = SingleDeviceSharding(devices(parse_target("h100"))[0])
    n_experts, m, d_in, d_out = 8, 256, 512, 1024

    def grouped(x, q, s, sizes):
        return fp8.fp8_ragged_dot(x, q, s, sizes, real=True)

    args = (jax.ShapeDtypeStruct((m, d_in), jnp.float32, sharding=sharding),
            jax.ShapeDtypeStruct((n_experts, d_in, d_out), jnp.float8_e4m3fn, sharding=sharding),
            jax.ShapeDtypeStruct((n_experts, d_out), jnp.float32, sharding=sharding),
            jax.ShapeDtypeStruct((n_experts,), jnp.int32, sharding=sharding))
    text = jax.jit(grouped).trace(*args).lower(lowering_platforms=("cuda",)).compile().as_text()
    # every computation holding a dot takes FP8 operands (no f8 -> f32 convert before it)
    gemms = [c.strip() for c in text.split("\n\n") if " dot(" in c]
    assert gemms, "no dot in the compiled program"
    for c in gemms:
        header = c.splitlines()[0]
        assert header.count("f8e4m3fn[") == 2 and "-> f32[" in header, header


def test_chip_table_decides_fp8_hardware():
    assert fp8.chip_of(SimpleNamespace(platform="gpu", device_kind="NVIDIA H100 80GB HBM3")) \
        == "h100"
    assert fp8.chip_of(SimpleNamespace(platform="tpu", device_kind="TPU v5 lite")) == "v5e"
    assert fp8.chip_of(SimpleNamespace(platform="cpu", device_kind="cpu")) is None


def _fp8_widenings(hlo: str) -> int:
    """How many converts of the compiled program take an FP8 value to a wider type (what
    a dequantizing, simulated matmul compiles to)."""
    types = {}
    for line in hlo.splitlines():
        if m := re.match(r"\s*(?:ROOT )?(%[\w.\-]+) = (\w+)\[", line):
            types[m.group(1)] = m.group(2)
        if m := re.match(r"^%?[\w.\-]+ \((.*)\) -> ", line):  # a computation's parameters
            for p in re.finditer(r"([\w.\-]+): (\w+)\[", m.group(1)):
                types["%" + p.group(1)] = p.group(2)
    widened = 0
    for line in hlo.splitlines():
        m = re.match(r"\s*(?:ROOT )?%[\w.\-]+ = (\w+)\[.*? convert\((%[\w.\-]+)\)", line)
        widened += bool(m and types.get(m.group(2)) == "f8e4m3fn" and m.group(1) != "f8e4m3fn")
    return widened


@pytest.mark.aot
@pytest.mark.skipif(not _HAVE_CUDA_PLUGIN, reason="needs the aot extra (pip install -e '.[aot]')")
@pytest.mark.skipif(os.environ.get("JAX_PLATFORMS") != "cpu",
                    reason="run with JAX_PLATFORMS=cpu (make test-aot)")
def test_fp8_moe_model_compiles_for_the_h100_without_dequantizing_a_weight():
    """The whole tiny Qwen3.5 MoE, compiled for the H100: the real FP8 forward widens no
    FP8 value (every quantized weight, experts included, meets FP8 activations in a GEMM);
    the simulated one widens each quantized parameter once (26 linears + 12 experts)."""
    from jax.sharding import SingleDeviceSharding

    from hldstudy.aot.targets import devices, parse_target

    model, quantized = _quantized("tiny-qwen-moe")
    n_params = len({Target.from_key(k).param_key for k in quantized})
    sharding = SingleDeviceSharding(devices(parse_target("h100"))[0])
    tokens = jax.ShapeDtypeStruct((2, 64), jnp.int32, sharding=sharding)
    for real in (True, False):
        graphdef, state = nnx.split(fp8_model(model, quantized, real=real))
        abstract = jax.tree.map(
            lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding), state)
        fn = jax.jit(lambda st, t, g=graphdef: nnx.merge(g, st)(t).logits)
        hlo = fn.trace(abstract, tokens).lower(lowering_platforms=("cuda",)).compile().as_text()
        gemms = [c.strip() for c in hlo.split("\n\n") if " dot(" in c]
        fp8_gemms = [c for c in gemms if c.splitlines()[0].count("f8e4m3fn[") >= 2]
        if real:
            assert _fp8_widenings(hlo) == 0 and fp8_gemms
            print(f"h100: {len(fp8_gemms)} FP8 GEMMs of {len(gemms)}")
        else:
            assert _fp8_widenings(hlo) == n_params == 38 and not fp8_gemms
