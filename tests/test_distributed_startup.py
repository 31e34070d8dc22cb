"""Multi-process start-up fails in one line of ours, never in JAX's abort, and before
anything is written (hldstudy.distributed).

Real processes: `python -m hldstudy.train` with a partial multi-process environment,
with a coordinator address nothing listens on, with a "coordinator" that accepts the
TCP connection and never answers, and as process 0 of a job whose other process never
comes. Each is bounded by a short start-up setting and a subprocess timeout.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from hldstudy import distributed, rundir
from hldstudy.errors import EXIT_INPUT, EXIT_RUNTIME, InputError, RuntimeFault

ROOT = Path(__file__).resolve().parent.parent
BASE_ENV = {k: v for k, v in os.environ.items()
            if k not in (*distributed.JAX_VARS, distributed.SLURM_SWITCH, "SLURM_JOB_ID")}
BASE_ENV["JAX_PLATFORMS"] = "cpu"


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _train(workdir: Path, env: dict, timeout: float = 120) -> tuple[subprocess.CompletedProcess,
                                                                     float]:
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "hldstudy.train", "--config", "tiny",
                           "--workdir", str(workdir), "--set", "train.steps=2",
                           "--set", "train.progress=false"],
                          cwd=ROOT, env={**BASE_ENV, **env}, capture_output=True, text=True,
                          timeout=timeout)
    return proc, time.monotonic() - t0


def _one_error_line(proc: subprocess.CompletedProcess) -> str:
    assert "Traceback" not in proc.stderr and "Check failure" not in proc.stderr, proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if "error:" in ln]
    assert len(lines) == 1, proc.stderr[-3000:]
    return lines[0]


@pytest.mark.parametrize("env,missing", [
    ({"JAX_NUM_PROCESSES": "2"}, "JAX_COORDINATOR_ADDRESS, JAX_PROCESS_ID"),
    ({"JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "0"}, "JAX_COORDINATOR_ADDRESS"),
    ({"JAX_COORDINATOR_ADDRESS": "127.0.0.1:1234"}, "JAX_NUM_PROCESSES, JAX_PROCESS_ID"),
    ({"HLDSTUDY_DISTRIBUTED": "1"}, "JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES"),
])
def test_a_partial_environment_is_refused(monkeypatch, env, missing):
    for key in (*distributed.JAX_VARS, distributed.SLURM_SWITCH, "SLURM_JOB_ID"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert distributed.requested()
    with pytest.raises(InputError, match=f"needs {missing}"):
        distributed.check_environment()


def test_slurm_with_the_switch_is_complete(monkeypatch):
    for key in distributed.JAX_VARS:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("HLDSTUDY_DISTRIBUTED", "1")
    monkeypatch.setenv("SLURM_JOB_ID", "42")
    assert distributed.check_environment() == (None, None, None)


@pytest.mark.parametrize("env,needle", [
    ({"JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "2", "JAX_COORDINATOR_ADDRESS": "h:1"},
     "JAX_PROCESS_ID=2 must be in 0..1"),
    ({"JAX_NUM_PROCESSES": "two", "JAX_PROCESS_ID": "0", "JAX_COORDINATOR_ADDRESS": "h:1"},
     "JAX_NUM_PROCESSES='two' is not an integer"),
    ({"JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "0", "JAX_COORDINATOR_ADDRESS": "node0"},
     "is not host:port"),
])
def test_bad_values_are_named(monkeypatch, env, needle):
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(InputError, match=needle):
        distributed.check_environment()


def test_the_probe_gives_up_on_a_closed_port_within_its_wait():
    port = _free_port()
    t0 = time.monotonic()
    with pytest.raises(RuntimeFault, match=f"coordinator at 127.0.0.1:{port} did not answer "
                                           r"within 1 s \(Connection refused\)"):
        distributed.probe_coordinator(f"127.0.0.1:{port}", 1.0)
    assert time.monotonic() - t0 < 5


def test_the_probe_returns_once_the_coordinator_listens():
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.bind(("127.0.0.1", 0))
    port = server.getsockname()[1]
    # Process 0 comes up a moment after this process starts probing.
    timer = threading.Timer(0.8, server.listen)
    timer.start()
    try:
        distributed.probe_coordinator(f"127.0.0.1:{port}", 10.0)
    finally:
        timer.cancel()
        server.close()


def test_process_0_refuses_a_port_in_use():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as busy:
        busy.bind(("", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(RuntimeFault, match=f"port {port}.*in use"):
            distributed.check_port_free(f"127.0.0.1:{port}")


def test_train_with_a_partial_environment_writes_nothing(tmp_path):
    workdir = tmp_path / "run"
    proc, _ = _train(workdir, {"JAX_NUM_PROCESSES": "2"})
    assert proc.returncode == EXIT_INPUT
    line = _one_error_line(proc)
    assert "incomplete multi-process setting" in line and "JAX_COORDINATOR_ADDRESS" in line
    assert not workdir.exists()


@pytest.mark.timeout(180)
@pytest.mark.parametrize("limit,seconds", [(distributed.PROBE_ENV, 3),
                                           # the job's timeout caps the probe (default 20 s)
                                           (distributed.INIT_TIMEOUT_ENV, 2)])
def test_an_unreachable_coordinator_is_one_line_exit_3(tmp_path, limit, seconds):
    workdir = tmp_path / "run"
    address = f"127.0.0.1:{_free_port()}"
    proc, _ = _train(workdir, {"JAX_COORDINATOR_ADDRESS": address,
                               "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "1",
                               limit: str(seconds)})
    assert proc.returncode == EXIT_RUNTIME, proc.stderr[-3000:]
    line = _one_error_line(proc)
    assert f"the coordinator at {address} did not answer within {seconds} s" in line
    assert "JAX_COORDINATOR_ADDRESS" in line and distributed.PROBE_ENV in line
    assert not workdir.exists()


@pytest.mark.timeout(180)
def test_a_coordinator_that_never_answers_ends_in_our_line_not_an_abort(tmp_path):
    """A socket that accepts the connection and never speaks gRPC: the probe passes, JAX
    waits; the watchdog ends it with one line and exit 3 (JAX would SIGABRT)."""
    workdir = tmp_path / "run"
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        address = f"127.0.0.1:{silent.getsockname()[1]}"
        proc, _ = _train(workdir, {"JAX_COORDINATOR_ADDRESS": address,
                                   "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "1",
                                   distributed.INIT_TIMEOUT_ENV: "8"})
    assert proc.returncode == EXIT_RUNTIME, proc.stderr[-3000:]
    line = _one_error_line(proc)
    assert f"did not start within 8 s (process 1 of 2, coordinator {address})" in line
    assert distributed.INIT_TIMEOUT_ENV in line
    # While it waits it says for what, and for how long (after 5 s).
    assert f"process 1 of 2 is waiting for the other processes of the job to join " \
           f"(coordinator {address}): 5 s of 8 s" in proc.stderr, proc.stderr[-2000:]
    assert not workdir.exists()


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_process_0_alone_ends_in_our_line(tmp_path):
    workdir = tmp_path / "run"
    proc, _ = _train(workdir, {"JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{_free_port()}",
                               "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "0",
                               distributed.INIT_TIMEOUT_ENV: "5"})
    assert proc.returncode == EXIT_RUNTIME, proc.stderr[-3000:]
    assert "did not start within 5 s (process 0 of 2" in _one_error_line(proc)
    assert not workdir.exists()


HOLDER = r"""
import sys, time
from hldstudy import rundir
with rundir.owned(sys.argv[1]):
    print("held", flush=True)
    time.sleep(300)
"""


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_two_process_job_on_a_held_directory_is_refused_by_every_process(tmp_path):
    """Process 0 fails to take the lock; process 1 hears it from process 0 (instead of
    waiting in a collective) and exits with the same line and code."""
    workdir = tmp_path / "run"
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(workdir)], cwd=ROOT,
                              env=BASE_ENV, stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    port = _free_port()
    procs = []
    try:
        for i in range(2):
            env = {**BASE_ENV, "JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}",
                   "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": str(i),
                   "XLA_FLAGS": "--xla_force_host_platform_device_count=1",
                   distributed.INIT_TIMEOUT_ENV: "120"}
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "hldstudy.train", "--config", "tiny", "--workdir",
                 str(workdir), "--set", "train.steps=2", "--set", "train.progress=false",
                 "--set", "train.mesh_fsdp=2", "--set", "train.mesh_data=1"],
                cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        results = [p.communicate(timeout=300) for p in procs]
    finally:
        for p in (*procs, holder):
            if p.poll() is None:
                p.kill()
                p.wait()
    for p, (_, err) in zip(procs, results, strict=True):
        assert p.returncode == EXIT_INPUT, err[-3000:]
        lines = [ln for ln in err.splitlines() if "error:" in ln]
        assert len(lines) == 1 and f"pid {holder.pid} on host" in lines[0], err[-3000:]
    assert sorted(p.name for p in workdir.iterdir()) == [rundir.LOCK_FILE]
