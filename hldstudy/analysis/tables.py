"""Comparison tables (pandas) and their markdown rendering.

Design notes: `docs/analysis.md`, under this file's name.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np
import pandas as pd

from hldstudy.analysis import intervals, stats
from hldstudy.distill import methods

PPL_DELTA = "valid_ppl_delta_pct"


# --------------------------------------------------------------------------- #
# Preparation
# --------------------------------------------------------------------------- #


def _keystr(row_vals) -> str:
    parts = []
    for v in row_vals:
        if v is None or (isinstance(v, float) and math.isnan(v)):
            parts.append("-")
        elif isinstance(v, float):
            parts.append(repr(v))
        else:
            parts.append(str(v))
    return "|".join(parts)


def grid_cols(df: pd.DataFrame) -> list[str]:
    return list(df.attrs.get("grid_cols", ["lr", "temperature", "alpha"]))


def metric_cols(df: pd.DataFrame) -> list[str]:
    cols = df.attrs.get("metric_cols")
    if cols is None:
        cols = sorted(c for c in df.columns if "/" in c and not c.endswith("_stderr"))
    return [c for c in cols if c in df.columns and df[c].notna().any()]


def finished(df: pd.DataFrame) -> pd.DataFrame:
    out = df[(df["status"] == "done") & np.isfinite(df["valid_ppl"].astype(float))].copy()
    out.attrs = dict(df.attrs)
    return out


def dedupe(df: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Keeps one run per (arm, grid point, seed): the first by run_id.

    Returns ``(kept, duplicates)``; duplicates are reported, never averaged
    in silently (two runs of the same arm at the same pair are usually a
    re-launch, and counting both would double-weight that point).
    """
    cols = ["arm"] + grid_cols(df) + ["seed"]
    key = df[cols].apply(lambda r: _keystr(r.values), axis=1) if len(df) else pd.Series(dtype=str)
    order = df.assign(_k=key).sort_values(["_k", "run_id"], kind="mergesort")
    dup = order.duplicated("_k", keep="first")
    kept = order[~dup].drop(columns="_k").sort_index()
    kept.attrs = dict(df.attrs)
    return kept, order[dup].drop(columns="_k")


def _pair_key(df: pd.DataFrame, with_seed: bool = True) -> pd.Series:
    cols = grid_cols(df) + (["seed"] if with_seed else [])
    if not len(df):
        return pd.Series(dtype=str)
    return df[cols].apply(lambda r: _keystr(r.values), axis=1)


# --------------------------------------------------------------------------- #
# (1) point by point
# --------------------------------------------------------------------------- #


def point_table(df: pd.DataFrame, reference: str = methods.REFERENCE) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Each non-reference distillation arm vs the reference at every shared (point, seed).

    Returns ``(pairs, unpaired)``. ``pairs`` has the grid columns, ``seed``,
    ``arm``, ``run_id``, ``ref_run_id``, ``valid_ppl``, ``ref_valid_ppl``,
    ``valid_ppl_delta_pct`` and ``d:<task/metric>`` (arm - reference) per
    downstream metric. ``unpaired`` lists arm runs without a reference run at
    their pair (left out of every paired statistic).
    """
    gcols = grid_cols(df)
    mcols = metric_cols(df)
    ref = df[df["arm"] == reference]
    ref = ref.assign(_k=_pair_key(ref)).set_index("_k")
    rows, unpaired = [], []
    arms = sorted(a for a in df["arm"].dropna().unique()
                  if a != reference and not str(a).startswith(methods.BASELINE))
    for arm in arms:
        sub = df[df["arm"] == arm]
        for k, rr in zip(_pair_key(sub), sub.to_dict("records"), strict=False):
            if k not in ref.index:
                unpaired.append({"arm": arm, "run_id": rr["run_id"],
                                 **{c: rr[c] for c in gcols}, "seed": rr["seed"]})
                continue
            b = ref.loc[k]
            out = {"arm": arm, **{c: rr[c] for c in gcols}, "seed": rr["seed"],
                   "run_id": rr["run_id"], "ref_run_id": b["run_id"],
                   "valid_ppl": rr["valid_ppl"], "ref_valid_ppl": b["valid_ppl"],
                   PPL_DELTA: stats.relative_delta_pct(rr["valid_ppl"], b["valid_ppl"])}
            for m in mcols:
                out[f"d:{m}"] = float(rr.get(m, np.nan)) - float(b.get(m, np.nan))
            rows.append(out)
    cols = ["arm"] + gcols + ["seed", "run_id", "ref_run_id", "valid_ppl", "ref_valid_ppl",
                              PPL_DELTA] + [f"d:{m}" for m in mcols]
    pairs = pd.DataFrame(rows, columns=cols)
    pairs.attrs = {"grid_cols": gcols, "metrics": mcols}
    return pairs, pd.DataFrame(unpaired, columns=["arm", "run_id"] + gcols + ["seed"])


# --------------------------------------------------------------------------- #
# (3) across the grid
# --------------------------------------------------------------------------- #


def delta_columns(pairs: pd.DataFrame) -> list[tuple[str, str]]:
    """(column in pairs, metric name) for perplexity and every downstream metric."""
    out = [(PPL_DELTA, "valid_ppl (%)")]
    out += [(c, c[2:]) for c in pairs.columns if c.startswith("d:")]
    return out


def grid_summary(pairs: pd.DataFrame, *, n_resamples: int = 10_000, level: float = 0.95,
                 seed: int = 0) -> pd.DataFrame:
    """Mean delta vs the reference across the grid, per arm and metric.

    Per-seed deltas of one grid point are averaged first; the grid points are
    the paired units for the Student-t interval of the mean (``level``; the
    percentile bootstrap undercovers at these sizes: benchmarks/
    interval_calibration.py), the exact sign test and the Wilcoxon test. An arm
    that shares a single grid point with the reference is read seed by seed
    instead (``unit``). ``n_resamples`` and ``seed`` are kept for callers.
    ``sign_p_holm`` is Holm-adjusted across the metrics of one arm.
    ``seed_std`` is the pooled std of the delta across seeds at a point (the
    noise of a single paired comparison), NaN with one seed per point.
    ``n_better`` counts points where the arm beats the reference in the
    metric's own direction.
    """
    gcols = list(pairs.attrs.get("grid_cols", []))
    rows = []
    for arm in sorted(pairs["arm"].unique()):
        sub = pairs[pairs["arm"] == arm]
        key = _keystr_frame(sub, gcols)
        arm_rows = []
        for col, name in delta_columns(pairs):
            vals = sub[col].astype(float)
            ok = np.isfinite(vals.to_numpy())
            if not ok.any():
                continue
            g = vals[ok].groupby(key[ok])
            per_point = g.mean()
            counts = g.count()
            stds = g.std(ddof=1)
            # The unit: the grid point (its seeds averaged), or the seed when the arm
            # shares one point with the reference (single configurations, many seeds).
            by_seed = per_point.size == 1 and int(ok.sum()) >= 2
            d = vals[ok].to_numpy() if by_seed else per_point.to_numpy()
            ci = intervals.t_interval(d, level=level)
            st = stats.sign_test(d)
            lower = col == PPL_DELTA or stats.lower_is_better(name)
            arm_rows.append({
                "arm": arm, "metric": name, "better": "lower" if lower else "higher",
                "n_points": int(per_point.size), "n_pairs": int(ok.sum()),
                "unit": "seed" if by_seed else "grid point", "n_units": int(d.size),
                "mean_delta": ci.mean, "ci_lo": ci.lo, "ci_hi": ci.hi, "delta_sd": ci.sd,
                "t_p": ci.p_value(0.0),
                "n_better": st.n_neg if lower else st.n_pos,
                "n_worse": st.n_pos if lower else st.n_neg, "n_tie": st.n_zero,
                "sign_p": st.p_value, "wilcoxon_p": stats.wilcoxon_signed_rank(d),
                "seed_std": stats.pooled_std(stds.to_numpy(), counts.to_numpy()),
            })
        adj = stats.holm([r["sign_p"] for r in arm_rows])
        for r, a in zip(arm_rows, adj, strict=False):
            r["sign_p_holm"] = float(a)
        rows += arm_rows
    cols = ["arm", "metric", "better", "n_points", "n_pairs", "unit", "n_units", "mean_delta",
            "ci_lo", "ci_hi", "delta_sd", "t_p", "n_better", "n_worse", "n_tie", "sign_p",
            "sign_p_holm", "wilcoxon_p", "seed_std"]
    out = pd.DataFrame(rows, columns=cols)
    out.attrs = {"level": level, "n_resamples": n_resamples, "seed": seed}
    return out


def _isnan_value(v) -> bool:
    return v is None or (isinstance(v, (float, np.floating)) and math.isnan(v))


def _keystr_frame(df: pd.DataFrame, cols: Sequence[str]) -> pd.Series:
    if not cols:
        return pd.Series(["all"] * len(df), index=df.index)
    return df[list(cols)].apply(lambda r: _keystr(r.values), axis=1)


def seed_table(df: pd.DataFrame) -> pd.DataFrame:
    """Seed variance per arm: pooled std across seeds at a fixed point, for ppl and each metric."""
    gcols = grid_cols(df)
    rows = []
    for arm in sorted(df["arm"].dropna().unique()):
        sub = df[df["arm"] == arm].copy()
        sub["_point"] = _keystr_frame(sub, gcols)
        for m in ["valid_ppl"] + metric_cols(df):
            if sub[m].notna().sum() == 0:
                continue
            per, pooled = stats.seed_variance(sub, m, ["_point"])
            multi = per[per["n_seeds"] >= 2]
            mean = float(sub[m].mean())
            rows.append({"arm": arm, "metric": m, "n_points_multi_seed": int(len(multi)),
                         "max_seeds": int(per["n_seeds"].max()) if len(per) else 0,
                         "pooled_std": pooled,
                         "pooled_std_pct": 100 * pooled / mean if mean else math.nan})
    return pd.DataFrame(rows, columns=["arm", "metric", "n_points_multi_seed", "max_seeds",
                                       "pooled_std", "pooled_std_pct"])


# --------------------------------------------------------------------------- #
# (2) best vs best
# --------------------------------------------------------------------------- #


def selection_seeds(arm_df: pd.DataFrame) -> list:
    """The seeds every config of one arm was run with: the best config is chosen on these
    alone, so that seeds re-run only at a chosen config (the quickstart's `double` size)
    neither pick the config nor compete with configs run once. Empty: no common seed."""
    gcols = grid_cols(arm_df)
    if arm_df.empty:
        return []
    per_config = arm_df.groupby(_keystr_frame(arm_df, gcols))["seed"].apply(set)
    return sorted(set.intersection(*per_config))


def best_table(df: pd.DataFrame, reference: str = methods.REFERENCE) -> pd.DataFrame:
    """Each arm at its best config, chosen on validation perplexity (seed-mean, lowest)
    over the arm's ``selection_seeds`` (every seed when no seed is common to all configs);
    the reported values average every seed of the winning config.

    Ties are broken by the grid columns ascending (``stats.select_best``).
    Downstream columns per metric: ``<m>`` (seed-mean), ``<m>_stderr`` (the
    lm-eval standard error, averaged over seeds: seeds share the eval items,
    so averaging models does not shrink it), ``<m>_seed_std``; and versus the
    reference's best config ``d:<m>`` with ``d:<m>_se = sqrt(se^2 + se_ref^2)``
    (conservative: it ignores that both models answer the same items).
    Caveat: the perplexity that picks the config is also the one reported
    (optimistic for every arm alike).
    """
    gcols = grid_cols(df)
    mcols = metric_cols(df)
    rows = []
    for arm in sorted(df["arm"].dropna().unique()):
        sub = df[df["arm"] == arm]
        sel_seeds = selection_seeds(sub)
        pick = sub[sub["seed"].isin(sel_seeds)] if sel_seeds else sub
        key, _ = stats.select_best(pick, "valid_ppl", gcols)
        rows_best = sub[np.logical_and.reduce(
            [(sub[c].isna() if _isnan_value(v) else sub[c] == v) for c, v in key.items()]
            + [np.ones(len(sub), dtype=bool)])]
        r = {"arm": arm, "method": sub["method"].iloc[0], **key,
             "n_seeds": int(len(rows_best)),
             "selection_seeds": ",".join(str(x) for x in sel_seeds),
             "run_ids": ",".join(sorted(rows_best["run_id"].astype(str))),
             "n_configs": int(_keystr_frame(sub, gcols).nunique()),
             "valid_ppl": float(rows_best["valid_ppl"].mean()),
             "valid_ppl_seed_std": (float(rows_best["valid_ppl"].std(ddof=1))
                                    if len(rows_best) > 1 else math.nan)}
        for m in mcols:
            v = rows_best[m].astype(float)
            r[m] = float(v.mean()) if v.notna().any() else math.nan
            se = rows_best[m + "_stderr"].astype(float) if m + "_stderr" in rows_best else None
            r[m + "_stderr"] = float(se.mean()) if se is not None and se.notna().any() else math.nan
            r[m + "_seed_std"] = float(v.std(ddof=1)) if v.notna().sum() > 1 else math.nan
        rows.append(r)
    best = pd.DataFrame(rows)
    if best.empty:
        return best
    refrow = best[best["arm"] == reference]
    if len(refrow):
        ref = refrow.iloc[0]
        best[PPL_DELTA] = stats.relative_delta_pct(best["valid_ppl"].to_numpy(), ref["valid_ppl"])
        for m in mcols:
            best[f"d:{m}"] = best[m] - ref[m]
            best[f"d:{m}_se"] = np.sqrt(best[m + "_stderr"] ** 2 + ref[m + "_stderr"] ** 2)
    # Reference first, baseline last, others alphabetical.
    order = {reference: 0}
    best["_o"] = [order.get(a, 2 if str(a).startswith(methods.BASELINE) else 1) for a in best["arm"]]
    best = best.sort_values(["_o", "arm"], kind="mergesort").drop(columns="_o")
    best = best.reset_index(drop=True)
    best.attrs = {"grid_cols": gcols, "metrics": mcols, "reference": reference}
    return best


CONFIRM_COLS = ["arm", "reference", "seeds", "n", "mean_delta", "ci_lo", "ci_hi", "delta_sd",
                "p_zero"]


def confirm_table(kept: pd.DataFrame, best: pd.DataFrame,
                  reference: str = methods.REFERENCE) -> pd.DataFrame:
    """Best vs best on fresh seeds, the one confirmatory reading of a pick: each arm's chosen
    config (``best_table``) against the reference's, paired by seed, over the seeds that
    chose neither config (the runs of the chosen configs outside both arms'
    ``selection_seeds``: `python -m hldstudy.sweep SWEEP --confirm SEEDS`, or the
    quickstart's `double` size). Per seed the relative perplexity delta in %, and its t
    interval (`analysis.paper` reads it against the paper). An arm without two fresh
    seeds in common with the reference has no row: its best vs best stays exploratory."""
    rows = []
    if best.empty or reference not in set(best["arm"]):
        return pd.DataFrame(columns=CONFIRM_COLS)

    def fresh(row) -> pd.Series:
        ids = set(str(row["run_ids"]).split(","))
        chosen = {str(s) for s in str(row["selection_seeds"]).split(",") if s}
        runs = kept[kept["run_id"].astype(str).isin(ids)
                    & ~kept["seed"].astype(str).isin(chosen)]
        return runs.groupby("seed")["valid_ppl"].mean().astype(float)

    ref = fresh(best[best["arm"] == reference].iloc[0])
    for _, row in best.iterrows():
        if row["arm"] == reference:
            continue
        mine = fresh(row)
        seeds = sorted(set(mine.index) & set(ref.index))
        if len(seeds) < 2:
            continue
        delta = stats.relative_delta_pct(mine[seeds].to_numpy(), ref[seeds].to_numpy())
        iv = intervals.t_interval(delta)
        rows.append({"arm": row["arm"], "reference": reference,
                     "seeds": ",".join(str(s) for s in seeds), "n": iv.n,
                     "mean_delta": iv.mean, "ci_lo": iv.lo, "ci_hi": iv.hi, "delta_sd": iv.sd,
                     "p_zero": iv.p_value(0.0)})
    return pd.DataFrame(rows, columns=CONFIRM_COLS)


# --------------------------------------------------------------------------- #
# (4) FLOPs
# --------------------------------------------------------------------------- #


def flops_table(df: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame, float]:
    """FLOPs each finished run spent vs its budget.

    Returns ``(per_run, per_arm, max_abs_rel_dev_pct)``; relative deviation is
    ``100 * (spent - budget) / budget`` (NaN without a budget). Under
    ``floor(C / flops_per_step)`` steps every run spends slightly *under* its
    budget, by less than one step.
    """
    per = df[["run_id", "arm", "method", "steps", "flops_budget", "flops_spent"]].copy()
    fb = per["flops_budget"].astype(float)
    per["rel_dev_pct"] = np.where(fb > 0, 100 * (per["flops_spent"].astype(float) - fb) / fb,
                                  np.nan)
    per["flops_per_step"] = per["flops_spent"].astype(float) / per["steps"].astype(float)
    rows = []
    for arm in sorted(per["arm"].dropna().unique()):
        s = per[per["arm"] == arm]
        rows.append({"arm": arm, "n_runs": int(len(s)),
                     "steps_min": s["steps"].min(), "steps_max": s["steps"].max(),
                     "flops_per_step": float(s["flops_per_step"].median()),
                     "spent_min": s["flops_spent"].min(), "spent_max": s["flops_spent"].max(),
                     "rel_dev_min_pct": s["rel_dev_pct"].min(),
                     "rel_dev_max_pct": s["rel_dev_pct"].max()})
    arms = pd.DataFrame(rows)
    dev = per["rel_dev_pct"].abs()
    max_dev = float(dev.max()) if dev.notna().any() else math.nan
    return per.reset_index(drop=True), arms, max_dev


# --------------------------------------------------------------------------- #
# Markdown
# --------------------------------------------------------------------------- #


def fmt_num(v, digits: int = 4) -> str:
    if v is None:
        return ""
    if isinstance(v, (bool, np.bool_)):
        return str(bool(v))
    if isinstance(v, (int, np.integer)):
        return str(int(v))
    if isinstance(v, (float, np.floating)):
        if math.isnan(v):
            return "–"
        if v != 0 and (abs(v) >= 1e5 or abs(v) < 1e-3):
            return f"{v:.{max(1, digits - 1)}e}"
        return f"{v:.{digits}g}"
    return str(v)


def fmt_p(v) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "–"
    return "<1e-4" if v < 1e-4 else f"{v:.3g}"


def fmt_signed(v, digits: int = 3) -> str:
    """Signed, fixed-point: +0.0031 (accuracy deltas), -0.360 (%), +1.40 (perplexity)."""
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "–"
    a = abs(v)
    if a >= 100:
        return f"{v:+.0f}"
    if a >= 10:
        return f"{v:+.1f}"
    if a >= 1:
        return f"{v:+.2f}"
    if a >= 0.1:
        return f"{v:+.3f}"
    return f"{v:+.4f}"


def md_table(df: pd.DataFrame, formats: dict[str, Callable] | None = None,
             columns: Sequence[str] | None = None, headers: dict[str, str] | None = None) -> str:
    """Renders a DataFrame as a GitHub markdown table (no extra dependency)."""
    formats = formats or {}
    headers = headers or {}
    cols = list(columns) if columns is not None else list(df.columns)
    if df.empty:
        return "_(no rows)_\n"
    head = "| " + " | ".join(headers.get(c, c) for c in cols) + " |"
    align = []
    for c in cols:
        num = c in df and pd.api.types.is_numeric_dtype(df[c])
        align.append("---:" if num else ":---")
    lines = [head, "| " + " | ".join(align) + " |"]
    for _, r in df.iterrows():
        cells = []
        for c in cols:
            f = formats.get(c, fmt_num)
            cells.append(str(f(r[c])).replace("|", "\\|").replace("\n", " "))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def pm(mean, se, digits: int = 4, signed: bool = False) -> str:
    if mean is None or (isinstance(mean, float) and math.isnan(mean)):
        return "–"
    m = fmt_signed(mean) if signed else fmt_num(mean, digits)
    if se is None or (isinstance(se, float) and math.isnan(se)):
        return m
    return f"{m} ± {fmt_num(se, 2)}"
