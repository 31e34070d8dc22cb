"""Expert parallelism (`moe.expert_parallel_swiglu`): with the experts split over the mesh's
"expert" axis, capacity dispatch sends each expert's buffers to the device holding it (an
all-to-all there and back) and computes what the one-device capacity path computes, drops
included. conftest's 4 CPU devices."""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from hldstudy.model import preset
from hldstudy.model.moe import MoE, capacity_swiglu, expert_capacity, expert_parallel_swiglu

B, T, D, F, E, K = 4, 32, 16, 8, 8, 2


def _mesh(fsdp: int, expert: int):
    return jax.make_mesh((1, fsdp, expert), ("data", "fsdp", "expert"),
                         devices=jax.devices()[:fsdp * expert],
                         axis_types=(jax.sharding.AxisType.Auto,) * 3)


def _inputs(seed: int = 0):
    keys = jax.random.split(jax.random.PRNGKey(seed), 5)
    x = jax.random.normal(keys[0], (B, T, D), jnp.float32)
    # Skewed routing (expert 0 favoured) so that a small capacity drops rows.
    logits = jax.random.normal(keys[1], (B, T, E)) + 2.0 * (jnp.arange(E) == 0)
    experts = jax.lax.top_k(logits, K)[1]
    gate = jax.random.normal(keys[2], (E, D, F)) / 4
    up = jax.random.normal(keys[3], (E, D, F)) / 4
    down = jax.random.normal(keys[4], (E, F, D)) / 3
    return x, experts, gate, up, down


@pytest.mark.parametrize("fsdp,expert", [(1, 4), (2, 2)])
@pytest.mark.parametrize("factor", [1.0, 8.0])  # with drops, and none
def test_expert_parallel_computes_the_capacity_path(fsdp, expert, factor):
    x, experts, gate, up, down = _inputs()
    capacity = expert_capacity(T * K, E, factor)
    one = jax.vmap(capacity_swiglu, in_axes=(0, 0, None, None, None, None))

    def loss(f):
        def run(x, gate, up, down):
            out, dropped = f(x, experts, gate, up, down)
            return jnp.sum(jnp.sin(out)), dropped
        return jax.value_and_grad(run, argnums=(0, 1, 2, 3), has_aux=True)

    (want, want_drop), want_g = jax.jit(loss(lambda *a: one(*a, capacity)))(x, gate, up, down)
    mesh = _mesh(fsdp, expert)
    axes = tuple(a for a in ("fsdp", "expert") if mesh.shape[a] > 1)
    rows, by_expert = NamedSharding(mesh, P(axes)), NamedSharding(mesh, P("expert"))
    placed = (jax.device_put(x, rows), jax.device_put(gate, by_expert),
              jax.device_put(up, by_expert), jax.device_put(down, by_expert))
    ep = jax.jit(loss(lambda *a: expert_parallel_swiglu(*a, capacity, mesh, axes)))
    with jax.set_mesh(mesh):
        (got, got_drop), got_g = ep(*placed)
        hlo = ep.lower(*placed).compile().as_text()
    assert "all-to-all" in hlo
    np.testing.assert_array_equal(np.asarray(got_drop), np.asarray(want_drop))
    if factor == 1.0:
        assert float(jnp.mean(want_drop)) > 0.05  # the skew drops rows: the same ones
    else:
        assert float(jnp.max(want_drop)) == 0.0
    assert float(got) == pytest.approx(float(want), rel=1e-5)
    for g, w in zip(got_g, want_g, strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-4, atol=1e-5)


def test_the_moe_layer_goes_expert_parallel_under_an_expert_axis():
    """The layer takes the all-to-all path only where the traced mesh splits the experts
    (train.mesh_expert > 1), with the one-device layer's output and drop rates."""
    cfg = dataclasses.replace(preset("tiny-qwen-moe"), moe_dispatch="capacity",
                              moe_capacity_factor=1.0)
    layer = MoE(cfg, nnx.Rngs(0))
    graphdef, params = nnx.split(layer)
    x = jax.random.normal(jax.random.PRNGKey(3), (B, T, cfg.d_model), jnp.float32)

    def run(params, x):
        out, aux, dropped = nnx.merge(graphdef, params)(x)
        return out, aux, dropped

    want = jax.jit(run)(params, x)
    mesh = _mesh(2, 2)
    rows = NamedSharding(mesh, P(("fsdp", "expert")))
    experts = {"gate", "up", "down"}
    placed = jax.tree_util.tree_map_with_path(
        lambda path, v: jax.device_put(v, NamedSharding(
            mesh, P("expert") if path[0].key in experts else P())), params)
    with jax.set_mesh(mesh):
        fn = jax.jit(run)
        got = fn(placed, jax.device_put(x, rows))
        assert "all-to-all" in fn.lower(placed, jax.device_put(x, rows)).compile().as_text()
    np.testing.assert_allclose(np.asarray(got[0]), np.asarray(want[0]), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(got[2]), np.asarray(want[2]))
    assert float(jnp.mean(want[2])) > 0.0  # capacity 1.0 drops some: the same ones
    # Without an expert axis (batch over fsdp only) the layer stays per batch shard.
    mesh = _mesh(4, 1)
    with jax.set_mesh(mesh):
        hlo = jax.jit(run).lower(params, x).compile().as_text()
    assert "all-to-all" not in hlo


def test_ragged_routes_each_batch_shard_on_its_own():
    """Ragged (dropless) dispatch runs per batch shard wherever the traced mesh splits the
    batch: each device sorts its own rows' expert ids (s32[B/4 T k], not the whole batch's
    all-gathered), and the layer's output and gradients are the one-device layer's."""
    cfg = dataclasses.replace(preset("tiny-qwen-moe"), moe_dispatch="ragged")
    graphdef, params = nnx.split(MoE(cfg, nnx.Rngs(0)))
    x = jax.random.normal(jax.random.PRNGKey(5), (B, T, cfg.d_model), jnp.float32)

    def loss(params, x):
        out, aux, _ = nnx.merge(graphdef, params)(x)
        return jnp.sum(jnp.sin(out)) + aux

    want, want_g = jax.jit(jax.value_and_grad(loss))(params, x)
    mesh = _mesh(4, 1)
    placed = jax.device_put(params, NamedSharding(mesh, P()))
    rows = jax.device_put(x, NamedSharding(mesh, P("fsdp")))
    fn = jax.jit(jax.value_and_grad(loss))
    with jax.set_mesh(mesh):
        got, got_g = fn(placed, rows)
        hlo = fn.lower(placed, rows).compile().as_text()
    sorts = re.findall(r"s32\[(\d+)\][^\n]*? sort\(", hlo)
    assert sorts and {int(n) for n in sorts} == {B // 4 * T * cfg.experts_per_token}, sorts
    assert float(got) == pytest.approx(float(want), rel=1e-5)
    for g, w in zip(jax.tree.leaves(got_g), jax.tree.leaves(want_g), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-4, atol=1e-5)
