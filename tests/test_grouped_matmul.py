"""The Hopper grouped matmul (hldstudy.model.grouped_matmul): JAX's Mosaic GPU kernels run
in GPU interpret mode on this CPU against `jax.lax.ragged_dot`, the VJP's wiring against
ragged_dot's own gradients, the compiled program for an H100 (three kernels an MoE layer,
their FLOPs counted), and the refusals."""

import importlib.util
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hldstudy.errors import ConfigError
from hldstudy.flops.hlo_count import hlo_flops
from hldstudy.model import grouped_matmul as gm

HAVE_CUDA_PLUGIN = (importlib.util.find_spec("jax_plugins") is not None
                    and importlib.util.find_spec("jax_plugins.xla_cuda12") is not None)
needs_plugin = pytest.mark.skipif(not HAVE_CUDA_PLUGIN,
                                  reason="Mosaic GPU needs the aot extra (jax-cuda12-plugin)")
cpu_host = pytest.mark.skipif(os.environ.get("JAX_PLATFORMS") != "cpu",
                              reason="compiles for a GPU from the CPU host (JAX_PLATFORMS=cpu)")

# Ragged groups: one empty, none a multiple of the kernels' 64-row blocks.
SIZES = (100, 0, 60, 96)
M, K, N = sum(SIZES), 64, 128


def _operands(seed=0):
    k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
    lhs = jax.random.normal(k1, (M, K), jnp.float32).astype(jnp.bfloat16)
    w = jax.random.normal(k2, (len(SIZES), K, N), jnp.float32).astype(jnp.bfloat16)
    d_out = jax.random.normal(k3, (M, N), jnp.float32).astype(jnp.bfloat16)
    return lhs, w, d_out, jnp.array(SIZES, jnp.int32)


def _reference_grads(lhs, w, sizes, d_out):
    f32 = jnp.float32
    _, vjp = jax.vjp(lambda a, b: jax.lax.ragged_dot(a, b, sizes), lhs.astype(f32), w.astype(f32))
    return vjp(d_out.astype(f32))


def _close(got, want, rel=2e-2):
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert np.abs(got - want).max() <= rel * np.abs(want).max(), (got, want)


@needs_plugin
def test_the_mosaic_gpu_kernel_in_interpret_mode_equals_ragged_dot():
    """The product JAX's Hopper kernel computes, run in GPU interpret mode, is
    `jax.lax.ragged_dot`'s (bf16 output rounding), an empty group and ragged edges
    included."""
    from jax._src.pallas.mosaic_gpu.interpret.params import force_gpu_interpret_mode

    lhs, w, _, sizes = _operands()
    with force_gpu_interpret_mode():
        got = np.asarray(gm._product(lhs, w, sizes))
    want = jax.lax.ragged_dot(lhs, w, sizes, preferred_element_type=jnp.float32)
    _close(got, want, rel=1e-2)


def _kernel_doubles(interpreted: bool):
    """(ragged_dot, transposed_ragged_dot) with the kernels' signatures. ragged_dot is the
    real kernel in interpret mode where it can run (the interpreter has no transposed
    shared-memory read, so transpose_rhs reads a transposed copy), else ragged_dot;
    transposed_ragged_dot (whose `layout_cast` the interpreter lacks) is its closed form."""
    from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu

    calls = []

    def ragged_dot(lhs, rhs, *, group_sizes, transpose_rhs=False, **blocks):
        calls.append(("ragged_dot", transpose_rhs, blocks))
        rhs = jnp.swapaxes(rhs, 1, 2) if transpose_rhs else rhs
        if interpreted:
            return ragged_dot_mgpu.ragged_dot(lhs, rhs, group_sizes=group_sizes, **blocks)
        return jax.lax.ragged_dot(lhs, rhs, group_sizes)

    def transposed_ragged_dot(lhs_KxM, rhs_KxN, *, group_sizes, **blocks):
        calls.append(("transposed_ragged_dot", False, blocks))
        group_of_row = jnp.repeat(jnp.arange(group_sizes.shape[0]), group_sizes,
                                  total_repeat_length=lhs_KxM.shape[0])
        onehot = jax.nn.one_hot(group_of_row, group_sizes.shape[0], dtype=jnp.float32)
        out = jnp.einsum("rg,rm,rn->gmn", onehot, lhs_KxM.astype(jnp.float32),
                         rhs_KxN.astype(jnp.float32))
        return out.astype(lhs_KxM.dtype)

    return (ragged_dot, transposed_ragged_dot), calls


@pytest.mark.parametrize("interpreted", [
    pytest.param(True, marks=needs_plugin), False])
def test_the_vjp_wires_the_kernels_to_ragged_dots_gradients(monkeypatch, interpreted):
    """hopper_ragged_dot's value and both gradients equal ragged_dot's: the rows' gradient
    by the product kernel reading the weights transposed, the weights' by the transposed
    kernel over the same groups."""
    kernels, calls = _kernel_doubles(interpreted)
    monkeypatch.setattr(gm, "_hopper_kernels", lambda: kernels)
    monkeypatch.setattr(gm, "_process_has_gpu", lambda: True)
    lhs, w, d_out, sizes = _operands(1)

    def run():
        out, vjp = jax.vjp(lambda a, b: gm.hopper_ragged_dot(a, b, sizes), lhs, w)
        return out, vjp(d_out)

    if interpreted:
        from jax._src.pallas.mosaic_gpu.interpret.params import force_gpu_interpret_mode

        with force_gpu_interpret_mode():
            out, (d_lhs, d_w) = run()
    else:
        out, (d_lhs, d_w) = run()
    want_lhs, want_w = _reference_grads(lhs, w, sizes, d_out)
    _close(out, jax.lax.ragged_dot(lhs.astype(jnp.float32), w.astype(jnp.float32), sizes))
    _close(d_lhs, want_lhs)
    _close(d_w, want_w)
    assert d_lhs.dtype == lhs.dtype and d_w.dtype == w.dtype
    assert [c[:2] for c in calls] == [("ragged_dot", False), ("ragged_dot", True),
                                      ("transposed_ragged_dot", False)]


def test_shapes_the_kernels_cannot_tile_are_refused_and_auto_takes_capacity():
    assert gm.hopper_unfit(2048, 512, jnp.bfloat16) is None
    assert "float32" in gm.hopper_unfit(2048, 512, jnp.float32)
    assert "multiple of 16" in gm.hopper_unfit(2048, 40, jnp.bfloat16)


def _h100_mesh(n: int):
    from jax.sharding import Mesh

    from hldstudy.aot.targets import devices, parse_target

    return Mesh(np.array(devices(parse_target(f"h100:{n}"))), ("data",))


def _moe(dtype="bfloat16", dispatch="auto", forward_only=True):
    from flax import nnx

    from hldstudy.model.moe import MoE
    from hldstudy.model.presets import preset

    cfg = preset("tiny-qwen-moe", dtype=dtype, param_dtype=dtype, d_model=128, d_expert=64,
                 moe_dispatch=dispatch, forward_only=forward_only)
    return cfg, MoE(cfg, nnx.Rngs(0))


def _compiled_forward(layer, mesh, batch: int, seq: int, d: int, grad: bool = False,
                      split: bool = True):
    from flax import nnx
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    graphdef, state = nnx.split(layer)

    def forward(state, x):
        out = nnx.merge(graphdef, state)(x)[0]
        return jnp.sum(out.astype(jnp.float32))

    fn = jax.grad(forward, argnums=1) if grad else forward
    rows = NamedSharding(mesh, P("data"))
    whole = NamedSharding(mesh, P())
    state_in = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=whole),
                            state)
    x = jax.ShapeDtypeStruct((batch, seq, d), jnp.bfloat16, sharding=rows if split else whole)
    with jax.set_mesh(mesh):
        return jax.jit(fn).lower(state_in, x).compile().as_text()


@needs_plugin
@cpu_host
def test_an_moe_layer_compiled_for_h100s_runs_three_kernels_per_shard_at_their_cost():
    """Auto dispatch of a forward (a teacher's) on an H100 is ragged through the Mosaic GPU
    kernel: three grouped matmuls (gate, up, down), each on its own device's rows (the batch split over 2 GPUs:
    routing stays on the shard), no dense pass over the experts, and the HLO count carries
    their declared FLOPs (2 x rows x d_in x d_out each)."""
    cfg, layer = _moe()
    b, t = 4, 128
    text = _compiled_forward(layer, _h100_mesh(2), b, t, cfg.d_model)
    kernels = [ln for ln in text.splitlines() if 'custom_call_target="mosaic_gpu_v2"' in ln]
    assert len(kernels) == 3, kernels
    local_rows = b // 2 * t * cfg.experts_per_token
    shapes = sorted(re.search(r"= bf16\[([\d,]+)\]", ln).group(1) for ln in kernels)
    assert shapes == sorted([f"{local_rows},{cfg.d_expert}"] * 2 + [f"{local_rows},{cfg.d_model}"])
    count = hlo_flops(text)
    assert not count.uncounted_kernels
    experts = 3 * 2 * local_rows * cfg.d_model * cfg.d_expert
    declared = sum(float(m) for m in re.findall(r"declared_flops_(\d+)", "\n".join(kernels)))
    assert declared == experts
    # No dense pass: the whole layer counts under 2x its routed experts (router, shared
    # expert: the rest), where ragged_dot run densely would be n_experts / k = 4x.
    assert count.flops < 2 * experts, (count.flops, experts)


@needs_plugin
@cpu_host
def test_training_through_the_kernels_from_a_host_without_a_gpu_says_what_to_do():
    """The weights' gradient kernel sizes its grid from the process's GPU: tracing an MoE's
    backward through it (ragged, set explicitly) for an H100 on this CPU host is one
    ConfigError naming the knob; auto for a trained MoE is capacity there and compiles;
    auto on an untileable float32 layer is capacity even for a forward."""
    cfg, layer = _moe(dispatch="ragged", forward_only=False)
    with pytest.raises(ConfigError, match=r"model\.moe_dispatch.*moe_dispatch=capacity"):
        _compiled_forward(layer, _h100_mesh(1), 2, 128, cfg.d_model, grad=True)
    cfg, layer = _moe(forward_only=False)
    text = _compiled_forward(layer, _h100_mesh(1), 2, 128, cfg.d_model, grad=True)
    assert "mosaic_gpu_v2" not in text and " dot(" in text
    cfg, layer = _moe(dtype="float32")
    text = _compiled_forward(layer, _h100_mesh(1), 2, 128, cfg.d_model)
    assert "mosaic_gpu_v2" not in text
    # The kernels run per batch shard: a batch the devices do not divide is refused.
    cfg, layer = _moe()
    with pytest.raises(ConfigError, match=r"3 sequences do not split over the 2 devices"):
        _compiled_forward(layer, _h100_mesh(2), 3, 128, cfg.d_model, split=False)


@pytest.mark.parametrize("backend,hopper,forward_only,auto,dense", [
    ("gpu", True, True, "ragged", False),     # a teacher's forward on H100 / H200: kernels
    ("gpu", True, False, "capacity", False),  # trained: the weight gradient needs the GPU
    ("gpu", False, True, "capacity", False),  # A100: XLA would expand ragged densely
    ("tpu", False, False, "ragged", False),   # libtpu's grouped matmul
    ("cpu", False, False, "ragged", True)])   # the reference, dense on XLA CPU
def test_auto_dispatch_is_ragged_where_a_grouped_matmul_runs_it(backend, hopper, forward_only,
                                                               auto, dense):
    from hldstudy.config import experts_run_dense, moe_dispatch_for

    assert moe_dispatch_for("auto", backend, hopper, forward_only) == auto
    assert experts_run_dense("auto", backend, hopper, forward_only) is dense
    for explicit in ("ragged", "capacity"):
        assert moe_dispatch_for(explicit, backend, hopper, forward_only) == explicit
    assert experts_run_dense("ragged", "gpu", hopper=False) and \
        not experts_run_dense("ragged", "gpu", hopper=True)


def test_a_teachers_forward_config_is_forward_only():
    from hldstudy.config import TeacherConfig
    from hldstudy.model.presets import preset
    from hldstudy.teacher.colocated import forward_config

    assert not preset("tiny-qwen-moe").forward_only
    assert forward_config(preset("tiny-qwen-moe"), TeacherConfig()).forward_only
