"""Multi-process training: 2 JAX processes on loopback (a real coordinator on 127.0.0.1,
CPU collectives through gloo, one host device each) train the tiny config with FSDP
across the processes, and their losses equal 1 process with 2 forced devices; their
checkpoints restore in 1 process and vice versa, with and without a colocated teacher.

Every subprocess runs under a timeout: a hung collective fails the test instead of
hanging it."""

import dataclasses
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from helpers.runs import data_config

from hldstudy.config import (
    Config,
    DistillConfig,
    TeacherConfig,
    TrainConfig,
    config_to_dict,
)
from hldstudy.model import preset
from hldstudy.train.loop import Interrupted, Trainer

ROOT = Path(__file__).resolve().parent.parent
# One launch of 2 processes (import, join, compile, a few steps) takes 20-60 s on 2
# shared cores; far beyond that, a collective is hung.
LAUNCH_TIMEOUT_S = 300
# 2 processes (gloo) against 1 process with 2 devices: the same program and sharding;
# only how the cross-device sums are carried differs.
SAME_MESH_RTOL = 1e-6
# A resume on another layout (1 device <-> 2 processes): reductions split differently.
MOVED_RTOL = 1e-5

DRIVER = r"""
import json, sys
from hldstudy.config import config_from_dict
from hldstudy.train.loop import Interrupted, Trainer
import jax
cfg = config_from_dict(json.loads(sys.argv[1]))
stop = int(sys.argv[3]) or None
trainer = Trainer(cfg, sys.argv[2])
print(f"joined: process {jax.process_index()} of {jax.process_count()}, "
      f"{len(jax.local_devices())} of {len(jax.devices())} devices", flush=True)
try:
    trainer.run(stop_at_step=stop)
except Interrupted:
    sys.exit(143)
"""

def _cfg(steps=8, tokenizer=None, **distill) -> Config:
    return Config(
        name="mp",
        model=preset("tiny", vocab_size=384),
        data=data_config(tokenizer),
        train=TrainConfig(steps=steps, lr=3e-3, warmup_steps=2, log_every=1, checkpoint_every=4,
                          eval_batches=2, progress=False, mesh_data=1, mesh_fsdp=2),
        distill=DistillConfig(**distill),
    )


def _one_device(cfg: Config) -> Config:
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, mesh_fsdp=1))


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(cfg: Config, workdir: Path, stop_at: int = 0, n: int = 2) -> list[int]:
    """Runs the Trainer in `n` processes joined through a coordinator on 127.0.0.1;
    returns their exit codes (143: stopped at `stop_at` after saving)."""
    port = _free_port()
    procs, logs = [], []
    for i in range(n):
        env = {**os.environ, "JAX_PLATFORMS": "cpu",
               "XLA_FLAGS": "--xla_force_host_platform_device_count=1",
               "JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}",
               "JAX_NUM_PROCESSES": str(n), "JAX_PROCESS_ID": str(i),
               "HLDSTUDY_DISTRIBUTED_TIMEOUT_S": "120"}
        log = open(workdir.parent / f"{workdir.name}.proc{i}.log", "w")
        logs.append(log)
        procs.append(subprocess.Popen(
            [sys.executable, "-c", DRIVER, json.dumps(config_to_dict(cfg)), str(workdir),
             str(stop_at)], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT))
    codes = []
    try:
        for p in procs:
            codes.append(p.wait(timeout=LAUNCH_TIMEOUT_S))
    except subprocess.TimeoutExpired:
        pytest.fail(f"{n}-process run did not finish in {LAUNCH_TIMEOUT_S} s (hung collective?)"
                    + _tails(workdir, n))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for log in logs:
            log.close()
    want = 143 if stop_at else 0
    assert codes == [want] * n, f"exit codes {codes}" + _tails(workdir, n)
    for i in range(n):  # really n processes of one device each, not forced devices
        log = (workdir.parent / f"{workdir.name}.proc{i}.log").read_text()
        assert f"joined: process {i} of {n}, 1 of {n} devices" in log, log[-2000:]
    return codes


def _tails(workdir: Path, n: int) -> str:
    out = ""
    for i in range(n):
        path = workdir.parent / f"{workdir.name}.proc{i}.log"
        if path.exists():
            out += f"\n--- process {i}:\n" + "\n".join(path.read_text().splitlines()[-25:])
    return out


def _losses(workdir: Path) -> dict[int, float]:
    out = {}
    for line in (workdir / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if "loss" in rec:
            assert rec["step"] not in out, f"step {rec['step']} logged twice (only process 0 logs)"
            out[rec["step"]] = rec["loss"]
    return out


def _close(a: dict, b: dict, steps, rtol: float) -> None:
    x, y = np.array([a[s] for s in steps]), np.array([b[s] for s in steps])
    print(f"steps {steps.start}-{steps.stop - 1}: max relative difference "
          f"{np.max(np.abs(x - y) / np.abs(y)):.2e} (tolerance {rtol:g})")
    np.testing.assert_allclose(x, y, rtol=rtol)


def _run_here(cfg: Config, workdir: Path, n_devices: int, stop_at: int | None = None) -> None:
    trainer = Trainer(cfg, workdir, devices=jax.devices()[:n_devices])
    if stop_at is None:
        trainer.run()
    else:
        with pytest.raises(Interrupted):
            trainer.run(stop_at_step=stop_at)


@pytest.mark.slow
def test_two_processes_match_one_and_checkpoints_move_between_them(tmp_path, tokenizer_path):
    assert len(jax.devices()) >= 2, "conftest sets 4 host devices"
    cfg = _cfg(steps=8, tokenizer=tokenizer_path)
    _run_here(cfg, tmp_path / "ref", 2)  # 1 process, 2 forced devices, the same 1x2 mesh
    ref = _losses(tmp_path / "ref")

    # 2 processes train to step 4 and stop (checkpoint 4); 1 process (1 device) resumes.
    _launch(cfg, tmp_path / "a", stop_at=4)
    a = tmp_path / "a"
    assert (a / "checkpoints" / "4").is_dir() and not (a / "results.json").exists()
    _close(_losses(a), ref, range(1, 5), SAME_MESH_RTOL)
    _run_here(_one_device(cfg), a, 1)
    _close(_losses(a), ref, range(5, 9), MOVED_RTOL)
    assert json.loads((a / "results.json").read_text())["steps"] == 8

    # 1 process (1 device) trains to step 4; 2 processes resume and finish.
    _run_here(_one_device(cfg), tmp_path / "b", 1, stop_at=4)
    _launch(cfg, tmp_path / "b")
    b = tmp_path / "b"
    assert sorted(_losses(b)) == list(range(1, 9))
    _close(_losses(b), ref, range(1, 9), MOVED_RTOL)
    res = json.loads((b / "results.json").read_text())
    ref_res = json.loads((tmp_path / "ref" / "results.json").read_text())
    assert res["steps"] == 8
    np.testing.assert_allclose(res["valid_nll"], ref_res["valid_nll"], rtol=MOVED_RTOL)


@pytest.mark.slow
def test_two_processes_with_a_colocated_teacher(tmp_path, tokenizer_path):
    teacher = _cfg(steps=4, tokenizer=tokenizer_path)
    _run_here(_one_device(teacher), tmp_path / "teacher", 1)
    cfg = _cfg(steps=6, tokenizer=tokenizer_path, method="kd", temperature=2.0)
    cfg = dataclasses.replace(cfg, teacher=TeacherConfig(checkpoint=str(tmp_path / "teacher")))
    _run_here(cfg, tmp_path / "ref", 2)
    ref = _losses(tmp_path / "ref")

    _launch(cfg, tmp_path / "kd", stop_at=4)  # 2 processes to step 4, then 1 process
    kd = tmp_path / "kd"
    _close(_losses(kd), ref, range(1, 5), SAME_MESH_RTOL)
    _run_here(_one_device(cfg), kd, 1)
    _close(_losses(kd), ref, range(5, 7), MOVED_RTOL)
    assert json.loads((kd / "results.json").read_text())["steps"] == 6


def test_submitit_job_of_several_tasks_names_the_coordinator():
    """A submitit job of 4 tasks on 2 nodes is one JAX job: the coordinator on its first
    host, at a port derived from the job id; a one-task job sets nothing."""
    from types import SimpleNamespace

    from hldstudy.sweep.executors import JAX_PORT_BASE, jax_distributed_env

    job = SimpleNamespace(num_tasks=4, global_rank=3, raw_job_id="123456",
                          hostnames=["gpu-017", "gpu-018"])
    assert jax_distributed_env(job) == {
        "JAX_COORDINATOR_ADDRESS": f"gpu-017:{JAX_PORT_BASE + 123456 % 4096}",
        "JAX_NUM_PROCESSES": "4", "JAX_PROCESS_ID": "3"}
    assert jax_distributed_env(SimpleNamespace(num_tasks=1, global_rank=0, raw_job_id="7",
                                               hostnames=["a"])) == {}


def test_distributed_environment_is_checked(monkeypatch):
    """A malformed process count is one line naming the variable (before JAX starts)."""
    from hldstudy import sharding
    from hldstudy.errors import InputError

    monkeypatch.setenv("JAX_COORDINATOR_ADDRESS", "127.0.0.1:1")
    monkeypatch.setenv("JAX_NUM_PROCESSES", "two")
    monkeypatch.setenv("JAX_PROCESS_ID", "0")
    monkeypatch.setattr(jax.distributed, "is_initialized", lambda: False)
    from jax._src import xla_bridge

    monkeypatch.setattr(xla_bridge, "backends_are_initialized", lambda: False)
    with pytest.raises(InputError, match="JAX_NUM_PROCESSES='two'"):
        sharding.maybe_initialize_distributed()


# --------------------------------------------------------------------------- #
# Prepared shards: each process reads its own rows
# --------------------------------------------------------------------------- #

DATA_DRIVER = r"""
import functools, hashlib, json, sys
from hldstudy import sharding
from hldstudy.config import TrainConfig, config_from_dict
from hldstudy.data import prepare_data
import numpy as np
sharding.maybe_initialize_distributed()
import jax
from jax.experimental import multihost_utils
cfg = config_from_dict(json.loads(sys.argv[1]))
B = cfg.data.batch_size
mesh = sharding.make_mesh(TrainConfig(mesh_data=-1))
rows = sharding.process_rows(mesh, B)
stream = prepare_data(cfg.data, sys.argv[2] + f"/p{jax.process_index()}", rows=rows).train
stream.gather_cursor = functools.partial(sharding.gather_cursor, batch_size=B)
digests = []
for step in range(4):
    batch = sharding.put_batch(stream.batch_at(step), mesh, B)
    full = {k: np.asarray(multihost_utils.process_allgather(v, tiled=True)) for k, v in batch.items()}
    digests.append(hashlib.sha256(b"".join(full[k].tobytes() for k in sorted(full))).hexdigest())
print(json.dumps({"rows": rows, "local_rows": stream.local_rows, "digests": digests,
                  "cursor": stream.state_at(4)["cursor"]}), flush=True)
"""


@pytest.fixture(scope="module")
def shards_dir(tmp_path_factory, tokenizer_path):
    from hldstudy.data.prepare import prepare

    out = tmp_path_factory.mktemp("mp_shards") / "shards"
    prepare(data_config(tokenizer_path), out, docs_per_shard=100, progress=False)
    return out


def _shards(cfg: Config, shards_dir: Path) -> Config:
    return dataclasses.replace(cfg, data=dataclasses.replace(
        cfg.data, source="shards", path=str(shards_dir), tokenizer=None))


def test_two_processes_read_disjoint_rows_of_prepared_shards(tmp_path, shards_dir):
    import hashlib

    from hldstudy.data import prepare_data

    cfg = _shards(_cfg(), shards_dir)
    port = _free_port()
    procs = []
    for i in range(2):
        env = {**os.environ, "JAX_PLATFORMS": "cpu",
               "XLA_FLAGS": "--xla_force_host_platform_device_count=1",
               "JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}", "JAX_NUM_PROCESSES": "2",
               "JAX_PROCESS_ID": str(i), "HLDSTUDY_DISTRIBUTED_TIMEOUT_S": "120"}
        procs.append(subprocess.Popen(
            [sys.executable, "-c", DATA_DRIVER, json.dumps(config_to_dict(cfg)), str(tmp_path)],
            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=LAUNCH_TIMEOUT_S)
        assert p.returncode == 0, err[-3000:]
        outs.append(json.loads(out.strip().splitlines()[-1]))
    assert [o["rows"] for o in outs] == [[0, 1, 2, 3], [4, 5, 6, 7]]  # disjoint: 4 rows each
    assert [o["local_rows"] for o in outs] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    one = prepare_data(cfg.data, tmp_path / "one").train
    want = []
    for step in range(4):
        b = one.batch_at(step)
        want.append(hashlib.sha256(b"".join(b[k].tobytes() for k in sorted(b))).hexdigest())
    assert outs[0]["digests"] == outs[1]["digests"] == want  # the global batch, bitwise
    assert outs[0]["cursor"] == outs[1]["cursor"] == one.state_at(4)["cursor"]


@pytest.mark.slow
def test_two_processes_train_from_shards_and_resume_in_one(tmp_path, shards_dir):
    cfg = _shards(_cfg(steps=8), shards_dir)
    _run_here(cfg, tmp_path / "ref", 2)  # 1 process, 2 forced devices, the same 1x2 mesh
    ref = _losses(tmp_path / "ref")
    _launch(cfg, tmp_path / "a", stop_at=4)  # each process packs its 4 rows
    _close(_losses(tmp_path / "a"), ref, range(1, 5), SAME_MESH_RTOL)
    _run_here(_one_device(cfg), tmp_path / "a", 1)  # all 8 rows from the gathered cursor
    _close(_losses(tmp_path / "a"), ref, range(5, 9), MOVED_RTOL)
