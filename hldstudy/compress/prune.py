"""2:4 pruning of a whole decoder, block by block, on the pruned model's activations.

For block l (in order), with x the residual stream entering it computed by the
already-pruned blocks 0..l-1 on the calibration batches:

1. q, k, v from the attention input `pre_attn_norm(x)`;
2. o from the attention output before `o`, recomputed with the pruned q, k, v;
3. gate, up from `pre_mlp_norm(x + post_attn_norm(attn(x)))` with the pruned attention;
4. down from `gelu(x W_gate) * (x W_up)` with the pruned gate, up;

then x moves through the pruned block to the next one ("true sequential":
every linear sees inputs produced by pruned weights only). Inputs before `o`
and `down` are read by running the module with that projection replaced by
an identity, so the model's own forward code is reused unchanged. Tokens
outside the loss mask (padding) do not enter the Hessians or norms.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm.auto import tqdm

from hldstudy.compress import sparse
from hldstudy.compress.layout import LINEARS, Target, input_dims, targets
from hldstudy.errors import ConfigError

METHODS = ("magnitude", "wanda", "sparsegpt")


def parse_prune(spec: str) -> tuple[str, int, int]:
    """'sparsegpt-2:4' -> ('sparsegpt', 2, 4)."""
    try:
        method, nm = spec.rsplit("-", 1)
        n, m = (int(v) for v in nm.split(":"))
    except ValueError:
        raise ConfigError("compress.prune", f"{spec!r} is not METHOD-N:M",
                          f"e.g. sparsegpt-2:4; methods: {', '.join(METHODS)}") from None
    if method not in METHODS:
        raise ConfigError("compress.prune", f"unknown method {method!r}",
                          f"one of {', '.join(m + '-2:4' for m in METHODS)}")
    if not 0 < n < m:
        raise ConfigError("compress.prune", f"{n}:{m} needs 0 < N < M")
    return method, n, m


def check_prunable(cfg, m: int = 4, names: tuple[str, ...] = LINEARS) -> None:
    """One clear ConfigError when an input dimension is not a multiple of m."""
    dims = input_dims(cfg)
    for name in names:
        sparse.check_groupable(dims[name], m, f"every block's {name!r} projection")


def _flat_tokens(a, mask):
    """[B, T, d] activations -> [n_valid, d] float64 rows of valid tokens."""
    a = np.asarray(a, np.float64).reshape(-1, a.shape[-1])
    return a[np.asarray(mask).reshape(-1) > 0]


class _Stats:
    """Running H = 2 X^T X / n (SparseGPT) or sum of squares per channel (Wanda)."""

    def __init__(self, d: int, full: bool):
        self.full, self.n = full, 0
        self.acc = np.zeros((d, d) if full else (d,), np.float64)

    def add(self, rows: np.ndarray) -> None:
        self.n += rows.shape[0]
        self.acc += rows.T @ rows if self.full else np.sum(rows * rows, axis=0)

    def hessian(self) -> np.ndarray:
        return 2.0 * self.acc / max(self.n, 1)

    def norms(self) -> np.ndarray:
        return np.sqrt(self.acc)


def _identity_like(shape_in: tuple[int, ...], dtype) -> jax.Array:
    d = int(np.prod(shape_in))
    return jnp.eye(d, dtype=dtype).reshape(*shape_in, d)


def prune_model(model, method: str, batches: list[dict] | None = None, *, n: int = 2,
                m: int = 4, names: tuple[str, ...] = LINEARS, blocksize: int = 128,
                percdamp: float = 0.01, progress: bool = True,
                max_layers: int | None = None, on_layer=None) -> dict[str, np.ndarray]:
    """Prunes `model` in place to N:M along the input dimension of every block linear.

    method: magnitude (no data), wanda or sparsegpt (need `batches`: dicts with
    tokens, positions, segment_ids, mask as the data pipeline yields them).
    Returns {target key: bool mask [in, out]}. `max_layers` stops after that many
    blocks (benchmarks); `on_layer(layer)` is called when a block is done.
    """
    cfg = model.cfg
    check_prunable(cfg, m, names)
    masks: dict[str, np.ndarray] = {}
    tgts = targets(cfg.n_layers, names)
    if method == "magnitude":
        for t in tqdm(tgts, desc="prune magnitude", disable=not progress, leave=False):
            w = np.asarray(t.get2d(model))
            masks[t.key] = sparse.nm_mask(sparse.magnitude_scores(w), n, m)
            t.set2d(model, w * masks[t.key])
        return masks
    if method not in ("wanda", "sparsegpt"):
        raise ConfigError("compress.prune", f"unknown method {method!r}")
    if not batches:
        raise ConfigError("compress.calibration_batches",
                          f"{method} needs calibration data and none was given",
                          "set --calibration-batches N > 0 (and a readable data source)")
    full = method == "sparsegpt"

    def apply(t: Target, stats: _Stats) -> None:
        w = np.asarray(t.get2d(model))
        if full:
            w_new, mask = sparse.sparsegpt_prune(w, stats.hessian(), n=n, m=m,
                                                 blocksize=blocksize, percdamp=percdamp)
            w_new, mask = np.asarray(w_new), np.asarray(mask)
        else:
            mask = sparse.nm_mask(sparse.wanda_scores(w, stats.norms()), n, m)
            w_new = w * mask
        masks[t.key] = mask
        t.set2d(model, w_new)

    xs = [model.embed(jnp.asarray(b["tokens"])) for b in batches]
    pos = [jnp.asarray(b["positions"]) for b in batches]
    segs = [jnp.asarray(b["segment_ids"]) for b in batches]
    vmask = [np.asarray(b["mask"]) for b in batches]
    fwd = nnx.jit(lambda blk, x, p, seg: blk(x, p, seg))
    bar = tqdm(total=cfg.n_layers, desc=f"prune {method}", unit="layer", disable=not progress,
               leave=False)
    for layer in range(cfg.n_layers if max_layers is None else max_layers):
        block = model.blocks[layer]
        want = {nm_: Target(layer, nm_) for nm_ in names}

        def attn_in(i, block=block, xs=xs):
            return block.pre_attn_norm(xs[i])

        # 1. q, k, v
        if {"q", "k", "v"} & set(want):
            st = _Stats(cfg.d_model, full)
            for i in range(len(batches)):
                st.add(_flat_tokens(attn_in(i), vmask[i]))
            for nm_ in ("q", "k", "v"):
                if nm_ in want:
                    apply(want[nm_], st)
        # 2. o: attention output before o, with the pruned q, k, v
        if "o" in want:
            probe = nnx.clone(block.attn)
            o = probe.o[...]
            probe.o = nnx.Param(_identity_like(o.shape[:2], o.dtype))
            st = _Stats(cfg.n_heads * cfg.head_dim, full)
            for i in range(len(batches)):
                st.add(_flat_tokens(probe(attn_in(i), pos[i], segs[i], block.rope_base), vmask[i]))
            apply(want["o"], st)
        # 3. gate, up
        mids = [xs[i] + block.post_attn_norm(block.attn(attn_in(i), pos[i], segs[i],
                                                            block.rope_base))
                for i in range(len(batches))]
        if {"gate", "up"} & set(want):
            st = _Stats(cfg.d_model, full)
            for i in range(len(batches)):
                st.add(_flat_tokens(block.pre_mlp_norm(mids[i]), vmask[i]))
            for nm_ in ("gate", "up"):
                if nm_ in want:
                    apply(want[nm_], st)
        # 4. down: gelu(x W_gate) * (x W_up) with the pruned gate, up
        if "down" in want:
            probe = nnx.clone(block.mlp)
            probe.down = nnx.Param(jnp.eye(cfg.d_ff, dtype=probe.down[...].dtype))
            st = _Stats(cfg.d_ff, full)
            for i in range(len(batches)):
                st.add(_flat_tokens(probe(block.pre_mlp_norm(mids[i])), vmask[i]))
            apply(want["down"], st)
        # 5. the pruned block's output feeds the next block
        xs = [fwd(block, xs[i], pos[i], segs[i]) for i in range(len(batches))]
        bar.update(1)
        if on_layer is not None:
            on_layer(layer)
    bar.close()
    return masks


def apply_masks(model, masks: dict[str, np.ndarray]) -> None:
    """Zeroes every masked weight (e.g. to re-impose masks on a loaded model)."""
    for key, mask in masks.items():
        _, layer, _, name = key.split(".")
        t = Target(int(layer), name)
        t.set2d(model, np.asarray(t.get2d(model)) * mask)


def masks_from_zeros(model, names: tuple[str, ...] = LINEARS) -> dict[str, np.ndarray]:
    """Masks implied by the zeros of a pruned model (how an export records them)."""
    return {t.key: np.asarray(t.get2d(model)) != 0 for t in targets(model.cfg.n_layers, names)}


def sparsity_report(model, names: tuple[str, ...] = LINEARS) -> dict:
    """Zero fraction over the target matrices and whether each is 2:4."""
    zeros = total = 0
    nm_ok = True
    for t in targets(model.cfg.n_layers, names):
        w = np.asarray(t.get2d(model))
        zeros += int((w == 0).sum())
        total += w.size
        nm_ok &= sparse.is_nm_sparse(w)
    return {"sparsity": zeros / max(total, 1), "is_2_4": bool(nm_ok)}
