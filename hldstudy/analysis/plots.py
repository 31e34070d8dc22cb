"""Figures for the comparison report (matplotlib, Agg backend, PNG files).

Each function takes the tables built by ``hldstudy.analysis.tables`` and a
path, writes one PNG, and returns the path (or None when there is nothing to
draw).
"""

from __future__ import annotations

import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

from hldstudy.analysis import stats  # noqa: E402
from hldstudy.analysis.tables import PPL_DELTA, _keystr_frame, grid_cols  # noqa: E402
from hldstudy.distill import methods  # noqa: E402

# One color per registered method, in registration order (baseline grey, kd blue,
# hldf red, hldc green, patient purple), so a method keeps its color in every plot.
_METHOD_PALETTE = ["#7f7f7f", "#1f77b4", "#d62728", "#2ca02c", "#9467bd"]
_EXTRA = ["#ff7f0e", "#8c564b", "#e377c2", "#17becf", "#bcbd22"]


def arm_colors(arms) -> dict:
    out, k = {}, 0
    for a in arms:
        base = str(a).split("[", 1)[0]
        names = methods.names()
        if base in names and names.index(base) < len(_METHOD_PALETTE) \
                and base not in {str(x).split("[", 1)[0] for x in out}:
            out[a] = _METHOD_PALETTE[names.index(base)]
        else:
            out[a] = _EXTRA[k % len(_EXTRA)]
            k += 1
    return out


def _save(fig, path: Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return path


def plot_ppl_vs_lr(df: pd.DataFrame, path: str | Path, title: str = "") -> Path | None:
    """Validation perplexity vs learning rate, one line per arm.

    The line is the median over the other hyperparameters (temperature, NLL
    weight, ...) of the seed-mean perplexity at each learning rate; the bars
    span min..max over those configs, the dotted line is the best config.
    """
    d = df[np.isfinite(df["valid_ppl"].astype(float))]
    if d.empty:
        return None
    others = [c for c in grid_cols(df) if c != "lr"]
    arms = sorted(d["arm"].dropna().unique(), key=lambda a: (a != methods.REFERENCE, str(a)))
    colors = arm_colors(arms)
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    n = len(arms)
    for i, arm in enumerate(arms):
        sub = d[d["arm"] == arm].copy()
        sub["_cfg"] = _keystr_frame(sub, others)
        per_cfg = sub.groupby(["lr", "_cfg"])["valid_ppl"].mean().reset_index()
        g = per_cfg.groupby("lr")["valid_ppl"]
        lr = np.asarray(sorted(per_cfg["lr"].unique()), dtype=float)
        med, lo, hi = g.median().loc[lr], g.min().loc[lr], g.max().loc[lr]
        # small multiplicative jitter so overlapping bars stay visible on a log axis
        x = lr * (1.0 + 0.04 * (i - (n - 1) / 2))
        ax.errorbar(x, med, yerr=[med - lo, hi - med], marker="o", ms=5, capsize=3, lw=1.6,
                    color=colors[arm], label=f"{arm} ({sub['_cfg'].nunique()} cfg/lr)")
        ax.plot(x, lo, ls=":", lw=1, color=colors[arm])
    ax.set_xscale("log")
    ax.set_xlabel("learning rate")
    ax.set_ylabel("validation perplexity (lower is better)")
    ax.set_title(title or "Validation perplexity vs learning rate")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, title="median over other hparams\nbars: min–max, dotted: best",
              title_fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return _save(fig, path)


def plot_deltas(pairs: pd.DataFrame, summary: pd.DataFrame | None, path: str | Path,
                title: str = "", reference: str = methods.REFERENCE) -> Path | None:
    """Per-grid-point perplexity delta vs the reference (%), one row per arm, mean and CI.

    Each dot is one grid point (its seeds averaged), so the dots are exactly
    the units the sign test and the bootstrap CI use.
    """
    if pairs.empty or pairs[PPL_DELTA].notna().sum() == 0:
        return None
    gcols = list(pairs.attrs.get("grid_cols", []))
    arms = sorted(pairs["arm"].unique())
    colors = arm_colors([reference] + arms)
    fig, ax = plt.subplots(figsize=(7.5, 1.2 + 0.9 * len(arms)))
    rng = np.random.default_rng(0)
    for i, arm in enumerate(arms):
        sub = pairs[pairs["arm"] == arm]
        per_point = sub[PPL_DELTA].astype(float).groupby(_keystr_frame(sub, gcols)).mean()
        v = per_point.dropna().to_numpy()
        y = i + rng.uniform(-0.18, 0.18, size=v.size)
        ax.scatter(v, y, s=18, alpha=0.6, color=colors[arm], edgecolor="none",
                   label=None)
        if summary is not None and len(summary):
            row = summary[(summary["arm"] == arm) & (summary["metric"] == "valid_ppl (%)")]
            if len(row):
                r = row.iloc[0]
                lo = r["ci_lo"] if math.isfinite(r["ci_lo"]) else r["mean_delta"]
                hi = r["ci_hi"] if math.isfinite(r["ci_hi"]) else r["mean_delta"]
                ax.errorbar([r["mean_delta"]], [i + 0.35], xerr=[[r["mean_delta"] - lo],
                                                                 [hi - r["mean_delta"]]],
                            fmt="D", color="black", ms=5, capsize=4)
                ax.annotate(f"mean {r['mean_delta']:+.3f}%  [{lo:+.3f}, {hi:+.3f}]  "
                            f"sign p={r['sign_p']:.3g}  n={int(r['n_points'])}",
                            (r["mean_delta"], i + 0.35), xytext=(0, 6),
                            textcoords="offset points", fontsize=7, ha="center")
    ax.axvline(0, color="grey", lw=1, ls="--")
    ax.set_yticks(range(len(arms)))
    ax.set_yticklabels(arms)
    ax.set_ylim(-0.6, len(arms) - 0.2)
    ref = reference.upper() if reference == methods.REFERENCE else reference
    level = summary.attrs.get("level", 0.95) if summary is not None else 0.95
    ax.set_xlabel(f"validation perplexity vs {ref} at the same grid point (%)  "
                  f"← better than {ref}")
    ax.set_title(title or f"Point-by-point perplexity delta vs {ref} (dots: grid points, "
                 f"diamond: mean, {level:.0%} bootstrap CI)", fontsize=9)
    ax.grid(True, axis="x", alpha=0.3)
    return _save(fig, path)


def plot_downstream(best: pd.DataFrame, path: str | Path, title: str = "") -> Path | None:
    """Downstream scores of each arm's best config, ± the evaluation stderr."""
    metrics = list(best.attrs.get("metrics", []))
    metrics = [m for m in metrics if m in best and best[m].notna().any()]
    if best.empty or not metrics:
        return None
    arms = list(best["arm"])
    colors = arm_colors(arms)
    ncols = min(4, len(metrics))
    nrows = math.ceil(len(metrics) / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(3.2 * ncols, 2.9 * nrows), squeeze=False)
    for ax, m in zip(axes.ravel(), metrics, strict=False):
        y = best[m].astype(float).to_numpy()
        se = best.get(m + "_stderr", pd.Series([np.nan] * len(best))).astype(float).to_numpy()
        x = np.arange(len(arms))
        for xi, yi, si, arm in zip(x, y, se, arms, strict=False):
            ax.errorbar([xi], [yi], yerr=None if not np.isfinite(si) else [[si], [si]],
                        fmt="o", color=colors[arm], capsize=4, ms=6)
        ax.set_xticks(x)
        ax.set_xticklabels(arms, rotation=30, ha="right", fontsize=8)
        arrow = "↓" if stats.lower_is_better(m) else "↑"
        ax.set_title(f"{m} {arrow}", fontsize=9)
        ax.grid(True, axis="y", alpha=0.3)
        ax.tick_params(axis="y", labelsize=8)
    for ax in axes.ravel()[len(metrics):]:
        ax.axis("off")
    fig.suptitle(title or "Downstream scores at each arm's best config (±1 stderr)", fontsize=10)
    fig.tight_layout()
    return _save(fig, path)


def plot_paired_arms(seeds: pd.DataFrame, contrasts: pd.DataFrame, path: str | Path,
                     paper_gap_pct: float, title: str = "") -> Path | None:
    """Left: each arm's validation perplexity per seed (dots, one line per seed across the
    arms: the pairing) and its seed mean. Right: each contrast's paired gap in % with its
    95% t interval, against 0 and the paper's gap (`analysis.arms`' tables)."""
    if seeds.empty:
        return None
    arms = list(dict.fromkeys(seeds["arm"]))
    x = {a: i for i, a in enumerate(arms)}
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.2),
                                      gridspec_kw={"width_ratios": [1.2, 1]})
    for _, by_seed in seeds.groupby("seed"):
        by_seed = by_seed.set_index("arm").reindex(arms)
        left.plot(range(len(arms)), by_seed["valid_ppl"].astype(float), color="#cccccc",
                  lw=0.7, zorder=1)
    colors = arm_colors(arms)
    for a in arms:
        v = seeds.loc[seeds["arm"] == a, "valid_ppl"].astype(float)
        left.scatter([x[a]] * len(v), v, s=12, color=colors[a], zorder=2)
        left.hlines(v.mean(), x[a] - 0.3, x[a] + 0.3, color="black", lw=1.5, zorder=3)
    left.set_xticks(range(len(arms)), arms, rotation=30, ha="right")
    left.set_ylabel("validation perplexity")
    left.set_title("per seed (grey lines join one seed's arms)")
    c = contrasts[np.isfinite(contrasts["gap_pct"].astype(float))]
    labels = [f"{r.arm} vs {r.reference}" for r in c.itertuples()]
    y = np.arange(len(c))[::-1]
    right.errorbar(c["gap_pct"], y, xerr=[c["gap_pct"] - c["ci_lo"], c["ci_hi"] - c["gap_pct"]],
                   fmt="o", color="black", capsize=3)
    right.axvline(0, color="grey", lw=0.8)
    right.axvline(paper_gap_pct, color="#d62728", lw=0.8, ls="--", label="the paper's gap")
    right.set_yticks(y, labels)
    right.set_xlabel("perplexity gap, % (negative: the arm ahead; 95% t interval)")
    right.legend(loc="best", fontsize=8)
    if title:
        fig.suptitle(title, y=1.04)
    return _save(fig, Path(path))
