"""A tiny sweep end to end: 2 methods x 2 points, one run interrupted mid-way and resumed,
evaluation, the report accounting for every run exactly once; SLURM through submitit."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers.runs import DATA
from helpers.sweep_stop import runs_stopped_at

from hldstudy.sweep.__main__ import main as sweep_main

ROOT = Path(__file__).resolve().parent.parent


def _sweep_file(tmp_path: Path, teacher: Path, *, eval_tasks=("synth_mc",), methods=None,
                lr=(3e-3, 1e-2), steps=8, seeds=(0,)) -> Path:
    f = tmp_path / "tiny_sweep.py"
    f.write_text(f'''"""Tiny test sweep.

    python -m hldstudy.sweep {f} --workdir RUNS
"""
from hldstudy.config import Config, DataConfig, DistillConfig, TrainConfig
from hldstudy.model import preset
from hldstudy.sweep import Sweep


def get_sweep():
    base = Config(name="s", model=preset("tiny", vocab_size=384), data=DataConfig(**{DATA!r}),
                  train=TrainConfig(warmup_steps=1, log_every=1, checkpoint_every=0,
                                    eval_batches=1),
                  distill=DistillConfig(alpha=0.5, temperature=1.0))
    return Sweep(name="tiny", base=base, methods={methods or ("baseline", "kd")!r},
                 lr={lr!r}, seeds={tuple(seeds)!r}, budget_baseline_steps={steps}, teacher={str(teacher) if teacher else None!r},
                 eval_tasks={tuple(eval_tasks)!r}, eval_limit=8, eval_batch_size=8)
''')
    return f


def _steps(run_dir: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()
            if "loss" in json.loads(line)]


@pytest.mark.slow  # 53 s; a sweep resumed through submitit stays in the default suite
# (test_slurm_executor_through_submitit_debug_resumes)
def test_sweep_interrupted_resumed_and_reported_once(tmp_path, teacher_dir, monkeypatch, capsys):
    sweep = _sweep_file(tmp_path, teacher_dir)
    runs_dir = tmp_path / "runs"
    listing = json.loads(_dry(sweep, runs_dir, capsys))
    ids = [r["run_id"] for r in listing]
    assert ids == ["baseline_lr3e-3_s0", "baseline_lr1e-2_s0", "kd_lr3e-3_s0",
                   "kd_lr1e-2_s0"]
    victim = "kd_lr3e-3_s0"
    total = next(r["steps"] for r in listing if r["run_id"] == victim)

    # 1st launch: the victim is stopped at step 3 exactly as a SIGTERM would stop it.
    with runs_stopped_at({victim: 3}):
        rc = sweep_main([str(sweep), "--workdir", str(runs_dir), "--no-progress"])
    assert rc == 128 + signal.SIGTERM
    err = capsys.readouterr().err
    assert f"{victim}: interrupted (checkpoint at step 3)" in err
    assert (runs_dir / "baseline_lr3e-3_s0" / "results.json").exists()
    assert not (runs_dir / victim / "results.json").exists()
    assert (runs_dir / victim / "checkpoints" / "3").is_dir()
    assert not (runs_dir / "kd_lr1e-2_s0").exists()  # never started
    before = (runs_dir / victim / "metrics.jsonl").read_text().splitlines()
    expected = json.loads((runs_dir / "sweep.json").read_text())
    assert [e["run_id"] for e in expected["runs"]] == ids

    # 2nd launch: finished runs skipped, the victim resumes from its checkpoint.
    rc = sweep_main([str(sweep), "--workdir", str(runs_dir), "--no-progress"])
    assert rc == 0
    err = capsys.readouterr().err
    assert "baseline_lr3e-3_s0: skipped" in err and "4 run(s): 2 trained, 2 already done" in err
    after = (runs_dir / victim / "metrics.jsonl").read_text().splitlines()
    assert after[:len(before)] == before  # steps 1-3 were not retrained
    assert _steps(runs_dir / victim) == list(range(1, total + 1))
    launch = json.loads((runs_dir / ".sweep" / "last_launch.json").read_text())
    assert launch["teacher_loads"] == 1  # two kd runs, one teacher load

    for rid in ids:
        res = json.loads((runs_dir / rid / "results.json").read_text())
        assert res["status"] == "done" and res["run_id"] == rid
        assert set(res["eval"]) == {"synth_mc"} and "acc" in res["eval"]["synth_mc"]
        assert res["flops_spent"] <= res["flops_budget"]

    # 3rd launch: nothing to do.
    assert sweep_main([str(sweep), "--workdir", str(runs_dir), "--no-progress"]) == 0
    assert "0 trained, 4 already done" in capsys.readouterr().err

    from hldstudy.analysis import build_report

    summary = build_report(runs_dir, tmp_path / "report", n_resamples=200)
    assert sorted(summary["runs"]) == sorted(ids)  # every run exactly once ({run_id: used as})
    assert all(v.startswith(("baseline", "reference")) for v in summary["runs"].values())
    accounting = (tmp_path / "report" / "tables" / "accounting.csv").read_text().splitlines()
    assert sorted(line.split(",")[0] for line in accounting[1:]) == sorted(ids)
    report = (tmp_path / "report" / "report.md").read_text()
    assert "synth_mc/acc" in report


def _last_launch(runs_dir: Path) -> dict:
    return json.loads((runs_dir / ".sweep" / "last_launch.json").read_text())


def _dry(sweep, runs_dir, capsys) -> str:
    assert sweep_main([str(sweep), "--workdir", str(runs_dir), "--dry-run", "--json"]) == 0
    return capsys.readouterr().out


def test_slurm_executor_through_submitit_debug_resumes(tmp_path, monkeypatch):
    """(No capsys here: submitit's debug executor and pytest's capture fixtures do not mix.)
    submitit's debug executor runs the job in this process: a run stopped mid-way (as a
    SIGTERM would) is resumed by the resubmitted sweep; a finished sweep submits nothing."""
    sweep = _sweep_file(tmp_path, None, eval_tasks=(), methods=("baseline",), lr=(3e-3,),
                        steps=5)
    runs_dir = tmp_path / "runs"
    rid = "baseline_lr3e-3_s0"
    args = [str(sweep), "--workdir", str(runs_dir), "--executor", "slurm", "--cluster", "debug",
            "--no-progress", "--slurm", "timeout_min=5"]
    with runs_stopped_at({rid: 2}):
        assert sweep_main(args) == 128 + signal.SIGTERM
    assert _last_launch(runs_dir)["interrupted"] == [rid]
    assert (runs_dir / rid / "checkpoints" / "2").is_dir()
    jobs = json.loads((runs_dir / ".sweep" / "jobs.json").read_text())
    assert jobs[0]["runs"] == [rid]
    assert sweep_main(args) == 0
    assert _last_launch(runs_dir)["done"] == [rid]
    res = json.loads((runs_dir / rid / "results.json").read_text())
    assert res["status"] == "done" and res["run_id"] == rid and res["steps"] == 5
    assert _steps(runs_dir / rid) == [1, 2, 3, 4, 5]
    assert sweep_main(args) == 0  # everything done: nothing is submitted
    assert _last_launch(runs_dir)["skipped"] == [rid] and not _last_launch(runs_dir)["done"]

    # requeue on preemption resubmits the same job
    import submitit

    from hldstudy.sweep.executors import SweepJob

    delayed = SweepJob({"workdir": str(runs_dir)}).checkpoint(["x"])
    assert isinstance(delayed, submitit.helpers.DelayedSubmission) and delayed.args == (["x"],)


@pytest.mark.slow
def test_parallel_workers_sigterm_and_resume(tmp_path, teacher_dir):
    """--parallel 2 in a subprocess: a real SIGTERM mid-sweep checkpoints the running runs;
    the rerun finishes every run, each trained exactly once per step."""
    sweep = _sweep_file(tmp_path, teacher_dir, eval_tasks=(), steps=60)
    runs_dir = tmp_path / "runs"
    cmd = [sys.executable, "-m", "hldstudy.sweep", str(sweep), "--workdir", str(runs_dir),
           "--parallel", "2", "--no-progress"]
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=1"}
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 300
    while time.time() < deadline:
        logged = [p for p in runs_dir.glob("*/metrics.jsonl") if len(p.read_text().splitlines()) >= 3]
        if logged:
            break
        time.sleep(0.5)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert "interrupted (checkpoint at step" in err
    proc = subprocess.run(cmd, cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr
    manifest = json.loads((runs_dir / "sweep.json").read_text())
    for e in manifest["runs"]:
        d = runs_dir / e["run_id"]
        assert json.loads((d / "results.json").read_text())["status"] == "done"
        assert _steps(d) == list(range(1, e["steps"] + 1))
    launch = json.loads((runs_dir / ".sweep" / "last_launch.json").read_text())
    assert launch["teacher_loads"] <= 2  # at most one per worker
