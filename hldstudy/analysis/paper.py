"""Reading one run's comparison against the paper it reproduces.

Design notes: `docs/analysis.md`, under this file's name.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from hldstudy.analysis import stats
from hldstudy.analysis.intervals import Interval, detectable, seeds_needed
from hldstudy.analysis.tables import PPL_DELTA, fmt_num, fmt_p, fmt_signed
from hldstudy.analysis.verdict import DISAGREES, EXPLORATORY, read_gap
from hldstudy.config import Config, config_from_dict
from hldstudy.distill import methods
from hldstudy.shapes import count_params

PAPER = "Guigon, Dixon, Sander (arXiv 2605.11513, 2026)"
# Claim 1: HLDF's mean relative perplexity change vs KD over the shared configs, in %
# (negative = better), the same at both student sizes.
PAPER_HLDF_PPL_DELTA_PCT = -0.26
HLDF = "hldf"  # the method claim 1 is about (a name in hldstudy.distill.methods)
PPL_METRIC = "valid_ppl (%)"  # tables.grid_summary's name for the perplexity row
ALPHA = 0.05

# Verdicts (the last word of each reading). Claim 1 reads `analysis.verdict`'s rule
# (agrees / disagrees / cannot tell); claims 2 and 3 keep their own words.
AGREES = "agrees"
SAME_DIRECTION = "same direction, not resolved"
OPPOSITE = "opposite, resolved"
OPPOSITE_UNRESOLVED = "opposite direction, not resolved"
DIFFERS = "differs"  # claim 2: an HLD arm wins (or loses) on every downstream metric
# A comparison that could not have detected the effect the claim is about: too few
# points or seeds for its smallest detectable effect, or its test cannot reach p < alpha.
CANNOT_TELL = "cannot tell"
NO_WINNER_UNRESOLVED = CANNOT_TELL  # claim 2 when not every arm's tests could separate
MIXED = "mixed across the HLD arms"  # the arms' verdicts differ
SILENT = "cannot speak to it"
CORRECTION = "Holm"  # one multiple-comparison correction over every test of the reading

# The paper's setting, as DESIGN.md states it; None: not stated there.
PAPER_SETTING = {
    "teacher": "Gemma 3 3.4B (34 layers, d_model 2560), pretrained on C4 (106B tokens)",
    "students": "123M (18 layers) and 735M (26 layers), random init",
    "tokens": "up to 168B tokens of C4 English per student",
    "budget": "same FLOPs per method (refined 6ND, student side); ~6·N·D ≈ 1.2e20 FLOPs "
              "(123M) and 7.4e20 (735M) at 168B tokens (a rough count, not the paper's figure)",
    "stage1_share": None,
    "corpus": "C4 English, ~32k vocabulary",
    "seeds": None,
    "grid": "learning rate × temperature × NLL weight, shared by all methods",
    "eval": "C4 perplexity, Wikitext-103, HellaSwag, WinoGrande, LAMBADA, PIQA, ARC-E",
}
NOT_STATED = "not stated in DESIGN.md's account of the paper"


@dataclass(frozen=True)
class ClaimReading:
    """What one run says about one claim of the paper."""

    claim: str          # the paper's claim, one sentence
    shows: list[str]    # what this run shows, one finding per line (with its statistics)
    verdict: str        # one of AGREES, SAME_DIRECTION, OPPOSITE, OPPOSITE_UNRESOLVED, DIFFERS, SILENT
    caveats: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class RunSetting:
    """The setting of one budget's runs, the facts the paper's setting is compared with."""

    budget_flops: float
    count_teacher: bool
    student_params: list[int]        # distinct student sizes (total parameters)
    teacher_params: int | None       # None: the teacher's config is not readable
    tokens_per_run: dict[str, int]   # method -> training tokens (steps x batch x seq_len)
    data_source: str
    vocab_size: int
    seq_len: int
    stage1_shares: list[float]       # hldf runs' distill.hldf_stage1_share values
    max_seeds_per_point: int
    seeds_at_best: dict[str, int]    # arm -> seeds of its best config
    n_shared_points: dict[str, int]  # arm -> grid points shared with the reference
    eval_metrics: list[str]


# --------------------------------------------------------------------------- #
# Claim 1: HLDF's perplexity gain over KD across shared configurations
# --------------------------------------------------------------------------- #


def _arms_of(frame: pd.DataFrame, method: str) -> list[str]:
    if frame.empty or "arm" not in frame:
        return []
    return sorted(a for a in frame["arm"].dropna().unique()
                  if str(a) == method or str(a).startswith(method + "["))


def _min_sign_p(n: int) -> float:
    return min(1.0, 2.0 / 2 ** n) if n > 0 else 1.0


def _summary_interval(r) -> Interval:
    """The t interval `tables.grid_summary` computed for one row, rebuilt from its columns."""
    return Interval("t", float(r["mean_delta"]), float(r["ci_lo"]), float(r["ci_hi"]),
                    int(r["n_units"]), float(r["n_units"]) - 1, float(r["delta_sd"]))


def _confirm_interval(r) -> Interval:
    """The t interval `tables.confirm_table` computed for one row, rebuilt from its columns."""
    return Interval("t", float(r["mean_delta"]), float(r["ci_lo"]), float(r["ci_hi"]),
                    int(r["n"]), float(r["n"]) - 1, float(r["delta_sd"]))


def confirm_verdicts(confirm: pd.DataFrame, method: str = HLDF) -> pd.DataFrame:
    """`tables.confirm_table` with the one verdict rule's reading of each `method` arm
    (`verdict`, `why`, `p_paper`; other arms compare with no figure of the paper: blank)."""
    out = confirm.copy()
    words, whys, pp = [], [], []
    for _, r in out.iterrows():
        if r["arm"] in _arms_of(out, method):
            v = read_gap(_confirm_interval(r), PAPER_HLDF_PPL_DELTA_PCT)
            words.append(v.word), whys.append(v.why), pp.append(v.p_paper)
        else:
            words.append(""), whys.append(""), pp.append(math.nan)
    out["verdict"], out["why"], out["p_paper"] = words, whys, pp
    return out


def read_ppl_gain(summary: pd.DataFrame, best: pd.DataFrame, method: str = HLDF,
                  reference: str = methods.REFERENCE,
                  adjusted: dict | None = None,
                  confirm: pd.DataFrame | None = None) -> ClaimReading:
    """Claim 1 for each arm of `method`: the mean relative perplexity delta vs the reference
    over its paired units (grid points, or seeds at a single shared point), its t
    interval, read by the one verdict rule (`analysis.verdict.read_gap`: below 0 agrees,
    above 0 or away from the paper's figure disagrees, else cannot tell), both p-values
    (`adjusted`: after the reading's one correction), the smallest gap it detects and
    the seeds the paper's figure would need, and the best-vs-best delta (exploratory:
    each arm's best is picked on the same runs) with, where `confirm`
    (`tables.confirm_table`) has the arm, its confirmatory reading on fresh seeds."""
    claim = (f"{method.upper()} gives a small but systematic validation-perplexity gain over "
             f"{reference.upper()} across the shared configurations: "
             f"{PAPER_HLDF_PPL_DELTA_PCT:+.2f}% on average, at both student sizes.")
    rows = summary[summary["metric"] == PPL_METRIC] if len(summary) else summary
    arms = _arms_of(rows, method)
    if not arms:
        return ClaimReading(claim, [f"No {method} run shares a grid point with {reference}."],
                            SILENT)
    shows, caveats, verdicts = [], [], []
    for arm in arms:
        r = rows[rows["arm"] == arm].iloc[0]
        iv = _summary_interval(r)
        v = read_gap(iv, PAPER_HLDF_PPL_DELTA_PCT)
        unit = "seed(s) at one shared point" if r["unit"] == "seed" else "shared point(s)"
        ci = (f"95% t interval [{fmt_signed(iv.lo)}, {fmt_signed(iv.hi)}]" if iv.defined
              else "no interval (one value)")
        line = (f"`{arm}` vs `{reference}` over {iv.n} {unit}: mean Δppl "
                f"{fmt_signed(iv.mean)}% ({ci}; {v.why}); better at {int(r['n_better'])}, "
                f"worse at {int(r['n_worse'])}, tied at {int(r['n_tie'])}; p vs 0 "
                f"{fmt_p(v.p_zero)}, vs the paper's {PAPER_HLDF_PPL_DELTA_PCT:+.2f}% "
                f"{fmt_p(v.p_paper)}")
        seed_std = float(r["seed_std"]) if pd.notna(r["seed_std"]) else math.nan
        if np.isfinite(seed_std):
            line += f"; seed std of one point's Δ {fmt_num(seed_std, 3)}%"
        if adjusted:
            pz = adjusted.get(("ppl", arm), v.p_zero)
            pp = adjusted.get(("ppl_paper", arm), v.p_paper)
            line += f" ({CORRECTION}-adjusted over the reading's tests: {fmt_p(pz)}, {fmt_p(pp)})"
            deciding = {"zero": pz, "paper": pp}.get(v.decides)
            if deciding is not None and not deciding < ALPHA:
                caveats.append(f"`{arm}`: its verdict does not survive the {CORRECTION} "
                               "adjustment over the reading's tests.")
        mde = detectable(iv.sd, iv.n)
        need = seeds_needed(PAPER_HLDF_PPL_DELTA_PCT, iv.sd)
        line += (f"; smallest detectable mean Δ {fmt_num(mde, 3)}% (power 0.8); the paper's "
                 f"{PAPER_HLDF_PPL_DELTA_PCT:+.2f}% would need {need if need else 'many'} "
                 f"{'seeds' if r['unit'] == 'seed' else 'units'} at this spread")
        b = best[best["arm"] == arm] if len(best) and PPL_DELTA in best else best.iloc[0:0]
        if len(b):
            line += (f". Best vs best ({EXPLORATORY}: each arm's best picked on these runs): "
                     f"{fmt_signed(float(b.iloc[0][PPL_DELTA]))}% "
                     f"({int(b.iloc[0]['n_seeds'])} seed(s))")
        c = confirm[confirm["arm"] == arm] if confirm is not None and len(confirm) else None
        if c is not None and len(c):
            line += _confirm_line(c.iloc[0], adjusted, caveats)
        shows.append(line + ".")
        verdicts.append(v.word)
        if r["n_worse"] and r["n_better"]:
            caveats.append(f"`{arm}`: not systematic: the sign of Δ changes across units.")
        if np.isfinite(seed_std) and abs(iv.mean) < seed_std:
            caveats.append(f"`{arm}`: |mean Δ| is below the seed noise of a single paired "
                           "comparison.")
    return ClaimReading(claim, shows, _combine(verdicts), caveats)


def _confirm_line(r, adjusted: dict | None, caveats: list[str]) -> str:
    """The confirmatory best vs best of one arm: its fresh seeds' interval and verdict."""
    iv = _confirm_interval(r)
    v = read_gap(iv, PAPER_HLDF_PPL_DELTA_PCT)
    line = (f". Confirmed on {iv.n} fresh seed(s) ({r['seeds']}; the picks made before "
            f"them): mean Δppl {fmt_signed(iv.mean)}%, 95% t interval [{fmt_signed(iv.lo)}, "
            f"{fmt_signed(iv.hi)}]: **{v.word}** ({v.why}; p vs 0 {fmt_p(v.p_zero)}, vs the "
            f"paper's {fmt_p(v.p_paper)}")
    if adjusted:
        pz = adjusted.get(("confirm", r["arm"]), v.p_zero)
        pp = adjusted.get(("confirm_paper", r["arm"]), v.p_paper)
        line += f"; {CORRECTION}-adjusted {fmt_p(pz)}, {fmt_p(pp)}"
        deciding = {"zero": pz, "paper": pp}.get(v.decides)
        if deciding is not None and not deciding < ALPHA:
            caveats.append(f"`{r['arm']}`: its confirmatory verdict does not survive the "
                           f"{CORRECTION} adjustment over the reading's tests.")
    return line + ")"


def _combine(verdicts: list[str]) -> str:
    """One verdict for several arms: theirs when they agree, else MIXED (each arm's line
    says which way it points); an arm that cannot speak to the claim is left out unless
    all cannot."""
    spoken = [v for v in verdicts if v != SILENT] or [SILENT]
    return spoken[0] if len(set(spoken)) == 1 else MIXED


# --------------------------------------------------------------------------- #
# Claim 2: no consistent downstream winner
# --------------------------------------------------------------------------- #


def read_downstream(summary: pd.DataFrame, best: pd.DataFrame,
                    reference: str = methods.REFERENCE, alpha: float = ALPHA,
                    adjusted: dict | None = None) -> ClaimReading:
    """Claim 2: per HLD arm, the downstream metrics on which it separates from the reference:
    across the grid, the Holm-adjusted sign test (p < alpha); best vs best, |Δ| beyond
    1.96 combined standard errors. A consistent winner is an arm that separates on every
    downstream metric in the same direction (better or worse). "No winner" is read over
    every arm: it agrees only when each arm's tests could have found one (`CANNOT_TELL`
    otherwise). `adjusted`: the sign tests' p after the reading's one correction (else
    Holm within each arm)."""
    claim = (f"No consistent downstream winner: HLD does not consistently beat (or lose to) "
             f"{reference.upper()} on the downstream tasks.")
    down = summary[summary["metric"] != PPL_METRIC] if len(summary) else summary
    arms = sorted(down["arm"].unique()) if len(down) else []
    if not arms:
        return ClaimReading(claim, ["No downstream metric is paired with the reference."],
                            SILENT)
    shows, caveats, winners = [], [], []
    floors = {}
    for arm in arms:
        sub = down[down["arm"] == arm]
        if adjusted:
            sub = sub.assign(sign_p_holm=[adjusted.get(("down", arm, m), p)
                                          for m, p in zip(sub["metric"], sub["sign_p_holm"],
                                                          strict=True)])
        better = sub[(sub["sign_p_holm"] < alpha) & (sub["n_better"] > sub["n_worse"])]
        worse = sub[(sub["sign_p_holm"] < alpha) & (sub["n_worse"] > sub["n_better"])]
        ci_b = sub[_ci_side(sub, better_side=True)]
        ci_w = sub[_ci_side(sub, better_side=False)]
        line = (f"`{arm}` across the grid, {len(sub)} metric(s): better at Holm p < {alpha:g} "
                f"on {_names(better)}, worse on {_names(worse)}; CI of the mean Δ excludes 0 "
                f"towards better on {_names(ci_b)}, towards worse on {_names(ci_w)}")
        bb = _best_separations(best, arm, list(sub["metric"]))
        if bb is not None:
            line += (f". Best vs best, |Δ| > 1.96 combined stderr: better on {_names(bb[0])}, "
                     f"worse on {_names(bb[1])}")
        shows.append(line + ".")
        n_min = int(sub["n_points"].min())
        m = len(sub) if not adjusted else len(adjusted)  # the tests the correction spans
        floors[arm] = _min_sign_p(n_min) * m
        if floors[arm] > alpha:  # the smallest Holm p (lowest p times m)
            caveats.append(f"`{arm}`: with {n_min} point(s) and {m} tests the Holm-adjusted "
                           "sign test cannot reach p < 0.05; only the CIs and best-vs-best "
                           "differences are informative, and they are not corrected for "
                           "multiple metrics.")
        if len(better) == len(sub):
            winners.append(f"`{arm}` better than `{reference}` on every metric")
        elif len(worse) == len(sub):
            winners.append(f"`{reference}` better than `{arm}` on every metric")
    if winners:
        shows.append("Consistent winner(s): " + "; ".join(winners) + ".")
        verdict = DIFFERS
    else:  # "no winner" holds only if every arm could have shown one
        verdict = AGREES if all(f <= alpha for f in floors.values()) else CANNOT_TELL
    return ClaimReading(claim, shows, verdict, caveats)


def _ci_side(sub: pd.DataFrame, better_side: bool) -> pd.Series:
    lower = sub["better"] == "lower"
    lo, hi = sub["ci_lo"].astype(float), sub["ci_hi"].astype(float)
    below, above = hi < 0, lo > 0
    return (lower & below) | (~lower & above) if better_side else (lower & above) | (~lower & below)


def _names(frame: pd.DataFrame) -> str:
    names = list(frame["metric"]) if len(frame) else []
    return ", ".join(f"`{n}`" for n in names) if names else "none"


def _best_separations(best: pd.DataFrame, arm: str, metrics: list[str]):
    """(better, worse) metric frames where the best-vs-best |Δ| > 1.96 combined stderr."""
    if best.empty or arm not in set(best["arm"]):
        return None
    r = best[best["arm"] == arm].iloc[0]
    better, worse = [], []
    for m in metrics:
        d, se = r.get(f"d:{m}"), r.get(f"d:{m}_se")
        if d is None or se is None or not (np.isfinite(d) and np.isfinite(se)) or se <= 0:
            continue
        if abs(d) > 1.96 * se:
            good = (d < 0) == stats.lower_is_better(m)
            (better if good else worse).append(m)
    return pd.DataFrame({"metric": better}), pd.DataFrame({"metric": worse})


# --------------------------------------------------------------------------- #
# Claim 3: HLD's gains appear where KD is weak
# --------------------------------------------------------------------------- #


def read_kd_weak(pairs: pd.DataFrame, reference: str = methods.REFERENCE,
                 adjusted: dict | None = None) -> ClaimReading:
    """Claim 3 per HLD arm, over its grid points shared with the reference (per-seed values
    averaged per point): Spearman's rho between the reference's perplexity at a point and
    the arm's relative delta there (the claim predicts rho < 0: the weaker KD, the larger
    HLD's gain), with its exact permutation p; and the mean delta at the points where KD is
    weaker than its median vs the others."""
    claim = (f"HLD's gains over {reference.upper()} appear mainly where {reference.upper()} "
             f"itself is weak (configurations where {reference.upper()}'s perplexity is high).")
    if pairs.empty:
        return ClaimReading(claim, [f"No HLD run shares a grid point with {reference}."], SILENT)
    shows, caveats, verdicts = [], [], []
    for arm, ref_ppl, delta, rc in _kd_weak_points(pairs):
        if not np.isfinite(rc.rho):
            shows.append(f"`{arm}`: {rc.n} shared point(s) (or no spread in "
                         f"{reference}'s perplexity): no rank correlation.")
            verdicts.append(SILENT)
            continue
        median = float(np.median(ref_ppl))
        weak = ref_ppl > median
        line = (f"`{arm}` over {rc.n} points: Spearman ρ({reference} ppl, Δppl%) = "
                f"{rc.rho:+.2f}, {'exact ' if rc.exact else ''}p {fmt_p(rc.p_value)}")
        if weak.any() and (~weak).any():
            line += (f"; mean Δppl {fmt_signed(float(delta[weak].mean()))}% where {reference} "
                     f"is weaker than its median (ppl > {fmt_num(median, 4)}), "
                     f"{fmt_signed(float(delta[~weak].mean()))}% elsewhere")
        shows.append(line + ".")
        if (delta >= 0).all():
            caveats.append(f"`{arm}` gains nowhere (Δ ≥ 0 at every point): the correlation "
                           f"says where it loses least, not where it gains.")
        floor = 2.0 / math.factorial(rc.n) if rc.exact else 0.0
        tests = len(adjusted) if adjusted else 1
        if floor * tests > ALPHA:
            caveats.append(f"`{arm}`: with {rc.n} points the exact p cannot go below "
                           f"{fmt_p(floor)}.")
        p = (adjusted or {}).get(("kd_weak", arm), rc.p_value)
        resolved = p < ALPHA
        if not resolved and floor * tests > ALPHA:
            verdicts.append(CANNOT_TELL)
        elif rc.rho < 0:
            verdicts.append(AGREES if resolved else SAME_DIRECTION)
        else:
            verdicts.append(OPPOSITE if resolved else OPPOSITE_UNRESOLVED)
    return ClaimReading(claim, shows, _combine(verdicts), caveats)


def adjusted_p_values(summary: pd.DataFrame, pairs: pd.DataFrame, method: str = HLDF,
                      reference: str = methods.REFERENCE,
                      confirm: pd.DataFrame | None = None) -> dict:
    """Every test of the reading against the paper ({("ppl", arm) | ("down", arm, metric) |
    ("kd_weak", arm) | ("confirm", arm): p}), Holm-adjusted together: one correction over
    all of them."""
    raw = {}
    if confirm is not None:
        for _, r in confirm[confirm["arm"].isin(_arms_of(confirm, method))].iterrows():
            iv = _confirm_interval(r)
            raw[("confirm", r["arm"])] = iv.p_value(0.0)
            raw[("confirm_paper", r["arm"])] = iv.p_value(PAPER_HLDF_PPL_DELTA_PCT)
    if len(summary):
        for _, r in summary.iterrows():
            if r["metric"] == PPL_METRIC:
                if r["arm"] in _arms_of(summary[summary["metric"] == PPL_METRIC], method):
                    iv = _summary_interval(r)
                    raw[("ppl", r["arm"])] = iv.p_value(0.0)
                    raw[("ppl_paper", r["arm"])] = iv.p_value(PAPER_HLDF_PPL_DELTA_PCT)
            else:
                raw[("down", r["arm"], r["metric"])] = float(r["sign_p"])
    if len(pairs):
        for arm, p in kd_weak_p_values(pairs).items():
            raw[("kd_weak", arm)] = p
    keys = list(raw)
    return dict(zip(keys, stats.holm([raw[k] for k in keys]).tolist(), strict=True))


def _kd_weak_points(pairs: pd.DataFrame):
    """Per arm: (arm, the reference's perplexity and the arm's delta at each grid point,
    per-seed values averaged, their rank correlation)."""
    gcols = [c for c in pairs.attrs.get("grid_cols", []) if c in pairs]
    for arm in sorted(pairs["arm"].unique()):
        sub = pairs[pairs["arm"] == arm]
        per = (sub.groupby(gcols, dropna=False)[["ref_valid_ppl", PPL_DELTA]].mean()
               if gcols else sub[["ref_valid_ppl", PPL_DELTA]].mean().to_frame().T)
        ref_ppl = per["ref_valid_ppl"].to_numpy(float)
        delta = per[PPL_DELTA].to_numpy(float)
        yield arm, ref_ppl, delta, stats.rank_correlation(ref_ppl, delta)


def kd_weak_p_values(pairs: pd.DataFrame) -> dict[str, float]:
    """Claim 3's rank-correlation p per arm (the arms where one can be computed)."""
    return {arm: float(rc.p_value) for arm, _, _, rc in _kd_weak_points(pairs)
            if np.isfinite(rc.rho)}


def read_all(summary: pd.DataFrame, best: pd.DataFrame, pairs: pd.DataFrame,
             reference: str = methods.REFERENCE,
             confirm: pd.DataFrame | None = None) -> list[ClaimReading]:
    """The three claims, their tests under one Holm correction over all of them
    (`confirm`: `tables.confirm_table`, best vs best on fresh seeds)."""
    adjusted = adjusted_p_values(summary, pairs, reference=reference, confirm=confirm)
    return [read_ppl_gain(summary, best, reference=reference, adjusted=adjusted,
                          confirm=confirm),
            read_downstream(summary, best, reference=reference, adjusted=adjusted),
            read_kd_weak(pairs, reference=reference, adjusted=adjusted)]


# --------------------------------------------------------------------------- #
# The setting
# --------------------------------------------------------------------------- #


def setting_from_configs(configs: dict[str, dict], kept: pd.DataFrame, best: pd.DataFrame,
                         pairs: pd.DataFrame, teacher_config: dict | None,
                         reference: str = methods.REFERENCE) -> RunSetting:
    """The RunSetting of one budget's finished runs. `configs`: run_id -> its config.json;
    `kept`: the finished runs (``tables.dedupe``); `teacher_config`: the teacher run's
    config.json, None when it cannot be read."""
    cfgs = {rid: config_from_dict(c, Config) for rid, c in configs.items()}
    any_cfg = next(iter(cfgs.values()))
    student_params = sorted({count_params(c.model)["total"] for c in cfgs.values()})
    teacher_params = None
    if teacher_config is not None:
        teacher_params = count_params(config_from_dict(teacher_config, Config).model)["total"]
    tokens: dict[str, int] = {}
    for r in kept.itertuples(index=False):
        c = cfgs.get(str(r.run_id))
        if c is None or not np.isfinite(r.steps):
            continue
        t = int(r.steps) * c.data.batch_size * c.data.seq_len
        tokens[str(r.method)] = max(tokens.get(str(r.method), 0), t)
    shares = sorted({c.distill.hldf_stage1_share for c in cfgs.values()
                     if c.distill.method == HLDF})
    gcols = [c for c in kept.attrs.get("grid_cols", []) if c in kept]
    per_point = kept.groupby(["arm"] + gcols, dropna=False)["seed"].nunique()
    n_shared = ({str(a): int(g[gcols].drop_duplicates().shape[0])
                 for a, g in pairs.groupby("arm")} if len(pairs) else {})
    n_shared[reference] = max(n_shared.values(), default=0)
    return RunSetting(
        budget_flops=float(kept["budget_flops"].iloc[0]),
        count_teacher=bool(kept["count_teacher"].iloc[0]),
        student_params=student_params, teacher_params=teacher_params,
        tokens_per_run=dict(sorted(tokens.items())),
        data_source=any_cfg.data.source, vocab_size=any_cfg.model.vocab_size,
        seq_len=any_cfg.data.seq_len, stage1_shares=shares,
        max_seeds_per_point=int(per_point.max()) if len(per_point) else 0,
        seeds_at_best={str(r["arm"]): int(r["n_seeds"]) for _, r in best.iterrows()}
        if len(best) else {},
        n_shared_points={k: v for k, v in n_shared.items() if v},
        eval_metrics=sorted(c for c in kept.attrs.get("metric_cols", []) if c in kept))


def read_setting(runs_dir: str | Path, kept: pd.DataFrame, best: pd.DataFrame,
                 pairs: pd.DataFrame, reference: str = methods.REFERENCE) -> RunSetting:
    """setting_from_configs with the config.json files of `kept`'s runs (and of their
    teacher, when teacher.checkpoint is an hldstudy run directory) read from disk."""
    root = Path(runs_dir)
    configs = {str(r.run_id): json.loads((root / str(r.dir) / "config.json").read_text())
               for r in kept.itertuples(index=False)}
    teacher = None
    for c in configs.values():
        ckpt = (c.get("teacher") or {}).get("checkpoint")
        if ckpt and (Path(ckpt) / "config.json").is_file():
            teacher = json.loads((Path(ckpt) / "config.json").read_text())
            break
    return setting_from_configs(configs, kept, best, pairs, teacher, reference)


def setting_rows(s: RunSetting) -> list[tuple[str, str, str]]:
    """(aspect, the paper, this run) rows of the setting table."""
    def params(n: int) -> str:
        return f"{n / 1e6:.3g}M" if n >= 1e5 else f"{n:,}"

    stated = {k: (v if v is not None else NOT_STATED) for k, v in PAPER_SETTING.items()}
    ratio = 1.2e20 / s.budget_flops if s.budget_flops else math.nan
    seeds_best = ", ".join(f"{a}: {n}" for a, n in s.seeds_at_best.items())
    return [
        ("teacher", stated["teacher"],
         params(s.teacher_params) + " parameters" if s.teacher_params else "not readable here"),
        ("students", stated["students"],
         ", ".join(params(n) for n in s.student_params) + " parameters"),
        ("training tokens per student", stated["tokens"],
         ", ".join(f"{m}: {t:,}" for m, t in s.tokens_per_run.items())),
        ("FLOP budget per run", stated["budget"],
         f"{s.budget_flops:.4g} FLOPs (teacher {'counted' if s.count_teacher else 'not counted'}"
         + (f"; ~{ratio:.1e}x below the 123M figure)" if np.isfinite(ratio) else ")")),
        ("HLDF stage-1 share of the budget", stated["stage1_share"],
         ", ".join(f"{v:g}" for v in s.stage1_shares) or "no hldf run"),
        ("corpus", stated["corpus"],
         f"{s.data_source} (vocabulary {s.vocab_size:,}, sequence length {s.seq_len})"
         + (": a generated corpus, not natural text" if s.data_source == "synthetic" else "")),
        ("seeds", stated["seeds"],
         f"up to {s.max_seeds_per_point} per grid point; best configs: {seeds_best}"),
        ("shared grid", stated["grid"],
         ", ".join(f"{a}: {n} points" for a, n in s.n_shared_points.items())
         or "no shared points"),
        ("evaluation", stated["eval"],
         "validation perplexity; " + (", ".join(s.eval_metrics) or "no downstream metric")),
    ]


# --------------------------------------------------------------------------- #
# Markdown
# --------------------------------------------------------------------------- #


def against_paper_md(readings: list[ClaimReading], setting: RunSetting | None) -> list[str]:
    """The "Against the paper" section of one budget (markdown lines)."""
    L = ["### Against the paper\n",
         f"The claims of {PAPER}, as DESIGN.md states them, what this run shows about each, "
         f"and a verdict. Claim 1 reads the one verdict rule (`docs/analysis.md`): the 95% "
         f"Student-t interval of the mean Δ below 0 `{AGREES}`, above 0 `{DISAGREES}`, "
         f"containing 0 but not the paper's {PAPER_HLDF_PPL_DELTA_PCT:+.2f}% `{DISAGREES}` "
         f"(no effect as large as the paper's), containing both `{CANNOT_TELL}`; best vs "
         f"best is `{EXPLORATORY}` (picked on the same runs). Claim 2: `{AGREES}` when every "
         f"HLD arm's tests could have found a winner and none did, `{DIFFERS}` when an arm "
         f"wins or loses on every metric, else `{CANNOT_TELL}`. Claim 3: `{AGREES}` / "
         f"`{SAME_DIRECTION}` / `{OPPOSITE_UNRESOLVED}` / `{OPPOSITE}` from the exact "
         f"rank-correlation p, `{CANNOT_TELL}` where it cannot reach p < 0.05. `{MIXED}` "
         f"when the HLD arms point different ways; `{SILENT}`. Every p is "
         f"{CORRECTION}-adjusted once over all the tests of the three claims; the intervals "
         "are not.\n"]
    for i, r in enumerate(readings, 1):
        L.append(f"**{i}. {r.claim}** Verdict: **{r.verdict}**.\n")
        L += [f"- {s}" for s in r.shows]
        L += [f"- _{c}_" for c in r.caveats]
        L.append("")
    if setting is not None:
        L.append("What in the setting differs from the paper's:\n")
        L.append("| | the paper | this run |")
        L.append("| :--- | :--- | :--- |")
        for aspect, paper, run in setting_rows(setting):
            L.append(f"| {aspect} | {paper} | {run} |")
        L.append("")
        if setting.max_seeds_per_point < 2:
            L.append("_One seed per grid point: the run cannot separate an effect from seed "
                     "noise at any single point; claims 1 and 3 rest on the spread across "
                     "points alone._\n")
    return L
