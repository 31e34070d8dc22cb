"""The fused-KD Pallas kernels lowered for devices this machine does not have.

`jax.jit(f).trace(*specs).lower(lowering_platforms=(p,))` runs the real Triton
(p = "cuda") and Mosaic (p = "tpu") lowerings on a CPU, in about a second per
case, and rejects what those reject (a Triton tile that is not a power of two,
a Mosaic block whose last dimension is not a multiple of 128) where interpret
mode would not. Small shapes; the compile tier (test_aot_kernels.py) compiles the
study's shapes for named chips.
"""

from __future__ import annotations

import json
import re

import jax
import jax.numpy as jnp
import pytest
from jax import export

from hldstudy import chips
from hldstudy.errors import ConfigError
from hldstudy.losses import fused, kernel_blocks, kernel_cases
from hldstudy.losses.kernel_blocks import KernelBlocks

PLATFORM = {"mosaic": "tpu", "triton": "cuda"}
SMALL = dict(d_s=64, d_t=128, vocab=1000, n_rows=256)  # V not a multiple of any block
DTYPES = (jnp.float32, jnp.bfloat16)
TRITON_CALL = "__gpu$xla.gpu.triton"


def _small_blocks(family: str, vmem_limit: int = 0) -> KernelBlocks:
    rows, cols = (128, 256) if family == "mosaic" else (32, 64)
    return KernelBlocks(family, rows, cols, vmem_limit_bytes=vmem_limit)


def _lower(fn, specs, platform: str):
    return jax.jit(fn).trace(*specs).lower(lowering_platforms=(platform,))


def _abstract_mesh(device_kind: str, platform: str, num_cores: int = 1):
    device = jax.sharding.AbstractDevice(device_kind=device_kind, num_cores=num_cores,
                                         platform=platform)
    return jax.sharding.use_abstract_mesh(
        jax.sharding.AbstractMesh((1,), ("x",), abstract_device=device))


KERNEL_VARIANTS = [(fam, kernel, dt) for fam, kernels in kernel_cases.KERNELS.items()
                   for kernel in kernels for dt in DTYPES]


@pytest.mark.parametrize("family,kernel,dtype", KERNEL_VARIANTS,
                         ids=[f"{f}-{k}-{jnp.dtype(d).name}" for f, k, d in KERNEL_VARIANTS])
def test_every_kernel_lowers_for_its_platform(family, kernel, dtype):
    fn, specs = kernel_cases.kernel_case(kernel, _small_blocks(family), dtype=dtype, **SMALL)
    text = _lower(fn, specs, PLATFORM[family]).as_text()
    target = "tpu_custom_call" if family == "mosaic" else TRITON_CALL
    assert target in text


@pytest.mark.parametrize("family", ["mosaic", "triton"])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("variant", ["forward_kl", "reverse_kl_softcap"])
def test_loss_forward_and_backward_lower(family, dtype, variant):
    divergence, softcap = ("forward_kl", None) if variant == "forward_kl" else ("reverse_kl", 30.0)
    fn, specs = kernel_cases.loss_case(family, dtype=dtype, row_block=_small_blocks(family).row_block,
                                       vocab_block=_small_blocks(family).vocab_block,
                                       divergence=divergence, softcap=softcap, **SMALL)
    text = _lower(fn, specs, PLATFORM[family]).as_text()
    # Forward: the stats kernel; backward: dh + dW (Mosaic) or the one grads kernel (Triton).
    names = re.findall(r"fused_kd_\w+_(?:mosaic|triton)", text)
    expected = {"mosaic": {"fused_kd_stats_mosaic", "fused_kd_dh_mosaic", "fused_kd_dw_mosaic"},
                "triton": {"fused_kd_stats_triton", "fused_kd_grads_triton"}}[family]
    assert expected <= set(names)


def test_triton_loss_exports_with_the_custom_call_check_disabled():
    fn, specs = kernel_cases.loss_case("triton", dtype=jnp.bfloat16, row_block=32, vocab_block=64,
                                       **SMALL)
    with pytest.raises(ValueError, match="custom call"):
        export.export(jax.jit(fn), platforms=("cuda",))(*specs)
    exp = export.export(jax.jit(fn), platforms=("cuda",), disabled_checks=[
        export.DisabledSafetyCheck.custom_call(TRITON_CALL)])(*specs)
    assert exp.platforms == ("cuda",) and TRITON_CALL in exp.mlir_module()


def test_a_mosaic_block_of_64_columns_fails_to_lower():
    # Mosaic's rule: a block's last dimension is a multiple of 128 (or the whole array).
    blocks = KernelBlocks("mosaic", 128, 64)
    fn, specs = kernel_cases.kernel_case("stats", blocks, dtype=jnp.float32, **SMALL)
    with pytest.raises(ValueError, match="divisible by 8 and 128"):
        _lower(fn, specs, "tpu")


def test_a_triton_tile_that_is_not_a_power_of_two_fails():
    blocks = KernelBlocks("triton", 48, 64)
    fn, specs = kernel_cases.kernel_case("stats", blocks, dtype=jnp.float32, d_s=64, d_t=128,
                                         vocab=1000, n_rows=96)
    with pytest.raises(ValueError, match="power of two"):
        _lower(fn, specs, "cuda")


def _custom_call_configs(text: str) -> list[dict]:
    """Backend configs of the Mosaic custom calls in MLIR text (\\XX-escaped JSON)."""
    raws = re.findall(r'@tpu_custom_call\(.*?backend_config = "(.*?)"[,}]', text)
    unescape = lambda raw: re.sub(r"\\([0-9A-Fa-f]{2})", lambda m: chr(int(m.group(1), 16)), raw)
    return [json.loads(unescape(raw)) for raw in raws]


def test_mosaic_kernels_carry_their_vmem_limit_and_cost():
    blocks = _small_blocks("mosaic", vmem_limit=48 << 20)
    fn, specs = kernel_cases.kernel_case("stats", blocks, dtype=jnp.float32, **SMALL)
    [config] = _custom_call_configs(_lower(fn, specs, "tpu").as_text())
    assert config["scoped_memory_configs"][0]["size"] == 48 << 20
    flops, transcendentals, moved = kernel_blocks.kernel_cost(
        "stats", "mosaic", SMALL["n_rows"], 1024, SMALL["d_s"], SMALL["d_t"], jnp.float32, 128, 256,
        softcap=False, temperature_is_one=False)
    assert config["custom_call_config"]["cost_estimate"] == {"flops": flops, "transcendentals": transcendentals,
                                       "bytes_accessed": moved, "remote_bytes_transferred": 0}
    # The matmuls dominate: 2 * T * V_padded * (d_s + d_t) of them.
    assert flops >= 2 * 256 * 1024 * (64 + 128)


def test_loss_traced_for_an_abstract_tpu_takes_that_chips_blocks_and_limit():
    chip = chips.chip("v5e")
    d, vocab = 2560, 262144
    with _abstract_mesh("TPU v5 lite", "tpu"):
        assert chips.traced_target() == ("tpu", chip)
        assert fused.resolve_backend("auto") == "pallas_mosaic"
        fn, specs = kernel_cases.loss_case("mosaic", d_s=d, d_t=d, vocab=vocab,
                                           dtype=jnp.float32, n_rows=512)
        text = _lower(fn, specs, "tpu").as_text()
    want = kernel_blocks.for_target(chip, d, vocab, jnp.float32)
    assert want.vmem_limit_bytes > chip.scoped_default_bytes
    configs = _custom_call_configs(text)
    assert len(configs) == 3  # stats, dh, dW
    assert {c["scoped_memory_configs"][0]["size"] for c in configs} == {want.vmem_limit_bytes}


def test_auto_backend_resolves_against_a_named_platform():
    assert fused.resolve_backend("auto", "tpu") == "pallas_mosaic"
    assert fused.resolve_backend("auto", "gpu") == "pallas_triton"
    assert fused.resolve_backend("auto", "cpu") == "xla"
    assert fused.resolve_backend("pallas", "tpu") == "pallas_mosaic"
    with _abstract_mesh("NVIDIA H100 80GB HBM3", "gpu"):
        assert chips.traced_target() == ("gpu", chips.chip("h100"))
        assert fused.resolve_backend("auto") == "pallas_triton"


def test_auto_takes_the_xla_path_where_no_mosaic_block_fits_and_pallas_mosaic_refuses():
    # float32 Gemma 2 heads (d 2304) on v4's 16 MiB of VMEM.
    specs = dict(d_s=2304, d_t=2304, vocab=4096, dtype=jnp.float32, n_rows=256)

    def loss(backend):
        return lambda h_s, w_s, h_t, w_t, y: fused.fused_kd_loss(h_s, w_s, h_t, w_t, y,
                                                                 backend=backend)[0]

    _, args = kernel_cases.loss_case("mosaic", **specs)
    with _abstract_mesh("TPU v4", "tpu"):
        text = _lower(loss("auto"), args, "tpu").as_text()
        assert "tpu_custom_call" not in text
        with pytest.raises(ConfigError, match="do not fit v4"):
            _lower(loss("pallas_mosaic"), args, "tpu")
