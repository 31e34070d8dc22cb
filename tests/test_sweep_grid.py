"""One teacher replica set for the whole grid (`python -m hldstudy.sweep --cohort K
--teacher-replicas N`): the planner's grid layout, the members the replicas declare, and
every refusal (one line, exit 2 or 3, no replica process left behind). The end-to-end
sweeps are in tests/test_sweep_grid_e2e.py."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hldstudy.commands.plan import main as plan_main
from hldstudy.config import Config, DataConfig, TrainConfig
from hldstudy.model import preset
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


# --------------------------------------------------------------------------- #
# Refusals through the command line: one line, exit 2 or 3, no replica left


def write_grid_sweep(path: Path, teacher, tokenizer, *, methods=("kd", "hldf", "hldc"),
                     temperature=(1.0, 2.0), steps: int = 8, extra=()) -> Path:
    """A tiny grid of `methods` x lr (2) x `temperature` on the session's tokenizer,
    distilled from `teacher`, checkpointing every 4 steps."""
    path.write_text(f'''"""Tiny grid-teacher sweep."""
from hldstudy.config import Config, DataConfig, DistillConfig, TrainConfig
from hldstudy.model import preset
from hldstudy.sweep import Sweep


def get_sweep():
    data = DataConfig(seq_len=64, batch_size=8, tokenizer_vocab_size=384, synthetic_docs=600,
                      synthetic_valid_docs=50, tokenizer={str(tokenizer)!r})
    base = Config(name="g", model=preset("tiny", vocab_size=384), data=data,
                  train=TrainConfig(warmup_steps=1, log_every=1, checkpoint_every=4,
                                    eval_batches=1),
                  distill=DistillConfig(alpha=0.5))
    return Sweep(name="grid", base=base, methods={tuple(methods)!r}, lr=(3e-3, 1e-2),
                 temperature={tuple(temperature)!r}, budget_baseline_steps={steps},
                 teacher={str(teacher)!r}, teacher_preset="tiny-teacher",
                 overrides=("teacher.timeout_s=300",) + {tuple(extra)!r})
''')
    return path


def serve_processes(marker: str) -> list[int]:
    """Pids of `hldstudy.teacher.serve` processes whose command line mentions `marker`."""
    out = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if "hldstudy.teacher.serve" in cmd and marker in cmd:
            out.append(int(pid))
    return out


def _sweep_cli(args, cwd=None, timeout=600):
    return subprocess.run([sys.executable, "-m", "hldstudy.sweep", *args, "--no-progress"],
                          capture_output=True, text=True, timeout=timeout, cwd=cwd)


def _one_error_line(stderr: str) -> str:
    lines = [ln for ln in stderr.strip().splitlines() if ln.strip()]
    errors = [ln for ln in lines if ": error: " in ln]
    assert len(errors) == 1, stderr
    return errors[0]


def test_zero_replicas_is_refused_before_anything(tmp_path, capsys):
    from hldstudy.sweep.__main__ import main as sweep_main

    with pytest.raises(SystemExit) as e:
        sweep_main(["cpu", "--workdir", str(tmp_path / "w"), "--cohort", "4",
                    "--teacher-replicas", "0"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("python -m hldstudy.sweep: error: "
                                                   "--teacher-replicas: must be an integer >= 1")
    assert not (tmp_path / "w").exists()


def test_a_replica_that_never_answers_is_named_and_stopped(tmp_path, teacher_dir,
                                                            tokenizer_path):
    sweep = write_grid_sweep(tmp_path / "grid.py", teacher_dir, tokenizer_path,
                             methods=("kd",), temperature=(1.0,))
    work = tmp_path / "w"
    r = _sweep_cli([str(sweep), "--workdir", str(work), "--cohort", "4",
                    "--teacher-replicas", "1", "--teacher-ready-timeout-s", "0.5"])
    assert r.returncode == 3, r.stderr
    line = _one_error_line(r.stderr)
    assert "teacher replica 0 (pid " in line and "did not answer within 0.5 s" in line, line
    assert str(work / ".sweep" / "teacher" / "replica0.log") in line
    assert serve_processes(str(work)) == []
    assert not any((work / rid / "metrics.jsonl").exists() for rid in os.listdir(work)
                   if not rid.startswith("."))


def test_a_replica_that_cannot_load_the_teacher_exits_with_its_line(tmp_path, teacher_dir,
                                                                   tokenizer_path):
    import shutil

    damaged = tmp_path / "teacher"
    shutil.copytree(teacher_dir, damaged)
    shutil.rmtree(damaged / "checkpoints")
    sweep = write_grid_sweep(tmp_path / "grid.py", damaged, tokenizer_path,
                             methods=("kd",), temperature=(1.0,))
    work = tmp_path / "w"
    r = _sweep_cli([str(sweep), "--workdir", str(work), "--cohort", "4",
                    "--teacher-replicas", "1"])
    assert r.returncode in (2, 3), r.stderr
    line = _one_error_line(r.stderr)
    assert "teacher replica 0 (pid " in line and "exited with code" in line, line
    assert serve_processes(str(work)) == []


def test_a_method_whose_layers_the_teacher_lacks_is_refused(tmp_path, teacher_dir,
                                                            tokenizer_path):
    sweep = write_grid_sweep(tmp_path / "grid.py", teacher_dir, tokenizer_path,
                             methods=("hldc",), temperature=(1.0,),
                             extra=("distill.layer_pairs=2:9",))
    work = tmp_path / "w"
    r = _sweep_cli([str(sweep), "--workdir", str(work), "--cohort", "4",
                    "--teacher-replicas", "1"])
    assert r.returncode == 2, r.stderr
    line = _one_error_line(r.stderr)
    assert "distill.layer_pairs" in line and "teacher layer 9 is out of range 1..6" in line
    assert serve_processes(str(work)) == []


def test_runs_reading_different_batches_cannot_share_a_replica_set(tmp_path, teacher_dir,
                                                                  tokenizer_path):
    from hldstudy.errors import ConfigError
    from hldstudy.sweep.gridteach import check_grid
    from hldstudy.sweep.spec import load_sweep

    sweep = write_grid_sweep(tmp_path / "grid.py", teacher_dir, tokenizer_path,
                             methods=("kd", "hldc"), temperature=(1.0,))
    runs = expand(load_sweep(sweep))
    check_grid(runs, ReplicaOptions(1))
    import dataclasses

    other = dataclasses.replace(runs[-1], config=dataclasses.replace(
        runs[-1].config, data=dataclasses.replace(runs[-1].config.data, seed=7)))
    with pytest.raises(ConfigError, match=r"^data.seed: runs kd_\S+ and hldc_\S+ differ"):
        check_grid([*runs[:-1], other], ReplicaOptions(1))
    with pytest.raises(ConfigError, match=r"^teacher.timeout_s: 300 s .* is not above"):
        check_grid(runs, ReplicaOptions(1, lag_timeout_s=300))


def test_the_study_launch_lines_start_the_grid_teacher():
    import shlex

    from hldstudy.cli_common import SWEEPS
    from hldstudy.sweep.__main__ import parse_args
    from hldstudy.sweep.spec import load_sweep

    for name in ("c4_123m", "c4_735m"):
        launch = load_sweep(SWEEPS / f"{name}.py").launch
        ns = parse_args(shlex.split(launch)[3:])
        assert (ns.executor, ns.cohort, ns.teacher_replicas) == ("slurm", 12, 8), name
        assert "gpus_per_node=1" in ns.teacher_slurm


def test_sigterm_while_the_replicas_start_stops_them(tmp_path, teacher_dir, tokenizer_path):
    sweep = write_grid_sweep(tmp_path / "grid.py", teacher_dir, tokenizer_path,
                             methods=("kd",), temperature=(1.0,))
    work = tmp_path / "w"
    proc = subprocess.Popen([sys.executable, "-m", "hldstudy.sweep", str(sweep), "--workdir",
                             str(work), "--cohort", "4", "--teacher-replicas", "1",
                             "--no-progress"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        deadline = time.monotonic() + 300
        while not serve_processes(str(work)) and time.monotonic() < deadline \
                and proc.poll() is None:
            time.sleep(0.1)
        assert serve_processes(str(work)), proc.communicate()[1][-3000:]
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 128 + signal.SIGTERM, err[-3000:]
    assert "stopped by a signal" in err
    assert serve_processes(str(work)) == []


@pytest.mark.slow
def test_a_local_replica_that_dies_is_restarted_on_its_port(tmp_path, teacher_dir,
                                                            tokenizer_path):
    from hldstudy.sweep.gridteach import ReplicaSet
    from hldstudy.sweep.replica_launch import LocalLauncher
    from hldstudy.sweep.spec import load_sweep
    from hldstudy.teacher.remote import GrpcLink

    sweep = write_grid_sweep(tmp_path / "grid.py", teacher_dir, tokenizer_path,
                             methods=("kd", "hldc"), temperature=(1.0,))
    runs = expand(load_sweep(sweep))
    members = grid_members(group(runs, 4), TEACHER)
    work = tmp_path / "w"
    with ReplicaSet(members, runs[0].config, work, ReplicaOptions(1, stop_grace_s=5.0),
                    LocalLauncher()) as replicas:
        (address,) = replicas.addresses
        info = GrpcLink(address).info()
        assert info["cohort"]["members"] == sorted(m.id for m in members)
        assert (info["final"], info["layers"]) == (True, [TEACHER.n_layers // 2])
        first = replicas.replicas[0].proc.pid
        os.kill(first, signal.SIGKILL)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if replicas.restarted[0] and (work / ".sweep/teacher/replica0.address").exists():
                try:
                    GrpcLink(address).info()
                    break
                except ConnectionError:
                    pass
            time.sleep(0.2)
        else:
            pytest.fail("the replica was not restarted on its port")
        second = replicas.replicas[0].proc.pid
        assert second != first and replicas.restarted == [1]
    assert serve_processes(str(work)) == []
    stats = json.loads((work / ".sweep/teacher/stats.json").read_text())
    assert stats["restarts"] == [1] and stats["replicas"][address]["forwards"] == 0
