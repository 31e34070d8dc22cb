"""Mixture of experts (Qwen3.5-MoE): softmax router, top-k, grouped SwiGLU experts (dropless
`ragged_dot`, or capacity-padded batched matmuls: `model.moe_dispatch`), one sigmoid-gated
shared expert, and the router's load-balancing loss.

Design notes: `docs/model.md`, under this file's name.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from hldstudy.chips import traced_target
from hldstudy.config import ModelConfig, moe_dispatch_for
from hldstudy.errors import ConfigError
from hldstudy.mesh_axes import axes_size, shard_mapped, traced_batch_axes
from hldstudy.model.grouped_matmul import grouped_matmul, hopper_kernels_run, hopper_unfit
from hldstudy.model.layers import _init_normal
from hldstudy.sharding import expert_dim_metadata

__all__ = ["MoE", "capacity_swiglu", "expert_capacity", "expert_parallel_swiglu",
           "grouped_swiglu", "load_balancing_loss", "resolve_dispatch", "route"]


def route(logits_MxE: jax.Array, k: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(probs [M, E] float32, top-k weights [M, k] renormalised, expert ids [M, k])."""
    probs = jax.nn.softmax(logits_MxE.astype(jnp.float32), axis=-1)
    top_w, top_i = jax.lax.top_k(probs, k)
    return probs, top_w / jnp.sum(top_w, axis=-1, keepdims=True), top_i


def load_balancing_loss(probs_MxE: jax.Array, experts_MxK: jax.Array) -> jax.Array:
    """E * sum_e (share of assignments to e) * (mean probability of e); float32 scalar."""
    n_experts = probs_MxE.shape[-1]
    assigned = jax.nn.one_hot(experts_MxK, n_experts, dtype=jnp.float32)  # [M, k, E]
    share = jnp.mean(assigned, axis=0)  # [k, E]
    return n_experts * jnp.sum(share * jnp.mean(probs_MxE, axis=0)[None])


def _ragged_dot(rows_MxI, w_ExIxO, sizes_E) -> jax.Array:
    """The target's grouped matmul (`grouped_matmul`), or the weight's own where it brings
    one (an FP8-compressed model's experts: hldstudy.compress.fp8_forward.FP8Experts)."""
    own = getattr(w_ExIxO, "grouped_matmul", None)
    return grouped_matmul(rows_MxI, w_ExIxO, sizes_E) if own is None else own(rows_MxI, sizes_E)


def grouped_swiglu(x_MxD, experts_MxK, gate_ExDxF, up_ExDxF, down_ExFxD):
    """Each (token, slot) row through its expert's SwiGLU, dropless: [M, k, D]."""
    m, d = x_MxD.shape
    k = experts_MxK.shape[1]
    n_experts = gate_ExDxF.shape[0]
    flat = experts_MxK.reshape(-1)
    order = jnp.argsort(flat, stable=True)  # rows grouped by expert, token order within
    rows = jnp.take(x_MxD, order // k, axis=0)
    sizes = jnp.bincount(flat, length=n_experts).astype(jnp.int32)
    h = jax.nn.silu(_ragged_dot(rows, gate_ExDxF, sizes)) * _ragged_dot(rows, up_ExDxF, sizes)
    out_sorted = _ragged_dot(h, down_ExFxD, sizes)
    out = jnp.zeros_like(out_sorted).at[order].set(out_sorted, unique_indices=True)
    return out.reshape(m, k, d)


def expert_capacity(rows: int, n_experts: int, factor: float) -> int:
    """Rows each expert's buffer holds: factor x the even share of the routed rows, rounded
    up to a multiple of 8 (at most all of them)."""
    return min(rows, max(8, -(-math.ceil(factor * rows / n_experts) // 8) * 8))


def _capacity_layout(x_MxD, experts_MxK, n_experts: int, capacity: int):
    """The (token, slot) rows laid out [E, C, D] in token order within their expert, and
    what `_capacity_return` needs to bring each expert's output back: (rows, (order, slot,
    kept)). A row past its expert's capacity is left out (kept False)."""
    m, d = x_MxD.shape
    k = experts_MxK.shape[1]
    flat = experts_MxK.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    expert_of_row = flat[order]
    sizes = jnp.bincount(flat, length=n_experts)
    starts = jnp.cumsum(sizes) - sizes
    place = jnp.arange(m * k) - starts[expert_of_row]  # the row's place in its expert's rows
    kept = place < capacity
    slot = jnp.where(kept, expert_of_row * capacity + place, n_experts * capacity)  # past end
    rows = jnp.zeros((n_experts * capacity, d), x_MxD.dtype).at[slot].set(
        jnp.take(x_MxD, order // k, axis=0), mode="drop", unique_indices=True)
    return rows.reshape(n_experts, capacity, d), (order, slot, kept)


def _capacity_return(out_ExCxD, layout, k: int):
    """Each expert's output rows back to their (token, slot): ([M, k, D], [M] share of each
    token's k slots dropped)."""
    order, slot, kept = layout
    n_experts, capacity, d = out_ExCxD.shape
    out_rows = out_ExCxD.reshape(n_experts * capacity, d)
    out_sorted = jnp.where(kept[:, None], jnp.take(out_rows, slot, axis=0, mode="clip"), 0)
    out = jnp.zeros_like(out_sorted).at[order].set(out_sorted, unique_indices=True)
    dropped_MxK = jnp.zeros(order.shape, jnp.float32).at[order].set(
        1.0 - kept.astype(jnp.float32), unique_indices=True).reshape(-1, k)
    return out.reshape(-1, k, d), jnp.mean(dropped_MxK, axis=1)


def _expert_swiglu(rows_ExCxD, gate_ExDxF, up_ExDxF, down_ExFxD):
    """Every expert's SwiGLU over its buffer: three batched matmuls, [E, C, D]."""
    h = (jax.nn.silu(jnp.einsum("ecd,edf->ecf", rows_ExCxD, gate_ExDxF))
         * jnp.einsum("ecd,edf->ecf", rows_ExCxD, up_ExDxF))
    return jnp.einsum("ecf,efd->ecd", h, down_ExFxD)


def capacity_swiglu(x_MxD, experts_MxK, gate_ExDxF, up_ExDxF, down_ExFxD, capacity: int):
    """Each (token, slot) row through its expert's SwiGLU with a fixed buffer of `capacity`
    rows per expert: rows laid out [E, C, D] in token order within their expert, three
    batched matmuls, and back. A row past its expert's capacity is dropped (its slot
    contributes 0). Returns ([M, k, D], [M] share of each token's k slots dropped). With
    capacity >= every expert's rows it computes what `grouped_swiglu` does."""
    rows_ExCxD, layout = _capacity_layout(x_MxD, experts_MxK, gate_ExDxF.shape[0], capacity)
    out_ExCxD = _expert_swiglu(rows_ExCxD, gate_ExDxF, up_ExDxF, down_ExFxD)
    return _capacity_return(out_ExCxD, layout, experts_MxK.shape[1])


def expert_parallel_swiglu(x_BxTxD, experts_BxTxK, gate_ExDxF, up_ExDxF, down_ExFxD,
                           capacity: int, mesh, batch_axes: tuple[str, ...]):
    """`capacity_swiglu` per sequence with the experts split over the mesh's "expert" axis
    (expert parallelism): each device lays out its own sequences' rows [E, C, D] per
    sequence, an all-to-all over the expert axis sends each expert's buffers to the device
    that holds the expert, that device runs its E / n experts over the n devices' buffers,
    and a second all-to-all brings the outputs back. The same rows and drops as
    `capacity_swiglu` (each sequence's buffers are its own); no device holds another's
    experts. The batch is split over `batch_axes` (which include "expert")."""
    n_experts, k = gate_ExDxF.shape[0], experts_BxTxK.shape[-1]

    def per_device(x_BxTxD, experts_BxTxK, gate, up, down):
        layout_rows = jax.vmap(_capacity_layout, in_axes=(0, 0, None, None))
        rows_BxExCxD, layout = layout_rows(x_BxTxD, experts_BxTxK, n_experts, capacity)
        # [E, B, C, D] -> each device's E / n experts over every device's sequences.
        mine = jax.lax.all_to_all(rows_BxExCxD.transpose(1, 0, 2, 3), "expert",
                                  split_axis=0, concat_axis=1, tiled=True)
        e, nb, c, d = mine.shape  # every device's buffers of an expert as one buffer
        out = _expert_swiglu(mine.reshape(e, nb * c, d), gate, up, down).reshape(e, nb, c, d)
        back = jax.lax.all_to_all(out, "expert", split_axis=1, concat_axis=0, tiled=True)
        return jax.vmap(_capacity_return, in_axes=(0, 0, None))(
            back.transpose(1, 0, 2, 3), layout, k)

    rows, experts = P(batch_axes), P("expert")
    return shard_mapped(per_device, mesh, (rows, rows, experts, experts, experts),
                        (rows, rows), x_BxTxD, experts_BxTxK, gate_ExDxF, up_ExDxF,
                        down_ExFxD)


def _expert_axis(n_experts: int, batch: int):
    """(mesh, batch axes) where the traced mesh splits the experts over an "expert" axis of
    more than one device that divides them and the batch; (None, ()) otherwise."""
    mesh, axes = traced_batch_axes()
    if "expert" not in axes or n_experts % mesh.shape["expert"] \
            or batch % axes_size(mesh, axes):
        return None, ()
    return mesh, axes


def _on_batch_shards(x):
    """`x` (batch leading) held split by the batch where the mesh traced under splits it:
    each device then runs its own sequences' expert buffers against gathered weights. Left
    to itself XLA may keep the weights sharded and gather every sequence's buffers instead
    (the 35B-A3B replica over 8 H100s: the [E, C, F] products of all 8 sequences on every
    device, 7.5 GiB)."""
    mesh, axes = traced_batch_axes()
    size = axes_size(mesh, axes)
    if size <= 1 or x.shape[0] % size:
        return x
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, P(axes)))


def resolve_dispatch(dispatch: str, d_model: int = 0, d_expert: int = 0,
                     dtype="bfloat16", forward_only: bool = False) -> str:
    """`model.moe_dispatch` for the chip being traced for (`chips.traced_target`;
    `config.moe_dispatch_for` says what auto means there). Auto on a Hopper GPU whose
    kernels cannot take these experts (`grouped_matmul.hopper_unfit`) is capacity."""
    backend = traced_target()[0]
    hopper = hopper_kernels_run()
    resolved = moe_dispatch_for(dispatch, backend, hopper, forward_only)
    if dispatch == "auto" and hopper and resolved == "ragged" and \
            hopper_unfit(d_model, d_expert, dtype):
        return "capacity"
    return resolved


def _per_batch_shard(fn, x_BxTxD, experts_BxTxK, weights, *, strict: bool):
    """`fn(x, experts, *weights)` on each device's own sequences where the traced mesh
    splits the batch, the experts' weights gathered whole (as FSDP gathers any layer's):
    routing, its sort and its grouped rows stay on the shard. Left to XLA's partitioner a
    global sort all-gathers every row's expert ids (the 35B-A3B replica over v5p:2x2x2:
    s32[8388608] per MoE layer, sorted on every device). A batch the devices do not divide
    runs as one program, or (`strict`: the Mosaic kernels, which XLA does not partition)
    is refused."""
    mesh, axes = traced_batch_axes()
    size = axes_size(mesh, axes)
    if size <= 1 or (x_BxTxD.shape[0] % size and not strict):
        return fn(x_BxTxD, experts_BxTxK, *weights)
    if x_BxTxD.shape[0] % size:
        raise ConfigError("model.moe_dispatch", f"ragged on a Hopper GPU runs per batch shard, "
                          f"and {x_BxTxD.shape[0]} sequences do not split over the {size} "
                          f"devices of mesh axes {axes}",
                          "use moe_dispatch=capacity, or a batch the devices divide")
    rows = P(axes)
    return shard_mapped(fn, mesh, (rows, rows) + (P(),) * len(weights), rows,
                        x_BxTxD, experts_BxTxK, *weights)


class MoE(nnx.Module):
    """Router `[D, E]`, experts `gate/up [E, D, F]`, `down [E, F, D]`, shared expert
    `shared_gate/shared_up [D, Fs]`, `shared_down [Fs, D]`, `shared_expert_gate [D, 1]`."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        d, e, f, fs = cfg.d_model, cfg.n_experts, cfg.d_expert, cfg.d_shared_expert
        pdt = jnp.dtype(cfg.param_dtype)
        self.router = nnx.Param(_init_normal(rngs, (d, e), d, pdt))
        # Dimension 0 indexes experts: split over the mesh's expert axis (hldstudy.sharding).
        experts = expert_dim_metadata(0)
        self.gate = nnx.Param(_init_normal(rngs, (e, d, f), d, pdt), **experts)
        self.up = nnx.Param(_init_normal(rngs, (e, d, f), d, pdt), **experts)
        self.down = nnx.Param(_init_normal(rngs, (e, f, d), f, pdt), **experts)
        if fs:
            self.shared_gate = nnx.Param(_init_normal(rngs, (d, fs), d, pdt))
            self.shared_up = nnx.Param(_init_normal(rngs, (d, fs), d, pdt))
            self.shared_down = nnx.Param(_init_normal(rngs, (fs, d), fs, pdt))
            self.shared_expert_gate = nnx.Param(_init_normal(rngs, (d, 1), d, pdt))
        self.has_shared = bool(fs)
        self.k = cfg.experts_per_token
        self.compute_dtype = jnp.dtype(cfg.dtype)
        self.dispatch, self.capacity_factor = cfg.moe_dispatch, cfg.moe_capacity_factor
        self.forward_only = cfg.forward_only

    def __call__(self, x_BxTxD) -> tuple[jax.Array, jax.Array, jax.Array]:
        """(output [B, T, D], this layer's load-balancing loss, [B] share of each row's
        routed slots dropped: 0 when dropless)."""
        dt = self.compute_dtype
        b, t, d = x_BxTxD.shape
        x_MxD = x_BxTxD.astype(dt).reshape(b * t, d)
        probs, weights, experts = route(x_MxD @ self.router[...].astype(dt), self.k)
        weights_in = (self.gate[...].astype(dt), self.up[...].astype(dt),
                      self.down[...].astype(dt))
        own_matmul = hasattr(weights_in[0], "grouped_matmul")  # FP8 experts: ragged only
        dispatch = resolve_dispatch(self.dispatch, d, self.gate.shape[2], dt, self.forward_only)
        if dispatch == "capacity" and not own_matmul:
            # Each sequence dispatched on its own (its buffers sized for its T x k rows):
            # routing stays where the sequence is when the batch is split over devices,
            # no sort or buffer spans the global batch.
            capacity = expert_capacity(t * self.k, self.gate.shape[0], self.capacity_factor)
            mesh, axes = _expert_axis(self.gate.shape[0], b)
            if mesh is not None:  # experts split over devices: all-to-all to their holders
                routed, dropped_BxT = expert_parallel_swiglu(
                    x_MxD.reshape(b, t, d), experts.reshape(b, t, -1), *weights_in,
                    capacity, mesh, axes)
            else:
                per_row = jax.vmap(capacity_swiglu, in_axes=(0, 0, None, None, None, None))
                routed, dropped_BxT = per_row(_on_batch_shards(x_MxD.reshape(b, t, d)),
                                              _on_batch_shards(experts.reshape(b, t, -1)),
                                              *weights_in, capacity)
                routed = _on_batch_shards(routed)
            routed = routed.reshape(b * t, self.k, d)
            dropped_B = jnp.mean(dropped_BxT, axis=1)
        else:  # ragged (dropless), per batch shard: the Mosaic kernels on Hopper, XLA's
            # ragged_dot elsewhere; FP8 experts bring their own grouped matmul
            def per_shard(x_BxTxD, experts_BxTxK, *weights):
                n = x_BxTxD.shape[0] * t
                return grouped_swiglu(x_BxTxD.reshape(n, d), experts_BxTxK.reshape(n, -1),
                                      *weights).reshape(-1, t, self.k, d)

            if own_matmul:
                routed = grouped_swiglu(x_MxD, experts, *weights_in)
            else:
                routed = _per_batch_shard(per_shard, x_MxD.reshape(b, t, d),
                                          experts.reshape(b, t, -1), weights_in,
                                          strict=hopper_kernels_run())
            routed = routed.reshape(b * t, self.k, d)
            dropped_B = jnp.zeros((b,), jnp.float32)
        out = jnp.sum(routed * weights.astype(dt)[..., None], axis=1)
        if self.has_shared:
            shared = (jax.nn.silu(x_MxD @ self.shared_gate[...].astype(dt))
                      * (x_MxD @ self.shared_up[...].astype(dt))) @ self.shared_down[...].astype(dt)
            out = out + jax.nn.sigmoid(x_MxD @ self.shared_expert_gate[...].astype(dt)) * shared
        return out.reshape(b, t, d), load_balancing_loss(probs, experts), dropped_B
