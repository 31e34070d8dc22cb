"""Statistics of hldstudy.analysis on constructed data with known answers."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hldstudy.analysis import stats, tables

# --------------------------------------------------------------------------- #
# Sign test: exact binomial, hand-computed
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("deltas, p", [
    ([1, 2, 3, 4, 5, 6], 2 / 64),                           # 6/0: 2 * (1/2)^6
    ([-1] * 6, 2 / 64),
    ([1] * 8 + [-1] * 2, 2 * (1 + 10 + 45) / 1024),         # 0.109375
    ([1] * 4 + [-1], 2 * (1 + 5) / 32),                      # 0.375
    ([1, 1, -1, -1], 1.0),                                   # 2 * 11/16 capped at 1
    ([1, 1, 1, 0, 0], 2 / 8),                                # zeros dropped: n = 3
    ([1] * 10 + [-1] * 0, 2 / 1024),
    ([1] * 15 + [-1] * 5, 2 * sum(math.comb(20, k) for k in range(6)) / 2**20),
])
def test_sign_test_known_values(deltas, p):
    res = stats.sign_test(deltas)
    assert res.p_value == pytest.approx(p, rel=1e-12)


def test_sign_test_counts_and_edge_cases():
    r = stats.sign_test([0.5, -0.2, 0.0, np.nan, 3])
    assert (r.n_pos, r.n_neg, r.n_zero, r.n) == (2, 1, 1, 3)
    assert stats.sign_test([]).p_value == 1.0
    assert stats.sign_test([0, 0]).p_value == 1.0
    # symmetric: flipping every sign gives the same p
    d = np.array([1, 2, -3, 4, 5, 6, -1])
    assert stats.sign_test(d).p_value == stats.sign_test(-d).p_value


# --------------------------------------------------------------------------- #
# Bootstrap CI
# --------------------------------------------------------------------------- #


def test_bootstrap_covers_true_mean_for_known_shift():
    rng = np.random.default_rng(123)
    shift, n, reps = 0.3, 40, 120
    covered = 0
    for i in range(reps):
        d = shift + rng.standard_normal(n)
        ci = stats.paired_bootstrap_ci(d, n_resamples=1000, seed=i)
        covered += ci.lo <= shift <= ci.hi
    # nominal 95%; percentile bootstrap undercovers a little at n = 40
    assert covered / reps >= 0.88


def test_bootstrap_width_matches_normal_theory():
    rng = np.random.default_rng(0)
    d = 1.0 + 2.0 * rng.standard_normal(400)
    ci = stats.paired_bootstrap_ci(d, n_resamples=20_000, seed=0)
    half = 1.96 * d.std(ddof=1) / math.sqrt(d.size)
    assert (ci.hi - ci.lo) / 2 == pytest.approx(half, rel=0.1)
    assert ci.mean == pytest.approx(d.mean())


def test_bootstrap_excludes_zero_for_large_shift():
    rng = np.random.default_rng(1)
    d = 5.0 + rng.standard_normal(12)
    ci = stats.paired_bootstrap_ci(d, n_resamples=5000, seed=0)
    assert ci.lo > 0 and ci.excludes_zero()
    # and not for a null shift
    d0 = rng.standard_normal(200) - 0.0
    d0 -= d0.mean()  # exactly zero mean
    assert not stats.paired_bootstrap_ci(d0, n_resamples=2000).excludes_zero()


def test_bootstrap_degenerate_cases():
    ci = stats.paired_bootstrap_ci([0.25] * 7)
    assert ci.lo == ci.hi == ci.mean == 0.25 and ci.n == 7
    one = stats.paired_bootstrap_ci([1.5])
    assert one.mean == 1.5 and math.isnan(one.lo) and math.isnan(one.hi)
    empty = stats.paired_bootstrap_ci([])
    assert empty.n == 0 and math.isnan(empty.mean)
    with pytest.raises(ValueError):
        stats.paired_bootstrap_ci([1, 2], level=1.5)


def test_bootstrap_is_seeded():
    d = np.random.default_rng(5).standard_normal(30)
    a = stats.paired_bootstrap_ci(d, n_resamples=3000, seed=7)
    b = stats.paired_bootstrap_ci(d, n_resamples=3000, seed=7)
    c = stats.paired_bootstrap_ci(d, n_resamples=3000, seed=8)
    assert a == b
    assert (a.lo, a.hi) != (c.lo, c.hi)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.floats(-100, 100, allow_nan=False), min_size=2, max_size=30))
def test_bootstrap_interval_contains_observed_mean(xs):
    ci = stats.paired_bootstrap_ci(xs, n_resamples=300, seed=0)
    assert ci.lo <= ci.mean <= ci.hi
    assert min(xs) - 1e-9 <= ci.lo and ci.hi <= max(xs) + 1e-9


# --------------------------------------------------------------------------- #
# Wilcoxon, Holm, relative delta
# --------------------------------------------------------------------------- #


def test_wilcoxon_exact_small_sample():
    # all 6 deltas positive and untied: exact two-sided p = 2 / 2^6
    assert stats.wilcoxon_signed_rank([0.1, 0.2, 0.3, 0.4, 0.5, 0.6]) == pytest.approx(2 / 64)
    assert math.isnan(stats.wilcoxon_signed_rank([0.0, 0.0]))


def test_holm_known_values():
    adj = stats.holm([0.01, 0.04, 0.03])
    # sorted 0.01*3 = 0.03, 0.03*2 = 0.06, 0.04*1 = 0.04 -> monotone 0.03, 0.06, 0.06
    np.testing.assert_allclose(adj, [0.03, 0.06, 0.06])
    adj = stats.holm([0.5, np.nan, 0.001])
    assert adj[0] == pytest.approx(0.5) and math.isnan(adj[1]) and adj[2] == pytest.approx(0.002)
    assert stats.holm([0.9, 0.8]).tolist() == [1.0, 1.0]  # 0.8 * 2 capped at 1


@settings(max_examples=40, deadline=None)
@given(st.lists(st.floats(0, 1), min_size=1, max_size=12))
def test_holm_properties(ps):
    adj = stats.holm(ps)
    assert np.all(adj >= np.asarray(ps) - 1e-12) and np.all(adj <= 1)
    order = np.argsort(ps, kind="mergesort")
    assert np.all(np.diff(adj[order]) >= -1e-12)


def test_relative_delta_pct():
    assert stats.relative_delta_pct(99.0, 100.0) == pytest.approx(-1.0)
    np.testing.assert_allclose(stats.relative_delta_pct([20.2, 19.8], [20.0, 20.0]), [1.0, -1.0])


def test_lower_is_better():
    assert stats.lower_is_better("lambada_openai/perplexity")
    assert stats.lower_is_better("wikitext/word_perplexity")
    assert stats.lower_is_better("valid_ppl")
    assert not stats.lower_is_better("hellaswag/acc_norm")


# --------------------------------------------------------------------------- #
# Seed variance
# --------------------------------------------------------------------------- #


def test_pooled_std_and_seed_variance():
    assert stats.pooled_std([1.0, 2.0, np.nan], [3, 5, 1]) == pytest.approx(math.sqrt(3.0))
    assert math.isnan(stats.pooled_std([np.nan], [1]))
    df = pd.DataFrame({
        "point": ["A", "A", "A", "B", "B", "C"],
        "seed": [0, 1, 2, 0, 1, 0],
        "ppl": [1.0, 2.0, 3.0, 10.0, 14.0, 7.0],
    })
    per, pooled = stats.seed_variance(df, "ppl", ["point"])
    per = per.set_index("point")
    assert per.loc["A", "std"] == pytest.approx(1.0)
    assert per.loc["B", "std"] == pytest.approx(math.sqrt(8.0))
    assert math.isnan(per.loc["C", "std"]) and per.loc["C", "n_seeds"] == 1
    # (2 * 1 + 1 * 8) / (2 + 1)
    assert pooled == pytest.approx(math.sqrt(10 / 3))


# --------------------------------------------------------------------------- #
# Best-vs-best selection
# --------------------------------------------------------------------------- #


def _cfg_frame():
    return pd.DataFrame({
        "lr": [1e-3, 1e-3, 3e-3, 3e-3, 1e-2, 1e-2],
        "temperature": [1.0] * 6,
        "seed": [0, 1, 0, 1, 0, 1],
        # lr 1e-2 has the single luckiest seed (9.0) but the worst mean (10.5)
        "valid_ppl": [10.2, 10.2, 10.0, 10.1, 9.0, 12.0],
        "run_id": list("abcdef"),
    })


def test_select_best_uses_seed_mean():
    key, rows = stats.select_best(_cfg_frame(), "valid_ppl", ["lr", "temperature"])
    assert key == {"lr": 3e-3, "temperature": 1.0}
    assert sorted(rows["run_id"]) == ["c", "d"]


def test_select_best_ties_are_deterministic():
    df = pd.DataFrame({"lr": [3e-3, 1e-3, 1e-2], "valid_ppl": [10.0, 10.0, 10.0],
                       "run_id": ["x", "y", "z"]})
    for perm in ([0, 1, 2], [2, 1, 0], [1, 2, 0]):
        key, rows = stats.select_best(df.iloc[perm], "valid_ppl", ["lr"])
        assert key == {"lr": 1e-3} and rows["run_id"].tolist() == ["y"]


def test_select_best_ignores_nan_and_fails_cleanly():
    df = pd.DataFrame({"lr": [1.0, 2.0], "valid_ppl": [np.nan, 5.0]})
    key, _ = stats.select_best(df, "valid_ppl", ["lr"])
    assert key == {"lr": 2.0}
    with pytest.raises(ValueError):
        stats.select_best(df.iloc[:1], "valid_ppl", ["lr"])


# --------------------------------------------------------------------------- #
# Tables on a constructed grid
# --------------------------------------------------------------------------- #


def _runs(effects: dict[str, float], lrs=(1e-3, 3e-3, 1e-2), seeds=(0, 1)) -> pd.DataFrame:
    rows = []
    for arm, eff in effects.items():
        for lr in lrs:
            for s in seeds:
                ppl = (20 + 100 * abs(math.log10(lr / 3e-3))) * (1 + eff / 100) + 0.01 * s
                rows.append({"run_id": f"{arm}-{lr:g}-{s}", "arm": arm, "method": arm,
                             "status": "done", "lr": lr, "temperature": 1.0, "alpha": 0.5,
                             "seed": s, "valid_ppl": ppl, "task/acc": 0.5 + eff / 1000,
                             "task/acc_stderr": 0.01, "count_teacher": False,
                             "steps": 10, "flops_budget": 1e12, "flops_spent": 0.99e12})
    df = pd.DataFrame(rows)
    df.attrs["grid_cols"] = ["lr", "temperature", "alpha"]
    df.attrs["metric_cols"] = ["task/acc"]
    return df


def test_point_table_and_grid_summary_known_effect():
    df = _runs({"kd": 0.0, "hldf": -0.5, "hldc": 0.0})
    pairs, unpaired = tables.point_table(df)
    assert len(pairs) == 2 * 3 * 2 and unpaired.empty
    h = pairs[pairs["arm"] == "hldf"]
    np.testing.assert_allclose(h[tables.PPL_DELTA], -0.5, atol=1e-3)
    np.testing.assert_allclose(h["d:task/acc"], -0.0005)
    s = tables.grid_summary(pairs, n_resamples=500).set_index(["arm", "metric"])
    r = s.loc[("hldf", "valid_ppl (%)")]
    assert r["n_points"] == 3 and r["n_pairs"] == 6       # seeds averaged per point
    assert r["n_better"] == 3 and r["sign_p"] == pytest.approx(0.25)
    assert r["mean_delta"] == pytest.approx(-0.5, abs=1e-3)
    # hldc identical to kd in ppl up to the seed offset, which is shared -> exact ties
    r = s.loc[("hldc", "valid_ppl (%)")]
    assert r["n_tie"] == 3 and r["sign_p"] == 1.0 and r["ci_lo"] == r["ci_hi"] == 0.0


def test_best_table_and_unpaired():
    df = _runs({"kd": 0.0, "hldf": -1.0})
    extra = df[df["arm"] == "hldf"].iloc[:1].copy()
    extra["lr"], extra["run_id"] = 3e-2, "hldf-lonely"
    df = pd.concat([df, extra], ignore_index=True)
    df.attrs = {"grid_cols": ["lr", "temperature", "alpha"], "metric_cols": ["task/acc"]}
    pairs, unpaired = tables.point_table(df)
    assert unpaired["run_id"].tolist() == ["hldf-lonely"]
    best = tables.best_table(df).set_index("arm")
    assert best.loc["kd", "lr"] == 3e-3 and best.loc["hldf", "lr"] == 3e-3
    assert best.loc["hldf", "n_seeds"] == 2
    assert best.loc["hldf", tables.PPL_DELTA] == pytest.approx(-1.0, abs=1e-3)
    assert best.loc["hldf", "d:task/acc_se"] == pytest.approx(math.sqrt(2) * 0.01)


def test_dedupe_keeps_first_run_id():
    df = _runs({"kd": 0.0}, lrs=(1e-3,), seeds=(0,))
    dup = df.copy()
    dup["run_id"] = "a-relaunch"
    both = pd.concat([dup, df], ignore_index=True)
    both.attrs = df.attrs
    kept, dups = tables.dedupe(both)
    assert kept["run_id"].tolist() == ["a-relaunch"] and dups["run_id"].tolist() == [df["run_id"][0]]


def test_flops_table():
    df = _runs({"kd": 0.0}, lrs=(1e-3,), seeds=(0,))
    per, arms, max_dev = tables.flops_table(df)
    assert per["rel_dev_pct"].iloc[0] == pytest.approx(-1.0)
    assert max_dev == pytest.approx(1.0)


# --------------------------------------------------------------------------- #
# rank correlation (Spearman, exact permutation p for small n)
# --------------------------------------------------------------------------- #


def test_rank_correlation_hand_computed():
    from hldstudy.analysis.stats import rank_correlation

    # perfectly reversed: rho = -1; of the 4! = 24 orderings only the two monotone
    # ones reach |rho| = 1, so p = 2/24
    r = rank_correlation([10, 20, 40, 80], [-1, -2, -3, -4])
    assert r.rho == pytest.approx(-1.0) and r.p_value == pytest.approx(2 / 24) and r.exact
    # one adjacent swap: rho = 1 - 6 * 2 / (4 * 15) = 0.8; |rho| >= 0.8 for the identity,
    # the 3 adjacent swaps and their 4 reversals: p = 8/24
    r = rank_correlation([1, 2, 3, 4], [1, 3, 2, 4])
    assert r.rho == pytest.approx(0.8) and r.p_value == pytest.approx(8 / 24)
    # ties get average ranks: y ranks (1.5, 1.5, 3) -> rho = corr((1,2,3), (1.5,1.5,3))
    r = rank_correlation([1, 2, 3], [5, 5, 7])
    assert r.rho == pytest.approx(0.8660254, rel=1e-6)


def test_rank_correlation_degenerate_and_large_n():
    from scipy import stats as scipy_stats

    from hldstudy.analysis.stats import rank_correlation

    assert math.isnan(rank_correlation([1, 2], [2, 1]).rho)          # n < 3
    assert math.isnan(rank_correlation([1, 2, 3], [4, 4, 4]).p_value)  # constant
    r = rank_correlation([1, 2, float("nan"), 4, 5], [2, 1, 9, 4, 3])  # NaN pair dropped
    assert r.n == 4
    x = np.arange(12.0)
    y = x + 4 * np.sin(3 * x)
    r = rank_correlation(x, y)
    ref = scipy_stats.spearmanr(x, y)
    assert not r.exact and r.rho == pytest.approx(ref.statistic)
    assert r.p_value == pytest.approx(ref.pvalue)
    with pytest.raises(ValueError, match="differ in length"):
        rank_correlation([1, 2, 3], [1, 2])
