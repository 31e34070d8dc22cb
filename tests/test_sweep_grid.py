"""One teacher replica set for the whole grid (`python -m hldstudy.sweep --cohort K
--teacher-replicas N`): the planner's grid layout, the members the replicas declare, and
every refusal (one line, exit 2 or 3, no replica process left behind). The end-to-end
sweeps are in tests/test_sweep_grid_e2e.py."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hldstudy.config import Config, DataConfig, TrainConfig
from hldstudy.model import preset
from hldstudy.plan.__main__ import main as plan_main
from hldstudy.plan.layouts import grid_teacher_flops
from hldstudy.sweep import Sweep, expand
from hldstudy.sweep.cohorts import group, run_flops, study_flops
from hldstudy.sweep.gridteach import ReplicaOptions, cohort_spec, grid_members

TEACHER = preset("tiny-teacher", vocab_size=384)


def _sweep(**kw) -> Sweep:
    base = Config(name="g", model=preset("tiny", vocab_size=384),
                  data=DataConfig(seq_len=64, batch_size=8, tokenizer_vocab_size=384),
                  train=TrainConfig(warmup_steps=1))
    grid = dict(name="g", base=base, methods=("baseline", "kd", "hldf", "hldc"),
                lr=(1e-3, 3e-3), temperature=(1.0, 2.0), budget_baseline_steps=20,
                teacher_preset="tiny-teacher")
    return Sweep(**{**grid, **kw})


# --------------------------------------------------------------------------- #
# Planner: layouts.grid


def test_grid_teacher_flops_is_the_union_per_step():
    # Two runs: 10 steps needing 5 per step, 12 steps needing 3 per step.
    g = grid_teacher_flops([(0, 10, 5.0), (0, 12, 3.0)])
    assert g["teacher_flops"] == 10 * 5 + 2 * 3
    assert g["bound"] == 12 * 5 and g["longest_steps"] == 12
    # A two-stage run (stage 1 shallower) beside a one-stage one: the deepest need wins.
    g = grid_teacher_flops([(0, 3, 1.0), (3, 9, 4.0), (0, 8, 4.0)])
    assert g["teacher_flops"] == 9 * 4.0 and g["bound"] == 9 * 4.0
    assert grid_teacher_flops([]) == {"teacher_flops": 0.0, "longest_steps": 0, "bound": 0.0}
    with pytest.raises(ValueError):
        grid_teacher_flops([(5, 2, 1.0)])


def test_grid_layout_of_a_tiny_study():
    runs = expand(_sweep())
    out = study_flops(runs, TEACHER, 100)
    lay = out["layouts"]
    assert lay["grid"]["student_flops"] == lay["colocated"]["student_flops"]
    assert lay["grid"]["teacher_flops"] < lay["cohort"]["teacher_flops"] \
        < lay["colocated"]["teacher_flops"]
    # The longest schedule's steps, each one whole forward (kd's per-step teacher FLOPs).
    kd = next(r for r in runs if r.method == "kd")
    longest = max(r.steps for r in runs if r.method != "baseline")
    per_step = run_flops(kd, TEACHER).teacher / kd.steps
    assert out["grid"]["longest_steps"] == longest
    assert lay["grid"]["teacher_flops"] == pytest.approx(longest * per_step, rel=1e-9)
    assert out["grid"]["replica_window_bytes"] > 0 and out["grid"]["window"] == 4


def test_c4_123m_grid_within_one_percent_of_the_bound(capsys):
    assert plan_main(["--sweep", "c4_123m", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    g, lay = r["grid"], r["layouts"]
    assert set(lay["grid"]) >= {"teacher_flops", "student_flops", "total_flops", "device_hours"}
    assert g["longest_steps"] == 50466  # hldf's schedule, not kd's 40,000
    assert abs(lay["grid"]["teacher_flops"] / g["bound"] - 1) < 0.01
    assert round(lay["colocated"]["teacher_flops"] / g["bound"], 1) == 28.7
    assert lay["grid"]["device_hours"] < lay["cohort"]["device_hours"]
    assert plan_main(["--sweep", "c4_123m"]) == 0
    text = capsys.readouterr().out
    assert "| grid |" in text
    line = next(ln for ln in text.splitlines() if ln.startswith("grid (one replica set"))
    assert "28.7x below colocated; bound" in line and "grid / bound = 1.0000" in line


# --------------------------------------------------------------------------- #
# Members and options


def test_members_are_cohorts_with_their_methods_union_of_layers():
    runs = expand(_sweep())
    cohorts = group(runs, 4)
    members = grid_members(cohorts, TEACHER)
    assert [m.method for m in members] == ["kd", "hldf", "hldc"]  # the baseline has no teacher
    by = {m.method: m for m in members}
    mid = TEACHER.n_layers // 2
    assert (by["kd"].final, by["kd"].layers) == (True, ())
    # hldf: stage 1 aligns a middle teacher layer, stage 2 distills the logits: both declared.
    assert (by["hldf"].final, by["hldf"].layers) == (True, (mid,))
    assert (by["hldc"].final, by["hldc"].layers) == (True, (mid,))
    assert cohort_spec(members) == ";".join(
        f"{m.id}=final" + (f",{mid}" if m.method != "kd" else "") for m in members)
    assert all(len(m.runs) == 4 for m in members)


def test_a_layer_the_teacher_does_not_have_names_the_run():
    """The grid was expanded for a 6-layer teacher; the checkpoint served has 2."""
    import dataclasses

    from hldstudy.errors import ConfigError

    runs = expand(_sweep(methods=("hldc",), overrides=("distill.layer_pairs=2:5",)))
    small = dataclasses.replace(TEACHER, n_layers=2)
    with pytest.raises(ConfigError, match=r"distill.layer_pairs: run hldc_\S+ \(hldc\): the "
                                          r"teacher \(2 layers\) cannot serve it: teacher "
                                          r"layer 5 is out of range"):
        grid_members(group(runs, 4), small)


@pytest.mark.parametrize("kw, field", [(dict(replicas=0), "--teacher-replicas"),
                                       (dict(replicas=1, window=0), "--teacher-window"),
                                       (dict(replicas=1, lag_timeout_s=float("inf")),
                                        "--teacher-lag-timeout-s"),
                                       (dict(replicas=1, ready_timeout_s=0),
                                        "--teacher-ready-timeout-s")])
def test_bad_options_name_their_flag(kw, field):
    from hldstudy.errors import ConfigError

    with pytest.raises(ConfigError, match=f"^{field}:"):
        ReplicaOptions(**kw)
