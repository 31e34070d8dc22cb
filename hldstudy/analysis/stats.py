"""Statistics for comparing distillation methods (pure numpy / scipy).

Design notes: `docs/analysis.md`, under this file's name.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass

import numpy as np
from scipy import stats as _st

__all__ = [
    "BootstrapCI",
    "SignTest",
    "paired_deltas",
    "relative_delta_pct",
    "paired_bootstrap_ci",
    "sign_test",
    "wilcoxon_signed_rank",
    "holm",
    "pooled_std",
    "seed_variance",
    "select_best",
    "lower_is_better",
    "RankCorrelation",
    "rank_correlation",
]


def _as_1d(x: Iterable[float]) -> np.ndarray:
    arr = np.asarray(list(x) if not isinstance(x, np.ndarray) else x, dtype=float).ravel()
    return arr


def paired_deltas(values: Iterable[float], reference: Iterable[float]) -> np.ndarray:
    """``values - reference`` elementwise; both are aligned on the same points. NaN pairs dropped."""
    a, b = _as_1d(values), _as_1d(reference)
    if a.shape != b.shape:
        raise ValueError(f"paired arrays differ in length: {a.shape[0]} vs {b.shape[0]}")
    d = a - b
    return d[np.isfinite(d)]


def relative_delta_pct(value, reference):
    """``100 * (value - reference) / reference``: the relative change in %.

    For perplexity a negative number means the method is better than the
    reference. Works on scalars and arrays.
    """
    value = np.asarray(value, dtype=float)
    reference = np.asarray(reference, dtype=float)
    with np.errstate(divide="ignore", invalid="ignore"):
        out = 100.0 * (value - reference) / reference
    return out.item() if out.ndim == 0 else out


@dataclass(frozen=True)
class BootstrapCI:
    """Percentile-bootstrap CI of the mean of paired deltas.

    ``mean`` is the observed mean delta; ``[lo, hi]`` is the central
    ``level`` interval of the bootstrap distribution of the mean, obtained by
    resampling the ``n`` pairs with replacement ``n_resamples`` times
    (``seed`` makes it reproducible). ``lo``/``hi`` are NaN when n < 2 (one
    pair says nothing about variability) and equal ``mean`` when all deltas
    are identical.
    """

    mean: float
    lo: float
    hi: float
    n: int
    level: float
    n_resamples: int
    seed: int

    def excludes_zero(self) -> bool:
        return bool(np.isfinite(self.lo) and (self.lo > 0 or self.hi < 0))

    def as_dict(self) -> dict:
        return asdict(self)


def paired_bootstrap_ci(
    deltas: Iterable[float],
    *,
    n_resamples: int = 10_000,
    level: float = 0.95,
    seed: int = 0,
) -> BootstrapCI:
    """Percentile bootstrap CI of the mean paired delta.

    ``deltas[i]`` is the difference between the two methods at shared point i
    (the pairing is done by the caller; see ``paired_deltas``). The pairs are
    the resampling unit: the CI describes the uncertainty of the *mean delta
    over the grid* due to which points happened to be run, and says nothing
    about any single point. Percentile method, no bias correction.
    """
    if not 0 < level < 1:
        raise ValueError(f"level must be in (0, 1), got {level}")
    if n_resamples < 1:
        raise ValueError(f"n_resamples must be >= 1, got {n_resamples}")
    d = _as_1d(deltas)
    d = d[np.isfinite(d)]
    n = int(d.size)
    if n == 0:
        return BootstrapCI(math.nan, math.nan, math.nan, 0, level, n_resamples, seed)
    mean = float(d.mean())
    if n == 1:
        return BootstrapCI(mean, math.nan, math.nan, 1, level, n_resamples, seed)
    if np.all(d == d[0]):
        return BootstrapCI(mean, mean, mean, n, level, n_resamples, seed)
    rng = np.random.default_rng(seed)
    # Resample in blocks to bound memory for large n * n_resamples.
    means = np.empty(n_resamples)
    block = max(1, 2_000_000 // n)
    for start in range(0, n_resamples, block):
        stop = min(n_resamples, start + block)
        idx = rng.integers(0, n, size=(stop - start, n))
        means[start:stop] = d[idx].mean(axis=1)
    alpha = (1.0 - level) / 2.0
    lo, hi = np.quantile(means, [alpha, 1.0 - alpha])
    # Guard against float rounding pushing the interval off the observed mean.
    return BootstrapCI(mean, float(min(lo, mean)), float(max(hi, mean)), n, level, n_resamples, seed)


@dataclass(frozen=True)
class SignTest:
    """Exact two-sided sign test. ``n = n_pos + n_neg`` (zeros dropped)."""

    n_pos: int
    n_neg: int
    n_zero: int
    p_value: float

    @property
    def n(self) -> int:
        return self.n_pos + self.n_neg

    def as_dict(self) -> dict:
        return {**asdict(self), "n": self.n}


def sign_test(deltas: Iterable[float]) -> SignTest:
    """Exact two-sided binomial sign test of H0: P(delta > 0) = P(delta < 0) = 1/2.

    Zeros are dropped (the usual convention). With k = min(#pos, #neg) and
    n = #pos + #neg, ``p = min(1, 2 * P[Binomial(n, 1/2) <= k])``; p = 1 when
    n = 0.
    """
    d = _as_1d(deltas)
    d = d[np.isfinite(d)]
    n_pos = int((d > 0).sum())
    n_neg = int((d < 0).sum())
    n_zero = int((d == 0).sum())
    n = n_pos + n_neg
    if n == 0:
        return SignTest(n_pos, n_neg, n_zero, 1.0)
    k = min(n_pos, n_neg)
    p = min(1.0, 2.0 * float(_st.binom.cdf(k, n, 0.5)))
    return SignTest(n_pos, n_neg, n_zero, p)


def wilcoxon_signed_rank(deltas: Iterable[float]) -> float:
    """Two-sided Wilcoxon signed-rank p-value of the paired deltas (NaN if it can't be computed).

    Secondary to the sign test: it assumes the deltas are symmetric around
    their median. Zeros are dropped ("wilcox"); exact distribution for small
    n without ties, normal approximation otherwise (scipy's choice).
    """
    d = _as_1d(deltas)
    d = d[np.isfinite(d)]
    d = d[d != 0]
    if d.size == 0:
        return math.nan
    try:
        return float(_st.wilcoxon(d, zero_method="wilcox", alternative="two-sided").pvalue)
    except ValueError:
        return math.nan


def holm(p_values: Sequence[float]) -> np.ndarray:
    """Holm-Bonferroni adjusted p-values (family-wise error control), NaNs passed through.

    Sort the m finite p-values ascending; adjusted p_(i) = max_{j<=i} min(1, (m - j + 1) p_(j)).
    """
    p = np.asarray(p_values, dtype=float)
    out = np.full_like(p, np.nan)
    ok = np.isfinite(p)
    pv = p[ok]
    m = pv.size
    if m == 0:
        return out
    order = np.argsort(pv, kind="mergesort")
    adj = np.minimum(1.0, (m - np.arange(m)) * pv[order])
    adj = np.maximum.accumulate(adj)
    res = np.empty(m)
    res[order] = adj
    out[ok] = res
    return out


def pooled_std(stds: Iterable[float], counts: Iterable[int]) -> float:
    """``sqrt(sum (n_i - 1) s_i^2 / sum (n_i - 1))`` over groups with n_i >= 2 (NaN if none)."""
    s = _as_1d(stds)
    n = _as_1d(counts)
    ok = np.isfinite(s) & (n >= 2)
    dof = (n[ok] - 1).sum()
    if dof <= 0:
        return math.nan
    return float(np.sqrt(((n[ok] - 1) * s[ok] ** 2).sum() / dof))


def seed_variance(df, value: str, group_cols: Sequence[str], seed_col: str = "seed"):
    """Std across seeds of ``value`` at each point, and the pooled std.

    ``group_cols`` identify a point (everything but the seed, method included).
    Returns ``(per_point, pooled)`` where ``per_point`` is a DataFrame with
    ``group_cols + ["n_seeds", "mean", "std"]`` (std with ddof=1, NaN for one
    seed) and ``pooled`` the pooled std over points with >= 2 seeds
    (``pooled_std``), NaN when no point has two seeds.
    """
    import pandas as pd

    cols = list(group_cols)
    sub = df[cols + [seed_col, value]].dropna(subset=[value])
    if sub.empty:
        return pd.DataFrame(columns=cols + ["n_seeds", "mean", "std"]), math.nan
    g = sub.groupby(cols, dropna=False, sort=True)[value]
    per = g.agg(n_seeds="count", mean="mean", std=lambda x: x.std(ddof=1) if len(x) > 1 else np.nan)
    per = per.reset_index()
    return per, pooled_std(per["std"].to_numpy(), per["n_seeds"].to_numpy())


def select_best(df, score: str = "valid_ppl", config_cols: Sequence[str] = (),
                tiebreak: Sequence[str] = ()):
    """The best config in ``df``: lowest ``score`` (validation perplexity by default).

    Rows that share ``config_cols`` (differing only by seed) are averaged
    first, so a config wins on its seed-mean, not on its luckiest seed.
    Ties on the score are broken by ascending ``tiebreak`` columns then by the
    config tuple itself (NaN last), so the choice is deterministic. Returns
    ``(config_key: dict, rows: DataFrame)`` with the rows of the winning
    config; raises ValueError when no row has a finite score.
    """
    cols = list(config_cols)
    sub = df[np.isfinite(df[score].astype(float))]
    if sub.empty:
        raise ValueError(f"no row has a finite {score!r}")
    if cols:
        grp = sub.groupby(cols, dropna=False, sort=False)
        agg = grp[score].mean().reset_index()
    else:
        agg = sub[[score]].mean().to_frame().T
    keys = [score] + list(tiebreak) + [c for c in cols if c not in tiebreak]
    agg = agg.sort_values(keys, kind="mergesort", na_position="last").reset_index(drop=True)
    top = agg.iloc[0]
    key = {c: top[c] for c in cols}
    mask = np.ones(len(sub), dtype=bool)
    for c, v in key.items():
        col = sub[c]
        mask &= (col.isna().to_numpy() if _isnan(v) else (col == v).to_numpy())
    return key, sub[mask]


@dataclass(frozen=True)
class RankCorrelation:
    """Spearman's rho of n finite pairs and its two-sided p-value.

    ``exact``: p counts the permutations of y whose |rho| is at least the
    observed one (all n! of them, n <= ``EXACT_MAX_N``); otherwise scipy's
    t-approximation. rho and p are NaN for n < 3 or a constant input.
    """

    rho: float
    p_value: float
    n: int
    exact: bool

    def as_dict(self) -> dict:
        return asdict(self)


EXACT_MAX_N = 8  # 8! = 40320 permutations


def _ranks(x: np.ndarray) -> np.ndarray:
    return _st.rankdata(x)  # average ranks for ties


def _pearson(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a - a.mean(), b - b.mean()
    return float((a * b).sum() / math.sqrt((a * a).sum() * (b * b).sum()))


def rank_correlation(x: Iterable[float], y: Iterable[float]) -> RankCorrelation:
    """Spearman's rho of paired ``x``, ``y`` (pairs with a non-finite value dropped).

    rho is the Pearson correlation of the (average) ranks. For n <= EXACT_MAX_N
    the two-sided p is exact under H0 "every pairing of the ranks is equally
    likely": the share of the n! permutations of y's ranks whose |rho| >= the
    observed |rho| (so the smallest p is 2/n! without ties: 1/3 at n = 3,
    1/12 at n = 4). Above, scipy's t-approximation.
    """
    a, b = _as_1d(x), _as_1d(y)
    if a.shape != b.shape:
        raise ValueError(f"paired arrays differ in length: {a.shape[0]} vs {b.shape[0]}")
    ok = np.isfinite(a) & np.isfinite(b)
    a, b = a[ok], b[ok]
    n = int(a.size)
    if n < 3 or np.all(a == a[0]) or np.all(b == b[0]):
        return RankCorrelation(math.nan, math.nan, n, n <= EXACT_MAX_N)
    ra, rb = _ranks(a), _ranks(b)
    rho = _pearson(ra, rb)
    if n > EXACT_MAX_N:
        return RankCorrelation(rho, float(_st.spearmanr(a, b).pvalue), n, False)
    import itertools

    hits = total = 0
    for perm in itertools.permutations(rb):
        total += 1
        # the 1e-12 keeps permutations equal to the observed |rho| despite rounding
        hits += abs(_pearson(ra, np.asarray(perm))) >= abs(rho) - 1e-12
    return RankCorrelation(rho, hits / total, n, True)


def _isnan(v) -> bool:
    try:
        return bool(np.isnan(v))
    except TypeError:
        return v is None


_LOWER_TOKENS = ("perplexity", "ppl", "nll", "loss", "bits_per_byte", "byte_perplexity", "bpb")


def lower_is_better(metric: str) -> bool:
    """True for perplexity / NLL / loss / bits-per-byte metrics, False for accuracies."""
    m = metric.lower().split("/")[-1]
    return any(t in m for t in _LOWER_TOKENS)
