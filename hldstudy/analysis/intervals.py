"""Intervals for a mean paired difference at the study's sample sizes (3 to 25 values),
the tests read from them, and the power of a comparison from the same model.

Design notes: `docs/analysis.md`, under this file's name.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass

import numpy as np
from scipy import optimize
from scipy import stats as _st

from hldstudy.analysis.stats import paired_bootstrap_ci

ALPHA = 0.05
POWER = 0.8


@dataclass(frozen=True)
class Interval:
    """A two-sided `level` interval for the mean of n paired differences.

    kind: "t" (Student's t from the sample's own spread, df n - 1), "pooled-t" (the spread
    pooled over several comparisons that share a noise level, df from all of them) or
    "bootstrap" (percentile; no df, no p-value). `sd`: the spread of one difference the
    interval used; `se = sd / sqrt(n)`. NaN bounds: too few values for this kind."""

    kind: str
    mean: float
    lo: float
    hi: float
    n: int
    df: float
    sd: float
    level: float = 1 - ALPHA

    @property
    def se(self) -> float:
        return self.sd / math.sqrt(self.n) if self.n > 0 else math.nan

    @property
    def defined(self) -> bool:
        return bool(np.isfinite(self.lo) and np.isfinite(self.hi))

    def excludes(self, x: float) -> bool:
        return self.defined and (self.lo > x or self.hi < x)

    def p_value(self, null: float = 0.0) -> float:
        """Two-sided p of "the mean is `null`" from the same t model (NaN for the
        bootstrap and an undefined interval); 0 when the spread is 0 and mean != null."""
        if self.kind == "bootstrap" or not self.defined or not np.isfinite(self.df):
            return math.nan
        if self.se == 0:
            return 1.0 if self.mean == null else 0.0
        return float(2 * _st.t.sf(abs(self.mean - null) / self.se, self.df))

    def as_dict(self) -> dict:
        return {**asdict(self), "se": self.se}


def _finite(values: Iterable[float]) -> np.ndarray:
    v = np.asarray(list(values) if not isinstance(values, np.ndarray) else values,
                   dtype=float).ravel()
    return v[np.isfinite(v)]


def _undefined(kind: str, v: np.ndarray, level: float) -> Interval:
    mean = float(v.mean()) if v.size else math.nan
    return Interval(kind, mean, math.nan, math.nan, int(v.size), math.nan, math.nan, level)


def _from_spread(kind: str, mean: float, n: int, sd: float, df: float,
                 level: float) -> Interval:
    half = float(_st.t.ppf(0.5 + level / 2, df)) * sd / math.sqrt(n)
    return Interval(kind, mean, mean - half, mean + half, n, float(df), float(sd), level)


def t_interval(values: Iterable[float], level: float = 1 - ALPHA) -> Interval:
    """Student's t interval of the mean (non-finite values dropped; undefined below 2)."""
    v = _finite(values)
    if v.size < 2:
        return _undefined("t", v, level)
    return _from_spread("t", float(v.mean()), int(v.size), float(v.std(ddof=1)), v.size - 1,
                        level)


def pooled_spread(groups: Sequence[Iterable[float]]) -> tuple[float, int]:
    """(sd, df): the spread pooled over groups assumed to share one noise level,
    sqrt(sum (n_i - 1) s_i^2 / df), df = sum (n_i - 1) over groups with 2+ values."""
    ss, df = 0.0, 0
    for g in groups:
        v = _finite(g)
        if v.size >= 2:
            ss += float(((v - v.mean()) ** 2).sum())
            df += v.size - 1
    return (math.sqrt(ss / df), df) if df else (math.nan, 0)


def pooled_t_interval(values: Iterable[float], sd: float, df: int,
                      level: float = 1 - ALPHA) -> Interval:
    """The t interval of one group's mean with the pooled spread `sd` (df `df`): valid
    only when the groups share their noise level (benchmarks/interval_calibration.py
    measures what it gives when they do not)."""
    v = _finite(values)
    if v.size < 1 or not (df >= 1 and np.isfinite(sd)):
        return _undefined("pooled-t", v, level)
    return _from_spread("pooled-t", float(v.mean()), int(v.size), sd, df, level)


def bootstrap_interval(values: Iterable[float], level: float = 1 - ALPHA,
                       n_resamples: int = 10_000, seed: int = 0) -> Interval:
    """The percentile bootstrap of the mean (`stats.paired_bootstrap_ci`) as an Interval:
    it undercovers below about 20 values (the calibration's table), so no report decides
    on it."""
    ci = paired_bootstrap_ci(values, n_resamples=n_resamples, level=level, seed=seed)
    v = _finite(values)
    sd = float(v.std(ddof=1)) if v.size >= 2 else math.nan
    return Interval("bootstrap", ci.mean, ci.lo, ci.hi, ci.n, math.nan, sd, level)


def tost_p(iv: Interval, margin: float) -> float:
    """Two one-sided tests of "the mean lies within +-margin" (equivalence): the larger
    of the two one-sided p's; < alpha means the (1 - 2 alpha) interval lies inside the
    margin. NaN where the interval has no t model."""
    if iv.kind == "bootstrap" or not iv.defined or not margin > 0:
        return math.nan
    if iv.se == 0:
        return 0.0 if abs(iv.mean) < margin else 1.0
    lower = _st.t.sf((iv.mean + margin) / iv.se, iv.df)   # H0: mean <= -margin
    upper = _st.t.cdf((iv.mean - margin) / iv.se, iv.df)  # H0: mean >= +margin
    return float(max(lower, upper))


def power(effect: float, sd: float, n: int, df: float | None = None,
          alpha: float = ALPHA) -> float:
    """The chance a two-sided t test at `alpha` rejects 0 when the true mean is `effect`
    (noncentral t; df n - 1 unless pooled)."""
    df = n - 1 if df is None else df
    if n < 1 or df < 1 or not (np.isfinite(sd) and sd > 0):
        return math.nan
    crit = _st.t.ppf(1 - alpha / 2, df)
    nc = abs(effect) * math.sqrt(n) / sd
    p = float(_st.nct.sf(crit, df, nc) + _st.nct.cdf(-crit, df, nc))
    return p if np.isfinite(p) else float(nc > crit)  # scipy's nct fails far in the tail


def detectable(sd: float, n: int, df: float | None = None, alpha: float = ALPHA,
               target: float = POWER) -> float:
    """The smallest |mean| that n values of spread `sd` detect with power `target` (t
    quantiles, noncentral t); inf without a spread to go on."""
    df = n - 1 if df is None else df
    if n < 1 or df < 1 or not (np.isfinite(sd) and sd > 0):
        return math.inf
    hi = sd * 20
    return float(optimize.brentq(lambda e: power(e, sd, n, df, alpha) - target, 0.0, hi,
                                 xtol=sd * 1e-6))


def seeds_needed(effect: float, sd: float, alpha: float = ALPHA, target: float = POWER,
                 limit: int = 100_000) -> int | None:
    """The fewest paired values (seeds) whose t test detects `effect` with power `target`
    at spread `sd` (None: more than `limit`, or no spread to go on)."""
    if not (np.isfinite(sd) and sd > 0) or effect == 0:
        return None
    n = 2
    while power(effect, sd, n, alpha=alpha) < target:
        n = n * 2 if n < 64 else n + max(n // 8, 1)
        if n > limit:
            return None
    lo = max(2, n // 2)
    while lo < n:  # the smallest n in (lo, n] with enough power
        mid = (lo + n) // 2
        if power(effect, sd, mid, alpha=alpha) >= target:
            n = mid
        else:
            lo = mid + 1
    return n
