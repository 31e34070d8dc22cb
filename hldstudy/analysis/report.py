"""Builds the comparison report: report.md, tables/*.csv, summary.json, PNGs.

``build_report(runs_dir, out_dir)`` loads the runs (``runs.load_runs``),
splits them by FLOP budget (one budget unless ``allow_mixed_budgets``), and
for each budget writes the four tables of ``tables`` and the three figures of
``plots``. Every run directory is accounted for exactly once in the "Run
accounting" section and in ``summary.json["runs"]``.
"""

from __future__ import annotations

import datetime as _dt
import json
import logging
import math
import os
import re
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from hldstudy.analysis import paper, plots, stats, tables
from hldstudy.analysis.runs import load_runs
from hldstudy.analysis.tables import PPL_DELTA, fmt_num, fmt_p, fmt_signed, md_table, pm
from hldstudy.analysis.verdict import EXPLORATORY
from hldstudy.distill import methods
from hldstudy.wandb_online import wandb_online

log = logging.getLogger("hldstudy.analysis")



def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "_", text).strip("_").lower()


def _jsonable(x: Any) -> Any:
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, (np.integer,)):
        return int(x)
    if isinstance(x, (np.floating, float)):
        return None if not math.isfinite(float(x)) else float(x)
    if isinstance(x, np.bool_):
        return bool(x)
    if x is pd.NA or x is pd.NaT:
        return None
    return x


def _config_str(row: pd.Series | dict, gcols: list[str]) -> str:
    names = {"lr": "lr", "temperature": "T", "alpha": "α"}
    parts = []
    for c in gcols:
        v = row.get(c)
        if v is None or (isinstance(v, float) and math.isnan(v)):
            continue
        parts.append(f"{names.get(c, c)}={fmt_num(v)}")
    return ", ".join(parts) if parts else "(defaults)"


class _Budget:
    """Everything computed for one FLOP budget."""

    def __init__(self, label: str, df: pd.DataFrame, *, n_resamples: int, level: float,
                 seed: int, reference: str):
        self.label = label
        self.all = df
        fin = tables.finished(df)
        self.kept, self.duplicates = tables.dedupe(fin)
        self.gcols = tables.grid_cols(self.kept)
        self.metrics = tables.metric_cols(self.kept)
        self.reference = reference
        self.has_reference = bool((self.kept["arm"] == reference).any())
        if self.has_reference:
            self.pairs, self.unpaired = tables.point_table(self.kept, reference)
            self.summary = tables.grid_summary(self.pairs, n_resamples=n_resamples,
                                               level=level, seed=seed)
        else:
            self.pairs = pd.DataFrame(columns=["arm", "run_id", PPL_DELTA])
            self.pairs.attrs = {"grid_cols": self.gcols, "metrics": self.metrics}
            self.unpaired = pd.DataFrame(columns=["arm", "run_id"])
            self.summary = pd.DataFrame()
        self.seeds = tables.seed_table(self.kept)
        self.best = tables.best_table(self.kept, reference)
        self.confirm = paper.confirm_verdicts(tables.confirm_table(self.kept, self.best,
                                                                   reference))
        self.flops_runs, self.flops_arms, self.max_dev = tables.flops_table(self.kept)
        self.count_teacher = sorted(set(bool(x) for x in self.kept["count_teacher"]))
        self.figures: dict[str, str] = {}
        self.paper = paper.read_all(self.summary, self.best, self.pairs, reference=reference,
                                    confirm=self.confirm)
        self.setting: paper.RunSetting | None = None


def build_report(runs_dir: str | Path, out_dir: str | Path, *, allow_mixed_budgets: bool = False,
                 check_names: bool = True, n_resamples: int = 10_000, level: float = 0.95,
                 seed: int = 0, reference: str = methods.REFERENCE, wandb_report: bool = False) -> dict:
    """Writes the report into ``out_dir`` and returns the summary dict (also summary.json)."""
    out = Path(out_dir)
    df = load_runs(runs_dir, allow_mixed_budgets=allow_mixed_budgets, check_names=check_names)
    warnings = list(df.attrs.get("warnings", []))
    out.mkdir(parents=True, exist_ok=True)
    (out / "tables").mkdir(exist_ok=True)
    (out / "figures").mkdir(exist_ok=True)

    done = df[df["status"] == "done"]
    labels = sorted(done["budget"].unique(), key=lambda b: float(done.loc[done["budget"] == b,
                                                                         "budget_flops"].iloc[0]))
    budgets = []
    for i, label in enumerate(labels):
        sub = df[(df["status"] == "done") & (df["budget"] == label)].copy()
        sub.attrs = dict(df.attrs)
        b = _Budget(label, sub, n_resamples=n_resamples, level=level, seed=seed,
                    reference=reference)
        b.suffix = "" if len(labels) == 1 else f"_b{i + 1}"
        if not b.has_reference:
            warnings.append(f"[{label}] no {reference!r} runs: no point-by-point comparison")
        if len(b.duplicates):
            warnings.append(f"[{label}] {len(b.duplicates)} duplicate run(s) at an already "
                            f"covered (arm, point, seed) left out: "
                            + ", ".join(b.duplicates["run_id"].astype(str).head(5)))
        if len(b.unpaired):
            warnings.append(f"[{label}] {len(b.unpaired)} run(s) have no {reference} run at "
                            f"their (point, seed) and are left out of paired statistics")
        if math.isfinite(b.max_dev) and b.max_dev > 1.0:
            warnings.append(f"[{label}] a run's FLOPs deviate {b.max_dev:.2f}% from the budget "
                            f"(> 1%): compute matching is not tight")
        over = b.flops_runs[b.flops_runs["rel_dev_pct"] > 1e-4]
        if len(over):
            warnings.append(f"[{label}] {len(over)} run(s) spent more FLOPs than the budget: "
                            + ", ".join(over["run_id"].astype(str).head(5)))
        try:
            b.setting = paper.read_setting(runs_dir, b.kept, b.best, b.pairs, reference)
        except (OSError, ValueError) as e:  # the comparison stands without the setting table
            warnings.append(f"[{label}] the setting of the runs could not be read for the "
                            f"comparison with the paper: {type(e).__name__}: {e}")
        budgets.append(b)
        _write_tables(b, out)
        _write_figures(b, out)

    accounting = _accounting(df, budgets, reference)
    accounting.to_csv(out / "tables" / "accounting.csv", index=False)
    df.to_csv(out / "tables" / "runs.csv", index=False)

    summary = _summary(df, budgets, accounting, warnings, runs_dir=runs_dir,
                       n_resamples=n_resamples, level=level, seed=seed, reference=reference)
    md = _markdown(df, budgets, accounting, warnings, summary)
    (out / "report.md").write_text(md)
    if wandb_report:
        url = publish_wandb_report(df, md, summary)
        summary["wandb_report"] = url
    summary = _jsonable(summary)
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


# --------------------------------------------------------------------------- #
# Files
# --------------------------------------------------------------------------- #


def _write_tables(b: _Budget, out: Path) -> None:
    t = out / "tables"
    b.pairs.to_csv(t / f"points{b.suffix}.csv", index=False)
    b.unpaired.to_csv(t / f"unpaired{b.suffix}.csv", index=False)
    b.best.to_csv(t / f"best_vs_best{b.suffix}.csv", index=False)
    b.confirm.to_csv(t / f"confirm{b.suffix}.csv", index=False)
    b.summary.to_csv(t / f"grid_summary{b.suffix}.csv", index=False)
    b.seeds.to_csv(t / f"seed_variance{b.suffix}.csv", index=False)
    b.flops_runs.to_csv(t / f"flops_runs{b.suffix}.csv", index=False)
    b.flops_arms.to_csv(t / f"flops{b.suffix}.csv", index=False)


def _write_figures(b: _Budget, out: Path) -> None:
    f = out / "figures"
    p = plots.plot_ppl_vs_lr(b.kept, f / f"ppl_vs_lr{b.suffix}.png",
                             title=f"Validation perplexity vs learning rate — {b.label}")
    if p:
        b.figures["ppl_vs_lr"] = p.relative_to(out).as_posix()
    p = plots.plot_deltas(b.pairs, b.summary, f / f"delta_vs_kd{b.suffix}.png",
                          reference=b.reference)
    if p:
        b.figures["delta_vs_kd"] = p.relative_to(out).as_posix()
    p = plots.plot_downstream(b.best, f / f"downstream_best{b.suffix}.png")
    if p:
        b.figures["downstream_best"] = p.relative_to(out).as_posix()


def _accounting(df: pd.DataFrame, budgets: list[_Budget], reference: str) -> pd.DataFrame:
    """One row per run directory (and per missing sweep entry): what the report did with it."""
    role: dict[str, str] = {}
    for b in budgets:
        paired = set(b.pairs["run_id"].astype(str)) | set(b.pairs.get("ref_run_id", pd.Series(
            dtype=str)).astype(str))
        unpaired = set(b.unpaired["run_id"].astype(str))
        for rid, arm in zip(b.kept["run_id"].astype(str), b.kept["arm"], strict=False):
            if rid in paired:
                role[rid] = "reference (paired)" if arm == reference else "compared (paired)"
            elif rid in unpaired:
                role[rid] = "compared (no reference at its point)"
            elif str(arm).startswith(methods.BASELINE):
                role[rid] = "baseline (best-vs-best only)"
            elif arm == reference:
                role[rid] = "reference (no other arm at its point)"
            else:
                role[rid] = "compared (best-vs-best only)"
        for rid in b.duplicates["run_id"].astype(str):
            role[rid] = "duplicate (left out)"
    rows = []
    for r in df.itertuples(index=False):
        rid = str(r.run_id)
        if r.status == "teacher":
            use = "teacher of the students (left out)"
        elif r.status != "done":
            use = f"{r.status} (left out)"
        elif rid in role:
            use = role[rid]
        else:
            use = "no validation perplexity (left out)"
        rows.append({"run_id": rid, "status": r.status, "arm": r.arm, "budget": r.budget,
                     "used_as": use})
    return pd.DataFrame(rows)


def _summary(df, budgets: list[_Budget], accounting, warnings, *, runs_dir, n_resamples, level,
             seed, reference) -> dict:
    out: dict[str, Any] = {
        "runs_dir": str(runs_dir),
        "generated_utc": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "reference": reference,
        "n_runs": int(len(df)),
        "status_counts": {str(k): int(v) for k, v in df["status"].value_counts().items()},
        "grid_cols": list(df.attrs.get("grid_cols", [])),
        "selection": "best config per arm = lowest seed-mean validation perplexity over the "
                     "seeds every config of the arm ran; ties broken by grid columns ascending; "
                     "reported values average every seed of the chosen config",
        "statistics": {
            "pairing": "same grid point and seed, same FLOP budget",
            "unit": "grid point (per-seed deltas averaged first)",
            "ci": f"percentile bootstrap of the mean delta, {level:.0%}, "
                  f"{n_resamples} resamples, seed {seed}",
            "tests": "exact two-sided sign test (primary), Wilcoxon signed-rank (secondary), "
                     "Holm across metrics per arm",
        },
        "warnings": warnings,
        "runs": {r.run_id: r.used_as for r in accounting.itertuples(index=False)},
        "budgets": [],
    }
    for b in budgets:
        arms: dict[str, Any] = {}
        for arm in sorted(b.kept["arm"].unique()):
            a: dict[str, Any] = {"n_runs": int((b.kept["arm"] == arm).sum())}
            br = b.best[b.best["arm"] == arm]
            if len(br):
                r = br.iloc[0]
                a["best"] = {"config": {c: r.get(c) for c in b.gcols},
                             "run_ids": r["run_ids"].split(","),
                             "valid_ppl": r["valid_ppl"],
                             "valid_ppl_delta_pct_vs_ref": r.get(PPL_DELTA),
                             "downstream": {m: {"value": r[m], "stderr": r[m + "_stderr"]}
                                            for m in b.metrics}}
            if len(b.summary):
                s = b.summary[b.summary["arm"] == arm]
                if len(s):
                    a["vs_reference"] = {
                        row["metric"]: {k: row[k] for k in (
                            "n_points", "mean_delta", "ci_lo", "ci_hi", "n_better", "n_worse",
                            "n_tie", "sign_p", "sign_p_holm", "wilcoxon_p", "seed_std")}
                        for _, row in s.iterrows()}
            sv = b.seeds[(b.seeds["arm"] == arm) & (b.seeds["metric"] == "valid_ppl")]
            a["selection_seeds"] = (br.iloc[0]["selection_seeds"].split(",")
                                    if len(br) and br.iloc[0]["selection_seeds"] else [])
            cr = b.confirm[b.confirm["arm"] == arm]
            if len(cr):
                a["confirmed"] = {k: cr.iloc[0][k] for k in cr.columns if k != "arm"}
            if len(sv):
                a["valid_ppl_seed_std"] = sv.iloc[0]["pooled_std"]
            arms[arm] = a
        out["budgets"].append({
            "budget": b.label,
            "flops": float(b.kept["budget_flops"].iloc[0]) if len(b.kept) else None,
            "teacher_flops_counted": b.count_teacher[0] if len(b.count_teacher) == 1 else None,
            "n_runs_compared": int(len(b.kept)),
            "n_pairs": int(len(b.pairs)),
            "n_duplicates": int(len(b.duplicates)),
            "n_unpaired": int(len(b.unpaired)),
            "max_abs_flops_dev_pct": b.max_dev,
            "arms": arms,
            "figures": b.figures,
            "against_paper": [{"claim": r.claim, "verdict": r.verdict, "shows": r.shows,
                               "caveats": r.caveats} for r in b.paper],
        })
    return out


# --------------------------------------------------------------------------- #
# Markdown
# --------------------------------------------------------------------------- #


def _markdown(df, budgets: list[_Budget], accounting, warnings, summary) -> str:
    L: list[str] = []
    ref = summary["reference"]
    L.append("# Distillation comparison: hidden-layer distillation vs logit KD\n")
    L.append(f"Runs: `{summary['runs_dir']}` — {summary['n_runs']} run directories "
             f"({', '.join(f'{k}: {v}' for k, v in summary['status_counts'].items())}). "
             f"Generated {summary['generated_utc']}.\n")
    L.append("## How to read this\n")
    for b in budgets:
        teacher = {True: "**teacher forward FLOPs counted** in the budget",
                   False: "**teacher FLOPs not counted** (student-side compute only, as in the "
                          "study)"}.get(b.count_teacher[0] if len(b.count_teacher) == 1 else None,
                                        "mixed teacher-FLOP accounting")
        flops = float(b.kept["budget_flops"].iloc[0]) if len(b.kept) else 0.0
        matched = (f"compute-matched at {flops:.4g} FLOPs per run" if flops
                   else "**no FLOP budget**: runs are step-matched, not compute-matched")
        L.append(f"- Budget `{b.label}`: {matched}; {teacher}. Largest deviation of spent FLOPs "
                 f"from the budget: {fmt_num(b.max_dev)}%.")
    L.append(f"- Reference: `{ref}`. Deltas are *method − {ref}* at the same grid point "
             f"(learning rate, temperature, NLL weight"
             + (", " + ", ".join(f"`{c}`" for c in df.attrs.get("extra_cols", []))
                if df.attrs.get("extra_cols") else "")
             + ") and seed. Perplexity deltas are relative (%), negative = better than "
             f"{ref}; downstream deltas are absolute metric differences (↑/↓ marks the "
             "better direction).")
    L.append("- Arms: a method plus any method-specific knob that varies within it "
             "(e.g. `hldc[hw=0.5]` for the hidden-alignment weight).")
    L.append("- **Config selection** (best-vs-best): for each arm the config with the lowest "
             "*seed-mean validation perplexity* over the seeds every config of the arm ran; "
             "ties broken by the grid values ascending. Downstream scores never enter the "
             "choice. The reported values average every seed of the chosen config; on the "
             "selection seeds they are the ones used to select (optimistic alike for every "
             "arm), seeds re-run only at the chosen config are not.")
    st = summary["statistics"]
    L.append(f"- **Across the grid**: per-seed deltas of a grid point are averaged, then the "
             f"grid points are the paired units: {st['ci']} (CI of the *mean delta over this "
             f"grid*, not of any single point); {st['tests']}. `seed std` is the pooled "
             f"std of the delta across seeds at a point — the noise floor of one comparison.")
    L.append("- Downstream `± stderr` is lm-eval's standard error of the mean over items; for "
             "differences of two models it is combined as √(se₁²+se₂²) (conservative, ignores "
             "that both answer the same items).")
    L.append("")
    if warnings:
        L.append("**Warnings**\n")
        L += [f"- {w}" for w in warnings]
        L.append("")

    for b in budgets:
        L.append(f"## Budget: {b.label}\n")
        L += paper.against_paper_md(b.paper, b.setting)
        L += _budget_md(b, ref)

    L.append("## Run accounting\n")
    L.append("Every run directory (and every sweep.json entry without a directory) appears "
             "exactly once.\n")
    counts = accounting["used_as"].value_counts()
    L.append(md_table(counts.rename_axis("used as").reset_index(name="runs")))
    L.append("<details><summary>All runs</summary>\n")
    L.append(md_table(accounting))
    L.append("</details>\n")
    L.append("Tables as CSV: `tables/`. Machine-readable summary: `summary.json`.\n")
    return "\n".join(L)


def _arrows(b: _Budget) -> dict[str, str]:
    return {m: ("↓" if stats.lower_is_better(m) else "↑") for m in b.metrics}


def _best_md(b: _Budget, ref: str) -> list[str]:
    """(2) Best vs best first: the headline."""
    L: list[str] = []
    gcols = b.gcols
    arrows = _arrows(b)
    L.append("### Best vs best (each arm at its best config on validation perplexity)\n")
    if b.best.empty:
        L.append("_(no finished runs)_\n")
    else:
        best = b.best.copy()
        best["config"] = [_config_str(r, gcols) for _, r in best.iterrows()]
        best["valid ppl"] = [pm(r["valid_ppl"], r["valid_ppl_seed_std"])
                             for _, r in best.iterrows()]
        cols = ["arm", "config", "n_seeds", "n_configs", "valid ppl"]
        heads = {"n_seeds": "seeds", "n_configs": "configs tried",
                 "valid ppl": "valid ppl (± seed std)"}
        if PPL_DELTA in best:
            best["Δppl % vs " + ref] = [fmt_signed(v) if a != ref else "—"
                                        for a, v in zip(best["arm"], best[PPL_DELTA], strict=True)]
            cols.append("Δppl % vs " + ref)
        for m in b.metrics:
            best[f"{m} {arrows[m]}"] = [pm(r[m], r[m + "_stderr"]) for _, r in best.iterrows()]
            cols.append(f"{m} {arrows[m]}")
        L.append(md_table(best, columns=cols, headers=heads, formats={c: str for c in cols
                                                                        if c != "n_seeds"}))
        if b.metrics and f"d:{b.metrics[0]}" in best:
            L.append(f"\nDownstream differences vs `{ref}`'s best config (± combined stderr):\n")
            for m in b.metrics:
                best[f"Δ {m}"] = [pm(r[f"d:{m}"], r[f"d:{m}_se"], signed=True)
                                  if r["arm"] != ref else "—"
                                  for _, r in best.iterrows()]
            dcols = ["arm"] + [f"Δ {m}" for m in b.metrics]
            L.append(md_table(best, columns=dcols, formats={c: str for c in dcols}))
        L.append("")
        L += _confirm_md(b, ref)
    if "downstream_best" in b.figures:
        L.append(f"![downstream scores at best configs]({b.figures['downstream_best']})\n")
    return L


def _confirm_md(b: _Budget, ref: str) -> list[str]:
    """Best vs best is exploratory (each pick chosen on the runs that show it) unless the
    picks were re-run on fresh seeds: then this table, the only best-vs-best verdicts."""
    if b.confirm.empty:
        return [f"Best vs best is `{EXPLORATORY}`: each arm's config was picked on these "
                "runs. To confirm the picks, re-run them on fresh seeds (`python -m "
                "hldstudy.sweep SWEEP --confirm SEEDS`); only those runs give a verdict.\n"]
    c = b.confirm.copy()
    c["Δppl % (95% t)"] = [f"{fmt_signed(r['mean_delta'])} [{fmt_signed(r['ci_lo'])}, "
                           f"{fmt_signed(r['ci_hi'])}]" for _, r in c.iterrows()]
    c["p vs 0"] = [fmt_p(v) for v in c["p_zero"]]
    cols = ["arm", "seeds", "Δppl % (95% t)", "p vs 0", "verdict"]
    return [f"Confirmed on fresh seeds (the picks above re-run at seeds that chose "
            f"neither config, paired by seed with `{ref}`'s pick; verdicts against the "
            "paper's HLDF figure, Holm-adjusted p in the claims below):\n",
            md_table(c, columns=cols, formats={k: str for k in cols}), ""]


def _grid_md(b: _Budget, ref: str) -> list[str]:
    """(3) Across the grid: mean paired delta per arm and metric."""
    L: list[str] = []
    L.append(f"### Across the grid: mean delta vs {ref} (paired)\n")
    if b.summary.empty:
        L.append("_(no paired comparisons)_\n")
    else:
        s = b.summary.copy()
        s["mean Δ [CI]"] = [
            f"{fmt_signed(r['mean_delta'])} [{fmt_signed(r['ci_lo'])}, {fmt_signed(r['ci_hi'])}]"
            for _, r in s.iterrows()]
        s["better / worse / tie"] = [f"{r['n_better']} / {r['n_worse']} / {r['n_tie']}"
                                     for _, r in s.iterrows()]
        s["metric"] = [f"{m} {'↓' if bt == 'lower' else '↑'}"
                       for m, bt in zip(s["metric"], s["better"], strict=False)]
        cols = ["arm", "metric", "n_points", "mean Δ [CI]", "better / worse / tie", "sign_p",
                "sign_p_holm", "wilcoxon_p", "seed_std"]
        L.append(md_table(s, columns=cols, formats={
            "mean Δ [CI]": str, "better / worse / tie": str, "sign_p": fmt_p,
            "sign_p_holm": fmt_p, "wilcoxon_p": fmt_p},
            headers={"n_points": "points", "sign_p": "sign-test p", "sign_p_holm": "Holm p",
                     "wilcoxon_p": "Wilcoxon p", "seed_std": "seed std of Δ"}))
        lvl = b.summary.attrs.get("level", 0.95)
        L.append(f"\nCI: {lvl:.0%} percentile bootstrap over grid points. "
                 "`valid_ppl (%)` is relative; downstream rows are absolute differences.\n")
        n_min = int(b.summary["n_points"].min())
        if n_min < 6:
            L.append(f"_Only {n_min} grid point(s) for some comparisons: the smallest possible "
                     f"two-sided sign-test p with n points is 2/2^n ({2 / 2 ** n_min:.3g} here), "
                     "so p < 0.05 is unreachable below 6 points, and the bootstrap CI of so few "
                     "points is unreliable (undefined for one point)._\n")
    if "delta_vs_kd" in b.figures:
        L.append(f"![perplexity delta vs {ref}]({b.figures['delta_vs_kd']})\n")
    return L


def _seeds_md(b: _Budget, ref: str) -> list[str]:
    """Seed variance, or why it cannot be estimated."""
    L: list[str] = []
    L.append("### Seed variance\n")
    sv = b.seeds[b.seeds["n_points_multi_seed"] > 0] if len(b.seeds) else b.seeds
    if sv.empty:
        L.append("_One seed per point: seed variance cannot be estimated; deltas smaller than "
                 "typical seed noise (often ~0.1–0.5% in perplexity) should not be read as "
                 "effects._\n")
    else:
        L.append(md_table(sv, headers={"n_points_multi_seed": "points with ≥2 seeds",
                                       "pooled_std": "pooled std across seeds",
                                       "pooled_std_pct": "pooled std (% of mean)"}))
    return L


def _points_md(b: _Budget, ref: str) -> list[str]:
    """(1) Point by point against the reference arm."""
    L: list[str] = []
    gcols = b.gcols
    arrows = _arrows(b)
    L.append(f"### Point by point vs {ref}\n")
    if b.pairs.empty:
        L.append("_(no shared points)_\n")
    else:
        p = b.pairs.copy()
        shown = [c for c in gcols if p[c].notna().any()]
        dcols = [PPL_DELTA] + [f"d:{m}" for m in b.metrics]
        fm = {c: fmt_signed for c in dcols}
        heads = {"ref_valid_ppl": f"{ref} ppl", "valid_ppl": "arm ppl", PPL_DELTA: "Δppl %",
                 "n_seeds": "seeds"}
        heads.update({f"d:{m}": f"Δ {m} {arrows[m]}" for m in b.metrics})
        per_seed_cols = ["arm"] + shown + ["seed", "ref_valid_ppl", "valid_ppl"] + dcols
        if p["seed"].nunique() > 1:
            key = tables._keystr_frame(p, ["arm"] + gcols)
            agg = p.groupby(key, sort=False).agg(
                {**{c: "first" for c in ["arm"] + shown}, "seed": "count",
                 "ref_valid_ppl": "mean", "valid_ppl": "mean",
                 **{c: "mean" for c in dcols}}).rename(columns={"seed": "n_seeds"})
            agg = agg.sort_values(["arm"] + shown, kind="mergesort")
            L.append("Mean over the seeds run at each point (per-seed rows below and in "
                     "`tables/points*.csv`):\n")
            L.append(md_table(agg, columns=["arm"] + shown + ["n_seeds", "ref_valid_ppl",
                                                              "valid_ppl"] + dcols,
                              formats=fm, headers=heads))
            L.append("<details><summary>Per seed</summary>\n")
            L.append(md_table(p, columns=per_seed_cols, formats=fm, headers=heads))
            L.append("</details>\n")
        else:
            L.append(md_table(p, columns=per_seed_cols, formats=fm, headers=heads))
        if len(b.unpaired):
            L.append(f"\n{len(b.unpaired)} run(s) without a {ref} run at their point: "
                     + ", ".join(b.unpaired["run_id"].astype(str).head(10)) + "\n")
    if "ppl_vs_lr" in b.figures:
        L.append(f"![perplexity vs learning rate]({b.figures['ppl_vs_lr']})\n")
    return L


def _flops_md(b: _Budget, ref: str) -> list[str]:
    """(4) Compute matching: FLOPs spent vs budget."""
    L: list[str] = []
    L.append("### Compute matching: FLOPs spent vs budget\n")
    if not b.flops_arms.empty:
        as_int = lambda v: "–" if v is None or not np.isfinite(v) else f"{int(v):,}"
        L.append(md_table(b.flops_arms, formats={"steps_min": as_int, "steps_max": as_int},
                          headers={"rel_dev_min_pct": "min dev %", "rel_dev_max_pct": "max dev %",
                                   "flops_per_step": "FLOPs/step (median)",
                                   "spent_min": "spent min", "spent_max": "spent max"}))
    L.append(f"\nMaximum |spent − budget| / budget over all runs: **{fmt_num(b.max_dev)}%** "
             "(per run: `tables/flops_runs*.csv`).\n")
    return L


def _budget_md(b: _Budget, ref: str) -> list[str]:
    return [*_best_md(b, ref), *_grid_md(b, ref), *_seeds_md(b, ref), *_points_md(b, ref),
            *_flops_md(b, ref)]


# --------------------------------------------------------------------------- #
# W&B
# --------------------------------------------------------------------------- #


def _import_reports():
    try:
        import wandb_workspaces.reports.v2 as wr  # wandb >= 0.17.x split

        return wr
    except ImportError:
        pass
    try:
        import wandb.apis.reports as wr  # older wandb bundled the reports API

        if hasattr(wr, "Report"):
            return wr
    except Exception:  # noqa: BLE001
        pass
    return None


def publish_wandb_report(df: pd.DataFrame, markdown: str, summary: dict) -> str | None:
    """Builds a W&B report from the same runs when W&B is online; logs why not otherwise.

    Never fails the local report: any W&B problem is logged and None returned.
    """
    ok, why = wandb_online()
    if not ok:
        log.warning("--wandb-report skipped: W&B is not online (%s); the local report is complete",
                    why)
        return None
    wr = _import_reports()
    if wr is None:
        log.warning("--wandb-report skipped: the W&B reports API is not installed "
                    "(pip install 'wandb[workspaces]')")
        return None
    cfg_project = df.attrs.get("wandb_project")
    project = cfg_project or os.environ.get("WANDB_PROJECT") or "hldstudy"
    entity = os.environ.get("WANDB_ENTITY")
    try:
        blocks = [wr.H1(text="Distillation comparison: HLD vs KD")
                  if _accepts_text(wr.H1) else wr.H1("Distillation comparison: HLD vs KD"),
                  # local PNG links would be dead in W&B; the figures stay in the local report
                  wr.MarkdownBlock(text=re.sub(r"^!\[[^\]]*\]\([^)]*\)\s*$", "", markdown,
                                               flags=re.M))]
        try:
            runset = wr.Runset(entity=entity, project=project) if entity else \
                wr.Runset(project=project)
            if hasattr(wr, "Config") and hasattr(wr, "SummaryMetric"):
                x, y = wr.Config("train.lr"), wr.SummaryMetric("valid_ppl")
            else:
                x, y = "c::train.lr", "valid_ppl"
            panels = [wr.ScatterPlot(title="validation perplexity vs learning rate", x=x, y=y,
                                     log_x=True)]
            blocks.append(wr.PanelGrid(runsets=[runset], panels=panels))
        except Exception as e:  # noqa: BLE001 - panels are a bonus
            log.warning("W&B report: skipping the run panels (%s)", e)
        kwargs = {"project": project, "title": "hldstudy: HLD vs KD comparison",
                  "description": f"Generated from {summary['runs_dir']}", "blocks": blocks}
        if entity:
            kwargs["entity"] = entity
        report = wr.Report(**kwargs)
        report.save()
        url = getattr(report, "url", None)
        log.info("W&B report saved: %s", url)
        return url
    except Exception as e:  # noqa: BLE001
        log.warning("--wandb-report failed (%s: %s); the local report is complete",
                    type(e).__name__, e)
        return None


def _accepts_text(cls) -> bool:
    import inspect

    try:
        return "text" in inspect.signature(cls).parameters
    except (TypeError, ValueError):
        return False
