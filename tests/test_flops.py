"""Analytic FLOP accounting: hand counts, compute matching, and XLA's own count."""

import dataclasses
import json

import pytest

from hldstudy.commands.flops import main
from hldstudy.config import BudgetConfig, Config, DataConfig, DistillConfig, TrainConfig
from hldstudy.distill import methods
from hldstudy.distill.pairs import PAIR_RULES, resolve_layer_pairs
from hldstudy.errors import ConfigError
from hldstudy.flops import (
    causal_context,
    flops_per_token,
    matmul_params_per_layer,
    step_flops,
)
from hldstudy.flops.budget import plan_stages
from hldstudy.model import preset
from hldstudy.train.probe import xla_flops_for

TINY = preset("tiny")  # 4 layers, d 64, 4 heads / 2 KV, head_dim 16, d_ff 192, V 512, W 32, global_every 2
TEACHER = preset("tiny-teacher")  # 6 layers, d 128, 4 / 2 heads, head_dim 32, d_ff 384, W 32, every 3


def cfg_for(method="baseline", model=TINY, b=2, t=64, **distill):
    return Config(model=model, data=DataConfig(batch_size=b, seq_len=t),
                  distill=DistillConfig(method=method, **distill),
                  budget=BudgetConfig())


def test_causal_context_matches_brute_force():
    for t in (1, 5, 64, 100):
        for w in (None, 1, 3, 32, 200):
            brute = sum(min(i + 1, w if w else t + 1) for i in range(t)) / t
            assert causal_context(t, w) == pytest.approx(brute)
    assert causal_context(4, None) == 2.5
    assert causal_context(4, 2) == pytest.approx((1 + 2 + 2 + 2) / 4)


def test_flops_per_token_by_hand():
    t = 64
    per_layer = 64 * 4 * 16 + 2 * 64 * 2 * 16 + 4 * 16 * 64 + 3 * 64 * 192
    assert matmul_params_per_layer(TINY) == per_layer
    f = flops_per_token(TINY, t)
    assert f["nonemb"] == 2 * 4 * per_layer
    assert f["deembed"] == 2 * 64 * 512
    # layers 0, 2 local (W=32), 1, 3 global
    local = (32 * 33 / 2 + 32 * 32) / 64
    assert f["attention"] == pytest.approx(4 * (2 * local + 2 * 32.5) * 4 * 16)
    assert f["total"] == pytest.approx(f["nonemb"] + f["deembed"] + f["attention"])
    dense = flops_per_token(TINY, t, attention="dense")
    assert dense["attention"] == 4 * 4 * 64 * 4 * 16 > f["attention"]
    part = flops_per_token(TINY, t, n_layers=2, head=False)
    assert part["deembed"] == 0 and part["nonemb"] == f["nonemb"] / 2
    with pytest.raises(ConfigError):
        flops_per_token(TINY, t, attention="flash")


def test_baseline_is_three_forwards():
    cfg = cfg_for()
    b = step_flops(cfg)
    f = flops_per_token(TINY, 64)
    assert b.tokens == 128
    assert b.total == pytest.approx(3 * 128 * f["total"])
    assert b.regressor == b.teacher == 0 and b.stage == "main"


def test_kd_teacher_switch():
    cfg = cfg_for("kd")
    b = step_flops(cfg, teacher_model=TEACHER)
    ft = flops_per_token(TEACHER, 64)
    assert b.teacher == pytest.approx(128 * ft["total"])
    assert b.teacher_head_flops == 128 * 2 * 128 * 512
    assert b.total == pytest.approx(step_flops(cfg_for()).total)  # student-side only
    counted = step_flops(cfg, teacher_model=TEACHER, count_teacher=True)
    assert counted.total == pytest.approx(b.total + b.teacher) and counted.count_teacher
    with pytest.raises(ConfigError):
        step_flops(cfg)  # no teacher model


def test_hldf_stage1_runs_half_the_student_no_head():
    cfg = cfg_for("hldf")
    stages = methods.get("hldf").resolve_stages(cfg)
    assert [(s.name, s.share) for s in stages] == [("stage1", 0.2), ("stage2", pytest.approx(0.8))]
    s1 = step_flops(cfg, stage="stage1", teacher_model=TEACHER, count_teacher=True)
    assert s1.layer_pairs == ((2, 3),) and s1.student_layers == 2 and not s1.student_head
    f = flops_per_token(TINY, 64, n_layers=2, head=False)
    assert s1.deembed == 0
    assert s1.nonemb + s1.attention == pytest.approx(3 * 128 * f["total"])
    assert s1.regressor == 6 * 128 * 64 * 128
    assert s1.teacher == pytest.approx(128 * flops_per_token(TEACHER, 64, n_layers=3,
                                                             head=False)["total"])
    s2 = step_flops(cfg, stage="stage2", teacher_model=TEACHER)
    kd = step_flops(cfg_for("kd"), teacher_model=TEACHER)
    assert s2.total == kd.total and s2.regressor == 0
    with pytest.raises(ConfigError):
        step_flops(cfg, teacher_model=TEACHER)  # hldf needs a stage name


def test_hldc_and_patient_regressors():
    hldc = step_flops(cfg_for("hldc"), teacher_model=TEACHER)
    kd = step_flops(cfg_for("kd"), teacher_model=TEACHER)
    assert hldc.total == pytest.approx(kd.total + 6 * 128 * 64 * 128)
    pat = step_flops(cfg_for("patient", patient_pairs=3), teacher_model=TEACHER)
    assert pat.layer_pairs == ((1, 1), (2, 3), (3, 4))
    assert pat.regressor == 3 * 6 * 128 * 64 * 128
    explicit = step_flops(cfg_for("hldc", layer_pairs="1:2,4:6"), teacher_model=TEACHER)
    assert explicit.layer_pairs == ((1, 2), (4, 6))


def test_layer_pair_errors():
    for spec in ("5:1", "0:1", "1:7"):
        with pytest.raises(ConfigError, match="layer_pairs"):
            resolve_layer_pairs(cfg_for("hldc", layer_pairs=spec), TEACHER)
    with pytest.raises(ConfigError, match="patient_pairs"):
        PAIR_RULES["patient"](4, 6, cfg_for("patient", patient_pairs=4))
    assert resolve_layer_pairs(cfg_for("kd"), TEACHER) == ()
    assert PAIR_RULES["patient"](18, 34, cfg_for("patient", patient_pairs=1)) == \
        PAIR_RULES["middle"](18, 34, cfg_for("hldf"))


def test_steps_for_budget_floor():
    cfg = cfg_for("hldf", hldf_stage1_share=0.25)
    s1 = step_flops(cfg, stage="stage1", teacher_model=TEACHER).total
    s2 = step_flops(cfg, stage="stage2", teacher_model=TEACHER).total
    budget = 1e12
    plans = plan_stages(cfg, TEACHER, budget_flops=budget)
    assert {p.stage.name: p.steps for p in plans} == {"stage1": int(budget * 0.25 // s1),
                                                       "stage2": int(budget * 0.75 // s2)}
    assert plans[1].start == plans[0].steps and plans[0].flops_per_step == s1
    base = plan_stages(cfg_for(), budget_flops=budget)
    assert [(p.stage.name, p.steps) for p in base] == [
        ("main", int(budget // step_flops(cfg_for()).total))]
    with pytest.raises(ConfigError, match="budget.flops"):
        plan_stages(cfg_for(), budget_flops=-1.0)
    with pytest.raises(ConfigError, match="gets no steps"):
        plan_stages(cfg_for(), budget_flops=1.0)
    # Without a budget, train.steps is split by share; the last stage takes the rest.
    by_steps = dataclasses.replace(cfg, train=TrainConfig(steps=10))
    assert [p.steps for p in plan_stages(by_steps, TEACHER)] == [2, 8]


def test_hardware_terms():
    cfg = cfg_for("kd", loss_impl="fused", fused_backend="pallas")
    b = step_flops(cfg, teacher_model=TEACHER)
    xla_path = step_flops(cfg_for("kd", loss_impl="fused", fused_backend="xla"),
                          teacher_model=TEACHER)
    assert xla_path.hardware["recompute_fused"] == 0  # one vocab chunk: no recompute
    assert b.hardware["recompute_fused"] == 128 * 2 * (64 + 128) * 512
    assert b.hardware["teacher"] > b.teacher  # dense attention + elementwise
    assert b.hardware_flops("disaggregated") == pytest.approx(
        b.hardware_total - b.hardware["teacher"] + b.teacher_head_flops)
    mat = step_flops(cfg_for("kd", loss_impl="materialized"), teacher_model=TEACHER)
    assert mat.hardware["recompute_fused"] == 0 and mat.total == b.total
    remat = step_flops(dataclasses.replace(cfg_for(), model=preset("tiny", remat=True)))
    assert remat.hardware["recompute_remat"] > 0 and remat.total == step_flops(cfg_for()).total


# Two layouts: GQA + sliding window (tiny), all-global MHA without QK-norm.
XLA_SHAPES = [
    (TINY, 1, 128),
    (preset("tiny", sliding_window=None, global_every=1, n_kv_heads=4, qk_norm=False,
            d_model=96, d_ff=256, vocab_size=1024), 2, 64),
]


@pytest.mark.parametrize("model,b,t", XLA_SHAPES)
def test_analytic_matches_xla_baseline_step(model, b, t):
    cfg = cfg_for(model=model, b=b, t=t)
    bd = step_flops(cfg)
    xla = xla_flops_for(cfg, "baseline", "main")
    # Executed FLOPs (dense attention + elementwise + AdamW) within 5% of XLA's count.
    assert xla == pytest.approx(bd.hardware_total, rel=0.05)
    # Matmuls alone are >90% of XLA's count even at d_model 64 (elementwise
    # work is the rest and shrinks with size).
    matmul_dense = bd.hardware["student_matmul"] + bd.hardware["student_attention_dense"]
    assert 0.9 < matmul_dense / xla < 1.0
    # The budget figure uses the causal average context: below what runs.
    assert bd.total < matmul_dense


def _experiment(tmp_path):
    p = tmp_path / "exp.py"
    p.write_text(
        "from hldstudy.config import Config, DataConfig\n"
        "from hldstudy.model.presets import preset\n"
        "def get_config():\n"
        "    return Config(model=preset('tiny'), data=DataConfig(batch_size=2, seq_len=64))\n")
    return str(p)


def test_cli_json_single_and_two_stage(tmp_path, capsys):
    exp = _experiment(tmp_path)
    assert main(["--config", exp, "--json", "--budget", "1e12", "--check-xla"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["method"] == "baseline" and out["steps"] == out["stages"]["main"]["steps"]
    assert out["xla_flops_per_step"] == pytest.approx(out["hardware_flops_per_step"], rel=0.05)
    assert out["analytic_flops_per_step"] == step_flops(cfg_for()).total

    assert main(["--config", exp, "--method", "hldf", "--teacher-preset", "tiny-teacher",
                 "--json", "--budget", "1e12", "--set", "distill.hldf_stage1_share=0.5"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out["stages"]) == {"stage1", "stage2"}
    assert out["stages"]["stage1"]["steps"] > out["stages"]["stage2"]["steps"]
    assert "steps" not in out  # two stages: per-stage keys only

    assert main(["--config", exp, "--method", "kd", "--teacher-preset", "tiny-teacher"]) == 0
    assert "kd" in capsys.readouterr().out


def test_cli_errors_are_clean(tmp_path, capsys):
    exp = _experiment(tmp_path)
    with pytest.raises(SystemExit) as e:
        main(["--config", exp, "--method", "kd"])
    assert e.value.code == 2 and "teacher" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["--config", exp, "--method", "hldc", "--teacher-preset", "tiny-teacher",
              "--set", "distill.layer_pairs=9:1"])
    assert e.value.code == 2 and "out of range" in capsys.readouterr().err


# The trainer's real distillation steps (colocated: teacher forward inside the
# step; disaggregated: streamed hidden states in). 64 tokens: one row window of
# the fused loss, whose scan body XLA would otherwise count only once.
DISTILL_CASES = [
    ("kd", "main", "colocated", dict(loss_impl="fused", fused_backend="xla")),
    ("hldf", "stage1", "disaggregated", {}),
    ("hldf", "stage2", "colocated", dict(loss_impl="materialized")),
    ("hldc", "main", "colocated", dict(loss_impl="materialized")),
    ("patient", "main", "disaggregated", dict(loss_impl="fused", fused_backend="xla",
                                              patient_pairs=2)),
]
# (student, teacher): GQA with sliding-window layers, and all-global MHA without QK-norm.
DISTILL_SHAPES = [
    (TINY, preset("tiny-teacher", n_layers=3)),  # 3 teacher layers keep the compiles short
    (XLA_SHAPES[1][0], preset("tiny-teacher", n_layers=3, vocab_size=1024, sliding_window=None,
                              global_every=1)),
]


@pytest.mark.parametrize("student,teacher", DISTILL_SHAPES, ids=["gqa-window", "mha-global"])
@pytest.mark.parametrize("method,stage,layout,distill", DISTILL_CASES,
                         ids=[f"{c[0]}-{c[1]}-{c[2]}" for c in DISTILL_CASES])
def test_analytic_matches_xla_distill_steps(method, stage, layout, distill, student, teacher):
    cfg = cfg_for(method, model=student, b=1, t=64, **distill)
    bd = step_flops(cfg, method, stage, teacher)
    xla = xla_flops_for(cfg, method, stage, teacher, layout=layout)
    assert xla == pytest.approx(bd.hardware_flops(layout), rel=0.05)


def test_xla_undercounts_fused_loop_and_we_say_so():
    from hldstudy.flops import xla_count_is_complete

    assert xla_count_is_complete(cfg_for("kd", b=1, t=64), "kd", "main")
    assert not xla_count_is_complete(cfg_for("kd", b=2, t=64), "kd", "main")
    assert xla_count_is_complete(cfg_for("kd", b=2, t=64, loss_impl="materialized"), "kd", "main")
    assert xla_count_is_complete(cfg_for("hldf", b=8, t=64), "hldf", "stage1")


def test_no_regressor_costs_nothing():
    teacher = preset("tiny", n_layers=6)  # same width as the student: raw states can align
    with_reg = step_flops(cfg_for("hldc"), "hldc", "main", teacher)
    without = step_flops(cfg_for("hldc", regressor=False), "hldc", "main", teacher)
    assert with_reg.regressor > 0 and without.regressor == 0
    assert with_reg.total - without.total == with_reg.regressor


def test_loss_flops_join_the_budget_only_when_asked():
    """budget.count_loss adds the KD loss beyond the NLL, the NMSE and (a served teacher,
    not counted itself) the student-side logit rebuild; never the regressor twice."""
    from hldstudy.flops import step_flops

    base = cfg_for("hldc")
    off = step_flops(base, "hldc", "main", TEACHER)
    on = step_flops(dataclasses.replace(base, budget=BudgetConfig(count_loss=True)),
                    "hldc", "main", TEACHER)
    tokens, vocab = off.tokens, TINY.vocab_size
    assert set(off.loss_terms) == {"kd_loss", "nmse"} and off.loss > 0
    assert on.total == pytest.approx(off.total + off.loss, rel=1e-12)
    assert on.regressor == off.regressor and on.loss_terms == off.loss_terms
    assert off.loss_terms["nmse"] == pytest.approx(tokens * 5.0 * TEACHER.d_model)
    assert step_flops(cfg_for("baseline"), "baseline").loss_terms == {}

    served = dataclasses.replace(base, teacher=dataclasses.replace(
        base.teacher, checkpoint="remote://127.0.0.1:5000"))
    rebuild = step_flops(served, "hldc", "main", TEACHER).loss_terms["logit_rebuild"]
    assert rebuild == pytest.approx(2.0 * tokens * TEACHER.d_model * vocab)
    counted = step_flops(served, "hldc", "main", TEACHER, count_teacher=True)
    assert "logit_rebuild" not in counted.loss_terms  # in the teacher's forward already
