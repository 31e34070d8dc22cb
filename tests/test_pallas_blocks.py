"""kernel_blocks: the fused-KD kernels' blocks and limits per chip (pure functions)."""

from __future__ import annotations

import jax.numpy as jnp
import pytest

from hldstudy import chips
from hldstudy.losses import kernel_blocks
from hldstudy.losses.kernel_blocks import KernelBlocks

STUDY = [(d, v, dt) for d in (640, 1152, 2304, 2560) for v in (32768, 128256, 256000, 262144)
         for dt in ("float32", "bfloat16")]


@pytest.mark.parametrize("name", ["v4", "v5e", "v5p", "v6e"])
def test_mosaic_blocks_fit_the_chips_budget_and_set_its_limit(name):
    chip = chips.chip(name)
    for d, vocab, dtype in STUDY:
        if name == "v4" and dtype == "float32" and d >= 2304:
            with pytest.raises(kernel_blocks.BlocksDoNotFit, match="bfloat16 heads"):
                kernel_blocks.for_target(chip, d, vocab, jnp.dtype(dtype))
            continue
        kb = kernel_blocks.for_target(chip, d, vocab, jnp.dtype(dtype))
        assert kb.family == "mosaic" and kb.chip == name
        assert kb.vocab_block % 128 == 0 and kb.row_block % 16 == 0
        assert kb.vmem_limit_bytes == kernel_blocks.mosaic_budget(chip) <= chip.onchip_bytes
        assert kernel_blocks.mosaic_peak_bytes(kb.row_block, kb.vocab_block, d, d, dtype) \
            <= kb.vmem_limit_bytes


def test_the_default_256_by_512_float32_blocks_exceed_the_scoped_default_that_the_limit_lifts():
    v5e = chips.chip("v5e")
    need = kernel_blocks.mosaic_peak_bytes(256, 512, 640, 640, "float32")
    assert need > v5e.scoped_default_bytes  # libtpu: 17.88M of 16.00M (issue 18)
    kb = kernel_blocks.for_target(v5e, 640, 32768, jnp.float32)
    assert (kb.row_block, kb.vocab_block) == (256, 512) and kb.vmem_limit_bytes >= need


def test_v4_takes_smaller_blocks_than_v5e_for_the_gemma_head():
    v4 = kernel_blocks.for_target(chips.chip("v4"), 2560, 262144, jnp.bfloat16)
    v5e = kernel_blocks.for_target(chips.chip("v5e"), 2560, 262144, jnp.bfloat16)
    assert v4.row_block * v4.vocab_block < v5e.row_block * v5e.vocab_block
    # The teacher's d counts too: the 640/2560 pair takes less than 2560/2560 would allow.
    pair = kernel_blocks.for_target(chips.chip("v4"), 640, 32768, jnp.bfloat16, d_teacher=2560)
    alone = kernel_blocks.for_target(chips.chip("v4"), 640, 32768, jnp.bfloat16)
    assert pair.row_block * pair.vocab_block <= alone.row_block * alone.vocab_block


@pytest.mark.parametrize("name", ["h100", "a100", "h200"])
def test_triton_tiles_are_powers_of_two_within_shared_memory(name):
    chip = chips.chip(name)
    for d, vocab, dtype in STUDY:
        kb = kernel_blocks.for_target(chip, d, vocab, jnp.dtype(dtype))
        assert kb.family == "triton" and kb.vmem_limit_bytes == 0
        for size in (kb.row_block, kb.vocab_block):
            assert size >= 16 and size & (size - 1) == 0
        assert kernel_blocks.triton_smem_bytes(kb.row_block, kb.vocab_block, d, dtype) \
            <= chip.onchip_bytes
    # The tile issue 18 tried: 655,360 bytes requested vs 232,448 on an H100.
    assert kernel_blocks.triton_smem_bytes(512, 2048, 640, "bfloat16") > chips.chip("h100").onchip_bytes


def test_no_known_chip_sizes_for_the_smallest_vmem_and_sets_no_limit():
    kb = kernel_blocks.for_target(None, 2560, 262144, jnp.float32)
    assert kb.vmem_limit_bytes == 0 and kb.chip == ""
    assert kernel_blocks.mosaic_peak_bytes(kb.row_block, kb.vocab_block, 2560, 2560,
                                           "float32") <= 16 << 20
    assert kernel_blocks.for_target(None, 640, 1000, jnp.float32, family="triton").family == "triton"


def test_blocks_never_outgrow_a_small_vocabulary():
    kb = kernel_blocks.for_target(chips.chip("v5e"), 64, 200, jnp.float32)
    assert kb.vocab_block == 256  # 200 rounded up to whole 128-lane tiles


def test_kernel_blocks_validate_their_fields():
    with pytest.raises(ValueError, match="family"):
        KernelBlocks("cuda", 64, 128)
    with pytest.raises(ValueError, match="row_block"):
        KernelBlocks("mosaic", 0, 128)
    with pytest.raises(ValueError, match="vmem_limit_bytes"):
        KernelBlocks("mosaic", 128, 128, vmem_limit_bytes=-1)


def test_device_kinds_map_to_chips():
    assert chips.for_device_kind("TPU v5 lite") is chips.chip("v5e")
    assert chips.for_device_kind("TPU v4") is chips.chip("v4")
    assert chips.for_device_kind("TPU v6 lite") is chips.chip("v6e")
    assert chips.for_device_kind("NVIDIA H100 80GB HBM3") is chips.chip("h100")
    assert chips.for_device_kind("NVIDIA A100-SXM4-40GB") is chips.chip("a100")
    assert chips.for_device_kind("cpu") is None
    assert chips.traced_target() == ("cpu", None)  # this host, no abstract mesh


def test_kernel_cost_counts_the_matmuls_and_the_streamed_heads():
    t, v, d_s, d_t = 1024, 4096, 640, 2560
    flops, exps, moved = kernel_blocks.kernel_cost("stats", "mosaic", t, v, d_s, d_t, "bfloat16",
                                                   256, 512, softcap=False,
                                                   temperature_is_one=False)
    assert 2 * t * v * (d_s + d_t) < flops < 1.01 * 2 * t * v * (d_s + d_t)
    assert exps >= 3 * t * v
    # Mosaic's stats grid streams both heads once per row block (4 of them).
    assert moved >= 4 * (d_s + d_t) * v * 2
    dh = kernel_blocks.kernel_cost("dh", "mosaic", t, v, d_s, d_t, "bfloat16", 256, 512,
                                   softcap=True, temperature_is_one=True)
    assert dh[0] > flops and dh[1] == 2 * t * v + 2 * t * v  # two softmaxes + the tanh
