"""Every attention path lowered (forward and backward) for the platforms it runs on,
on this CPU: splash, chunked and dense for `tpu`, chunked and dense for `cuda`; and
splash's numerics against dense in Pallas interpret mode.

cuDNN's fused attention is not lowered here: its lowering asks the installed cuDNN
for its version and stops with "RuntimeError: cuDNN is not detected" on a host
without it. We leave that path to a lent GPU rather than install nvidia-cudnn-cu12
into the compile tier.
"""

from __future__ import annotations

import logging
import re

import jax
import jax.numpy as jnp
import pytest

from hldstudy.errors import ConfigError
from hldstudy.model import attention

B, T, N, K, H = 2, 256, 4, 2, 128  # GQA: 4 query heads over 2 KV heads


def _specs(dtype=jnp.bfloat16, t=T):
    sds = jax.ShapeDtypeStruct
    return (sds((B, t, N, H), dtype), sds((B, t, K, H), dtype), sds((B, t, K, H), dtype),
            sds((B, t), jnp.int32))


def _fwd_bwd(impl: str, window, softcap, segments: bool):
    def loss(q, k, v, seg):
        out = attention.attend(q, k, v, seg if segments else None, implementation=impl,
                               window=window, softcap=softcap)
        return jnp.sum(out.astype(jnp.float32))

    return jax.value_and_grad(loss, argnums=(0, 1, 2))


def _tpu_mesh(kind: str = "TPU v5 lite"):
    device = jax.sharding.AbstractDevice(device_kind=kind, num_cores=1, platform="tpu")
    return jax.sharding.use_abstract_mesh(
        jax.sharding.AbstractMesh((1,), ("x",), abstract_device=device))


CASES = [(None, None, False), (None, None, True), (64, None, True), (None, 30.0, True)]
IDS = ["causal", "causal-segments", "local-segments", "softcap-segments"]


@pytest.mark.parametrize("window,softcap,segments", CASES, ids=IDS)
@pytest.mark.parametrize("impl", ["splash", "chunked", "dense"])
def test_attention_lowers_for_tpu(impl, window, softcap, segments):
    with _tpu_mesh():
        lowered = jax.jit(_fwd_bwd(impl, window, softcap, segments)).trace(*_specs()).lower(
            lowering_platforms=("tpu",))
    text = lowered.as_text()
    if impl == "splash":  # forward, dq and dkv kernels
        assert text.count("tpu_custom_call") >= 3


@pytest.mark.parametrize("window,softcap,segments", CASES[1:3], ids=IDS[1:3])
@pytest.mark.parametrize("impl", ["chunked", "dense"])
def test_attention_lowers_for_cuda(impl, window, softcap, segments):
    jax.jit(_fwd_bwd(impl, window, softcap, segments)).trace(*_specs()).lower(
        lowering_platforms=("cuda",))


def test_auto_is_splash_on_a_tpu_and_chunked_with_a_notice_where_splash_cannot(caplog):
    kw = dict(dtype="bfloat16", softcap=None, head_dim=H)
    assert attention.resolve_implementation("auto", seq_len=4096, backend="tpu", **kw) == "splash"
    with _tpu_mesh():  # the backend traced for, not this host's
        assert attention.resolve_implementation("auto", seq_len=4096, **kw) == "splash"
    with caplog.at_level(logging.WARNING, logger="hldstudy.model"):
        assert attention.resolve_implementation("auto", seq_len=1000, backend="tpu", **kw) == "chunked"
    assert sum("splash needs T a multiple of 128" in r.message for r in caplog.records) == 1
    assert attention.resolve_implementation("auto", seq_len=4096, backend="gpu", **kw) == "cudnn"
    assert attention.resolve_implementation("auto", seq_len=4096, backend="cpu", **kw) == "chunked"


def test_splash_off_a_tpu_is_a_config_error_when_traced():
    with pytest.raises(ConfigError, match="splash needs a TPU"):
        attention.check_implementation("splash", dtype="bfloat16", softcap=None, head_dim=H,
                                       backend="cpu")
    # Built on this CPU host (as hldstudy.aot builds a TPU target's model): allowed ...
    attention.check_implementation("splash", dtype="bfloat16", softcap=None, head_dim=H)
    # ... but traced for this host's CPU: refused, naming the field.
    x = jnp.zeros((1, 128, 2, 128), jnp.float32)
    with pytest.raises(ConfigError, match="splash needs a TPU") as e:
        attention.attend(x, x, x, implementation="splash")
    assert e.value.field == "model.attention"


@pytest.mark.slow
@pytest.mark.parametrize("window,softcap", [(64, None), (None, 30.0)])
def test_splash_equals_dense_in_interpret_mode(window, softcap):
    keys = jax.random.split(jax.random.PRNGKey(0), 3)
    q, k, v = (jax.random.normal(key, (B, T, n, 64), jnp.float32)
               for key, n in zip(keys, (N, K, K), strict=True))
    seg = jnp.concatenate([jnp.zeros((B, 100), jnp.int32), jnp.ones((B, T - 100), jnp.int32)], 1)

    def splash(q, k, v):
        return attention.splash_attention(q, k, v, seg, window=window, softcap=softcap,
                                          interpret=True)

    def dense(q, k, v):
        return attention.dense_attention(q, k, v, seg, window=window, softcap=softcap)

    assert jnp.max(jnp.abs(splash(q, k, v) - dense(q, k, v))) < 1e-5
    # A loss that weights outputs unevenly, so every gradient path is exercised.
    grad = lambda f: jax.grad(lambda *a: jnp.sum(jnp.cos(f(*a))), argnums=(0, 1, 2))(q, k, v)
    for got, want in zip(grad(splash), grad(dense), strict=True):
        assert jnp.max(jnp.abs(got - want)) < 1e-4


def _batch_mesh():
    """A 2 x 2 TPU mesh over the batch axes the trainer uses (data, fsdp)."""
    device = jax.sharding.AbstractDevice(device_kind="TPU v5 lite", num_cores=1, platform="tpu")
    return jax.sharding.AbstractMesh((2, 2), ("data", "fsdp"), abstract_device=device)


def test_splash_runs_per_batch_shard_over_a_mesh():
    """Mosaic kernels are not partitioned by XLA ("cannot be automatically partitioned":
    the 8-chip train step did not compile): over a mesh whose batch axes split the batch,
    splash runs under a shard_map, each device on its own sequences."""
    b = 8
    specs = (jax.ShapeDtypeStruct((b, T, N, H), jnp.bfloat16),
             *(jax.ShapeDtypeStruct((b, T, K, H), jnp.bfloat16),) * 2,
             jax.ShapeDtypeStruct((b, T), jnp.int32))
    with jax.sharding.use_abstract_mesh(_batch_mesh()):
        text = jax.jit(_fwd_bwd("splash", None, None, True)).trace(*specs).lower(
            lowering_platforms=("tpu",)).as_text()
    assert text.count("tpu_custom_call") >= 3
    assert "manual_computation" in text or "shard_map" in text
    # Each kernel call sees a quarter of the sequences, heads major: [N, T, H] per sequence
    # under a vmap over b / 4 = 2 of them.
    assert re.search(rf"tensor<{b // 4}x{N}x{T}x{H}xbf16>", text)


def test_splash_over_a_mesh_needs_the_batch_to_split():
    specs = [jax.ShapeDtypeStruct(shape, jnp.bfloat16)
             for shape in ((2, T, N, H), (2, T, K, H), (2, T, K, H))]
    with jax.sharding.use_abstract_mesh(_batch_mesh()), pytest.raises(ConfigError) as e:
        jax.jit(lambda q, k, v: attention.attend(q, k, v, implementation="splash")).trace(
            *specs)
    assert e.value.field == "model.attention" and "do not split over the 4" in str(e.value)


@pytest.mark.slow
def test_splash_per_batch_shard_equals_dense_on_four_devices():
    """Interpret mode on conftest's 4 CPU devices, batch split over a 2 x 2 mesh: the same
    outputs and gradients as dense attention on one device."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    b = 4
    keys = jax.random.split(jax.random.PRNGKey(1), 3)
    q, k, v = (jax.random.normal(key, (b, T, n, 64), jnp.float32)
               for key, n in zip(keys, (N, K, K), strict=True))
    seg = jnp.concatenate([jnp.zeros((b, 100), jnp.int32), jnp.ones((b, T - 100), jnp.int32)], 1)
    mesh = jax.make_mesh((2, 2), ("data", "fsdp"), devices=jax.devices()[:4],
                         axis_types=(jax.sharding.AxisType.Auto,) * 2)
    rows = NamedSharding(mesh, P(("data", "fsdp")))
    placed = [jax.device_put(x, rows) for x in (q, k, v, seg)]

    def loss(f):
        return lambda q, k, v, s: jnp.sum(jnp.cos(f(q, k, v, s)))

    def splash(q, k, v, s):
        return attention.splash_attention(q, k, v, s, window=64, interpret=True)

    def dense(q, k, v, s):
        return attention.dense_attention(q, k, v, s, window=64)

    with jax.set_mesh(mesh):
        got = jax.jit(jax.value_and_grad(loss(splash), argnums=(0, 1, 2)))(*placed)
    want = jax.jit(jax.value_and_grad(loss(dense), argnums=(0, 1, 2)))(q, k, v, seg)
    assert float(got[0]) == pytest.approx(float(want[0]), rel=1e-5)  # a sum of 262,144
    for g, w in zip(got[1], want[1], strict=True):
        assert jnp.max(jnp.abs(g - w)) < 1e-4
