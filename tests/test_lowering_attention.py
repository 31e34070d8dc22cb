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
