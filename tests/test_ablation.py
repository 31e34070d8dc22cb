"""The HLDF ablation's reading (`hldstudy.analysis.ablation`): gaps to KD paired by
regime and seed, factor effects paired on the other factors, verdicts with power."""

import math

import numpy as np
import pandas as pd

from hldstudy.analysis import ablation


def _runs(gap_of, seeds=(0, 1, 2), noise=0.0):
    """KD at ppl 10 per (regime, seed); HLDF at 10 x (1 + gap/100) for each configuration."""
    rng = np.random.default_rng(0)
    rows = []
    for alpha in (0.5, 0.9):
        for s in seeds:
            rows.append({"status": "done", "method": "kd", "alpha": alpha, "seed": s,
                         "valid_ppl": 10.0, "hldf_stage1_share": math.nan,
                         "stage_boundary": None, "nmse": None})
            for share in (0.1, 0.2):
                for boundary in ("restart", "continue"):
                    for nmse in ("batch", "token"):
                        gap = gap_of(alpha, share, boundary, nmse) + noise * rng.normal()
                        rows.append({"status": "done", "method": "hldf", "alpha": alpha,
                                     "seed": s, "valid_ppl": 10.0 * (1 + gap / 100),
                                     "hldf_stage1_share": share, "stage_boundary": boundary,
                                     "nmse": nmse})
    return pd.DataFrame(rows)


def test_factor_effects_are_the_paired_changes_of_the_gap():
    # continue lowers the gap by 2 points, token by 0.5, share 0.1 raises it by 1
    def gap(alpha, share, boundary, nmse):
        return 3.0 - 2.0 * (boundary == "continue") - 0.5 * (nmse == "token") \
            + 1.0 * (share == 0.1)

    g = ablation.gaps(_runs(gap))
    assert len(g) == 2 * 3 * 8
    eff = ablation.factor_effects(g, n_resamples=200).set_index(["alpha", "factor", "level"])
    assert abs(eff.loc[(0.5, "stage_boundary", "continue"), "effect_pct"] + 2.0) < 1e-9
    assert abs(eff.loc[(0.9, "nmse", "token"), "effect_pct"] + 0.5) < 1e-9
    assert abs(eff.loc[(0.5, "hldf_stage1_share", 0.1), "effect_pct"] - 1.0) < 1e-9
    assert eff.loc[(0.5, "nmse", "token"), "cells"] == 3 * 2 * 2  # seeds x other factors


def test_too_few_seeds_cannot_tell_and_enough_seeds_read_a_verdict():
    """A gap of -0.3% with seed noise 1%: 2 seeds cannot tell; with noise 0.02% and 3
    seeds it agrees; +2% clearly behind disagrees."""
    few = ablation.config_table(ablation.gaps(_runs(lambda *a: -0.3, seeds=(0, 1), noise=1.0)),
                                n_resamples=500)
    assert set(few["verdict"]) == {ablation.CANNOT_TELL}
    clear = ablation.config_table(ablation.gaps(_runs(lambda *a: -0.3, noise=0.02)),
                                  n_resamples=500)
    assert set(clear["verdict"]) == {ablation.AGREES}
    behind = ablation.config_table(ablation.gaps(_runs(lambda *a: 2.0, noise=0.02)),
                                   n_resamples=500)
    assert set(behind["verdict"]) == {ablation.DISAGREES}
    assert ablation.verdict(-0.1, 0.1, 0.05) == ablation.DISAGREES  # could see -0.26, did not
    assert ablation.verdict(-1.0, 1.0, 2.0) == ablation.CANNOT_TELL


def test_the_report_reads_each_claim(tmp_path, monkeypatch):
    def gap(alpha, share, boundary, nmse):
        return (1.0 if alpha == 0.5 else -0.5) - 0.8 * (boundary == "continue")

    frame = _runs(gap, noise=0.01)
    monkeypatch.setattr(ablation, "load_runs", lambda runs_dir, check_names: frame)
    summary = ablation.write_report("runs", tmp_path, n_resamples=300)
    words = [c["verdict"] for c in summary["claims"]]
    assert words[:2] == [ablation.DISAGREES, ablation.AGREES]  # default protocol per regime
    assert words[-1] == ablation.AGREES  # the gap is smaller where KD is weak
    md = (tmp_path / "report.md").read_text()
    assert "## Factor effects on the gap" in md and "stage_boundary=continue vs restart" in md
    assert (tmp_path / "tables" / "factor_effects.csv").is_file()


def test_categorical_axes_reach_the_analysis_as_written(tmp_path):
    """train.stage_boundary and distill.nmse are strings: a run's row keeps them (a
    numeric axis becomes a number, an axis the method does not use NaN)."""
    from hldstudy.analysis import runs as runs_mod
    from hldstudy.config import Config, DistillConfig, TrainConfig, config_to_dict, flatten

    cfg = Config(distill=DistillConfig(method="hldf", nmse="token"),
                 train=TrainConfig(stage_boundary="continue"))
    row = runs_mod._row("r", tmp_path, tmp_path, flatten(config_to_dict(cfg)), None, [])
    assert row["stage_boundary"] == "continue" and row["nmse"] == "token"
    assert row["hldf_stage1_share"] == 0.2
    kd = Config(distill=DistillConfig(method="kd"))
    row = runs_mod._row("k", tmp_path, tmp_path, flatten(config_to_dict(kd)), None, [])
    assert math.isnan(row["stage_boundary"]) and math.isnan(row["nmse"])
