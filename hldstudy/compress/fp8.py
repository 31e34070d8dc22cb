"""FP8 weight quantization (e4m3 / e5m2, scaled). Pure functions.

Design notes: `docs/compression.md`, under this file's name.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from hldstudy.chips import CHIPS
from hldstudy.errors import ConfigError


@dataclass(frozen=True)
class FP8Format:
    name: str
    dtype: object
    fmax: float
    mantissa_bits: int
    min_normal_exp: int


FORMATS = {
    "e4m3": FP8Format("e4m3", jnp.float8_e4m3fn, 448.0, 3, -6),
    "e5m2": FP8Format("e5m2", jnp.float8_e5m2, 57344.0, 2, -14),
}
GRANULARITIES = ("channel", "tensor")


def fp8_format(name: str) -> FP8Format:
    if name not in FORMATS:
        raise ConfigError("compress.fp8_format", f"{name!r} is not one of {', '.join(FORMATS)}")
    return FORMATS[name]


def fp8_scales(w, fmt: str = "e4m3", granularity: str = "channel") -> jax.Array:
    """float32 scales: [out] per output channel of w [in, out], or [] per tensor."""
    f = fp8_format(fmt)
    w = jnp.asarray(w, jnp.float32)
    if granularity == "channel":
        amax = jnp.max(jnp.abs(w), axis=0)
    elif granularity == "tensor":
        amax = jnp.max(jnp.abs(w))
    else:
        raise ConfigError("compress.fp8_granularity",
                          f"{granularity!r} is not one of {', '.join(GRANULARITIES)}")
    return jnp.where(amax > 0, amax / f.fmax, 1.0).astype(jnp.float32)


def quantize_fp8(w, fmt: str = "e4m3", granularity: str = "channel"):
    """(q [in, out] in the FP8 dtype, scale float32 [out] or []) with w ~= q * scale."""
    f = fp8_format(fmt)
    w = jnp.asarray(w, jnp.float32)
    scale = fp8_scales(w, fmt, granularity)
    scaled = jnp.clip(w / scale, -f.fmax, f.fmax)  # never round past fmax (e4m3fn has no inf)
    return scaled.astype(f.dtype), scale


def dequantize_fp8(q, scale) -> jax.Array:
    return q.astype(jnp.float32) * jnp.asarray(scale, jnp.float32)


def fake_quant(w, fmt: str = "e4m3", granularity: str = "channel") -> jax.Array:
    """w rounded onto its FP8 grid, in float32 (what the simulated forward sees)."""
    return dequantize_fp8(*quantize_fp8(w, fmt, granularity))


def error_bound(w, scale, fmt: str = "e4m3") -> np.ndarray:
    """Per-element bound on |w - dequantize(quantize(w))| (see the module docstring)."""
    f = fp8_format(fmt)
    w = np.abs(np.asarray(w, np.float64))
    s = np.asarray(scale, np.float64)
    rel = w * 2.0 ** -(f.mantissa_bits + 1)
    sub = s * 2.0 ** (f.min_normal_exp - f.mantissa_bits - 1)
    # + float32 rounding of w / s and of q * s
    return np.maximum(rel, sub) * (1 + 1e-6) + w * 2.0 ** -23


_TPU_KINDS = {"v4": "v4", "v5 lite": "v5e", "v5e": "v5e", "v5p": "v5p", "v5": "v5p",
              "v6 lite": "v6e", "v6e": "v6e"}


def chip_of(device) -> str | None:
    """The `hldstudy.chips` row name of a JAX device, or None for one not in the table."""
    kind = str(getattr(device, "device_kind", "")).lower()
    if device.platform == "gpu":
        return next((name for name, c in CHIPS.items()
                     if c.platform == "cuda" and name in kind.split()), None)
    if device.platform == "tpu":
        return next((name for k, name in _TPU_KINDS.items() if k in kind), None)
    return None


def backend_has_fp8_matmul() -> bool:
    """True where the first device has FP8 matrix units: its `hldstudy.chips` row's
    `fp8_matmul` (H100, H200); an NVIDIA GPU the table does not list by its compute
    capability (>= 8.9: Ada, Hopper, Blackwell)."""
    dev = jax.devices()[0]
    name = chip_of(dev)
    if name is not None:
        return CHIPS[name].fp8_matmul
    if dev.platform == "gpu":
        cc = getattr(dev, "compute_capability", None)
        try:
            return cc is not None and tuple(int(x) for x in str(cc).split(".")) >= (8, 9)
        except ValueError:
            return False
    return False


def quantize_activations(x, act_format: str = "e4m3"):
    """(x in the FP8 dtype, its float32 per-tensor scale): the activation side of the
    real FP8 matmuls (dynamic, per tensor: x's absmax mapped to the format's fmax)."""
    f = fp8_format(act_format)
    x = jnp.asarray(x, jnp.float32)
    amax = jnp.max(jnp.abs(x))
    x_scale = jnp.where(amax > 0, amax / f.fmax, 1.0)
    return jnp.clip(x / x_scale, -f.fmax, f.fmax).astype(f.dtype), x_scale


def fp8_dot(x, q, w_scale, *, real: bool | None = None, act_format: str = "e4m3"):
    """y = x @ (q * w_scale) for x [..., in], q [in, out] FP8, w_scale [out] or [].

    real=None picks the FP8 x FP8 path when the backend has FP8 matmuls; real=True
    forces it (XLA emulates it where there is no hardware: useful for tests),
    real=False dequantizes the weights and multiplies in float32 (the CPU simulation).
    The real path quantizes x per tensor to `act_format`, so it also carries the
    activation rounding error (W8A8); the simulated path is weight-only (W8A16/32).
    """
    if real is None:
        real = backend_has_fp8_matmul()
    if not real:
        return jnp.asarray(x, jnp.float32) @ dequantize_fp8(q, w_scale)
    xq, x_scale = quantize_activations(x, act_format)
    y = jax.lax.dot_general(xq, q, (((xq.ndim - 1,), (0,)), ((), ())),
                            preferred_element_type=jnp.float32)
    return y * x_scale * jnp.asarray(w_scale, jnp.float32)


def expert_scales(w_scale, n_experts: int) -> jax.Array:
    """Per-expert scales as [E, out] (per output channel) or [E, 1] (one per expert)."""
    return jnp.asarray(w_scale, jnp.float32).reshape(n_experts, -1)


def fp8_ragged_dot(x, q, w_scale, group_sizes, *, real: bool | None = None,
                   act_format: str = "e4m3"):
    """y [M, out] = each row of x [M, in] times its group's `q[e] * w_scale[e]`, rows
    grouped by expert in order (`group_sizes` [E] as `jax.lax.ragged_dot`), q [E, in, out]
    FP8, w_scale [E, out] (per expert and output channel) or [E] (per expert).

    `real` as in `fp8_dot`: the real path is `ragged_dot` with FP8 operands (x quantized
    per tensor) and float32 accumulation, then x's scale and each row's expert's scales;
    the simulated path dequantizes the weights and runs the float32 `ragged_dot`.
    """
    if real is None:
        real = backend_has_fp8_matmul()
    n_experts = q.shape[0]
    scales = expert_scales(w_scale, n_experts)
    if not real:
        return jax.lax.ragged_dot(jnp.asarray(x, jnp.float32),
                                  dequantize_fp8(q, scales[:, None, :]), group_sizes)
    xq, x_scale = quantize_activations(x, act_format)
    y = jax.lax.ragged_dot(xq, q, group_sizes, preferred_element_type=jnp.float32)
    # the expert of each row (rows past sum(group_sizes) are zero in y: any scale will do)
    row_expert = jnp.repeat(jnp.arange(n_experts), group_sizes, total_repeat_length=x.shape[0])
    return y * x_scale * jnp.take(scales, row_expert, axis=0)
