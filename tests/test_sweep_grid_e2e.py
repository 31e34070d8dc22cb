"""`python -m hldstudy.sweep SWEEP --cohort 4 --teacher-replicas 1` end to end on a tiny
kd / hldf / hldc grid: the sweep starts one replica for the whole grid, every run's
per-step losses equal its solo colocated run's, the replica computes each step once
for all three methods' cohorts (forwards = the longest schedule's steps), and no
replica process is left, also after the sweep is interrupted (SIGINT) mid-run and
rerun. The SLURM path runs the same grid through submitit's local executor."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from helpers.runs import losses
from test_sweep_grid import serve_processes, write_grid_sweep

RTOL = 1e-6


def _cli(*args) -> list[str]:
    return [sys.executable, "-m", "hldstudy.sweep", *map(str, args), "--no-progress"]


def _run(*args, timeout=2400):
    r = subprocess.run(_cli(*args), capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, r.stderr[-4000:]
    return r


def _run_ids(work: Path) -> list[str]:
    return [r["run_id"] for r in json.loads((work / "sweep.json").read_text())["runs"]]


def _assert_equal_to_solo(work: Path, solo: Path) -> None:
    for rid in _run_ids(solo):
        a, b = losses(work / rid), losses(solo / rid)
        assert sorted(a) == sorted(b), rid
        np.testing.assert_allclose([a[s] for s in sorted(a)], [b[s] for s in sorted(b)],
                                   rtol=RTOL, err_msg=rid)


def _replica_stats(work: Path) -> dict:
    rec = json.loads((work / ".sweep" / "teacher" / "stats.json").read_text())
    (stats,) = rec["replicas"].values()
    return stats


def _longest(work: Path) -> int:
    return max(r["steps"] for r in json.loads((work / "sweep.json").read_text())["runs"])


@pytest.fixture(scope="module")
def grid(tmp_path_factory, teacher_dir, tokenizer_path):
    """The sweep file and its solo colocated reference (every run alone, its own teacher)."""
    root = tmp_path_factory.mktemp("grid")
    sweep = write_grid_sweep(root / "grid.py", teacher_dir, tokenizer_path, temperature=(1.0,))
    _run(sweep, "--workdir", root / "solo")
    return sweep, root


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_grid_sweep_equals_solo_with_one_forward_per_step(grid):
    sweep, root = grid
    work = root / "one"
    r = _run(sweep, "--workdir", work, "--cohort", 4, "--teacher-replicas", 1,
             "--teacher-lag-timeout-s", 120)
    assert "starting 1 teacher replica(s) for 3 cohort(s) (hldc, hldf, kd)" in r.stderr
    _assert_equal_to_solo(work, root / "solo")
    stats = _replica_stats(work)
    (work / "replica_stats.json").write_text(json.dumps(stats))  # for a failure's reader
    assert _longest(work) == 9  # hldf's 3 + 6 steps; kd 8, hldc 7
    assert stats["recomputed"] == 0 and stats["forwards"] == 9  # not 8 + 9 + 7
    members = stats["cohort"]["members"]
    assert sorted(m["taken"] for m in members.values()) == [7, 8, 9]
    assert serve_processes(str(work)) == []


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_grid_sweep_interrupted_and_rerun(grid):
    sweep, root = grid
    work = root / "interrupted"
    proc = subprocess.Popen(_cli(sweep, "--workdir", work, "--cohort", 4,
                                 "--teacher-replicas", 1, "--teacher-lag-timeout-s", 120),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 1800
        while time.monotonic() < deadline and proc.poll() is None:
            trained = [rid for rid in (os.listdir(work) if work.exists() else [])
                       if (work / rid / "metrics.jsonl").exists() and losses(work / rid)]
            if len(trained) >= 2:
                break
            time.sleep(0.5)
        assert proc.poll() is None, proc.communicate()[1][-4000:]
        os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C: the sweep and its trainers, not replicas
        _, err = proc.communicate(timeout=900)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 128 + signal.SIGINT, err[-4000:]
    assert serve_processes(str(work)) == []
    first = _replica_stats(work)
    assert first["forwards"] < 9
    stopped = {rid: json.loads((work / rid / "outcome.json").read_text())
               for rid in _run_ids(work)}
    at = {rid: o["step"] for rid, o in stopped.items() if o["status"] == "interrupted"}
    assert any(rid.startswith("hldf") for rid in at), stopped  # the longest, still going

    _run(sweep, "--workdir", work, "--cohort", 4, "--teacher-replicas", 1,
         "--teacher-lag-timeout-s", 120)
    _assert_equal_to_solo(work, root / "solo")
    assert serve_processes(str(work)) == []
    again = _replica_stats(work)
    (work / "replica_stats.json").write_text(json.dumps([first, again]))
    # Resumed from their checkpoints (saved at the signal): each step from the earliest
    # resume point on is computed at most once for the grid, and at least hldf's (the
    # longest schedule's) remaining steps are; the rest are recomputed for a cohort that
    # resumed behind the window.
    resumed = [json.loads((work / rid / "outcome.json").read_text()) for rid in _run_ids(work)]
    assert all(o["status"] == "done" for o in resumed)
    hldf = max(s for rid, s in at.items() if rid.startswith("hldf"))
    assert 9 - hldf <= again["forwards"] - again["recomputed"] <= 9 - min(at.values()), at


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_grid_sweep_through_submitit_local(grid):
    pytest.importorskip("submitit")
    sweep, root = grid
    work = root / "slurm"
    _run(sweep, "--workdir", work, "--cohort", 4, "--teacher-replicas", 1,
         "--teacher-lag-timeout-s", 120, "--executor", "slurm", "--cluster", "local")
    _assert_equal_to_solo(work, root / "solo")
    stats = _replica_stats(work)
    assert stats["recomputed"] == 0 and stats["forwards"] == 9
    jobs = json.loads((work / ".sweep" / "jobs.json").read_text())
    assert len(jobs) == 3 and all(j["cohort"] for j in jobs)
