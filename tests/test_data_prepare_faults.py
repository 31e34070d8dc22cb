"""`hldstudy data prepare` fails in one line and leaves nothing running: a full disk, a
tokenizing worker killed, Ctrl-C (exit 130), and kill -9 of the command itself (its
workers die with it); each time the shards written so far stay, and a rerun ends with
the shards a one-shot prepare writes."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from helpers.runs import data_config
from test_data_shards import _PREPARE, _all_records, _experiment

from hldstudy.commands.data import main as data_main
from hldstudy.data import prepare as prepare_mod

ROOT = Path(__file__).resolve().parent.parent


def _children(pid: int) -> list[int]:
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return out


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _start(tmp_path, tokenizer_path, out: Path, workers: int = 2):
    exp = _experiment(tmp_path / "exp.py", data_config(tokenizer_path, synthetic_docs=4000))
    cmd = [c if c != "1" else str(workers) for c in _PREPARE]  # --workers N
    proc = subprocess.Popen(cmd + ["--config", str(exp), "--out", str(out)], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    deadline = time.time() + 120
    while time.time() < deadline and len(list(out.glob("train-*.array_record"))) < 3:
        time.sleep(0.005)
    assert proc.poll() is None, proc.communicate()
    return proc, exp


def _rerun_matches_one_shot(tmp_path, exp, out):
    once = tmp_path / "once"
    subprocess.run(_PREPARE + ["--config", str(exp), "--out", str(once)], check=True, cwd=ROOT,
                   timeout=300)
    subprocess.run(_PREPARE + ["--config", str(exp), "--out", str(out)], check=True, cwd=ROOT,
                   timeout=300)
    assert _all_records(out) == _all_records(once)


def test_a_full_disk_is_one_line_and_the_rerun_completes(tmp_path, tokenizer_path,
                                                         monkeypatch, capsys):
    """The disk fills at the third shard (an ENOSPC raised where the write fails)."""
    exp = _experiment(tmp_path / "exp.py", data_config(tokenizer_path, synthetic_docs=400))
    real, calls = prepare_mod.write_shard, []

    def full(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(*args, **kwargs)

    out = tmp_path / "out"
    args = ["prepare", "--config", str(exp), "--out", str(out), "--no-progress",
            "--docs-per-shard", "40"]
    monkeypatch.setattr(prepare_mod, "write_shard", full)
    with pytest.raises(SystemExit) as e:
        data_main(args)
    assert e.value.code == 3
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "the disk of" in err[0] and "is full" in err[0], err
    assert len(list(out.glob("train-*.array_record"))) == 2
    monkeypatch.setattr(prepare_mod, "write_shard", real)
    assert data_main(args) == 0
    once = tmp_path / "once"
    assert data_main(args[:4] + [str(once)] + args[5:]) == 0
    assert _all_records(out) == _all_records(once)


@pytest.mark.slow  # ~30 s: three prepares of 100 shards
def test_ctrl_c_is_one_line_exit_130_and_no_worker_stays(tmp_path, tokenizer_path):
    out = tmp_path / "out"
    proc, exp = _start(tmp_path, tokenizer_path, out)
    workers = _children(proc.pid)
    os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130
    assert err.strip().count("\n") == 0 and "interrupted" in err, err
    time.sleep(1)
    assert not [p for p in workers if _alive(p)]
    _rerun_matches_one_shot(tmp_path, exp, out)


def test_kill_9_of_the_command_takes_its_workers_with_it(tmp_path, tokenizer_path):
    proc, _ = _start(tmp_path, tokenizer_path, tmp_path / "out")
    workers = _children(proc.pid)
    assert workers
    os.kill(proc.pid, signal.SIGKILL)
    proc.communicate(timeout=30)
    deadline = time.time() + 10
    while time.time() < deadline and [p for p in workers if _alive(p)]:
        time.sleep(0.05)
    assert not [p for p in workers if _alive(p)]


@pytest.mark.slow  # ~30 s: three prepares of 100 shards
def test_a_killed_worker_is_one_line_and_the_rerun_completes(tmp_path, tokenizer_path):
    out = tmp_path / "out"
    proc, exp = _start(tmp_path, tokenizer_path, out)
    workers = [p for p in _children(proc.pid)
               if "resource_tracker" not in Path(f"/proc/{p}/cmdline").read_text()]
    os.kill(workers[-1], signal.SIGKILL)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 3
    assert err.strip().count("\n") == 0 and "a tokenizing worker died" in err, err
    _rerun_matches_one_shot(tmp_path, exp, out)
