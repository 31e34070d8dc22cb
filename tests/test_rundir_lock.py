"""One job owns a run directory (hldstudy.runlock, hldstudy.rundir.owned).

Real processes where the fault is between processes: a job holding the directory
while `python -m hldstudy.train` is started on it, a holder killed with SIGKILL
(its stale lock is taken over), two trainings started on one directory. Every
subprocess carries a timeout; files intact before are compared byte for byte after.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hldstudy import rundir, runlock
from hldstudy.errors import EXIT_INPUT, exit_code_of

ROOT = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "JAX_PLATFORMS": "cpu"}
for _var in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID",
             "HLDSTUDY_DISTRIBUTED"):
    ENV.pop(_var, None)

HOLDER = r"""
import sys, time
from hldstudy import rundir
with rundir.owned(sys.argv[1]):
    print("held", flush=True)
    time.sleep(float(sys.argv[2]))
"""

TRAIN_ARGS = ["--config", "tiny", "--set", "train.progress=false", "--set", "train.steps=2",
              "--set", "data.synthetic_docs=200", "--set", "data.synthetic_valid_docs=20"]


def _hashes(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def _start_holder(run_dir: Path, seconds: float = 120) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(run_dir), str(seconds)],
                            cwd=ROOT, env=ENV, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def _train(run_dir: Path, timeout: float = 240, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hldstudy.train", "--workdir", str(run_dir),
                           *TRAIN_ARGS, *extra], cwd=ROOT, env=ENV, capture_output=True,
                          text=True, timeout=timeout)


def _error_lines(stderr: str) -> list[str]:
    return [ln for ln in stderr.splitlines() if "error:" in ln]


def test_the_lock_file_names_its_owner_and_is_released(tmp_path):
    with rundir.owned(tmp_path / "run") as run_dir:
        owner = runlock.read_owner(run_dir / rundir.LOCK_FILE)
        assert owner.pid == os.getpid() and owner.host == socket.gethostname()
        assert owner.started.endswith("Z")
        with pytest.raises(runlock.LockHeld, match=f"pid {os.getpid()} on host") as err:
            with rundir.owned(run_dir):
                pass
        assert exit_code_of(err.value) == EXIT_INPUT
        assert (run_dir / rundir.LOCK_FILE).exists()  # the refused one took nothing away
    assert not (tmp_path / "run" / rundir.LOCK_FILE).exists()


def test_the_lock_is_released_when_the_block_raises(tmp_path):
    with pytest.raises(KeyError), rundir.owned(tmp_path):
        raise KeyError("boom")
    assert not (tmp_path / rundir.LOCK_FILE).exists()


def test_release_never_removes_another_owners_lock(tmp_path):
    path = tmp_path / "run.lock"
    mine = runlock.acquire(path, "d")
    path.unlink()
    theirs = runlock.acquire(path, "d")
    runlock.release(path, mine)
    assert runlock.read_owner(path).token == theirs.token


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _write_owner(path: Path, **fields) -> None:
    base = runlock.this_owner().__dict__
    path.write_text(json.dumps({**base, **fields}))


def test_a_stale_lock_on_this_host_is_taken_over_with_a_warning(tmp_path, capsys):
    path = tmp_path / rundir.LOCK_FILE
    dead = _dead_pid()
    _write_owner(path, pid=dead, token="old")
    with rundir.owned(tmp_path):
        assert runlock.read_owner(path).pid == os.getpid()
    err = capsys.readouterr().err
    assert f"took over the lock of the run directory {tmp_path} from pid {dead}" in err
    assert len(err.strip().splitlines()) == 1


def test_a_reused_pid_does_not_keep_a_lock_alive(tmp_path):
    """The owner's pid now belongs to a process that started later (pid reuse)."""
    path = tmp_path / rundir.LOCK_FILE
    _write_owner(path, pid=os.getpid(), proc_start="1", token="old")
    if not runlock.this_owner().proc_start:
        pytest.skip("no /proc: process start times cannot be read here")
    with rundir.owned(tmp_path):
        pass


def test_a_lock_from_another_host_is_never_taken_over(tmp_path):
    path = tmp_path / rundir.LOCK_FILE
    _write_owner(path, host="elsewhere-node", pid=_dead_pid(), token="remote")
    with pytest.raises(runlock.LockHeld, match=f"on host elsewhere-node.*remove {path}"):
        with rundir.owned(tmp_path):
            pass
    assert runlock.read_owner(path).token == "remote"


def test_a_lock_file_without_an_owner_is_refused_not_removed(tmp_path):
    path = tmp_path / rundir.LOCK_FILE
    path.write_text("")
    with pytest.raises(runlock.LockHeld, match="names no owner"):
        runlock.acquire(path, "the run directory")
    assert path.exists()


def test_two_contenders_for_one_stale_lock_do_not_both_win(tmp_path):
    path = tmp_path / rundir.LOCK_FILE
    _write_owner(path, pid=_dead_pid(), token="old")
    stale = runlock.read_owner(path)
    assert runlock._take_over(path, stale)
    first = runlock.acquire(path, "d")
    # The second contender read the same stale record before the first took over.
    assert not runlock._take_over(path, stale)
    assert runlock.read_owner(path).token == first.token


@pytest.mark.timeout(300)
def test_train_on_a_directory_another_job_holds_is_one_line_exit_2(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.json").write_text('{"keep": "me"}')
    (run_dir / "metrics.jsonl").write_text('{"step": 1}\n')
    holder = _start_holder(run_dir)
    try:
        before = _hashes(run_dir)
        proc = _train(run_dir)
        assert _hashes(run_dir) == before
        assert holder.poll() is None
    finally:
        holder.kill()
        holder.wait()
    assert proc.returncode == EXIT_INPUT, proc.stderr[-2000:]
    lines = _error_lines(proc.stderr)
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert f"the run directory {run_dir} is in use by another job: pid {holder.pid}" in lines[0]


@pytest.mark.timeout(120)
def test_a_lock_left_by_a_killed_process_is_taken_over_by_the_next(tmp_path):
    run_dir = tmp_path / "run"
    first = _start_holder(run_dir)
    first.send_signal(signal.SIGKILL)
    first.wait()
    second = subprocess.Popen([sys.executable, "-c", HOLDER, str(run_dir), "0"], cwd=ROOT,
                              env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = second.communicate(timeout=100)
    assert second.returncode == 0 and out.strip() == "held", err[-2000:]
    assert len(err.strip().splitlines()) == 1, err[-2000:]
    assert (f"warning: took over the lock of the run directory {run_dir} from pid "
            f"{first.pid} on host") in err
    assert not (run_dir / rundir.LOCK_FILE).exists()


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_lock_left_by_a_killed_job_is_taken_over_and_released(tmp_path):
    run_dir = tmp_path / "run"
    holder = _start_holder(run_dir)
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    assert (run_dir / rundir.LOCK_FILE).exists()
    proc = _train(run_dir)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"took over the lock of the run directory {run_dir} from pid {holder.pid}" \
        in proc.stderr
    assert not (run_dir / rundir.LOCK_FILE).exists()  # released at the end
    assert (run_dir / "results.json").exists()


@pytest.mark.timeout(300)
def test_a_refused_run_releases_the_lock(tmp_path):
    """A run refused after taking the lock (its run directory holds a checkpoint and an
    unreadable config.json) leaves no lock behind, and every file as it was."""
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints" / "4").mkdir(parents=True)
    (run_dir / "config.json").write_text("{torn")
    before = _hashes(run_dir)
    proc = _train(run_dir)
    assert proc.returncode == EXIT_INPUT, proc.stderr[-2000:]
    assert "config.json is not a readable config" in proc.stderr
    assert not (run_dir / rundir.LOCK_FILE).exists()
    assert _hashes(run_dir) == before


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_two_trainings_on_one_directory_one_wins(tmp_path):
    """Two real `hldstudy.train` processes started on one run directory: the second is
    refused in one line (exit 2) while the first trains to the end."""
    run_dir = tmp_path / "run"
    first = subprocess.Popen([sys.executable, "-m", "hldstudy.train", "--workdir", str(run_dir),
                              *TRAIN_ARGS, "--set", "train.steps=30"], cwd=ROOT, env=ENV,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not (run_dir / rundir.LOCK_FILE).exists():
            assert first.poll() is None and time.monotonic() < deadline, first.communicate()
            time.sleep(0.1)
        second = _train(run_dir)
        out, err = first.communicate(timeout=500)
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    assert second.returncode == EXIT_INPUT, second.stderr[-2000:]
    assert len(_error_lines(second.stderr)) == 1
    assert f"pid {first.pid} on host" in second.stderr
    assert first.returncode == 0, err[-2000:]
    assert json.loads((run_dir / "results.json").read_text())["status"] == "done"
    assert not (run_dir / rundir.LOCK_FILE).exists()


def test_a_sweep_run_refused_by_the_lock_writes_nothing_in_the_owners_directory(tmp_path):
    from hldstudy.sweep.worker import record_failure

    run_dir = tmp_path / "run"
    with rundir.owned(run_dir, "the first job"):
        before = sorted(p.name for p in run_dir.iterdir())
        with pytest.raises(runlock.LockHeld) as refused, rundir.owned(run_dir, "a second job"):
            pass
        line = record_failure(run_dir, refused.value)
        assert sorted(p.name for p in run_dir.iterdir()) == before  # no error.txt, no outcome
    assert "in use by another job" in line and exit_code_of(refused.value) == EXIT_INPUT
