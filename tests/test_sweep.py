"""Sweeps without training: grid expansion, run ids, --dry-run --json, errors, drift, W&B config."""

import dataclasses
import json
from pathlib import Path

import pytest

from hldstudy.analysis.runs import name_mismatches
from hldstudy.cli_common import EXPERIMENTS, SWEEPS, find_builtin
from hldstudy.config import config_to_dict, flatten, load_experiment
from hldstudy.errors import ConfigError, InputError
from hldstudy.flops import step_flops
from hldstudy.model.presets import preset
from hldstudy.sweep import Sweep, expand, load_sweep
from hldstudy.sweep.__main__ import main as sweep_main
from hldstudy.sweep.launch import prepare_workdir
from hldstudy.sweep.spec import fmt_value, run_status

ROOT = Path(__file__).resolve().parent.parent
CPU = SWEEPS / "cpu.py"
TEACHER = preset("tiny-teacher")


def _sweep(**kw) -> Sweep:
    base = dict(name="t", base=load_experiment(EXPERIMENTS / "tiny_distill.py"),
                methods=("baseline", "kd", "hldf", "hldc"), lr=(3e-3, 1e-2),
                temperature=(1.0, 2.0), alpha=(0.5,), hidden_weight=(0.5, 1.0), seeds=(0,),
                budget_baseline_steps=40, teacher_preset="tiny-teacher")
    base.update(kw)
    return Sweep(**base)


def test_grid_is_method_aware_and_names_round_trip():
    runs = expand(_sweep())
    by = {m: [r for r in runs if r.method == m] for m in ("baseline", "kd", "hldf", "hldc")}
    # baseline: lr only; kd and hldf: lr x T (hldf's stage 1 has no HLD weight); hldc: x hw
    assert [len(by[m]) for m in by] == [2, 4, 4, 8]
    assert len({r.run_id for r in runs}) == len(runs)
    assert all(set(r.params) == {"train.lr", "train.seed"} for r in by["baseline"])
    assert all("distill.hidden_weight" not in r.params for r in by["hldf"])
    assert "hldc_lr3e-3_T2_a0.5_hw0.5_s0" in {r.run_id for r in by["hldc"]}
    for r in runs:
        flat = flatten(config_to_dict(r.config))
        assert name_mismatches(r.run_id, flat) == []  # the analysis reads the names back
        assert flat["distill.method"] == r.method
        for k, v in r.params.items():
            assert flat[k] == v


def test_axes_keywords_and_run_ids_come_from_the_config_fields():
    """The Sweep's axis keywords, their order in run ids, their short names and the keys
    of a run's sweep.json entry are the config's axis fields (`knob(axis=, short=)`)."""
    from hldstudy.config import axis_names, grid_axes
    from hldstudy.sweep.spec import _SweepSpec

    axis_kw = [f.name for f in dataclasses.fields(Sweep)
               if f.name not in {g.name for g in dataclasses.fields(_SweepSpec)}]
    assert axis_kw == ["lr", "temperature", "alpha", "hidden_weight", "stage_boundary", "nmse",
                       "hldf_stage1_share"]
    assert [axis_names()[k]["column"] for k in grid_axes()] == axis_kw
    sweep = _sweep(extra_axes=(("train.weight_decay", (0.1, 0.2)),), seeds=(0, 1))
    assert [k for k, _ in sweep.axes()] == ["train.lr", "distill.temperature", "distill.alpha",
                                             "distill.hidden_weight", "train.weight_decay",
                                             "train.seed"]
    runs = {r.run_id: r for r in expand(sweep)}
    # an axis' short name; another field's name without underscores and "="
    assert "hldf_lr1e-2_T2_a0.5_weightdecay=0.2_s1" in runs
    entry = runs["hldc_lr3e-3_T1_a0.5_hw0.5_weightdecay=0.1_s1"].entry()
    assert {k: entry[k] for k in ("lr", "temperature", "alpha", "hidden_weight", "seed")} == \
        {"lr": 3e-3, "temperature": 1.0, "alpha": 0.5, "hidden_weight": 0.5, "seed": 1}
    hldf = runs["hldf_lr1e-2_T2_a0.5_weightdecay=0.2_s1"].entry()
    assert hldf["train.weight_decay"] == 0.2 and "hidden_weight" not in hldf
    with pytest.raises(TypeError, match="unexpected keyword argument 'tau'"):
        _sweep(tau=(1.0,))  # an alias names an axis in folder names, not a keyword


def test_steps_and_flops_follow_the_budget():
    runs = expand(_sweep())
    budget = runs[0].config.budget.flops
    cfg = runs[0].config
    assert budget == pytest.approx(40 * step_flops(cfg, "baseline").total)
    for r in runs:
        assert r.config.budget.flops == budget
        assert r.flops <= budget
        # less than one step (per stage) below the budget
        assert budget - r.flops < sum(r.flops_per_step.values())
        assert r.steps == sum(r.stage_steps.values())
        for stage in r.stage_steps:
            fps = step_flops(r.config, r.method, stage, TEACHER).total
            assert r.flops_per_step[stage] == fps
    hldf = next(r for r in runs if r.method == "hldf")
    assert set(hldf.stage_steps) == {"stage1", "stage2"}


def test_value_formatting():
    assert fmt_value(0.003) == "3e-3"
    assert fmt_value(0.01) == "1e-2"
    assert fmt_value(1.5e-4) == "1.5e-4"
    assert fmt_value(2.0) == "2"
    assert fmt_value(0.5) == "0.5"
    assert fmt_value(3) == "3"
    assert fmt_value(True) == "true"


def test_duplicate_axis_values_are_kept_once():
    warnings = []
    runs = expand(_sweep(methods=("baseline",), lr=(1e-3, 1e-3)), warnings=warnings)
    assert len(runs) == 1 and "duplicate" in warnings[0]


def test_dry_run_json_contract(capsys):
    assert sweep_main([str(CPU), "--dry-run", "--json"]) == 0
    runs = json.loads(capsys.readouterr().out)
    assert len(runs) == 14
    for r in runs:
        assert {"run_id", "method", "steps", "flops", "lr", "seed"} <= set(r)
        assert r["flops"] <= r["flops_budget"]
        if r["method"] != "baseline":
            assert {"temperature", "alpha"} <= set(r)
        else:
            assert "temperature" not in r and "alpha" not in r
    assert {r["method"] for r in runs} == {"baseline", "kd", "hldf", "hldc"}


def test_dry_run_table(capsys):
    assert sweep_main(["cpu", "--dry-run"]) == 0  # a built-in sweep, by name
    out = capsys.readouterr().out
    assert "14 run(s)" in out and "hldf_lr3e-3_T1_a0.5_s0" in out and "launch:" in out


def test_empty_grid_is_an_error(tmp_path, capsys):
    with pytest.raises(InputError, match="grid is empty.*train.seed"):
        expand(_sweep(seeds=()))
    with pytest.raises(InputError, match="grid is empty.*no methods"):
        expand(_sweep(methods=()))
    f = tmp_path / "empty.py"
    f.write_text(f"import sys; sys.path.insert(0, {str(ROOT / 'tests')!r})\n"
                 "from test_sweep import _sweep\n"
                 "def get_sweep():\n    return _sweep(lr=())\n")
    # an empty *standard* axis means "not swept", so this grid is not empty...
    assert sweep_main([str(f), "--dry-run", "--json"]) == 0
    capsys.readouterr()
    f.write_text(f.read_text().replace("lr=()", "extra_axes=(('train.warmup_steps', ()),)"))
    with pytest.raises(SystemExit) as e:  # ...an empty extra axis is
        sweep_main([str(f), "--dry-run"])
    assert e.value.code == 2
    assert "grid is empty (axis train.warmup_steps has no values" in capsys.readouterr().err


def test_unknown_executor_and_bad_sweep_file(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        sweep_main([str(CPU), "--executor", "kubernetes"])
    assert e.value.code == 2
    assert "invalid choice: 'kubernetes'" in capsys.readouterr().err
    f = tmp_path / "nosweep.py"
    f.write_text("x = 1\n")
    with pytest.raises(SystemExit):
        sweep_main([str(f), "--dry-run"])
    assert "has no get_sweep()" in capsys.readouterr().err


def test_a_teacherless_grid_says_what_to_pass():
    with pytest.raises(ConfigError, match="teacher.checkpoint"):
        expand(_sweep(teacher_preset=None))


def test_config_drift_is_refused_naming_the_field_unless_forced(tmp_path, capsys):
    sweep = _sweep(methods=("baseline", "kd"), lr=(3e-3,), temperature=(1.0,))
    runs = expand(sweep)
    kd = next(r for r in runs if r.method == "kd")
    d = tmp_path / kd.run_id
    d.mkdir(parents=True)
    old = config_to_dict(dataclasses.replace(
        kd.config, distill=dataclasses.replace(kd.config.distill, divergence="reverse_kl")))
    (d / "config.json").write_text(json.dumps(old))
    (d / "metrics.jsonl").write_text('{"step": 3, "loss": 1.0}\n')
    # cosmetic fields never count as drift, nor (in a finished run) fields the method ignores
    same = config_to_dict(dataclasses.replace(
        runs[0].config, train=dataclasses.replace(runs[0].config.train, log_every=7),
        distill=dataclasses.replace(runs[0].config.distill, temperature=9.0)))
    (tmp_path / runs[0].run_id).mkdir()
    (tmp_path / runs[0].run_id / "config.json").write_text(json.dumps(same))
    (tmp_path / runs[0].run_id / "results.json").write_text('{"status": "done"}')
    with pytest.raises(ConfigError, match="distill.divergence") as e:
        prepare_workdir(sweep, runs, runs, tmp_path, sweep_file=CPU)
    assert "reverse_kl" in str(e.value) and "--force" in str(e.value)
    assert not (tmp_path / "sweep.json").exists()
    prepare_workdir(sweep, runs, runs, tmp_path, sweep_file=CPU, force=True)
    assert not d.exists()
    stale = list((tmp_path / ".sweep" / "stale").iterdir())
    assert len(stale) == 1 and stale[0].name.startswith(kd.run_id)
    assert (tmp_path / runs[0].run_id / "config.json").exists()  # left alone
    manifest = json.loads((tmp_path / "sweep.json").read_text())
    assert [e["run_id"] for e in manifest["runs"]] == [r.run_id for r in runs]


def test_run_status(tmp_path):
    run = expand(_sweep(methods=("baseline",), lr=(3e-3,)))[0]
    d = tmp_path / run.run_id
    assert run_status(run, d) == "new"
    (d / "checkpoints" / "4").mkdir(parents=True)
    assert run_status(run, d) == "partial"
    (d / "results.json").write_text(json.dumps({"status": "done"}))
    assert run_status(run, d) == "done"
    assert run_status(run, d, ("synth_mc",)) == "trained"
    (d / "results.json").write_text(json.dumps({"status": "done", "eval": {"synth_mc": {}}}))
    assert run_status(run, d, ("synth_mc",)) == "done"


def test_wandb_sweep_config_offline(tmp_path, capsys, monkeypatch):
    """The generated W&B grid: one parameter (run_id) whose values are exactly the grid's runs,
    and a command that - expanded the way `wandb agent` expands it - runs that one run."""
    from wandb.sdk.launch.sweeps.utils import create_sweep_command_args, load_sweep_config

    from hldstudy.sweep.__main__ import parse_args

    monkeypatch.setenv("WANDB_MODE", "disabled")
    workdir = tmp_path / "w"
    teacher = tmp_path / "teacher"
    teacher.mkdir()
    rc = sweep_main([str(CPU), "--executor", "wandb", "--workdir", str(workdir),
                     "--set", f"teacher.checkpoint={teacher}"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "No agent started" in out and "wandb sweep" in out
    cfg = load_sweep_config(str(workdir / "wandb_sweep.yaml"))
    assert cfg["method"] == "grid" and cfg["metric"] == {"name": "valid_ppl", "goal": "minimize"}
    ids = cfg["parameters"]["run_id"]["values"]
    manifest = json.loads((workdir / "sweep.json").read_text())
    assert ids == [e["run_id"] for e in manifest["runs"]] and len(ids) == 14
    # what the agent runs for one grid point
    rid = ids[5]
    args = create_sweep_command_args({"args": {"run_id": {"value": rid}}})
    argv = []
    for c in cfg["command"]:
        if c.startswith("${") and c.endswith("}"):
            argv += {"env": [], "interpreter": [], "args": args["args"]}[c[2:-1]]
        else:
            argv.append(c)
    assert argv[:2] == ["-m", "hldstudy.sweep"]
    ns = parse_args(argv[2:])
    assert ns.run_id == rid and Path(ns.workdir) == workdir.absolute()
    assert f"teacher.checkpoint={teacher}" in ns.overrides
    sweep = load_sweep(ns.sweep)
    assert rid in {r.run_id for r in expand(sweep, ns.overrides)}


def test_sweep_files_load_and_expand():
    for f in sorted(SWEEPS.glob("[!_]*.py")):
        sweep = load_sweep(f)
        assert sweep.launch.startswith(("python -m hldstudy.sweep", "hldstudy ")), f
        runs = expand(sweep)
        assert runs and len({r.run_id for r in runs}) == len(runs)
        assert len({r.config.budget.flops for r in runs}) == 1


def test_builtin_files_by_name(tmp_path, monkeypatch):
    """`hldstudy sweep cpu` / `--config tiny`: a bare name finds the packaged file; an
    existing path always wins; anything else is left for the loader to refuse."""
    monkeypatch.chdir(tmp_path)
    assert find_builtin("cpu", SWEEPS) == CPU
    assert find_builtin("tiny.py", EXPERIMENTS) == EXPERIMENTS / "tiny.py"
    assert find_builtin("nope", SWEEPS) == Path("nope")
    assert find_builtin("sub/cpu.py", SWEEPS) == Path("sub/cpu.py")
    Path("cpu.py").write_text("")
    assert find_builtin("cpu.py", SWEEPS) == Path("cpu.py")


def test_unknown_run_id(capsys):
    with pytest.raises(SystemExit):
        sweep_main([str(CPU), "--dry-run", "--run-id", "nope"])
    assert "'nope' is not a run of cpu" in capsys.readouterr().err



def test_a_worker_loads_its_teacher_once(tmp_path, monkeypatch):
    from hldstudy.sweep.worker import Worker

    calls = []

    class FakeTeacher:
        def check_tokenizer(self, tokenizer):
            calls.append(("check", tokenizer))

    def load(cfg, tokenizer):
        calls.append(("load", cfg.teacher.checkpoint))
        return FakeTeacher()

    monkeypatch.setattr("hldstudy.teacher.load_teacher", load)
    worker = Worker(tmp_path)
    runs = expand(_sweep(methods=("baseline", "kd", "hldf", "hldc")),
                  ["teacher.checkpoint=/some/teacher"])
    teachers = {id(worker.teacher_for(r.config, "tok")) for r in runs if r.method != "baseline"}
    assert len(teachers) == 1 and worker.teacher_loads == 1
    assert [c for c in calls if c[0] == "load"] == [("load", "/some/teacher")]
    assert worker.teacher_for(runs[0].config, "tok") is None  # the baseline has none


def test_an_unreadable_config_is_named_as_such(tmp_path):
    """A run directory whose config.json is not JSON is refused naming the file and the
    parse error, not as a run "trained with 'unreadable JSON'"."""
    sweep = _sweep(methods=("baseline",), lr=(3e-3,))
    runs = expand(sweep)
    d = tmp_path / runs[0].run_id
    d.mkdir(parents=True)
    (d / "config.json").write_text('{"train": ')
    with pytest.raises(ConfigError) as e:
        prepare_workdir(sweep, runs, runs, tmp_path, sweep_file=CPU)
    msg = str(e.value)
    assert "is not readable JSON (line 1" in msg and str(d) in msg
    assert "trained with" not in msg and "--force" in msg
