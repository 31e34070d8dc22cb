"""Compile tier (`make test-aot`): the fused-KD kernels and splash attention compiled
by the targets' own compilers on this CPU (libtpu for TPU v5e / v4 / v6e, the JAX
CUDA plugin for the H100), on-chip memory limits included.

Needs the `aot` extra (pip install -e '.[dev,aot]') and JAX_PLATFORMS=cpu; tens of
compiles of 5-60 s, so marked `aot` and `slow` (never in the default suite).
benchmarks/aot_kernels.py writes the same compiles as a table.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import SingleDeviceSharding

from hldstudy.aot import targets
from hldstudy.losses import kernel_blocks, kernel_cases
from hldstudy.losses.kernel_blocks import KernelBlocks

pytestmark = [pytest.mark.aot, pytest.mark.slow]
pytest.importorskip("libtpu", reason="the aot extra (libtpu) is not installed")
if os.environ.get("JAX_PLATFORMS") != "cpu":
    pytest.skip("the compile tier runs with JAX_PLATFORMS=cpu (make test-aot)",
                allow_module_level=True)

STUDY_DIMS = (640, 1152, 2304, 2560)
STUDY_VOCAB = 262144  # the largest; V changes only the grid's length, not a block
AUTO_TARGETS = ("v5e:2x2", "v4:2x2x1", "h100:1")


def _device(spec: str):
    return targets.devices(targets.parse_target(spec))[0]


def _compile(kernel, blocks, device, *, d, vocab=STUDY_VOCAB, dtype=jnp.float32, d_t=None):
    fn, specs = kernel_cases.kernel_case(kernel, blocks, d_s=d, d_t=d if d_t is None else d_t,
                                         vocab=vocab, dtype=dtype, n_rows=4 * blocks.row_block,
                                         sharding=SingleDeviceSharding(device))
    return kernel_cases.compile_case(fn, specs)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("spec", AUTO_TARGETS)
def test_every_block_auto_chooses_compiles_at_the_study_shapes(spec, dtype):
    target = targets.parse_target(spec)
    device = _device(spec)
    refused = []
    for d in STUDY_DIMS:
        try:
            blocks = kernel_blocks.for_target(target.chip, d, STUDY_VOCAB, jnp.dtype(dtype))
        except kernel_blocks.BlocksDoNotFit:
            continue  # auto takes the XLA path here (test_lowering_kernels.py)
        for kernel in kernel_cases.KERNELS[blocks.family]:
            ok, why, _ = _compile(kernel, blocks, device, d=d, dtype=jnp.dtype(dtype))
            if not ok:
                refused.append((d, kernel, blocks, why))
    assert not refused


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_study_pair_compiles_on_v4(dtype):
    # The 123M student (d 640) under the 3.4B teacher (d 2560), on the smallest VMEM.
    target = targets.parse_target("v4:2x2x1")
    blocks = kernel_blocks.for_target(target.chip, 640, 32768, jnp.dtype(dtype), d_teacher=2560)
    for kernel in kernel_cases.KERNELS["mosaic"]:
        ok, why, _ = _compile(kernel, blocks, _device("v4:2x2x1"), d=640, d_t=2560, vocab=32768,
                              dtype=jnp.dtype(dtype))
        assert ok, why


def test_a_512_by_2048_triton_tile_is_over_h100_shared_memory():
    blocks = KernelBlocks("triton", 512, 2048)
    ok, why, _ = _compile("stats", blocks, _device("h100:1"), d=640, vocab=32768,
                          dtype=jnp.bfloat16)
    assert not ok and "shared memory" in why.lower(), why
    chip = targets.parse_target("h100:1").chip
    assert kernel_blocks.triton_smem_bytes(512, 2048, 640, jnp.bfloat16) > chip.onchip_bytes


def test_the_compiler_default_limit_refuses_what_the_explicit_limit_compiles():
    # The failure: (256, 512) float32 blocks need more than v5e's 16 MiB default.
    device = _device("v5e:2x2")
    ok, why, _ = _compile("dh", KernelBlocks("mosaic", 256, 512), device, d=640, vocab=32768)
    assert not ok and "Scoped allocation" in why, why
    chip = targets.parse_target("v5e:2x2").chip
    blocks = kernel_blocks.for_target(chip, 640, 32768, jnp.float32)
    assert (blocks.row_block, blocks.vocab_block) == (256, 512)
    assert blocks.vmem_limit_bytes > chip.scoped_default_bytes
    ok, why, _ = _compile("dh", blocks, device, d=640, vocab=32768)
    assert ok, why


@pytest.mark.parametrize("kernel,rows,cols,d,dtype", [
    ("stats", 256, 512, 640, "float32"), ("dh", 256, 512, 640, "float32"),
    ("dw", 256, 512, 2304, "bfloat16"), ("dh", 128, 256, 2560, "float32")])
def test_the_vmem_model_is_above_what_libtpu_asks_for(kernel, rows, cols, d, dtype):
    # Under an 8 MiB limit the compiler refuses and names the kernel's whole allocation.
    device = _device("v5e:2x2")
    blocks = KernelBlocks("mosaic", rows, cols, vmem_limit_bytes=8 << 20)
    ok, why, _ = _compile(kernel, blocks, device, d=d, vocab=32768, dtype=jnp.dtype(dtype))
    assert not ok, "needs under 8 MiB: pick a larger case"
    size, unit = why.split("size ")[1].split(" ")[0][:-1], why.split("size ")[1].split(" ")[0][-1]
    asked = float(size) * {"K": 2**10, "M": 2**20, "G": 2**30}[unit]
    model = kernel_blocks.mosaic_vmem_bytes(kernel, rows, cols, d, d, dtype)
    assert asked <= model < 1.6 * asked


def _target_mesh(device):
    return jax.sharding.use_abstract_mesh(jax.sharding.Mesh(np.array([device]), ("x",)).abstract_mesh)


def test_the_fused_loss_traced_for_v5e_compiles_with_its_own_blocks_and_counts_its_flops():
    device = _device("v5e:2x2")
    t, d_s, d_t, vocab = 2048, 640, 2560, 262144
    with _target_mesh(device):
        fn, specs = kernel_cases.loss_case("mosaic", d_s=d_s, d_t=d_t, vocab=vocab,
                                           dtype=jnp.bfloat16, n_rows=t,
                                           sharding=SingleDeviceSharding(device))
        compiled = jax.jit(fn).trace(*specs).lower().compile()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    # The kernels' pl.CostEstimate: logits built 3 times (stats, dh, dW) over both heads,
    # plus G @ W^T and h^T @ G. Without it libtpu counts a kernel as almost nothing.
    matmuls = 3 * 2 * t * vocab * (d_s + d_t) + 2 * 2 * t * vocab * d_s
    assert matmuls <= cost["flops"] < 1.1 * matmuls


def test_splash_attention_compiles_for_v5e():
    from hldstudy.model import attention

    device = _device("v5e:2x2")
    s = SingleDeviceSharding(device)
    b, t, n, k, h = 2, 4096, 8, 2, 256
    specs = [jax.ShapeDtypeStruct(shape, jnp.bfloat16, sharding=s)
             for shape in ((b, t, n, h), (b, t, k, h), (b, t, k, h))]
    specs.append(jax.ShapeDtypeStruct((b, t), jnp.int32, sharding=s))

    def loss(q, kk, v, seg):
        out = attention.attend(q, kk, v, seg, implementation="auto", window=512)
        return jnp.sum(out.astype(jnp.float32))

    with _target_mesh(device):
        assert attention.resolve_implementation("auto", dtype="bfloat16", softcap=None,
                                                head_dim=h, seq_len=t) == "splash"
        ok, why, _ = kernel_cases.compile_case(jax.value_and_grad(loss, argnums=(0, 1, 2)), specs)
    assert ok, why
