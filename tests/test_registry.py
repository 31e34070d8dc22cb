"""A new method is one declaration (here, in this file only): it flows through the
FLOP CLI, a sweep dry run, training, and the analysis with no change anywhere in
the package. Plus the registry's own rules and the config-field tags."""

import json
from dataclasses import dataclass
from pathlib import Path

import pytest

from hldstudy.commands.flops import main as flops_main
from hldstudy.config import (
    Config,
    DataConfig,
    TrainConfig,
    axis_names,
    field_rules,
    fields_where,
    grid_axes,
    knob,
    replicate_axis,
    traced_members,
)
from hldstudy.distill import methods
from hldstudy.distill.methods import ALIGN_FIELDS, MethodSpec, StageSpec
from hldstudy.model import preset
from hldstudy.sweep.__main__ import main as sweep_main
from hldstudy.train.loop import train

# Self-supervised NLL plus hidden alignment to the teacher's middle layer, no logit KD:
# a method the suite has never seen.
TOY = MethodSpec(
    "selfalign", (StageSpec("main", ("nll", "align")),),
    fields=ALIGN_FIELDS + ("distill.hidden_weight",), pairs="middle",
    description="NLL + hidden_weight x NMSE of the middle layers (no logit KD)")
DATA = dict(seq_len=64, batch_size=8, tokenizer_vocab_size=384, synthetic_docs=600,
            synthetic_valid_docs=50)


@pytest.fixture
def toy():
    methods.register(TOY)
    yield TOY.name
    methods.unregister(TOY.name)


def _experiment(tmp_path: Path) -> Path:
    f = tmp_path / "tiny_exp.py"
    f.write_text(f'''"""hldstudy flops --config {f} --method selfalign"""
from hldstudy.config import Config, DataConfig
from hldstudy.model import preset


def get_config():
    return Config(name="toy", model=preset("tiny", vocab_size=384), data=DataConfig(**{DATA!r}))
''')
    return f


def _sweep(tmp_path: Path, teacher: str | None, preset_name: str | None = None) -> Path:
    f = tmp_path / "toy_sweep.py"
    f.write_text(f'''"""python -m hldstudy.sweep {f}"""
from hldstudy.config import Config, DataConfig, TrainConfig
from hldstudy.model import preset
from hldstudy.sweep import Sweep


def get_sweep():
    base = Config(name="t", model=preset("tiny", vocab_size=384), data=DataConfig(**{DATA!r}),
                  train=TrainConfig(warmup_steps=1, log_every=1, checkpoint_every=0,
                                    eval_batches=1))
    return Sweep(name="toy", base=base, methods=("kd", "selfalign"), temperature=(1.0, 2.0),
                 hidden_weight=(0.5, 1.0), budget_baseline_steps=4, teacher={teacher!r},
                 teacher_preset={preset_name!r})
''')
    return f


def test_registry_declares_the_study_methods():
    assert methods.names()[:5] == ("baseline", "kd", "hldf", "hldc", "patient")
    hldf = methods.get("hldf")
    assert [s.name for s in hldf.stages] == ["stage1", "stage2"]
    assert hldf.stages[0].depth == "aligned" and not hldf.stages[0].student_head
    assert not methods.get("baseline").needs_teacher and methods.get("kd").needs_teacher
    assert methods.applies("distill.temperature", "kd")
    assert not methods.applies("distill.temperature", "baseline")
    assert not methods.applies("distill.hidden_weight", "hldf")  # stage 1 is NMSE alone
    assert methods.applies("distill.hldf_stage1_share", "hldf")
    assert methods.applies("teacher.dtype", "kd") and not methods.applies("teacher.dtype",
                                                                          "baseline")
    assert "distill.patient_pairs" in methods.arm_fields("patient")
    assert "distill.temperature" not in methods.arm_fields("hldc")  # shared: a grid axis
    with pytest.raises(ValueError, match="layer-pair rule"):
        MethodSpec("bad", (StageSpec("main", ("align",)),))
    with pytest.raises(ValueError, match="already holds the NLL"):
        MethodSpec("bad", (StageSpec("main", ("nll", "kd")),))
    with pytest.raises(ValueError, match="already registered"):
        methods.register(methods.get("kd"))


def test_field_rules_are_derived_from_tags():
    rules = field_rules()
    assert set(rules) >= {"train.lr", "distill.method", "wandb.mode", "data.seed"}
    resumable = fields_where("resume")
    # A mesh change on resume is allowed (restored resharded), as is every cadence knob.
    assert {"train.mesh_fsdp", "train.mesh_data", "train.steps", "budget.flops",
            "train.log_every"} <= resumable
    assert "train.lr" not in resumable and "model.d_model" not in resumable
    assert "train.mesh_fsdp" in fields_where("drift", False)
    assert "train.lr" not in fields_where("drift", False)
    assert {"data.seq_len", "data.seed", "data.batch_size"} <= fields_where("data_identity")
    assert "data.path" not in fields_where("data_identity")
    assert rules["distill.jsd_beta"]["relevant_if"] == ("distill.divergence", "jsd")
    # The grid axes, in run-id order, the seed axis, and what a cohort traces per member.
    assert grid_axes() == ("train.lr", "distill.temperature", "distill.alpha",
                           "distill.hidden_weight", "train.stage_boundary", "distill.nmse",
                           "distill.hldf_stage1_share")
    assert replicate_axis() == "train.seed" and fields_where("member", "init") == {"train.seed"}
    assert traced_members() == {"lr": ("train", "lr"), "temperature": ("distill", "temperature"),
                                "alpha": ("distill", "alpha"),
                                "hidden_weight": ("distill", "hidden_weight")}
    names = axis_names()
    assert [names[k]["short"] for k in (*grid_axes(), "train.seed")] == \
        ["lr", "T", "a", "hw", "sb", "nmse", "sh", "s"]
    assert names["distill.temperature"]["names"] == ("temperature", "T", "temp", "tau")
    assert names["distill.alpha"]["names"] == ("alpha", "a", "nllw", "nll")
    assert {k for k in names} <= fields_where("analysis", "column")  # an axis is a column


def test_axis_rules_are_checked_where_they_are_declared():
    with pytest.raises(TypeError, match="member=True"):
        knob(1.0, member=True)
    with pytest.raises(TypeError, match="short name"):
        knob(1.0, short="x")  # a short name without an axis
    with pytest.raises(TypeError, match="short name"):
        knob(1.0, axis=5)  # an axis without a short name
    with pytest.raises(TypeError, match="axis=1.5"):
        knob(1.0, axis=1.5, short="x")

    @dataclass(frozen=True)
    class Clash:
        seed: int = knob(0, axis="replicate", short="s")
        scale: float = knob(1.0, axis=1, short="s")

    with pytest.raises(TypeError, match="both use the axis name 's'"):
        axis_names(Clash)

    @dataclass(frozen=True)
    class NoSeed:
        scale: float = knob(1.0, axis=1, short="sc")

    with pytest.raises(TypeError, match="exactly one field has axis='replicate'"):
        replicate_axis(NoSeed)


def test_new_method_flows_through_the_flop_cli(toy, tmp_path, capsys):
    rc = flops_main(["--config", str(_experiment(tmp_path)), "--method", toy,
                     "--teacher-preset", "tiny-teacher", "--budget", "1e12", "--json"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert out["method"] == toy and list(out["stages"]) == ["main"]
    bd = out["breakdown"]
    teacher = preset("tiny-teacher")
    # NLL needs the student's head; alignment alone needs only the teacher's middle layer.
    assert bd["student_head"] and bd["deembed"] > 0
    assert not bd["teacher_head"] and bd["teacher_layers"] == teacher.n_layers // 2
    assert bd["layer_pairs"] == [[2, 3]] and bd["regressor"] == 6 * 8 * 64 * 64 * 128
    assert out["steps"] == int(1e12 // out["analytic_flops_per_step"])


def test_new_method_flows_through_a_sweep_dry_run(toy, tmp_path, capsys):
    sweep = _sweep(tmp_path, None, "tiny-teacher")
    rc = sweep_main([str(sweep), "--dry-run", "--json", "--workdir", str(tmp_path / "runs")])
    assert rc == 0
    runs = json.loads(capsys.readouterr().out)
    ids = [r["run_id"] for r in runs]
    # kd sweeps the temperature only; the new method sweeps only the fields it declares.
    assert ids == ["kd_T1_s0", "kd_T2_s0", "selfalign_hw0.5_s0", "selfalign_hw1_s0"]
    toy_run = next(r for r in runs if r["run_id"] == "selfalign_hw0.5_s0")
    assert toy_run["method"] == toy and toy_run["steps"] > 0
    assert toy_run["flops"] <= toy_run["flops_budget"]


@pytest.mark.slow  # 53 s; the registry's dry-run, FLOP and rule tests stay in the default suite
def test_new_method_trains_and_is_analysed(toy, tmp_path, capsys):
    teacher = tmp_path / "teacher"
    train(Config(name="teacher", model=preset("tiny-teacher", vocab_size=384),
                 data=DataConfig(**DATA),
                 train=TrainConfig(steps=4, warmup_steps=1, log_every=2, checkpoint_every=0,
                                   eval_batches=1, progress=False)), teacher)
    runs_dir = tmp_path / "runs"
    assert sweep_main([str(_sweep(tmp_path, str(teacher))), "--workdir", str(runs_dir),
                       "--no-progress"]) == 0
    capsys.readouterr()
    res = json.loads((runs_dir / "selfalign_hw0.5_s0" / "results.json").read_text())
    assert res["status"] == "done" and res["method"] == toy
    metrics = [json.loads(line) for line in
               (runs_dir / "selfalign_hw0.5_s0" / "metrics.jsonl").read_text().splitlines()]
    step = next(m for m in metrics if "loss" in m)
    # The generic strategy: loss = nll + hidden_weight * nmse.
    assert step["loss"] == pytest.approx(step["nll"] + 0.5 * step["nmse"], rel=1e-5)

    from hldstudy.analysis.__main__ import main as analysis_main

    assert analysis_main([str(runs_dir), "--out", str(tmp_path / "report"),
                          "--n-resamples", "100"]) == 0
    report = (tmp_path / "report" / "report.md").read_text()
    assert toy in report
    accounting = (tmp_path / "report" / "tables" / "accounting.csv").read_text()
    assert all(rid in accounting for rid in ("selfalign_hw0.5_s0", "selfalign_hw1_s0",
                                             "kd_T1_s0", "kd_T2_s0"))
