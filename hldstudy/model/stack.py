"""Running a stack of blocks: unrolled (one traced copy per layer) or scanned
(`model.scan_layers`: each repeating group of layers traced once and run under
`jax.lax.scan`, so compile time and the backward's live buffers are bounded by one group),
with remat and its policy (`model.remat_policy`).

Design notes (the group found from the blocks' graphdefs, the unscanned tail, hidden
states as the ends of scanned ranges, parameters stacked for the step): `docs/model.md`,
under this file's name.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from hldstudy.config import REMAT_POLICIES
from hldstudy.shapes import scan_groups, scan_ranges

__all__ = ["REMAT_POLICIES", "remat_policy", "run_stack", "scan_groups"]

def remat_policy(name: str):
    """The `jax.checkpoint` policy of a `model.remat_policy` name (REMAT_POLICIES): what
    the backward keeps from a block's forward. nothing_saveable: only the block's inputs
    (None: nnx.remat's default, so today's runs are unchanged); dots_saveable: matmul
    outputs too (less recompute, more memory); offload_dots: matmul outputs without batch
    dimensions kept in pinned host memory (TPU and GPU targets)."""
    if name == "nothing_saveable":
        return None
    if name == "dots_saveable":
        return jax.checkpoint_policies.dots_saveable
    if name == "offload_dots":
        return jax.checkpoint_policies.offload_dot_with_no_batch_dims("device", "pinned_host")
    raise ValueError(f"unknown remat policy {name!r}; expected one of {REMAT_POLICIES}")


def _call_block(block, x, positions, segment_ids, remat: bool, policy):
    if not remat:
        return block(x, positions, segment_ids)
    return nnx.remat(lambda blk, x, p, s: blk(x, p, s), policy=policy)(
        block, x, positions, segment_ids)


def run_stack(blocks: Sequence[nnx.Module], x_BxTxD: jax.Array, positions_BxT, segment_ids_BxT,
              *, n_run: int, stops: Sequence[int], aux: dict | None, scan: bool, remat: bool,
              policy_name: str) -> tuple[jax.Array, dict | None, dict]:
    """Runs blocks [0, n_run). Returns (x after block n_run, the mean over the run blocks of
    what they report beside x (blocks that do: `aux` is its zeros; None for blocks that do
    not), {layer: x after that block} for each layer in `stops` within 1..n_run)."""
    policy = remat_policy(policy_name)
    with_aux = aux is not None
    hidden = {}

    def one(block, x, aux):
        out = _call_block(block, x, positions_BxT, segment_ids_BxT, remat, policy)
        if with_aux:
            out, layer_aux = out
            aux = jax.tree.map(lambda a, x: a + x / max(n_run, 1), aux, layer_aux)
        return out, aux

    graphdefs = [nnx.graphdef(b) for b in blocks[:n_run]] if scan else None
    for start, stop, period, n_groups in scan_ranges(graphdefs, n_run, stops):
        if n_groups:
            x_BxTxD, aux = _scan_groups(blocks, start, period, n_groups, x_BxTxD, aux, one)
            start += period * n_groups
        for i in range(start, stop):
            x_BxTxD, aux = one(blocks[i], x_BxTxD, aux)
        hidden[stop] = x_BxTxD
    return x_BxTxD, aux, {s: hidden[s] for s in stops if 0 < s <= n_run}


def _scan_groups(blocks, start, period, n_groups, x, aux, one):
    """Layers [start, start + period * n_groups) as n_groups trips of one traced group."""
    graphdefs, stacked = [], []
    for j in range(period):
        members = [blocks[start + g * period + j] for g in range(n_groups)]
        graphdefs.append(nnx.graphdef(members[0]))
        states = [nnx.state(b) for b in members]
        stacked.append(jax.tree.map(lambda *leaves: jnp.stack(leaves), *states))

    def group(carry, states):
        x, aux = carry
        for gd, state in zip(graphdefs, states, strict=True):
            x, aux = one(nnx.merge(gd, state), x, aux)
        return (x, aux), None

    aux_in = jnp.zeros((), jnp.float32) if aux is None else aux
    (x, aux_out), _ = jax.lax.scan(group, (x, aux_in), stacked)
    return x, (None if aux is None else aux_out)
