"""Calibration by simulation of the intervals and the verdict rule the reports use.

Paired gaps drawn with a known mean (-1, -0.26, 0, +0.5 points), seed spread 0.4 points,
n = 3, 5, 10, 20, 25 values, normal noise and heavy-tailed noise (Student t, 3 d.o.f.,
scaled to the same spread); 2,000 replicates per cell. For each interval kind: its
coverage of the true mean (nominal 95%). For the verdict rule (`analysis/verdict.py` on
the t interval): how often it reads `disagrees` under a true gap of -0.26, `agrees`
under +0.5, and its power to read `agrees` at -0.26. The pooled-t interval is drawn
for 8 configurations sharing the spread, and for 8 whose spreads differ 4-fold (0.2 to
0.8): it holds only in the first case, which is why the reports use the per-configuration t.

    .venv/bin/python benchmarks/interval_calibration.py     # ~2 min on 2 cores

Writes results/interval_calibration.{json,md}. Not a timing: the load is not checked.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from pathlib import Path

import numpy as np

from hldstudy.analysis.intervals import (
    bootstrap_interval,
    pooled_spread,
    pooled_t_interval,
    power,
    t_interval,
)
from hldstudy.analysis.verdict import AGREES, DISAGREES, PAPER_GAP_PCT, read_gap
from hldstudy.fileio import write_json_atomic, write_text_atomic

MEANS = (-1.0, PAPER_GAP_PCT, 0.0, 0.5)
SPREAD = 0.4
SIZES = (3, 5, 10, 20, 25)
NOISES = ("normal", "t3")
CONFIGS = 8  # configurations sharing (or not) one noise level, for the pooled interval
OUT = Path(__file__).resolve().parent / "results"


def draw(rng, noise: str, shape, sd=SPREAD) -> np.ndarray:
    if noise == "normal":
        return rng.normal(0.0, 1.0, shape) * sd
    return rng.standard_t(3, shape) * sd / math.sqrt(3.0)  # t3's variance is 3


def cell(rng, mean: float, n: int, noise: str, reps: int, boot_reps: int) -> dict:
    x = mean + draw(rng, noise, (reps, n))
    ts = [t_interval(row) for row in x]
    verdicts = [read_gap(iv).word for iv in ts]
    boots = [bootstrap_interval(row, n_resamples=1000, seed=i)
             for i, row in enumerate(x[:boot_reps])]
    # pooled: CONFIGS configurations, the first one's interval with the pooled spread
    same = mean + draw(rng, noise, (reps, CONFIGS, n))
    sds = np.linspace(0.5, 2.0, CONFIGS)[::-1] * SPREAD  # the judged one the noisiest
    mixed = mean + draw(rng, noise, (reps, CONFIGS, n)) * (sds / SPREAD)[None, :, None]

    def pooled_cover(arr):
        hit = 0
        for groups in arr:
            sd, df = pooled_spread(groups)
            hit += not pooled_t_interval(groups[0], sd, df).excludes(mean)
        return hit / len(arr)

    return {"mean": mean, "n": n, "noise": noise, "reps": reps,
            "cover_t": float(np.mean([not iv.excludes(mean) for iv in ts])),
            "cover_bootstrap": float(np.mean([not iv.excludes(mean) for iv in boots])),
            "bootstrap_reps": len(boots),
            "cover_pooled_same": pooled_cover(same),
            "cover_pooled_mixed": pooled_cover(mixed),
            "agrees": verdicts.count(AGREES) / reps,
            "disagrees": verdicts.count(DISAGREES) / reps,
            "power_t_theory": power(mean, SPREAD, n) if mean else math.nan}


def table(rows: list[dict]) -> str:
    cov = ["| noise | n | t | percentile bootstrap | pooled t, shared spread | pooled t, "
           "spreads 0.2-0.8 |", "|---|---:|---:|---:|---:|---:|"]
    for noise in NOISES:
        for n in SIZES:
            sub = [r for r in rows if r["noise"] == noise and r["n"] == n]
            avg = {k: np.mean([r[k] for r in sub]) for k in
                   ("cover_t", "cover_bootstrap", "cover_pooled_same", "cover_pooled_mixed")}
            cov.append(f"| {noise} | {n} | {avg['cover_t']:.3f} | {avg['cover_bootstrap']:.3f} "
                       f"| {avg['cover_pooled_same']:.3f} | {avg['cover_pooled_mixed']:.3f} |")
    rule = ["| noise | n | `disagrees` at -0.26 (<= 0.05) | `agrees` at +0.5 (<= 0.05) | "
            "`agrees` at -0.26 (power) | `agrees` at -1 | `disagrees` at 0 |",
            "|---|---:|---:|---:|---:|---:|---:|"]
    for noise in NOISES:
        for n in SIZES:
            at = {r["mean"]: r for r in rows if r["noise"] == noise and r["n"] == n}
            rule.append(f"| {noise} | {n} | {at[PAPER_GAP_PCT]['disagrees']:.3f} | "
                        f"{at[0.5]['agrees']:.3f} | {at[PAPER_GAP_PCT]['agrees']:.3f} | "
                        f"{at[-1.0]['agrees']:.3f} | {at[0.0]['disagrees']:.3f} |")
    return "\n".join(["## Coverage of the nominal 95% interval (averaged over the four true "
                      "means)", "", *cov, "", "## The verdict rule on the t interval", "",
                      *rule, ""])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=2000)
    p.add_argument("--bootstrap-reps", type=int, default=500,
                   help="replicates of the (slow) percentile bootstrap per cell")
    p.add_argument("--out", type=Path, default=OUT)
    args = p.parse_args(argv)
    rng = np.random.default_rng(20261206)
    t0, rows = time.time(), []
    for noise in NOISES:
        for n in SIZES:
            for mean in MEANS:
                rows.append(cell(rng, mean, n, noise, args.reps, args.bootstrap_reps))
                print(f"{noise} n={n} mean={mean:+.2f}: t covers {rows[-1]['cover_t']:.3f}",
                      file=sys.stderr)
    normal_ok = all(0.93 <= r["cover_t"] <= 0.97 for r in rows if r["noise"] == "normal")
    rule_ok = all(r["disagrees"] <= 0.05 for r in rows if r["mean"] == PAPER_GAP_PCT) and \
        all(r["agrees"] <= 0.05 for r in rows if r["mean"] == 0.5)
    meta = {"spread": SPREAD, "reps": args.reps, "bootstrap_reps": args.bootstrap_reps,
            "configs_pooled": CONFIGS, "seconds": round(time.time() - t0, 1),
            "load_at_end": os.getloadavg()[0], "t_covers_93_97_normal": normal_ok,
            "rule_error_rates_within_5pct": rule_ok}
    args.out.mkdir(parents=True, exist_ok=True)
    write_json_atomic(args.out / "interval_calibration.json", {"meta": meta, "rows": rows})
    md = ["# Interval calibration (benchmarks/interval_calibration.py)", "",
          f"Paired gaps with a known mean, seed spread {SPREAD} points; {args.reps} replicates "
          f"per cell for the closed-form intervals, {args.bootstrap_reps} for the percentile "
          "bootstrap. t: per configuration, df n - 1 (what the reports use). Pooled t: "
          f"{CONFIGS} configurations' spreads pooled, the noisiest one's mean judged. "
          f"t within 93-97% for every n under normal noise: **{normal_ok}**; the rule's "
          f"error rates within 5%: **{rule_ok}**.", "", table(rows)]
    write_text_atomic(args.out / "interval_calibration.md", "\n".join(md))
    print(f"wrote {args.out}/interval_calibration.md in {meta['seconds']} s")
    return 0 if normal_ok and rule_ok else 1


if __name__ == "__main__":
    sys.exit(main())
