"""Confirming a sweep's picks on fresh seeds (`python -m hldstudy.sweep SWEEP --confirm`):
the picks are the analysis' own best configs, written down before they run and never
chosen again; the analysis gives best vs best a verdict from those seeds alone."""

import json

import pandas as pd
import pytest
from test_sweep_e2e import _sweep_file

from hldstudy.analysis import build_report
from hldstudy.analysis.tables import best_table, confirm_table
from hldstudy.errors import InputError
from hldstudy.sweep.__main__ import main as sweep_main
from hldstudy.sweep.confirm import CONFIRM_FILE, parse_seeds


def test_seeds_parse_and_one_seed_is_refused():
    assert parse_seeds("3-5,9,3") == (3, 4, 5, 9)
    with pytest.raises(InputError, match="at least 2 fresh seeds"):
        parse_seeds("7")
    with pytest.raises(InputError, match="expected seeds like"):
        parse_seeds("a-b")


def _frame(rows):
    df = pd.DataFrame(rows, columns=["run_id", "arm", "method", "lr", "seed", "valid_ppl"])
    df.attrs = {"grid_cols": ["lr"], "metric_cols": []}
    return df


def test_only_seeds_that_chose_neither_pick_confirm_it():
    # kd and hldf over 2 lrs at seed 0 (the selection seed); the picks (kd at 1e-2, hldf at
    # 3e-3) re-run at seeds 1-3, hldf's pick at seed 4 with no kd partner.
    rows = [("kd_a_s0", "kd", "kd", 3e-3, 0, 10.0), ("kd_b_s0", "kd", "kd", 1e-2, 0, 9.0),
            ("hl_a_s0", "hldf", "hldf", 3e-3, 0, 8.0), ("hl_b_s0", "hldf", "hldf", 1e-2, 0, 9.5)]
    gaps = {1: -1.0, 2: -2.0, 3: 0.5}
    for s, g in gaps.items():
        rows += [(f"kd_b_s{s}", "kd", "kd", 1e-2, s, 10.0),
                 (f"hl_a_s{s}", "hldf", "hldf", 3e-3, s, 10.0 * (1 + g / 100))]
    rows.append(("hl_a_s4", "hldf", "hldf", 3e-3, 4, 5.0))
    df = _frame(rows)
    best = best_table(df)
    assert best.set_index("arm").loc["hldf", "selection_seeds"] == "0"
    c = confirm_table(df, best).set_index("arm")
    assert list(c.index) == ["hldf"] and c.loc["hldf", "seeds"] == "1,2,3"
    assert c.loc["hldf", "mean_delta"] == pytest.approx(sum(gaps.values()) / 3)
    # one fresh seed: no interval, so no row (best vs best stays exploratory)
    assert confirm_table(df[~df["seed"].isin([2, 3])], best).empty


@pytest.mark.slow  # 8 tiny runs trained: ~90 s quiet, 175 s at load 3
def test_confirm_picks_once_trains_fresh_seeds_and_reads_them(tmp_path, teacher_dir, capsys):
    sweep = _sweep_file(tmp_path, teacher_dir, eval_tasks=(), methods=("kd", "hldf"))
    runs_dir = tmp_path / "runs"
    args = [str(sweep), "--workdir", str(runs_dir), "--no-progress"]

    def refused(extra):
        with pytest.raises(SystemExit) as e:
            sweep_main(args + extra)
        assert e.value.code == 2

    # Before the grid is finished: refused, nothing written.
    refused(["--confirm", "1,2"])
    assert "not finished" in capsys.readouterr().err
    assert not runs_dir.exists() or not (runs_dir / CONFIRM_FILE).exists()

    assert sweep_main(args) == 0
    refused(["--confirm", "0,1"])  # seed 0 chose the picks
    assert "chose the picks" in capsys.readouterr().err

    assert sweep_main(args + ["--confirm", "1,2"]) == 0
    record = json.loads((runs_dir / CONFIRM_FILE).read_text())
    assert record["selection_seeds"] == [0] and record["seeds"] == [1, 2]
    grid = {}
    for d in runs_dir.glob("*_s0"):
        grid[d.name] = json.loads((d / "results.json").read_text())["valid_ppl"]
    for arm, pick in record["picks"].items():
        mine = {k: v for k, v in grid.items() if k.startswith(arm + "_")}
        assert pick["from_runs"] == [min(mine, key=mine.get)]  # the lowest ppl at seed 0
        for s in (1, 2):
            rid = pick["from_runs"][0].replace("_s0", f"_s{s}")
            res = json.loads((runs_dir / rid / "results.json").read_text())
            assert res["status"] == "done"
            cfg = json.loads((runs_dir / rid / "config.json").read_text())
            assert cfg["train"]["seed"] == s and cfg["data"]["seed"] == s
    listed = [e["run_id"] for e in json.loads((runs_dir / "sweep.json").read_text())["runs"]]
    assert len(listed) == 8
    capsys.readouterr()

    # The picks are never chosen again: a plain rerun trains nothing and keeps the record.
    before = (runs_dir / CONFIRM_FILE).read_bytes()
    assert sweep_main(args) == 0
    assert "0 trained, 8 already done" in capsys.readouterr().err
    assert (runs_dir / CONFIRM_FILE).read_bytes() == before

    summary = build_report(runs_dir, tmp_path / "report", n_resamples=100)
    confirm = pd.read_csv(tmp_path / "report" / "tables" / "confirm.csv")
    assert list(confirm["arm"]) == ["hldf"] and list(confirm["seeds"]) == ["1,2"]
    assert confirm["verdict"].iloc[0] in ("agrees", "disagrees", "cannot tell")
    assert summary["budgets"][0]["arms"]["hldf"]["confirmed"]["n"] == 2
    report = (tmp_path / "report" / "report.md").read_text()
    assert "Confirmed on fresh seeds" in report and "Confirmed on 2 fresh seed(s)" in report
