"""Study-level planning: which runs share a teacher forward (cohorts), and what the whole
grid costs under the colocated, disaggregated and cohort layouts."""

import json

import pytest

from hldstudy.config import Config, DataConfig, TrainConfig
from hldstudy.model import preset
from hldstudy.plan import main as plan_main
from hldstudy.sweep import Sweep, expand
from hldstudy.sweep.cohorts import cohort_key, group, run_flops, study_flops

TEACHER = preset("tiny-teacher", vocab_size=384)


def _sweep(**kw) -> Sweep:
    base = Config(name="c", model=preset("tiny", vocab_size=384),
                  data=DataConfig(seq_len=64, batch_size=8, tokenizer_vocab_size=384),
                  train=TrainConfig(warmup_steps=1))
    grid = dict(name="c", base=base, methods=("baseline", "kd", "hldf"), lr=(1e-3, 3e-3),
                temperature=(1.0, 2.0), budget_baseline_steps=20, teacher_preset="tiny-teacher")
    return Sweep(**{**grid, **kw})


def test_members_differ_only_in_member_fields():
    runs = expand(_sweep())
    cohorts = group(runs, 100)
    by_method = {c[0].method: [r.run_id for r in c] for c in cohorts}
    assert set(by_method) == {"baseline", "kd", "hldf"}
    assert len(by_method["kd"]) == 4 and len(by_method["hldf"]) == 4  # lr x temperature
    assert [len(c) for c in group(runs, 3) if c[0].method == "kd"] == [3, 1]
    assert all(len(c) == 1 for c in group(runs, 1))
    # A field that changes what is trained (not a member field) splits the cohort.
    split = expand(_sweep(extra_axes=(("distill.divergence", ("forward_kl", "reverse_kl")),)))
    kd = [r for r in split if r.method == "kd"]
    assert len({cohort_key(r) for r in kd}) == 2
    with pytest.raises(ValueError):
        group(runs, 0)


def test_cohort_pays_one_teacher_forward_per_step():
    runs = expand(_sweep())
    per = {r.run_id: run_flops(r, TEACHER) for r in runs}
    out = study_flops(runs, TEACHER, 100)
    colo, coh = out["layouts"]["colocated"], out["layouts"]["cohort"]
    assert colo["teacher_flops"] == pytest.approx(sum(f.teacher for f in per.values()))
    assert out["layouts"]["disaggregated"] == colo
    kd = [r for r in runs if r.method == "kd"]
    hldf = [r for r in runs if r.method == "hldf"]
    # One kd member's and one hldf member's teacher forwards; the baseline has none.
    assert coh["teacher_flops"] == pytest.approx(per[kd[0].run_id].teacher
                                                 + per[hldf[0].run_id].teacher)
    assert per[runs[0].run_id].teacher == 0.0 and runs[0].method == "baseline"
    assert coh["student_flops"] == colo["student_flops"]
    assert coh["total_flops"] == pytest.approx(coh["teacher_flops"] + coh["student_flops"])
    # hldf's stage 1 runs the teacher only to its aligned layer: less than kd's forwards.
    assert per[hldf[0].run_id].teacher < per[kd[0].run_id].teacher


@pytest.mark.parametrize("sweep, total_at_least", [("c4_123m", 4.0), ("c4_735m", 2.0)])
def test_study_grid_with_one_cohort_per_method(sweep, total_at_least, capsys):
    assert plan_main(["--sweep", sweep, "--cohort", "12", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    lay = r["layouts"]
    for name in ("colocated", "disaggregated", "cohort"):
        assert set(lay[name]) >= {"teacher_flops", "student_flops", "total_flops",
                                  "device_hours"}
    assert lay["colocated"]["teacher_flops"] / lay["cohort"]["teacher_flops"] >= 10.0
    assert lay["colocated"]["total_flops"] / lay["cohort"]["total_flops"] >= total_at_least
    assert r["cohorts"] == 4  # baseline(s) + kd + hldf + hldc


def test_bad_study_inputs_are_one_line(capsys):
    with pytest.raises(SystemExit) as e:
        plan_main(["--sweep", "c4_123m", "--cohort", "0"])
    assert e.value.code == 2
    assert capsys.readouterr().err.strip().count("\n") == 0
