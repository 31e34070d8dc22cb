"""End-to-end tests of `python -m hldstudy.analysis` on a fake-but-realistic RUNS_DIR."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from scipy import stats as scipy_stats

from hldstudy.analysis import runs as runs_mod
from hldstudy.analysis.__main__ import main
from hldstudy.analysis.report import build_report
from hldstudy.analysis.runs import config_hash, load_runs
from hldstudy.config import (
    BudgetConfig,
    Config,
    DistillConfig,
    TeacherConfig,
    TrainConfig,
    config_to_dict,
)
from hldstudy.errors import InputError

FLOPS_PER_STEP = {"baseline": 0.96e9, "kd": 1.0e9, "hldf": 1.01e9, "hldc": 1.03e9, "patient": 1.05e9}
# Systematic relative perplexity effect vs KD (negative = better).
EFFECT = {"baseline": +0.025, "kd": 0.0, "hldf": -0.004, "hldc": +0.001, "patient": +0.002}


def run_name(method, lr, temp, alpha, seed, hw=None):
    if method == "baseline":
        return f"baseline_lr{lr:g}_s{seed}"
    name = f"{method}_lr{lr:g}_T{temp:g}_a{alpha:g}"
    if hw is not None:
        name += f"_hw{hw:g}"
    return name + f"_s{seed}"


def write_run(root: Path, method, lr, temp, alpha, seed, *, budget=1e15, hw=1.0, name=None,
              finished=True, rng=None, count_teacher=False, extra_results=None, subdir=None,
              teacher="/ckpt/teacher"):
    rng = rng or np.random.default_rng(0)
    name = name or run_name(method, lr, temp, alpha, seed)
    d = root / subdir / name if subdir else root / name
    d.mkdir(parents=True)
    cfg = Config(
        name=name,
        train=TrainConfig(lr=lr, seed=seed),
        distill=DistillConfig(method=method, temperature=temp, alpha=alpha, hidden_weight=hw),
        teacher=TeacherConfig(checkpoint=None if method == "baseline" else teacher),
        budget=BudgetConfig(flops=budget, count_teacher=count_teacher),
    )
    cfg_dict = config_to_dict(cfg)
    (d / "config.json").write_text(json.dumps(cfg_dict, indent=2, sort_keys=True))
    if not finished:
        return d
    # U-shaped perplexity in log-lr, mild temperature effect, method effect, seed noise.
    base = 28.0 * (1 + 0.08 * (math.log10(lr) - math.log10(3e-3)) ** 2) * (1 + 0.01 * (temp - 1))
    ppl = base * (1 + EFFECT[method]) * (1 + 0.0015 * rng.standard_normal())
    fps = FLOPS_PER_STEP[method]
    steps = int(budget // fps)
    hs = 0.30 - 0.004 * (ppl - 28) + 0.004 * rng.standard_normal()
    lam = 0.35 - 0.006 * (ppl - 28) + 0.006 * rng.standard_normal()
    res = {
        "status": "done", "steps": steps, "flops_spent": steps * fps, "flops_budget": budget,
        "valid_nll": math.log(ppl), "valid_ppl": ppl, "run_id": name,
        # what hldstudy.train records next to the metrics
        "name": name, "method": method, "count_teacher": count_teacher,
        "config_hash": config_hash(cfg_dict)[:16],
        "eval": {
            "hellaswag": {"acc": hs, "acc_stderr": 0.0046, "acc_norm": hs + 0.02,
                          "acc_norm_stderr": 0.0046},
            "lambada_openai": {"acc,none": lam, "acc_stderr,none": 0.0066,
                               "perplexity,none": 60 * ppl / 28, "perplexity_stderr,none": 2.0},
        },
    }
    res.update(extra_results or {})
    (d / "results.json").write_text(json.dumps(res))
    return d


def make_runs_dir(root: Path, *, methods=("baseline", "kd", "hldf", "hldc"),
                  lrs=(1e-3, 3e-3, 1e-2), temps=(1.0, 2.0), alphas=(0.5,), seeds=(0, 1),
                  budget=1e15, sweep=True, seed=0) -> list[str]:
    rng = np.random.default_rng(seed)
    names = []
    for method in methods:
        for lr in lrs:
            for temp in (temps if method != "baseline" else (1.0,)):
                for alpha in (alphas if method != "baseline" else (0.5,)):
                    for s in seeds:
                        d = write_run(root, method, lr, temp, alpha, s, budget=budget, rng=rng)
                        names.append(d.name)
    if sweep:
        (root / "sweep.json").write_text(json.dumps(
            {"runs": [{"run_id": n, "dir": n} for n in names]}))
    return names


# --------------------------------------------------------------------------- #


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    names = make_runs_dir(root)
    # one unfinished run and one listed-but-never-started run
    write_run(root, "hldc", 3e-2, 1.0, 0.5, 0, finished=False)
    sweep = json.loads((root / "sweep.json").read_text())
    sweep["runs"] += [{"run_id": "hldc_lr0.03_T1_a0.5_s0", "dir": "hldc_lr0.03_T1_a0.5_s0"},
                      {"run_id": "kd_lr0.03_T1_a0.5_s0", "dir": "kd_lr0.03_T1_a0.5_s0"}]
    (root / "sweep.json").write_text(json.dumps(sweep))
    out = tmp_path_factory.mktemp("report")
    summary = build_report(root, out, n_resamples=2000)
    return root, out, summary, names


def test_report_files(report):
    _, out, summary, _ = report
    md = (out / "report.md").read_text()
    for f in ("points.csv", "best_vs_best.csv", "grid_summary.csv", "seed_variance.csv",
              "flops.csv", "flops_runs.csv", "accounting.csv", "runs.csv"):
        assert (out / "tables" / f).exists(), f
    on_disk = json.loads((out / "summary.json").read_text())
    assert on_disk["budgets"][0]["budget"] == summary["budgets"][0]["budget"]
    # figures exist and are embedded by relative path
    figs = summary["budgets"][0]["figures"]
    assert set(figs) == {"ppl_vs_lr", "delta_vs_kd", "downstream_best"}
    for rel in figs.values():
        assert (out / rel).exists() and (out / rel).stat().st_size > 5000
        assert f"]({rel})" in md
    # header states compute accounting, selection rule and statistics
    assert "teacher FLOPs not counted" in md
    assert "compute-matched at 1e+15 FLOPs" in md
    assert "lowest *seed-mean validation perplexity*" in md
    assert "percentile bootstrap" in md and "sign test" in md and "Holm" in md
    for section in ("Best vs best", "Across the grid", "Point by point", "Seed variance",
                    "Compute matching", "Run accounting"):
        assert section in md


def test_every_run_accounted_once(report):
    root, out, summary, names = report
    accounting = (out / "tables" / "accounting.csv").read_text().splitlines()[1:]
    ids = [line.split(",")[0] for line in accounting]
    assert len(ids) == len(set(ids))
    expected = set(names) | {"hldc_lr0.03_T1_a0.5_s0", "kd_lr0.03_T1_a0.5_s0"}
    assert set(ids) == expected
    assert set(summary["runs"]) == expected
    assert summary["runs"]["hldc_lr0.03_T1_a0.5_s0"] == "unfinished (left out)"
    assert summary["runs"]["kd_lr0.03_T1_a0.5_s0"] == "missing (left out)"
    assert summary["runs"]["baseline_lr0.001_s0"].startswith("baseline")
    assert summary["runs"]["hldf_lr0.001_T1_a0.5_s0"] == "compared (paired)"
    assert summary["runs"]["kd_lr0.001_T1_a0.5_s0"] == "reference (paired)"
    assert summary["status_counts"] == {"done": len(names), "unfinished": 1, "missing": 1}
    assert any("not done" in w for w in summary["warnings"])


def test_summary_statistics(report):
    _, _, summary, _ = report
    b = summary["budgets"][0]
    assert b["teacher_flops_counted"] is False
    assert b["n_pairs"] == 2 * 3 * 2 * 2  # (hldf, hldc) x lr x T x seed
    hldf = b["arms"]["hldf"]["vs_reference"]["valid_ppl (%)"]
    # 6 grid points; true effect -0.4% with 0.15% noise per run
    assert hldf["n_points"] == 6
    assert hldf["ci_lo"] <= hldf["mean_delta"] <= hldf["ci_hi"]
    assert hldf["ci_hi"] < 0  # clearly better than KD
    assert hldf["n_better"] == 6 and hldf["sign_p"] == pytest.approx(2 / 64)
    assert math.isfinite(hldf["seed_std"])
    # best vs best: KD's best is at lr 3e-3, T=1 (U-shape minimum, temperature hurts)
    best = b["arms"]["kd"]["best"]
    assert best["config"]["lr"] == pytest.approx(3e-3)
    assert best["config"]["temperature"] == 1.0
    assert len(best["run_ids"]) == 2
    assert set(best["downstream"]) == {"hellaswag/acc", "hellaswag/acc_norm",
                                       "lambada_openai/acc", "lambada_openai/perplexity"}
    assert b["arms"]["baseline"]["best"]["config"]["temperature"] is None
    # FLOPs: floor(C / fps) steps -> under budget by < one step
    assert 0 < b["max_abs_flops_dev_pct"] < 100 * 1.03e9 / 1e15


def test_cli_writes_report_and_skips_wandb_offline(tmp_path, monkeypatch, capsys, caplog):
    root = tmp_path / "runs"
    make_runs_dir(root, methods=("kd", "hldf"), lrs=(1e-3, 3e-3), temps=(1.0,), seeds=(0,),
                  sweep=False)
    monkeypatch.setenv("WANDB_MODE", "offline")
    with caplog.at_level(logging.WARNING, logger="hldstudy.analysis"):
        rc = main([str(root), "--out", str(tmp_path / "rep"), "--wandb-report",
                   "--n-resamples", "500"])
    assert rc == 0
    assert (tmp_path / "rep" / "report.md").exists()
    assert "wandb-report skipped" in caplog.text and "WANDB_MODE=offline" in caplog.text
    summary = json.loads((tmp_path / "rep" / "summary.json").read_text())
    assert summary["wandb_report"] is None
    # one seed: no seed variance, said so
    assert "seed variance cannot be estimated" in (tmp_path / "rep" / "report.md").read_text()


# --------------------------------------------------------------------------- #
# Errors
# --------------------------------------------------------------------------- #


def _cli_error(argv, capsys) -> str:
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert len(err.strip().splitlines()) == 1
    return err


def test_empty_dir(tmp_path, capsys):
    (tmp_path / "runs").mkdir()
    err = _cli_error([str(tmp_path / "runs"), "--out", str(tmp_path / "o")], capsys)
    assert "no run directories" in err


def test_no_finished_runs(tmp_path, capsys):
    write_run(tmp_path / "runs", "kd", 1e-3, 1.0, 0.5, 0, finished=False)
    err = _cli_error([str(tmp_path / "runs"), "--out", str(tmp_path / "o")], capsys)
    assert "no finished runs" in err


def test_missing_dir(tmp_path, capsys):
    err = _cli_error([str(tmp_path / "nope"), "--out", str(tmp_path / "o")], capsys)
    assert "does not exist" in err


def test_mixed_budgets(tmp_path, capsys):
    root = tmp_path / "runs"
    make_runs_dir(root, methods=("kd", "hldf"), lrs=(1e-3,), temps=(1.0,), seeds=(0,),
                  budget=1e15, sweep=False)
    write_run(root, "kd", 3e-3, 1.0, 0.5, 0, budget=4e15, name="big_kd_lr0.003")
    write_run(root, "hldf", 3e-3, 1.0, 0.5, 0, budget=4e15, name="big_hldf_lr0.003")
    err = _cli_error([str(root), "--out", str(tmp_path / "o")], capsys)
    assert "different FLOP budgets" in err and "1e+15" in err and "4e+15" in err
    assert "big_kd_lr0.003" in err and "--allow-mixed-budgets" in err
    # with the flag: one section per budget, each budget analysed on its own
    summary = build_report(root, tmp_path / "o", allow_mixed_budgets=True, n_resamples=200)
    assert [b["n_runs_compared"] for b in summary["budgets"]] == [2, 2]
    md = (tmp_path / "o" / "report.md").read_text()
    assert md.count("## Budget:") == 2
    assert (tmp_path / "o" / "tables" / "points_b2.csv").exists()


def test_teacher_accounting_mixed_is_a_different_budget(tmp_path):
    root = tmp_path / "runs"
    write_run(root, "kd", 1e-3, 1.0, 0.5, 0)
    write_run(root, "hldf", 1e-3, 1.0, 0.5, 0, count_teacher=True)
    with pytest.raises(InputError, match="teacher counted"):
        load_runs(root)


def test_mismatched_run_id(tmp_path, capsys):
    root = tmp_path / "runs"
    make_runs_dir(root, methods=("kd",), lrs=(1e-3,), temps=(1.0,), seeds=(0,), sweep=False)
    write_run(root, "hldf", 1e-3, 1.0, 0.5, 0, name="run7", extra_results={"run_id": "run3"})
    err = _cli_error([str(root), "--out", str(tmp_path / "o")], capsys)
    assert "does not match its directory" in err and "run7" in err and "run3" in err


def test_mismatched_name_hyperparameters(tmp_path):
    root = tmp_path / "runs"
    write_run(root, "kd", 1e-3, 1.0, 0.5, 0)
    # folder says lr 3e-3 but the config holds 1e-3 (config overwritten / dir renamed)
    write_run(root, "hldf", 1e-3, 1.0, 0.5, 0, name="hldf_lr3e-3_T1_a0.5_s0")
    with pytest.raises(InputError, match=r"name says lr=3e-3 but train\.lr=0\.001"):
        load_runs(root)
    # the check can be switched off
    assert len(load_runs(root, check_names=False)) == 2


def test_name_precision():
    flat = {"train.lr": 0.0031, "distill.temperature": 2.0, "distill.method": "kd",
            "train.seed": 1}
    assert runs_mod.name_mismatches("kd_lr3e-3_T2_s1", flat) == []  # 1 significant digit
    assert runs_mod.name_mismatches("kd_lr3.1e-3_T2.0_s1", flat) == []
    assert len(runs_mod.name_mismatches("kd_lr3.0e-3_T2_s1", flat)) == 1  # 2 digits: 3.1 != 3.0
    assert len(runs_mod.name_mismatches("hldf_lr3e-3_T2_s1", flat)) == 1  # method
    assert len(runs_mod.name_mismatches("kd_lr3e-3_T2_s2", flat)) == 1  # seed
    assert runs_mod.name_mismatches("run_0007", flat) == []  # no encoded hparams


def test_edited_config_hash(tmp_path):
    root = tmp_path / "runs"
    write_run(root, "kd", 1e-3, 1.0, 0.5, 0, name="r1")
    d = write_run(root, "hldf", 1e-3, 1.0, 0.5, 0, name="r2")
    cfg = json.loads((d / "config.json").read_text())
    cfg["distill"]["temperature"] = 4.0
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(InputError, match="r2: config.json hash"):
        load_runs(root)


def test_sweep_params_mismatch(tmp_path):
    root = tmp_path / "runs"
    write_run(root, "kd", 1e-3, 1.0, 0.5, 0, name="r1")
    (root / "sweep.json").write_text(json.dumps({"runs": [
        {"run_id": "r1", "dir": "r1", "overrides": ["train.lr=0.003", "distill.method=kd"]}]}))
    with pytest.raises(InputError, match=r"sweep.json sets train.lr=0.003 but config has 0.001"):
        load_runs(root)


def test_load_runs_columns_and_nesting(tmp_path, caplog):
    root = tmp_path / "runs"
    write_run(root, "kd", 1e-3, 1.0, 0.5, 0, subdir="g1")
    write_run(root, "hldc", 1e-3, 1.0, 0.5, 0, subdir="g1", hw=0.5,
              name=run_name("hldc", 1e-3, 1.0, 0.5, 0, hw=0.5))
    write_run(root, "hldc", 1e-3, 1.0, 0.5, 0, subdir="g2", hw=2.0,
              name=run_name("hldc", 1e-3, 1.0, 0.5, 0, hw=2.0))
    write_run(root, "hldf", 1e-3, 1.0, 0.5, 0, subdir="g2", finished=False)
    with caplog.at_level(logging.WARNING, logger="hldstudy.analysis"):
        df = load_runs(root)
    assert "not done" in caplog.text
    assert len(df) == 4
    for c in ("run_id", "method", "lr", "temperature", "alpha", "hidden_weight", "seed",
              "budget", "flops_spent", "steps", "valid_ppl", "valid_nll", "status",
              "hellaswag/acc", "hellaswag/acc_stderr", "lambada_openai/perplexity"):
        assert c in df.columns, c
    assert set(df["run_id"]) >= {"g1/kd_lr0.001_T1_a0.5_s0", "g2/hldf_lr0.001_T1_a0.5_s0"}
    # hidden weight varies within hldc -> two arms
    assert set(df.loc[df["method"] == "hldc", "arm"]) == {"hldc[hw=0.5]", "hldc[hw=2]"}
    assert df.loc[df["method"] == "kd", "hidden_weight"].isna().all()
    assert (df.loc[df["run_id"].str.contains("hldf"), "status"] == "unfinished").all()


def test_extra_varying_config_field_is_a_grid_dimension(tmp_path):
    root = tmp_path / "runs"
    for method in ("kd", "hldf"):
        for div in ("forward_kl", "reverse_kl"):
            d = write_run(root, method, 1e-3, 1.0, 0.5, 0, name=f"{method}_{div}")
            cfg = json.loads((d / "config.json").read_text())
            cfg["distill"]["divergence"] = div
            (d / "config.json").write_text(json.dumps(cfg))
            res = json.loads((d / "results.json").read_text())
            res.pop("config_hash")
            (d / "results.json").write_text(json.dumps(res))
    df = load_runs(root)
    assert "distill.divergence" in df.attrs["grid_cols"]
    summary = build_report(root, tmp_path / "o", n_resamples=100)
    # hldf pairs with kd only at the same divergence: two pairs, not four
    assert summary["budgets"][0]["n_pairs"] == 2
    assert "`distill.divergence`" in (tmp_path / "o" / "report.md").read_text()


class _FakeReports:
    """Stands in for wandb_workspaces.reports.v2 to check what --wandb-report builds."""

    saved: list = []

    class _Block:
        def __init__(self, *args, **kwargs):
            self.args, self.kwargs = args, kwargs

    H1 = MarkdownBlock = Runset = ScatterPlot = PanelGrid = _Block

    class Report:
        def __init__(self, **kwargs):
            self.kwargs = kwargs
            self.url = "https://wandb.example/report/1"

        def save(self):
            _FakeReports.saved.append(self.kwargs)


def test_wandb_report_online_uses_reports_api(tmp_path, monkeypatch):
    from hldstudy.analysis import report as report_mod

    root = tmp_path / "runs"
    make_runs_dir(root, methods=("kd", "hldf"), lrs=(1e-3,), temps=(1.0,), seeds=(0,),
                  sweep=False)
    monkeypatch.setenv("WANDB_MODE", "online")
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    monkeypatch.setattr(report_mod, "_import_reports", lambda: _FakeReports)
    _FakeReports.saved.clear()
    summary = build_report(root, tmp_path / "o", n_resamples=100, wandb_report=True)
    assert summary["wandb_report"] == "https://wandb.example/report/1"
    (kw,) = _FakeReports.saved
    assert kw["project"] == "hldstudy"
    md_block = kw["blocks"][1]
    assert "Best vs best" in md_block.kwargs["text"]
    assert "](figures/" not in md_block.kwargs["text"]  # no dead local image links


def test_results_recorded_by_trainer_must_match_config(tmp_path):
    root = tmp_path / "runs"
    write_run(root, "kd", 1e-3, 1.0, 0.5, 0, name="r1")
    d = write_run(root, "hldf", 1e-3, 1.0, 0.5, 0, name="r2")
    res = json.loads((d / "results.json").read_text())
    res.pop("config_hash")
    res["method"] = "hldc"  # config.json was overwritten by another method's config
    (d / "results.json").write_text(json.dumps(res))
    with pytest.raises(InputError, match="results.json method=hldc but config distill.method=hldf"):
        load_runs(root)


def test_teacher_run_next_to_students_is_left_out(tmp_path):
    root = tmp_path / "runs"
    write_run(root, "baseline", 1e-3, 1.0, 0.5, 0, name="teacher", budget=0.0)
    for m in ("kd", "hldf"):
        write_run(root, m, 1e-3, 1.0, 0.5, 0, teacher=str(root / "teacher"))
    df = load_runs(root)  # no mixed-budget error: the teacher is not a contestant
    assert df.set_index("run_id").loc["teacher", "status"] == "teacher"
    summary = build_report(root, tmp_path / "o", n_resamples=100)
    assert summary["runs"]["teacher"] == "teacher of the students (left out)"
    assert "baseline" not in summary["budgets"][0]["arms"]


# --------------------------------------------------------------------------- #
# Against the paper (hldstudy.analysis.paper), on hand-computed cases
# --------------------------------------------------------------------------- #

from hldstudy.analysis import paper, tables  # noqa: E402

# KD's perplexity at four shared points, HLDF's relative change there (%): the gain grows
# where KD is weak (rank correlation -1), HLDC is 1% worse everywhere.
POINTS = [(1e-3, 1.0), (1e-3, 2.0), (3e-3, 1.0), (3e-3, 2.0)]
KD_PPL = [10.0, 20.0, 40.0, 80.0]
HLDF_PCT = [-1.0, -2.0, -3.0, -4.0]


def _exact_run(root, method, lr, temp, seed, ppl, acc):
    return write_run(root, method, lr, temp, 0.5, seed, extra_results={
        "valid_ppl": ppl, "valid_nll": math.log(ppl),
        "eval": {"synth_mc": {"acc": acc, "acc_stderr": 0.01}}})


def _paper_runs(root, hldf_acc_delta=0.05):
    for (lr, temp), kd, pct in zip(POINTS, KD_PPL, HLDF_PCT, strict=True):
        _exact_run(root, "kd", lr, temp, 0, kd, 0.30)
        _exact_run(root, "hldf", lr, temp, 0, kd * (1 + pct / 100), 0.30 + hldf_acc_delta)
        _exact_run(root, "hldc", lr, temp, 0, kd * 1.01, 0.30)


@pytest.fixture(scope="module")
def paper_budget(tmp_path_factory):
    root = tmp_path_factory.mktemp("paper_runs")
    _paper_runs(root)
    df = load_runs(root)
    kept, _ = tables.dedupe(tables.finished(df))
    pairs, _ = tables.point_table(kept)
    summary = tables.grid_summary(pairs, n_resamples=2000)
    best = tables.best_table(kept)
    return root, kept, pairs, summary, best


def test_paper_claim1_hldf_gain_read_with_its_statistics(paper_budget):
    _, _, _, summary, best = paper_budget
    r = paper.read_ppl_gain(summary, best)
    # mean of -1, -2, -3, -4 = -2.5%, sd 1.291: t(3) interval -2.5 -+ 3.182 x 0.6455 =
    # [-4.55, -0.446]: below 0, so it agrees (the rule is symmetric: power is no gate)
    assert r.verdict == paper.AGREES
    assert "95% t interval [-4.55, -0.446]; below 0)" in r.shows[0]
    assert "mean Δppl -2.50%" in r.shows[0]
    assert "better at 4, worse at 0, tied at 0; p vs 0 0.0305" in r.shows[0]
    # power 0.8 at sd 1.291 over 4 points; the paper's 0.26% would need many more
    assert "smallest detectable mean Δ 2.75% (power 0.8)" in r.shows[0]
    assert "would need 196 units at this spread" in r.shows[0]
    # best vs best: HLDF's best (9.9 at lr 1e-3, T 1) vs KD's best (10): -1%, exploratory
    assert "Best vs best (exploratory: each arm's best picked on these runs): -1.0" \
        in r.shows[0] and "% (1 seed(s))" in r.shows[0]
    assert not any("not systematic" in c for c in r.caveats)


def _claim1_row(**kw):
    row = {"arm": "hldf", "metric": paper.PPL_METRIC, "n_points": 8, "n_pairs": 8,
           "unit": "grid point", "n_units": 8, "mean_delta": 1.5, "ci_lo": 0.5, "ci_hi": 2.5,
           "delta_sd": 1.196, "n_better": 1, "n_worse": 7, "n_tie": 0, "sign_p": 0.0703,
           "seed_std": 2.0}
    return pd.DataFrame([{**row, **kw}])


def test_paper_claim1_one_rule_both_directions_and_silent():
    # interval [0.5, 2.5]: above 0 -> disagrees, however few the points
    r = paper.read_ppl_gain(_claim1_row(), pd.DataFrame())
    assert r.verdict == paper.DISAGREES and "above 0" in r.shows[0]
    assert any("not systematic" in c for c in r.caveats)
    assert any("below the seed noise" in c for c in r.caveats)  # |1.5| < 2.0
    gain = _claim1_row(mean_delta=-0.3, ci_lo=-0.4, ci_hi=-0.2, delta_sd=0.12, n_better=8,
                       n_worse=0, seed_std=0.1)
    assert paper.read_ppl_gain(gain, pd.DataFrame()).verdict == paper.AGREES
    level = _claim1_row(mean_delta=0.0, ci_lo=-0.1, ci_hi=0.1, delta_sd=0.12)
    r = paper.read_ppl_gain(level, pd.DataFrame())  # contains 0, excludes -0.26
    assert r.verdict == paper.DISAGREES and "excludes -0.26" in r.shows[0]
    wide = _claim1_row(mean_delta=0.0, ci_lo=-1.0, ci_hi=1.0, delta_sd=1.2)
    assert paper.read_ppl_gain(wide, pd.DataFrame()).verdict == paper.CANNOT_TELL
    one = _claim1_row(n_units=1, ci_lo=float("nan"), ci_hi=float("nan"),
                      delta_sd=float("nan"))
    assert paper.read_ppl_gain(one, pd.DataFrame()).verdict == paper.CANNOT_TELL
    only_hldc = _claim1_row(arm="hldc")
    assert paper.read_ppl_gain(only_hldc, pd.DataFrame()).verdict == paper.SILENT


def test_paper_claim2_downstream(paper_budget):
    _, _, _, summary, best = paper_budget
    r = paper.read_downstream(summary, best)
    hldf = next(s for s in r.shows if s.startswith("`hldf`"))
    # +0.05 at all 4 points: CI [0.05, 0.05] excludes 0, but sign p = 0.125 (Holm, 1 metric)
    assert "better at Holm p < 0.05 on none" in hldf
    assert "towards better on `synth_mc/acc`" in hldf
    # best vs best: 0.05 > 1.96 * sqrt(0.01^2 + 0.01^2) = 0.0277
    assert "Best vs best, |Δ| > 1.96 combined stderr: better on `synth_mc/acc`" in hldf
    assert r.verdict == paper.NO_WINNER_UNRESOLVED  # 4 points cannot separate: not "agrees"
    assert any("cannot reach p < 0.05" in c for c in r.caveats)


def _down_row(arm, metric, better, n_better, n_worse, holm_p, n=7):
    return {"arm": arm, "metric": metric, "better": better, "n_points": n,
            "mean_delta": 0.0, "ci_lo": -1.0, "ci_hi": 1.0, "n_better": n_better,
            "n_worse": n_worse, "n_tie": n - n_better - n_worse, "sign_p": holm_p,
            "sign_p_holm": holm_p, "wilcoxon_p": holm_p, "seed_std": math.nan}


def test_paper_claim2_winner_or_not():
    ppl = {**_down_row("hldf", paper.PPL_METRIC, "lower", 7, 0, 0.0156), "n_better": 7}
    # 7 points: sign p 2/128 = 0.0156, Holm x2 = 0.031 < 0.05 on both metrics
    mixed = pd.DataFrame([ppl, _down_row("hldf", "a/acc", "higher", 7, 0, 0.031),
                          _down_row("hldf", "b/acc", "higher", 0, 7, 0.031)])
    r = paper.read_downstream(mixed, pd.DataFrame())
    assert r.verdict == paper.AGREES and not r.caveats
    assert "better at Holm p < 0.05 on `a/acc`, worse on `b/acc`" in r.shows[0]
    sweep = pd.DataFrame([ppl, _down_row("hldf", "a/acc", "higher", 7, 0, 0.031),
                          _down_row("hldf", "b/perplexity", "lower", 7, 0, 0.031)])
    r = paper.read_downstream(sweep, pd.DataFrame())
    assert r.verdict == paper.DIFFERS
    assert "`hldf` better than `kd` on every metric" in r.shows[-1]
    assert paper._combine([paper.AGREES, paper.OPPOSITE_UNRESOLVED]) == paper.MIXED
    assert paper._combine([paper.SILENT, paper.AGREES]) == paper.AGREES
    assert paper.read_downstream(pd.DataFrame([ppl]), pd.DataFrame()).verdict == paper.SILENT


def test_paper_claim3_gains_where_kd_is_weak(paper_budget):
    _, _, pairs, _, _ = paper_budget
    r = paper.read_kd_weak(pairs)
    hldf = next(s for s in r.shows if s.startswith("`hldf`"))
    # KD ppl 10 < 20 < 40 < 80 against Δ -1 > -2 > -3 > -4: ρ = -1, exact p = 2/4! = 0.0833
    assert "Spearman ρ(kd ppl, Δppl%) = -1.00, exact p 0.0833" in hldf
    # KD's median ppl is 30: Δ -3.5% at the two weaker points, -1.5% at the others
    assert "mean Δppl -3.50% where kd is weaker than its median (ppl > 30)" in hldf
    assert "-1.50% elsewhere" in hldf
    # HLDC's Δ is +1% everywhere: no rank correlation, left out of the verdict
    assert any(s.startswith("`hldc`") and "no rank correlation" in s for s in r.shows)
    assert r.verdict == paper.CANNOT_TELL  # 4 points: the exact p cannot reach 0.05
    assert any("cannot go below 0.0833" in c for c in r.caveats)


def test_paper_setting_and_section_in_report(tmp_path):
    root = tmp_path / "runs"
    _paper_runs(root)
    summary = build_report(root, tmp_path / "rep", n_resamples=500)
    md = (tmp_path / "rep" / "report.md").read_text()
    assert "### Against the paper" in md
    assert md.index("### Against the paper") < md.index("### Best vs best")
    verdicts = [c["verdict"] for c in summary["budgets"][0]["against_paper"]]
    assert verdicts == [paper.AGREES] + [paper.CANNOT_TELL] * 2
    assert "Holm-adjusted once over all the tests of the three claims" in md
    cfg = Config()
    kd_tokens = int(1e15 // FLOPS_PER_STEP["kd"]) * cfg.data.batch_size * cfg.data.seq_len
    assert f"kd: {kd_tokens:,}" in md
    assert "| HLDF stage-1 share of the budget | not stated in DESIGN.md" in md
    assert "| 0.2 |" in md
    assert "| teacher |" in md and "not readable here" in md  # /ckpt/teacher does not exist
    assert "up to 1 per grid point; best configs: kd: 1, hldc: 1, hldf: 1" in md
    assert "One seed per grid point" in md


def test_best_config_is_chosen_on_the_seeds_every_config_ran(tmp_path):
    # kd: two configs at seed 0 (10 vs 11); the first re-run at seeds 1, 2 (12, 14): its
    # 3-seed mean (12) is worse than the other's single seed, yet it stays the choice.
    root = tmp_path / "runs"
    for seed, ppl in ((0, 10.0), (1, 12.0), (2, 14.0)):
        _exact_run(root, "kd", 1e-3, 1.0, seed, ppl, 0.3)
    _exact_run(root, "kd", 3e-3, 1.0, 0, 11.0, 0.3)
    kept, _ = tables.dedupe(tables.finished(load_runs(root)))
    assert tables.selection_seeds(kept) == [0]
    best = tables.best_table(kept).iloc[0]
    assert best["lr"] == pytest.approx(1e-3) and best["n_seeds"] == 3
    assert best["valid_ppl"] == pytest.approx(12.0)
    assert best["valid_ppl_seed_std"] == pytest.approx(2.0)


def test_paper_section_without_a_reference_or_hld_arm_cannot_speak(tmp_path):
    for i, ms in enumerate((("baseline", "hldf"), ("baseline", "kd"))):
        make_runs_dir(tmp_path / f"r{i}", methods=ms, lrs=(1e-3, 3e-3), temps=(1.0,), seeds=(0,))
        s = build_report(tmp_path / f"r{i}", tmp_path / f"rep{i}", n_resamples=100)
        assert [c["verdict"] for c in s["budgets"][0]["against_paper"]] == [paper.SILENT] * 3


def test_too_few_seeds_read_cannot_tell_and_enough_read_a_verdict():
    """The same mean gain: 4 points with a spread of 1% cannot tell (the interval holds 0
    and -0.26); 40 points with 0.2% resolve it, and the gain agrees."""
    few = paper.read_ppl_gain(_claim1_row(n_points=4, n_units=4, mean_delta=-0.3,
                                          ci_lo=-1.89, ci_hi=1.29, delta_sd=1.0),
                              pd.DataFrame())
    assert few.verdict == paper.CANNOT_TELL
    assert "smallest detectable mean Δ 2.13% (power 0.8)" in few.shows[0]
    many = _claim1_row(n_points=40, n_units=40, mean_delta=-0.3, ci_lo=-0.364, ci_hi=-0.236,
                       delta_sd=0.2, n_better=40, n_worse=0)
    assert paper.read_ppl_gain(many, pd.DataFrame()).verdict == paper.AGREES


def test_one_correction_spans_every_claim(paper_budget):
    """Claim 1's t tests, claim 2's sign tests and claim 3's rank test are Holm-adjusted
    together: each p at least its raw value, the smallest one times the whole family."""
    _, _, pairs, summary, _ = paper_budget
    adjusted = paper.adjusted_p_values(summary, pairs)
    assert {k[0] for k in adjusted} == {"ppl", "ppl_paper", "down", "kd_weak"}
    raw = {("kd_weak", "hldf"): 2 / 24}  # the exact p of rho = -1 over 4 points
    for _, r in summary.iterrows():
        if r["metric"] == paper.PPL_METRIC:  # claim 1: the t interval's two p-values
            if ("ppl", r["arm"]) in adjusted:
                se = r["delta_sd"] / np.sqrt(r["n_units"])
                for key, null in (("ppl", 0.0), ("ppl_paper", paper.PAPER_HLDF_PPL_DELTA_PCT)):
                    raw[(key, r["arm"])] = float(2 * scipy_stats.t.sf(
                        abs(r["mean_delta"] - null) / se, r["n_units"] - 1))
        elif ("down", r["arm"], r["metric"]) in adjusted:
            raw[("down", r["arm"], r["metric"])] = float(r["sign_p"])
    assert set(raw) == set(adjusted)  # hldc's claim 1 and claim 3 (no correlation) excluded
    assert all(adjusted[k] >= raw[k] - 1e-12 for k in raw)
    assert min(adjusted.values()) == pytest.approx(min(1.0, min(raw.values()) * len(raw)))
