"""2:4 pruning of a whole decoder, block by block, on the pruned model's activations.

Design notes: `docs/compression.md`, under this file's name.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm.auto import tqdm

from hldstudy.compress import sparse
from hldstudy.compress.layout import LINEARS, Target, in_dim, targets
from hldstudy.errors import ConfigError
from hldstudy.model.moe import route

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


def check_prunable(model, m: int = 4, names: tuple[str, ...] = LINEARS) -> None:
    """One clear ConfigError when no target is named, or an input dimension is not a
    multiple of m."""
    tgts = targets(model, names)
    if not tgts:
        raise ConfigError("compress.targets", f"none of {','.join(names)} is a linear of this "
                          f"{model.cfg.family} model",
                          f"name some of {','.join(sorted({t.name for t in targets(model)}))}")
    seen = set()
    for t in tgts:
        if t.name not in seen:
            seen.add(t.name)
            sparse.check_groupable(in_dim(model, t), m, f"every block's {t.name!r} projection")


def _flat_tokens(a, mask):
    """[B*T, d] (or [B, T, d]) activations -> [n_valid, d] float64 rows of valid tokens."""
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


class _Tap:
    """Stands in for a weight during one eager forward: `x @ tap` records (key, x) and
    returns `x @ weight`; `astype` / `reshape` act on the weight, as the modules call them."""

    def __init__(self, w, key: str, log: list):
        self.w, self.key, self.log = w, key, log

    def astype(self, dtype):
        return _Tap(self.w.astype(dtype), self.key, self.log)

    def reshape(self, *shape):
        return _Tap(self.w.reshape(*shape), self.key, self.log)

    def __rmatmul__(self, x):
        self.log.append((self.key, x))
        return x @ self.w


class _TapSlot:
    """What `module.name[...]` reads during a tapped forward."""

    def __init__(self, tap: _Tap):
        self.tap = tap

    def __getitem__(self, index):
        return self.tap


def _tapped_inputs(block, x, pos, seg, keys: dict[str, tuple[str, str]]) -> list:
    """[(key, input [B*T, in])] in the order the block's forward multiplies them, for
    keys {key: (module attribute, parameter name)}; runs a copy of the block eagerly."""
    probe = nnx.clone(block)
    log: list = []
    for key, (mod_name, name) in keys.items():
        module = getattr(probe, mod_name)
        setattr(module, name, _TapSlot(_Tap(getattr(module, name)[...], key, log)))
    probe(x, pos, seg)
    return log


def _block_out(out):
    return out[0] if isinstance(out, tuple) else out


def prune_model(model, method: str, batches: list[dict] | None = None, *, n: int = 2,
                m: int = 4, names: tuple[str, ...] = LINEARS, blocksize: int = 128,
                percdamp: float = 0.01, progress: bool = True,
                max_layers: int | None = None, on_layer=None) -> dict[str, np.ndarray]:
    """Prunes `model` in place to N:M along the input dimension of every target linear.

    method: magnitude (no data), wanda or sparsegpt (need `batches`: dicts with
    tokens, positions, segment_ids, mask as the data pipeline yields them).
    Returns {target key: bool mask [in, out]}. `max_layers` stops after that many
    blocks (benchmarks); `on_layer(layer)` is called when a block is done.
    """
    check_prunable(model, m, names)
    masks: dict[str, np.ndarray] = {}
    tgts = targets(model, names)
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
    fwd = nnx.jit(lambda blk, x, p, seg: _block_out(blk(x, p, seg)))
    n_layers = model.cfg.n_layers if max_layers is None else max_layers
    bar = tqdm(total=n_layers, desc=f"prune {method}", unit="layer", disable=not progress,
               leave=False)
    for layer in range(n_layers):
        block = model.blocks[layer]
        mine = [t for t in tgts if t.layer == layer]
        pending = {t.key: t for t in mine if t.expert is None}
        experts = [t for t in mine if t.expert is not None]
        while pending or experts:
            keys = {k: (t.module, t.name) for k, t in pending.items()}
            if experts:  # the MoE input is what the router multiplies
                keys["router"] = (experts[0].module, "router")
            group: list[str] = []
            stats: dict[str, _Stats] = {}
            moe_in: list = []
            for i in range(len(batches)):
                log = _tapped_inputs(block, xs[i], pos[i], segs[i], keys)
                first = log[0][1]
                here = [k for k, x in log if x is first]
                if i == 0:
                    group = here
                if "router" in group:
                    moe_in.append(first)
                rows = _flat_tokens(first, vmask[i])
                st = stats.setdefault("x", _Stats(rows.shape[1], full))
                st.add(rows)
            for k in group:
                if k != "router":
                    apply(pending.pop(k), stats["x"])
            if "router" in group:
                _prune_experts(block, experts, moe_in, vmask, apply, full)
                experts = []
        # the pruned block's output feeds the next block
        xs = [fwd(block, xs[i], pos[i], segs[i]) for i in range(len(batches))]
        bar.update(1)
        if on_layer is not None:
            on_layer(layer)
    bar.close()
    return masks


def _prune_experts(block, experts: list[Target], moe_in: list, vmask: list, apply,
                   full: bool) -> None:
    """Each expert's gate and up from the valid tokens routed to it, then its down from
    the pruned gate and up's product (see the module doc)."""
    moe = getattr(block, experts[0].module)
    dt = moe.compute_dtype
    routed = []  # per batch: (valid inputs [n, D], expert ids [n, k])
    for x, mask in zip(moe_in, vmask, strict=True):
        keep = np.asarray(mask).reshape(-1) > 0
        _, _, ids = route(x @ moe.router[...].astype(dt), moe.k)
        routed.append((np.asarray(x, np.float64)[keep], np.asarray(ids)[keep]))
    by_expert: dict[int, dict[str, Target]] = {}
    for t in experts:
        by_expert.setdefault(t.expert, {})[t.name] = t
    d_in = routed[0][0].shape[1]
    for e, mine in sorted(by_expert.items()):
        rows = [x[np.any(ids == e, axis=1)] for x, ids in routed]
        if {"gate", "up"} & set(mine):
            st = _Stats(d_in, full)
            for r in rows:
                st.add(r)
            for name in ("gate", "up"):
                if name in mine:
                    apply(mine[name], st)
        if "down" in mine:
            g, u = (np.asarray(getattr(moe, nm)[...][e], np.float64)
                    for nm in ("gate", "up"))
            st = _Stats(g.shape[1], full)
            for r in rows:
                st.add(np.asarray(jax.nn.silu(r @ g)) * (r @ u))
            apply(mine["down"], st)


def apply_masks(model, masks: dict[str, np.ndarray]) -> None:
    """Zeroes every masked weight (e.g. to re-impose masks on a loaded model)."""
    for key, mask in masks.items():
        t = Target.from_key(key)
        t.set2d(model, np.asarray(t.get2d(model)) * mask)


def masks_from_zeros(model, names: tuple[str, ...] = LINEARS) -> dict[str, np.ndarray]:
    """Masks implied by the zeros of a pruned model (how an export records them)."""
    return {t.key: np.asarray(t.get2d(model)) != 0 for t in targets(model, names)}


def sparsity_report(model, names: tuple[str, ...] = LINEARS) -> dict:
    """Zero fraction over the target matrices and whether each is 2:4."""
    zeros = total = 0
    nm_ok = True
    for t in targets(model, names):
        w = np.asarray(t.get2d(model))
        zeros += int((w == 0).sum())
        total += w.size
        nm_ok &= sparse.is_nm_sparse(w)
    return {"sparsity": zeros / max(total, 1), "is_2_4": bool(nm_ok)}
