"""Named arms paired by seed (the real-text study's confirmatory phase): each arm's seed
mean, each contrast's per-seed gap with its t interval, and the paper's three claims read
from those gaps under one Holm correction.

Design notes: `docs/analysis.md`, under this file's name.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pandas as pd

from hldstudy.analysis.ablation import eval_se_pct
from hldstudy.analysis.intervals import ALPHA, detectable, seeds_needed, t_interval
from hldstudy.analysis.verdict import (
    AGREES,
    CANNOT_TELL,
    DISAGREES,
    PAPER_GAP_PCT,
    WITHIN_MARGIN,
    adjust,
    read_effect,
    read_gap,
)

DIFFERS = "differs"  # claim 2: an HLD arm wins (or loses) on every downstream metric
# Claim 2 reads "no consistent winner" only where each metric's test could have found a
# winner of this many accuracy points (80% power): otherwise it cannot tell.
DOWNSTREAM_MARGIN_POINTS = 2.0


@dataclass(frozen=True)
class Contrast:
    """`arm` against `reference`, paired by seed."""

    arm: str
    reference: str


def per_seed(df: pd.DataFrame, arms: dict[str, list[str]]) -> pd.DataFrame:
    """One row per (arm, seed) of a finished run with a finite perplexity: `arms` maps an
    arm's name to its run ids (one run may serve two arms)."""
    done = df[(df["status"] == "done") & np.isfinite(df["valid_ppl"].astype(float))]
    by_id = done.set_index(done["run_id"].astype(str))
    rows = []
    for arm, ids in arms.items():
        for run_id in ids:
            if run_id in by_id.index:
                rows.append({**by_id.loc[run_id].to_dict(), "arm": arm, "run_id": run_id})
    return pd.DataFrame(rows)


def arm_table(seeds: pd.DataFrame, metrics: list[str]) -> pd.DataFrame:
    """Per arm: seeds, mean and sd of validation perplexity and of each metric."""
    rows = []
    for arm, sub in seeds.groupby("arm", sort=False):
        ppl = sub["valid_ppl"].astype(float)
        row = {"arm": arm, "seeds": len(sub), "valid_ppl": ppl.mean(),
               "valid_ppl_sd": ppl.std(ddof=1) if len(sub) > 1 else math.nan}
        for m in metrics:
            row[m] = sub[m].astype(float).mean() if m in sub else math.nan
        rows.append(row)
    return pd.DataFrame(rows)


def _paired(seeds: pd.DataFrame, c: Contrast) -> pd.DataFrame:
    a = seeds[seeds["arm"] == c.arm].set_index("seed")
    r = seeds[seeds["arm"] == c.reference].set_index("seed")
    common = sorted(set(a.index) & set(r.index))
    return a.loc[common], r.loc[common]


def ppl_gaps(seeds: pd.DataFrame, c: Contrast) -> pd.DataFrame:
    """Per shared seed: the arm's validation perplexity vs the reference's, in % (negative:
    the arm ahead), and the evaluation's standard error of that gap."""
    a, r = _paired(seeds, c)
    return pd.DataFrame({
        "seed": list(a.index),
        "gap_pct": 100.0 * (a["valid_ppl"].astype(float).values
                            / r["valid_ppl"].astype(float).values - 1),
        "eval_se_pct": [eval_se_pct(r.loc[s].get("valid_batch_nll"),
                                    r.loc[s].get("valid_batch_tokens"),
                                    a.loc[s].get("valid_batch_nll"),
                                    a.loc[s].get("valid_batch_tokens")) for s in a.index]})


def metric_gaps(seeds: pd.DataFrame, c: Contrast, metric: str) -> np.ndarray:
    """Per shared seed: the arm's metric minus the reference's, in points (x100)."""
    a, r = _paired(seeds, c)
    if metric not in a or metric not in r:
        return np.array([])
    return 100.0 * (a[metric].astype(float).values - r[metric].astype(float).values)


def contrast_table(seeds: pd.DataFrame, contrasts: list[Contrast]) -> pd.DataFrame:
    """Each contrast's perplexity gap: mean, 95% t interval, seeds, its seed spread and the
    evaluation's standard error, read by the one verdict rule."""
    rows = []
    for c in contrasts:
        g = ppl_gaps(seeds, c)
        iv = t_interval(g["gap_pct"])
        v = read_gap(iv)
        se = g["eval_se_pct"].astype(float)
        rows.append({"arm": c.arm, "reference": c.reference, "seeds": iv.n,
                     "gap_pct": iv.mean, "ci_lo": iv.lo, "ci_hi": iv.hi, "seed_sd_pct": iv.sd,
                     "eval_se_pct": float(np.sqrt(np.nanmean(se ** 2))) if se.notna().any()
                     else math.nan,
                     "detectable_pct": detectable(iv.sd, iv.n) if iv.n > 1 else math.inf,
                     "verdict": v.word, "p_zero": v.p_zero, "p_paper": v.p_paper})
    return pd.DataFrame(rows)


@dataclass(frozen=True)
class ClaimArms:
    """Which arms each claim reads: claim 1 `hldf` vs `kd`; claim 2 each of `hld` vs `kd`
    on the downstream metrics; claim 3 the gap `hldf_default_weak` vs `kd_weak` against
    `hldf_default` vs `kd` (the same HLDF configuration under a weak and a strong KD)."""

    kd: str
    kd_weak: str
    hldf: str
    hld: tuple[str, ...]
    hldf_default: str
    hldf_default_weak: str


def claims(seeds: pd.DataFrame, metrics: list[str], who: ClaimArms
           ) -> tuple[list[dict], pd.DataFrame]:
    """The paper's three claims from the paired arms, under one Holm correction over every
    test they read: ([{claim, verdict, unadjusted verdict, shows, p, p_holm}], the claim-2
    metric table)."""
    kd, hldf = who.kd, who.hldf
    # Claim 1: HLDF's perplexity gain over KD.
    g1 = ppl_gaps(seeds, Contrast(hldf, kd))
    iv1 = t_interval(g1["gap_pct"])
    v1 = read_gap(iv1)
    p1 = {"zero": v1.p_zero, "paper": v1.p_paper}.get(v1.decides, math.nan)
    sd1 = iv1.sd
    need = seeds_needed(PAPER_GAP_PCT, sd1) if np.isfinite(sd1) else None
    c1 = {"claim": "HLDF gives a small but systematic validation-perplexity gain over KD "
                   f"(the paper: {PAPER_GAP_PCT:+.2f}%)",
          "word": v1.word, "p": p1,
          "shows": f"`{hldf}` vs `{kd}`: {iv1.mean:+.2f}% [{iv1.lo:+.2f}, {iv1.hi:+.2f}] over "
                   f"{iv1.n} seeds ({v1.why}); seed sd of the gap {sd1:.2f} points: "
                   f"{iv1.n} seeds detect {detectable(sd1, iv1.n):.2f}% with 80% power, the "
                   f"paper's {abs(PAPER_GAP_PCT):.2f}% needs "
                   f"{need if need is not None else 'more than 100000'} seeds"}
    # Claim 2: no consistent downstream winner.
    rows = []
    for arm in who.hld:
        for m in metrics:
            d = metric_gaps(seeds, Contrast(arm, kd), m)
            iv = t_interval(d)
            rows.append({"arm": arm, "metric": m, "seeds": iv.n, "gap_points": iv.mean,
                         "ci_lo": iv.lo, "ci_hi": iv.hi, "p": iv.p_value(0.0),
                         "detectable_points": detectable(iv.sd, iv.n) if iv.n > 1
                         else math.inf})
    down = pd.DataFrame(rows, columns=["arm", "metric", "seeds", "gap_points", "ci_lo",
                                       "ci_hi", "p", "detectable_points"])
    # Claim 3: HLDF's gap larger where KD is weak (NLL weight 0.9) than where it is strong.
    strong = ppl_gaps(seeds, Contrast(who.hldf_default, kd)).set_index("seed")["gap_pct"]
    weak = ppl_gaps(seeds, Contrast(who.hldf_default_weak, who.kd_weak)
                    ).set_index("seed")["gap_pct"]
    both = sorted(set(strong.index) & set(weak.index))
    iv3 = t_interval(weak.loc[both].values - strong.loc[both].values)
    e3 = read_effect(iv3)
    if iv3.defined and iv3.hi < 0:
        w3, p3 = AGREES, e3.p_zero
    elif iv3.defined and iv3.lo > 0:
        w3, p3 = DISAGREES, e3.p_zero
    elif e3.word == WITHIN_MARGIN:
        w3, p3 = DISAGREES, e3.p_equiv
    else:
        w3, p3 = CANNOT_TELL, math.nan
    c3 = {"claim": "HLD's gains over KD appear mainly where KD is weak",
          "word": w3, "p": p3,
          "shows": f"the `{who.hldf_default}` gap at NLL weight 0.9 minus at 0.5: "
                   f"{iv3.mean:+.2f} points [{iv3.lo:+.2f}, {iv3.hi:+.2f}] over {iv3.n} seeds "
                   f"(negative: a larger HLDF gain where KD is weak; {e3.word} at the "
                   f"±{e3.margin:.2f}-point margin)"}
    # One correction over every test read.
    ps = [c1["p"], *down["p"], c3["p"]]
    adj = adjust(ps)
    c1["p_holm"], c3["p_holm"] = adj[0], adj[-1]
    down["p_holm"] = adj[1:-1]
    c2 = _downstream(down, who.hld, kd)
    out = []
    for c in (c1, c2, c3):
        word = c["word"]
        # A call whose own test does not survive the correction is not a call (claim 2's
        # tests are read after it already).
        if c["p_holm"] is not None and word in (AGREES, DISAGREES) \
                and not c["p_holm"] < ALPHA:
            word = CANNOT_TELL
        out.append({"claim": c["claim"], "verdict": word, "verdict_unadjusted": c["word"],
                    "shows": c["shows"], "p": c.get("p"), "p_holm": c.get("p_holm")})
    return out, down


def _downstream(down: pd.DataFrame, hld_arms: tuple[str, ...], kd: str) -> dict:
    winners, lines = [], []
    for arm in hld_arms:
        sub = down[down["arm"] == arm]
        sep = sub[sub["p_holm"] < ALPHA]
        if len(sub) and len(sep) == len(sub) and ((sep["gap_points"] > 0).all()
                                                 or (sep["gap_points"] < 0).all()):
            winners.append(arm)
        lines.append(f"`{arm}` vs `{kd}`: " + "; ".join(
            f"{r.metric} {r.gap_points:+.1f} [{r.ci_lo:+.1f}, {r.ci_hi:+.1f}]"
            for r in sub.itertuples()))
    could = bool(len(down)) and bool((down["detectable_points"] <= DOWNSTREAM_MARGIN_POINTS).all())
    if winners:
        word = DIFFERS
    else:
        word = AGREES if could else CANNOT_TELL
    return {"claim": "No consistent downstream winner: HLD does not consistently beat (or "
                     "lose to) KD on the downstream tasks",
            "word": word, "p": None, "p_holm": None,
            "shows": "; ".join(lines) + f" (points, 95% t intervals; a winner separates at "
                     f"Holm p < {ALPHA:g} on every metric in one direction; no winner is read "
                     f"only where every metric detects {DOWNSTREAM_MARGIN_POINTS:g} points)"}
