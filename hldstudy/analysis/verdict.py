"""The one verdict rule: a gap's interval read against the paper's figure, symmetric in
both directions; the equivalence reading of an effect; one multiplicity correction.

Design notes: `docs/analysis.md`, under this file's name.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hldstudy.analysis.intervals import ALPHA, Interval, tost_p
from hldstudy.analysis.stats import holm

PAPER_GAP_PCT = -0.26  # HLDF vs KD, validation perplexity, % (negative: HLDF ahead)
AGREES, DISAGREES, CANNOT_TELL = "agrees", "disagrees", "cannot tell"
EXPLORATORY = "exploratory"  # picked on the runs that would judge it: no verdict
# An effect (a factor's, an interaction's) on the gap: resolved either way, or neither.
MOVES, WITHIN_MARGIN = "moves the gap", "does not move it"
EQUIVALENCE_MARGIN_PCT = abs(PAPER_GAP_PCT)  # an effect smaller than the paper's whole gap
CORRECTION = "Holm"


@dataclass(frozen=True)
class Verdict:
    """A gap's reading. `word`: AGREES / DISAGREES / CANNOT_TELL / EXPLORATORY; `why`:
    which part of the rule decided it; `p_zero` / `p_paper`: two-sided p of "the gap is 0"
    and "the gap is the paper's figure" from the same interval's model; `decides`: the
    hypothesis the word rests on ("zero", "paper" or None), the one whose adjusted p says
    whether it survives the correction."""

    word: str
    why: str
    p_zero: float
    p_paper: float
    decides: str | None


def read_gap(iv: Interval, paper: float = PAPER_GAP_PCT, exploratory: bool = False) -> Verdict:
    """Against "HLDF is ahead of KD by about `paper`%": the interval below 0 -> agrees;
    above 0 -> disagrees; containing 0 but excluding the paper's figure -> disagrees (no
    effect as large as the paper's); containing both -> cannot tell. An interval that is
    not defined (fewer than 2 values, none finite) -> cannot tell. `exploratory`: the
    configuration was picked on these runs -> exploratory, whatever the interval says."""
    pz, pp = iv.p_value(0.0), iv.p_value(paper)
    if not iv.defined:
        return Verdict(CANNOT_TELL, f"no interval from {iv.n} value(s)", pz, pp, None)
    side = ("below 0" if iv.hi < 0 else "above 0" if iv.lo > 0 else
            f"contains 0, excludes {paper:+.2f}" if iv.excludes(paper) else
            f"contains 0 and {paper:+.2f}")
    if exploratory:
        return Verdict(EXPLORATORY, f"picked on these runs (interval {side})", pz, pp, None)
    if iv.hi < 0:
        return Verdict(AGREES, side, pz, pp, "zero")
    if iv.lo > 0:
        return Verdict(DISAGREES, side, pz, pp, "paper")
    if iv.excludes(paper):
        return Verdict(DISAGREES, side, pz, pp, "paper")
    return Verdict(CANNOT_TELL, side, pz, pp, None)


@dataclass(frozen=True)
class EffectReading:
    """An effect's reading: MOVES (its interval excludes 0), WITHIN_MARGIN (equivalence:
    TOST p < alpha against +-margin) or CANNOT_TELL; `p_zero`, `p_equiv` as read."""

    word: str
    p_zero: float
    p_equiv: float
    margin: float


def read_effect(iv: Interval, margin: float = EQUIVALENCE_MARGIN_PCT,
                alpha: float = ALPHA) -> EffectReading:
    pz, pe = iv.p_value(0.0), tost_p(iv, margin)
    if iv.excludes(0.0):
        word = MOVES
    elif np.isfinite(pe) and pe < alpha:
        word = WITHIN_MARGIN
    else:
        word = CANNOT_TELL
    return EffectReading(word, pz, pe, margin)


def adjust(p_values: list[float]) -> list[float]:
    """The report's one family-wise correction (Holm) over every p it reads a call from;
    NaN passed through."""
    return [float(x) for x in holm(p_values)]
