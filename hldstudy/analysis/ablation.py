"""The HLDF ablation (`sweeps/hldf_ablation.py`): how each factor (stage-1 share, stage
boundary, NMSE form) moves HLDF's perplexity gap to KD in each KD regime, and what the
gaps say about the paper's claim, read as `agrees`, `disagrees` or `cannot tell`."""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path

import numpy as np
import pandas as pd

from hldstudy.analysis.intervals import ALPHA, Interval, detectable, seeds_needed, t_interval
from hldstudy.analysis.paper import HLDF, PAPER_HLDF_PPL_DELTA_PCT
from hldstudy.analysis.runs import SEEDS_SPAN_DATA, SEEDS_SPAN_INIT, load_runs, seeds_span
from hldstudy.analysis.tables import fmt_num, fmt_p, fmt_signed, md_table
from hldstudy.analysis.verdict import (
    AGREES,
    CANNOT_TELL,
    CORRECTION,
    DISAGREES,
    EQUIVALENCE_MARGIN_PCT,
    EXPLORATORY,
    MOVES,
    WITHIN_MARGIN,
    adjust,
    read_effect,
    read_gap,
)
from hldstudy.distill import methods
from hldstudy.errors import InputError
from hldstudy.fileio import write_json_atomic, write_text_atomic

FACTORS = ("hldf_stage1_share", "stage_boundary", "nmse")  # analysis columns
DEFAULTS = {"hldf_stage1_share": 0.2, "stage_boundary": "restart", "nmse": "batch"}
REGIME = "alpha"  # the KD regimes differ in the NLL weight
__all__ = ["AGREES", "CANNOT_TELL", "DISAGREES", "EXPLORATORY", "gaps", "config_table",
           "factor_effects", "interactions", "claims", "write_report"]


def eval_se_pct(kd_batches, kd_tokens, hldf_batches, hldf_tokens) -> float:
    """The evaluation's own standard error of one paired gap, in points of %: the
    token-weighted mean of the per-batch NLL differences (both runs read the same
    validation batches), its standard error across batches, as % of perplexity
    (d ppl / ppl = d NLL). NaN when either run kept no per-batch losses."""
    if not (isinstance(kd_batches, list) and isinstance(hldf_batches, list)) \
            or len(kd_batches) != len(hldf_batches) or len(kd_batches) < 2:
        return math.nan
    d = np.asarray(hldf_batches, float) - np.asarray(kd_batches, float)
    w = np.asarray(kd_tokens if isinstance(kd_tokens, list) else [1] * len(d), float)
    w = w / w.sum()
    mean = float((w * d).sum())
    var = float((w ** 2 * (d - mean) ** 2).sum()) * len(d) / (len(d) - 1)
    return 100.0 * math.sqrt(var)


def gaps(df: pd.DataFrame) -> pd.DataFrame:
    """One row per finished HLDF run: its regime, seed, factors and its validation
    perplexity's gap to the KD run of the same regime and seed, in % (negative: HLDF
    ahead), and the evaluation's standard error of that gap (`eval_se_pct`). Runs with a
    non-finite perplexity are left out."""
    done = df[(df["status"] == "done") & np.isfinite(df["valid_ppl"].astype(float))]
    kd = done[done["method"] == methods.REFERENCE].set_index([REGIME, "seed"])
    rows = []
    for _, r in done[done["method"] == HLDF].iterrows():
        key = (r[REGIME], r["seed"])
        if key in kd.index:
            k = kd.loc[key]
            k = k.iloc[0] if isinstance(k, pd.DataFrame) else k
            rows.append({REGIME: r[REGIME], "seed": r["seed"],
                         **{f: r[f] for f in FACTORS},
                         "gap_pct": 100.0 * (float(r["valid_ppl"]) / float(k["valid_ppl"]) - 1),
                         "eval_se_pct": eval_se_pct(
                             k.get("valid_batch_nll"), k.get("valid_batch_tokens"),
                             r.get("valid_batch_nll"), r.get("valid_batch_tokens"))})
    return pd.DataFrame(rows, columns=[REGIME, "seed", *FACTORS, "gap_pct", "eval_se_pct"])


def _gap_row(iv: Interval, exploratory: bool = False) -> dict:
    v = read_gap(iv, PAPER_HLDF_PPL_DELTA_PCT, exploratory)
    return {"gap_pct": iv.mean, "ci_lo": iv.lo, "ci_hi": iv.hi, "seed_sd_pct": iv.sd,
            "detectable_pct": detectable(iv.sd, iv.n),
            "seeds_for_paper": seeds_needed(PAPER_HLDF_PPL_DELTA_PCT, iv.sd),
            "p_zero": v.p_zero, "p_paper": v.p_paper, "verdict": v.word, "why": v.why,
            "decides": v.decides}


def config_table(g: pd.DataFrame) -> pd.DataFrame:
    """Per regime and HLDF configuration: the mean gap over seeds, its t interval (the
    configuration's own spread), the smallest gap it detects (power 0.8), the seeds the
    paper's figure would need at that spread, both p-values and the verdict."""
    rows = []
    for key, sub in g.groupby([REGIME, *FACTORS], sort=True):
        iv = t_interval(sub["gap_pct"].to_numpy(float))
        rows.append({REGIME: key[0], **dict(zip(FACTORS, key[1:], strict=True)),
                     "seeds": iv.n, **_gap_row(iv)})
    return pd.DataFrame(rows)


def _effect_row(d: np.ndarray) -> dict:
    iv = t_interval(d)
    e = read_effect(iv)
    return {"cells": iv.n, "effect_pct": iv.mean, "ci_lo": iv.lo, "ci_hi": iv.hi,
            "p_zero": e.p_zero, "p_equiv": e.p_equiv, "reading": e.word}


def _levels(sub: pd.DataFrame, factor: str) -> list:
    return sorted(set(sub[factor]) - {DEFAULTS[factor]}, key=str)


def factor_effects(g: pd.DataFrame) -> pd.DataFrame:
    """Per regime, factor and level: the change of the gap from the factor's default
    level to this one, paired on the seed and the other factors' levels (mean over those
    cells, t interval), read as moving the gap, not moving it by more than the margin
    (equivalence, TOST), or cannot tell. Only the factors the grid varies."""
    rows = []
    for regime, sub in g.groupby(REGIME, sort=True):
        for factor in FACTORS:
            others = [f for f in FACTORS if f != factor]
            base = sub[sub[factor] == DEFAULTS[factor]].set_index(["seed", *others])["gap_pct"]
            for level in _levels(sub, factor):
                at = sub[sub[factor] == level].set_index(["seed", *others])["gap_pct"]
                d = (at - base).dropna().to_numpy(float)
                if d.size:
                    rows.append({REGIME: regime, "factor": factor, "level": level,
                                 "vs": DEFAULTS[factor], **_effect_row(d)})
    return pd.DataFrame(rows, columns=[REGIME, "factor", "level", "vs", "cells", "effect_pct",
                                       "ci_lo", "ci_hi", "p_zero", "p_equiv", "reading"])


def interactions(g: pd.DataFrame) -> pd.DataFrame:
    """Two-factor interactions per regime: for levels a (of A) and b (of B) away from
    their defaults, (gap[a, b] - gap[A0, b]) - (gap[a, B0] - gap[A0, B0]) paired on the
    seed and the third factor: how much A's effect changes when B moves (0: additive)."""
    rows = []
    for regime, sub in g.groupby(REGIME, sort=True):
        for fa, fb in itertools.combinations(FACTORS, 2):
            third = [f for f in FACTORS if f not in (fa, fb)]
            cells = sub.set_index([fa, fb, "seed", *third])["gap_pct"]
            for a in _levels(sub, fa):
                for b in _levels(sub, fb):
                    a0, b0 = DEFAULTS[fa], DEFAULTS[fb]
                    d = ((_cell(cells, a, b) - _cell(cells, a0, b))
                         - (_cell(cells, a, b0) - _cell(cells, a0, b0)))
                    d = d.dropna().to_numpy(float)
                    if d.size:
                        rows.append({REGIME: regime, "interaction": f"{fa} x {fb}",
                                     "levels": f"{fa}={a}, {fb}={b}",
                                     "vs": f"{DEFAULTS[fa]}, {DEFAULTS[fb]}", **_effect_row(d)})
    return pd.DataFrame(rows, columns=[REGIME, "interaction", "levels", "vs", "cells",
                                       "effect_pct", "ci_lo", "ci_hi", "p_zero", "p_equiv",
                                       "reading"])


def _cell(cells: pd.Series, a, b) -> pd.Series:
    """The gaps at levels (a, b) of two factors, indexed by seed and the third factor."""
    try:
        return cells.xs((a, b), level=[0, 1])
    except KeyError:  # a cell the grid (or a sweep still training) does not have yet
        names = cells.index.names[2:]
        return pd.Series(dtype=float, index=pd.MultiIndex.from_tuples([], names=names))


def claims(configs: pd.DataFrame, g: pd.DataFrame) -> list[dict]:
    """The paper's claim read three ways: under the suite's default protocol (fixed before
    the runs: confirmatory), at HLDF's best configuration of each regime (picked on the
    same runs: exploratory, never a verdict), and where KD is weak (the weak regime's gap
    minus the strong one's, default protocol, paired by seed)."""
    out = []
    is_default = np.logical_and.reduce([configs[f] == v for f, v in DEFAULTS.items()])
    for _, r in configs[is_default].iterrows():
        out.append({"claim": f"HLDF ahead of KD ({REGIME}={r[REGIME]}, default protocol)",
                    "n": int(r["seeds"]), **{k: r[k] for k in _CLAIM_KEYS}})
    for regime, sub in configs.groupby(REGIME):
        best = sub.sort_values("gap_pct").iloc[0]
        config = ", ".join(f"{f}={best[f]}" for f in FACTORS)
        at = g[(g[REGIME] == regime)
               & np.logical_and.reduce([g[f] == best[f] for f in FACTORS])]
        row = _gap_row(t_interval(at["gap_pct"].to_numpy(float)), exploratory=True)
        out.append({"claim": f"HLDF ahead of KD ({REGIME}={regime}, its best of {len(sub)} "
                    f"configurations: {config})", "n": int(best["seeds"]),
                    **{k: row[k] for k in _CLAIM_KEYS},
                    "note": "picked for its lowest mean gap on the same runs: exploratory "
                    "until re-run on fresh seeds"})
    regimes = sorted(g[REGIME].unique())
    if len(regimes) == 2:
        dg = g[np.logical_and.reduce([g[f] == v for f, v in DEFAULTS.items()])]
        d = dg.pivot_table(index="seed", columns=REGIME, values="gap_pct")
        if all(r in d for r in regimes):
            diff = (d[regimes[1]] - d[regimes[0]]).dropna().to_numpy(float)
            iv = t_interval(diff)
            word = (CANNOT_TELL if not iv.excludes(0.0) else AGREES if iv.hi < 0
                    else DISAGREES)
            out.append({"claim": f"HLDF's gap smaller where KD is weak ({REGIME}="
                        f"{regimes[1]} vs {regimes[0]}, default protocol)", "n": iv.n,
                        "gap_pct": iv.mean, "ci_lo": iv.lo, "ci_hi": iv.hi,
                        "seed_sd_pct": iv.sd, "detectable_pct": detectable(iv.sd, iv.n),
                        "seeds_for_paper": None, "p_zero": iv.p_value(0.0), "p_paper": math.nan,
                        "verdict": word, "decides": "zero" if word != CANNOT_TELL else None})
    return out


_CLAIM_KEYS = ("gap_pct", "ci_lo", "ci_hi", "seed_sd_pct", "detectable_pct", "seeds_for_paper",
               "p_zero", "p_paper", "verdict", "decides")


def correct(configs: pd.DataFrame, effects: pd.DataFrame, inter: pd.DataFrame,
            readings: list[dict]) -> int:
    """One Holm correction over every p-value the report reads a call from: each
    configuration's and claim's p against 0 and against the paper's figure, each factor
    effect's and interaction's p against 0 and its equivalence p. Adds the adjusted
    columns and `survives` (the call's deciding p, adjusted, below alpha; NaN for a call
    that rests on none). Returns the family's size."""
    tables = [(configs, ("p_zero", "p_paper")), (effects, ("p_zero", "p_equiv")),
              (inter, ("p_zero", "p_equiv"))]
    claim_frame = pd.DataFrame(readings)
    columns = [(t, c) for t, cols in [*tables, (claim_frame, ("p_zero", "p_paper"))]
               for c in cols if c in t and len(t)]
    family = [float(p) for t, c in columns for p in t[c]]
    adjusted = iter(adjust(family))
    for t, c in columns:
        t[c + "_adj"] = [next(adjusted) for _ in range(len(t))]
    configs["survives"] = [_survives(r) for _, r in configs.iterrows()]
    for t in (effects, inter):
        t["survives"] = [_survives_effect(r) for _, r in t.iterrows()]
    for c, (_, r) in zip(readings, claim_frame.iterrows(), strict=True):
        c["p_zero_adj"], c["p_paper_adj"] = r.get("p_zero_adj"), r.get("p_paper_adj")
        c["survives"] = _survives(r)
    return sum(1 for p in family if np.isfinite(p))


def _survives(r) -> bool | None:
    col = {"zero": "p_zero_adj", "paper": "p_paper_adj"}.get(r.get("decides"))
    return None if col is None else bool(r[col] < ALPHA)


def _survives_effect(r) -> bool | None:
    col = {MOVES: "p_zero_adj", WITHIN_MARGIN: "p_equiv_adj"}.get(r["reading"])
    return None if col is None else bool(r[col] < ALPHA)


def _claims_md(readings: list[dict]) -> list[str]:
    lines = ["| claim | seeds | gap (%) | 95% CI (t) | smallest detectable | seeds for "
             f"{PAPER_HLDF_PPL_DELTA_PCT:+.2f}% | p vs 0 (adj.) | p vs paper (adj.) | verdict "
             "| survives Holm |", "|---|---:|---:|---|---:|---:|---:|---:|---|---|"]
    for c in readings:
        lines.append(f"| {c['claim']} | {c['n']} | {fmt_signed(c['gap_pct'])} | "
                     f"{_ci(c['ci_lo'], c['ci_hi'])} | {fmt_num(c['detectable_pct'], 3)} | "
                     f"{c['seeds_for_paper'] if c['seeds_for_paper'] else '–'} | "
                     f"{fmt_p(c['p_zero'])} ({fmt_p(c.get('p_zero_adj'))}) | "
                     f"{fmt_p(c['p_paper'])} ({fmt_p(c.get('p_paper_adj'))}) | "
                     f"**{c['verdict']}** | {_yes(c.get('survives'))} |")
    return lines


def _ci(lo, hi) -> str:
    return f"[{fmt_signed(lo)}, {fmt_signed(hi)}]" if np.isfinite(lo) else "undefined"


def _yes(v) -> str:
    return "–" if v is None or (isinstance(v, float) and math.isnan(v)) else \
        ("yes" if v else "no")


def _problems(df: pd.DataFrame | None, g: pd.DataFrame) -> list[str]:
    """One line per thing that keeps the report from reading every run: unfinished or
    non-finite runs (left out; not known from a gaps table, `df` None), configurations
    with fewer than 2 seeds (no interval)."""
    out = []
    taught = df[df["method"].isin([HLDF, methods.REFERENCE])] if df is not None else None
    bad = taught[(taught["status"] != "done")
                 | ~np.isfinite(taught["valid_ppl"].astype(float))] if df is not None else []
    if len(bad):
        out.append(f"{len(bad)} run(s) unfinished or without a finite perplexity, left out: "
                   + ", ".join(sorted(bad["run_id"].astype(str))[:8])
                   + (" ..." if len(bad) > 8 else ""))
    few = g.groupby([REGIME, *FACTORS]).size()
    if (few < 2).any():
        out.append(f"{int((few < 2).sum())} configuration(s) with fewer than 2 seeds: no "
                   "interval, read `cannot tell`")
    if g["seed"].nunique() > 1 and (few < g["seed"].nunique()).any():
        out.append("seeds missing for some configurations: each is read from the seeds it has")
    return out


def read_gaps_table(path: Path) -> pd.DataFrame:
    """A committed `tables/gaps.csv` (one row per HLDF run and its gap), for re-reading an
    ablation whose run directories are gone: the categorical factors as written."""
    try:
        g = pd.read_csv(path, dtype={"stage_boundary": str, "nmse": str})
    except (OSError, pd.errors.ParserError, UnicodeDecodeError) as e:
        raise InputError(f"{path}: not a readable gaps table ({e})") from None
    missing = [c for c in (REGIME, "seed", *FACTORS, "gap_pct") if c not in g]
    if missing:
        raise InputError(f"{path}: a gaps table needs the columns {', '.join(missing)} "
                         "(an ablation report's tables/gaps.csv)")
    if "eval_se_pct" not in g:
        g["eval_se_pct"] = math.nan
    return g[np.isfinite(g["gap_pct"].astype(float))]


def write_report(runs_dir: str | Path, out_dir: str | Path) -> dict:
    """report.md, tables/*.csv and summary.json of the ablation in `out_dir` (made only
    once the runs could be read). `runs_dir` may also be a gaps table (`tables/gaps.csv`
    of an earlier report): its runs' seeds are then taken to vary the initialisation only
    (the tables before 2026-12 kept no data order) and unfinished runs cannot be named."""
    out = Path(out_dir)
    if Path(runs_dir).is_file():
        g, df = read_gaps_table(Path(runs_dir)), None
    else:
        df = load_runs(runs_dir, check_names=False)
        g = gaps(df)
    if g.empty:
        raise InputError(f"{runs_dir}: no finished HLDF run has a finished KD run of its regime "
                         f"({REGIME}) and seed to be compared with (is the sweep done?)")
    configs, effects, inter = config_table(g), factor_effects(g), interactions(g)
    readings = claims(configs, g)
    family = correct(configs, effects, inter, readings)
    span = seeds_span(df) if df is not None else SEEDS_SPAN_INIT
    problems = _problems(df, g)
    spread = float(np.sqrt(np.nanmean(configs["seed_sd_pct"].astype(float) ** 2)))
    eval_se = float(np.sqrt(np.nanmean(g["eval_se_pct"].astype(float) ** 2))) \
        if g["eval_se_pct"].notna().any() else math.nan
    (out / "tables").mkdir(parents=True, exist_ok=True)
    for name, frame in (("gaps", g), ("configs", configs), ("factor_effects", effects),
                        ("interactions", inter)):
        write_text_atomic(out / "tables" / f"{name}.csv", frame.to_csv(index=False))
    calls = [*configs["survives"], *effects["survives"], *inter["survives"],
             *(c["survives"] for c in readings)]
    made = [c for c in calls if c is not None]
    signed = {**{c: fmt_signed for c in ("gap_pct", "ci_lo", "ci_hi", "effect_pct")},
              **{c: fmt_p for c in ("p_zero", "p_paper", "p_equiv", "p_zero_adj",
                                    "p_paper_adj", "p_equiv_adj")}}
    hide = ["why", "decides"]
    md = ["# HLDF ablation: stage-1 share, stage boundary, NMSE form", "",
          f"Runs: `{runs_dir}`; {len(g)} HLDF runs paired with KD by regime and seed; the "
          f"seeds vary the **{span}**"
          + ("" if span == SEEDS_SPAN_DATA else " (one data order for every seed: the seed "
             "spread understates what a new run would see)") + ". The gap is HLDF's "
          "validation perplexity relative to KD's, in % (negative: HLDF ahead); the paper "
          f"reports {PAPER_HLDF_PPL_DELTA_PCT:+.2f}%.", "",
          *[f"- **{p}**" for p in problems], *([""] if problems else []),
          "How to read it (`docs/analysis.md`, the verdict rule): every interval is a 95% "
          "Student-t interval of a mean of paired values (chosen by its simulated coverage, "
          "`benchmarks/results/interval_calibration.md`; the percentile bootstrap "
          "undercovers at these sizes). Against the paper: interval below 0 `agrees`, above "
          f"0 `disagrees`, containing 0 but not {PAPER_HLDF_PPL_DELTA_PCT:+.2f} `disagrees` "
          "(no effect as large as the paper's), containing both `cannot tell`; a "
          "configuration picked on these runs reads `exploratory`. A factor `moves the gap` "
          "when its interval excludes 0 and `does not move it` only by an equivalence test "
          f"(TOST, margin ±{EQUIVALENCE_MARGIN_PCT:.2f} points). Smallest detectable: the "
          "gap the comparison finds with power 0.8 (noncentral t). p-values are "
          f"{CORRECTION}-adjusted over all {family} tests of this report; the intervals are "
          f"not. **{sum(made)} of {len(made)} calls survive the adjustment.**", "",
          f"Noise: the seed spread of one gap is {fmt_num(spread, 3)} points (RMS over "
          "configurations); the evaluation's own standard error of one gap is "
          + (f"{fmt_num(eval_se, 3)} points (the validation split, batch by batch), "
             f"{eval_se / spread:.2f} of the seed spread: it is inside every interval, "
             "since each seed's gap carries it." if np.isfinite(eval_se) else
             "not known (these runs kept no per-batch losses).") , "",
          "## Against the paper", "", *_claims_md(readings), "",
          "## Factor effects on the gap", "",
          md_table(effects, formats=signed), "",
          "## Interactions", "",
          "How much one factor's effect changes when another leaves its default "
          "(0: the effects add).", "",
          md_table(inter, formats=signed), "",
          "## Every configuration", "",
          md_table(configs, formats=signed, columns=[c for c in configs if c not in hide]),
          ""]
    write_text_atomic(out / "report.md", "\n".join(md))
    summary = {"claims": json.loads(pd.DataFrame(readings).to_json(orient="records")),
               "runs": len(g), "seeds_span": span, "tests": family,
               "calls_surviving": [int(sum(made)), len(made)], "problems": problems,
               "seed_sd_pct": spread, "eval_se_pct": eval_se,
               "factor_effects": json.loads(effects.to_json(orient="records")),
               "interactions": json.loads(inter.to_json(orient="records"))}
    write_json_atomic(out / "summary.json", summary)
    return summary
