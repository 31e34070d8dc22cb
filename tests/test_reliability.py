"""Nothing lost, nothing hangs: the trainer and its run files under faults.

Exit codes, finiteness (a non-finite state is never saved), checkpoint saves that
fail fast (a file where a directory must go, a full disk: what root cannot write
through either), resume that falls back from a damaged latest checkpoint, torn
metrics.jsonl, a corrected retry after a failed data load, eval_batches, the memory
check before the first step, and the sweep's record of each run's outcome.
Subprocess tests carry a timeout, so a hang fails them.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers.runs import data_config

from hldstudy.config import Config, ConfigError, TrainConfig, validate
from hldstudy.data import prepare_data
from hldstudy.errors import (
    EXIT_INPUT,
    EXIT_RUNTIME,
    InputError,
    RuntimeFault,
    exit_code_of,
    user_errors,
)
from hldstudy.model import preset
from hldstudy.train import loop, program
from hldstudy.train.loop import Interrupted, Trainer
from hldstudy.train.metrics import MetricsLogger, read_records

ROOT = Path(__file__).resolve().parent.parent
FAULTS = ROOT / "tests" / "helpers" / "train_faults.py"
ONE_DEVICE = jax.devices()[:1]


def _cfg(steps=8, tokenizer=None, **train) -> Config:
    base = dict(steps=steps, lr=3e-3, warmup_steps=2, log_every=1, checkpoint_every=2,
                keep_checkpoints=3, eval_batches=2, progress=False)
    return Config(
        name="t",
        model=preset("tiny", vocab_size=384),
        data=data_config(tokenizer),
        train=TrainConfig(**{**base, **train}),
    )


def _records(workdir: Path) -> list[dict]:
    return read_records(workdir / "metrics.jsonl", report=False)


def _losses(workdir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in _records(workdir) if "loss" in r}


def _cli(tokenizer_path: str, workdir: Path, *sets: str) -> list[str]:
    args = ["--config", "tiny", "--workdir", str(workdir), "--set", "train.progress=false",
            "--set", f"data.tokenizer={tokenizer_path}", "--set", "model.vocab_size=384",
            "--set", "data.synthetic_docs=600", "--set", "data.seq_len=64",
            "--set", "data.synthetic_valid_docs=50", "--set", "train.eval_batches=2"]
    for s in sets:
        args += ["--set", s]
    return args


def _run(cmd: list[str], timeout: float) -> subprocess.CompletedProcess:
    """Runs `cmd`; a hang (past `timeout`) fails the test."""
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=1"}
    try:
        return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=timeout)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"hung: no exit within {timeout} s: {' '.join(cmd)}\n"
                    f"{(e.stderr or b'')[-2000:]}")


def _error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if "error" in line.lower()]


def _assert_one_line(proc: subprocess.CompletedProcess, *needles: str) -> str:
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    lines = _error_lines(proc.stderr)
    assert len(lines) == 1, proc.stderr[-3000:]
    for n in needles:
        assert n in lines[0], (n, lines[0])
    return lines[0]


def _saved_params_finite(step_dir: Path) -> bool:
    import orbax.checkpoint as ocp

    tree = ocp.StandardCheckpointer().restore(step_dir / "state")
    return all(np.isfinite(np.asarray(x)).all() for x in jax.tree_util.tree_leaves(tree))


def _steps(workdir: Path) -> list[int]:
    ck = workdir / "checkpoints"
    return sorted(int(p.name) for p in ck.iterdir() if p.name.isdigit())


# --------------------------------------------------------------------------- #
# Exit codes
# --------------------------------------------------------------------------- #


def test_exit_codes_are_defined_once(capsys):
    assert exit_code_of(ConfigError("train.lr", "bad")) == EXIT_INPUT == 2
    assert exit_code_of(InputError("missing")) == 2
    assert exit_code_of(RuntimeFault("nan")) == EXIT_RUNTIME == 3
    assert exit_code_of(Interrupted(5, 15)) == 143
    assert exit_code_of(ValueError("a bug")) == 1
    with pytest.raises(SystemExit) as e, user_errors(prog="x"):
        raise RuntimeFault("the loss became nan at step 3")
    assert e.value.code == 3
    assert capsys.readouterr().err == "x: error: the loss became nan at step 3\n"
    with pytest.raises(RuntimeFault), user_errors(debug=True, prog="x"):  # --debug: traceback
        raise RuntimeFault("boom")


def test_keep_checkpoints_and_eval_batches_domains():
    cfg = _cfg()
    # eval_batches 0 is the whole validation split (round 5); below 0 is refused
    for field, value in (("keep_checkpoints", 1), ("eval_batches", -1)):
        bad = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, **{field: value}))
        with pytest.raises(ConfigError, match=f"train.{field}"):
            validate(bad, check_paths=False)


def test_no_validation_documents_is_refused_before_training(tmp_path):
    """Before: valid_holdout_docs=0 trained, then wrote valid_nll=0.0, ppl=1.00."""
    docs = tmp_path / "docs.txt"
    docs.write_text("\n\n".join(f"document number {i} " * 20 for i in range(50)))
    cfg = _cfg(2)
    cfg = dataclasses.replace(cfg, data=dataclasses.replace(
        cfg.data, source="text", path=str(docs), valid_holdout_docs=0, tokenizer_vocab_size=300))
    with pytest.raises(InputError, match="no validation documents.*data.valid_holdout_docs"):
        Trainer(cfg, tmp_path / "run", devices=ONE_DEVICE)


def test_evaluate_never_reports_an_empty_validation_as_perfect():
    """No validation tokens must not become valid_nll=0.0 / ppl=1.00 in results.json."""
    fake = SimpleNamespace(_eval_steps={}, data=SimpleNamespace(valid_batches=lambda n: []),
                           mesh=None)
    with pytest.raises(InputError, match="no tokens"):
        Trainer.evaluate(fake, SimpleNamespace(student=object()), {}, 2)


# --------------------------------------------------------------------------- #
# Non-finite state
# --------------------------------------------------------------------------- #


def _nan_from_step(monkeypatch, bad: int):
    """A train step that turns the state non-finite from global step `bad` on (test double)."""
    original = program.make_train_step

    def make(*args, **kwargs):
        step_fn = original(*args, **kwargs)

        def poisoned(state, batch, teacher_in):
            state, metrics = step_fn(state, batch, teacher_in)
            hit = state["step"] >= bad
            params = jax.tree_util.tree_map(lambda p: jnp.where(hit, p * jnp.nan, p),
                                            state["params"])
            metrics = {**metrics, "loss": jnp.where(hit, jnp.nan, metrics["loss"])}
            return {**state, "params": params}, metrics

        return poisoned

    monkeypatch.setattr(program, "make_train_step", make)


def test_non_finite_state_is_never_saved(tmp_path, tokenizer_path, monkeypatch):
    """NaN at step 5 between log steps (log_every=10): the save at step 6 is refused, the run
    stops naming step 5 and the fix; checkpoints 2 and 4 stay, finite."""
    _nan_from_step(monkeypatch, 5)
    cfg = _cfg(steps=12, tokenizer=tokenizer_path, log_every=10, keep_checkpoints=2)
    with pytest.raises(RuntimeFault) as e:
        Trainer(cfg, tmp_path / "run", devices=ONE_DEVICE).run()
    msg = str(e.value)
    assert "step 5" in msg and "train.lr" in msg and "step 4" in msg and "\n" not in msg
    assert exit_code_of(e.value) == 3
    assert _steps(tmp_path / "run") == [2, 4]
    assert all(_saved_params_finite(tmp_path / "run" / "checkpoints" / str(s)) for s in (2, 4))
    assert not (tmp_path / "run" / "results.json").exists()


def test_non_finite_loss_at_a_log_step_names_it(tmp_path, tokenizer_path, monkeypatch):
    _nan_from_step(monkeypatch, 3)
    cfg = _cfg(steps=12, tokenizer=tokenizer_path, log_every=1, checkpoint_every=5)
    with pytest.raises(RuntimeFault, match="first became non-finite at step 3; the loss was nan"):
        Trainer(cfg, tmp_path / "run", devices=ONE_DEVICE).run()
    assert not (tmp_path / "run" / "checkpoints").exists() or _steps(tmp_path / "run") == []
    assert max(_losses(tmp_path / "run")) == 2  # the NaN record is not logged


def test_cli_high_lr_exits_3_and_saves_nothing_non_finite(tmp_path, tokenizer_path):
    """The issue's scenario: train.lr=1e4, checkpoint_every=2, log_every=10."""
    workdir = tmp_path / "run"
    proc = _run([sys.executable, "-m", "hldstudy.train",
                 *_cli(tokenizer_path, workdir, "train.lr=1e4", "train.checkpoint_every=2",
                       "train.log_every=10", "train.steps=40")], timeout=240)
    assert proc.returncode == 3, proc.stderr[-3000:]
    line = _assert_one_line(proc, "non-finite", "train.lr")
    for s in _steps(workdir):
        assert _saved_params_finite(workdir / "checkpoints" / str(s)), (s, line)


# --------------------------------------------------------------------------- #
# Checkpoint saves that fail fast
# --------------------------------------------------------------------------- #


def test_checkpoint_directory_checked_before_training(tmp_path, tokenizer_path):
    workdir = tmp_path / "run"
    workdir.mkdir()
    (workdir / "checkpoints").write_text("in the way\n")
    with pytest.raises(InputError, match=r"checkpoints is a file"):
        Trainer(_cfg(tokenizer=tokenizer_path), workdir, devices=ONE_DEVICE)
    assert not (workdir / "metrics.jsonl").exists()


@pytest.mark.timeout(200)
@pytest.mark.parametrize("fault,needle", [("file_in_way", "Not a directory"),
                                          ("enospc", "No space left on device")])
def test_failed_save_is_one_line_exit_3_and_no_hang(tmp_path, tokenizer_path, fault, needle):
    """Before: a 300-line traceback, then the interpreter waited forever on Orbax's
    background threads. Now: one line, exit 3, the process ends."""
    workdir = tmp_path / "run"
    proc = _run([sys.executable, str(FAULTS), fault,
                 *_cli(tokenizer_path, workdir, "train.steps=4", "train.checkpoint_every=2")],
                timeout=150)
    assert proc.returncode == 3, proc.stderr[-3000:]
    _assert_one_line(proc, "could not save the checkpoint of step 2", needle)


@pytest.fixture
def small_disk(tmp_path):
    """A 4 MiB tmpfs (mounting needs root; skipped where the machine refuses)."""
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(disk)],
                             capture_output=True, text=True)
    if mounted.returncode:
        pytest.skip(f"cannot mount a small tmpfs here ({mounted.stderr.strip()[:100]})")
    try:
        yield disk
    finally:
        subprocess.run(["umount", "-l", str(disk)], capture_output=True)


@pytest.mark.timeout(200)
def test_a_full_disk_is_one_short_report_and_leaves_the_last_checkpoint(small_disk,
                                                                       tokenizer_path):
    """A real full disk mid-run (the checkpoint of step 2 fits, step 4's does not): before,
    ~1,000 lines of Orbax's and asyncio's background tracebacks ending in "out of memory";
    now one line naming the save, the disk and its free space; exit 3; step 2 intact and
    no half-written step left."""
    workdir = small_disk / "run"
    proc = _run([sys.executable, "-m", "hldstudy.train",
                 *_cli(tokenizer_path, workdir, "train.steps=8", "train.checkpoint_every=2")],
                timeout=150)
    assert proc.returncode == 3, proc.stderr[-3000:]
    assert len(proc.stderr.strip().splitlines()) <= 3, proc.stderr[-3000:]
    _assert_one_line(proc, "could not save the checkpoint of step 4", "No space left on device",
                     "MiB free there", "step 2 is the last checkpoint saved")
    assert "out of memory" not in proc.stderr
    assert _steps(workdir) == [2] and _saved_params_finite(workdir / "checkpoints" / "2")
    assert not list((workdir / "checkpoints").glob("*tmp*"))


def test_a_half_written_checkpoint_is_removed_at_the_next_start(tmp_path, capsys):
    """What a crash mid-save leaves (Orbax's temporary step directory) is removed when the
    run's checkpoints are opened again, with a line saying so."""
    from hldstudy.checkpoint import Checkpointer

    half = tmp_path / "checkpoints" / "6.orbax-checkpoint-tmp" / "state"
    half.mkdir(parents=True)
    (half / "part").write_bytes(b"x" * 100)
    Checkpointer(tmp_path / "checkpoints", 2).close()
    assert not (tmp_path / "checkpoints" / "6.orbax-checkpoint-tmp").exists()
    assert "a checkpoint whose save did not finish" in capsys.readouterr().err


def test_full_disk_in_process_raises_runtime_fault(tmp_path, tokenizer_path, monkeypatch):
    import orbax.checkpoint as ocp

    def full(self, step, *a, **k):
        raise OSError(errno.ENOSPC, "No space left on device", str(self.directory))

    trainer = Trainer(_cfg(steps=4, tokenizer=tokenizer_path), tmp_path / "run",
                      devices=ONE_DEVICE)
    monkeypatch.setattr(ocp.CheckpointManager, "save", full)
    with pytest.raises(RuntimeFault, match="No space left on device.*free disk space.*no checkpoint was saved"):
        trainer.run()


# --------------------------------------------------------------------------- #
# Resume that falls back from a damaged latest checkpoint
# --------------------------------------------------------------------------- #


@pytest.fixture(scope="module")
def interrupted_run(tmp_path_factory, tokenizer_path):
    """A run of 8 steps stopped at 6: checkpoints 2, 4, 6; metrics for steps 1-6."""
    work = tmp_path_factory.mktemp("base") / "run"
    with pytest.raises(Interrupted):
        Trainer(_cfg(8, tokenizer_path), work, devices=ONE_DEVICE).run(stop_at_step=6)
    assert _steps(work) == [2, 4, 6]
    return work


def _truncate_data_file(step_dir: Path) -> None:
    files = [p for p in (step_dir / "state").rglob("*") if p.is_file() and "/d/" in str(p)]
    biggest = max(files, key=lambda p: p.stat().st_size)
    with open(biggest, "r+b") as fh:
        fh.truncate(biggest.stat().st_size // 3)


DAMAGES = {
    "truncated_data_file": _truncate_data_file,
    "missing_metadata": lambda d: (d / "meta" / "metadata").unlink(),
    "missing_state_dir": lambda d: shutil.rmtree(d / "state"),
}


@pytest.mark.parametrize("damage", sorted(DAMAGES))
def test_resume_falls_back_from_a_damaged_latest_checkpoint(tmp_path, interrupted_run,
                                                            tokenizer_path, damage, capsys):
    work = tmp_path / "run"
    shutil.copytree(interrupted_run, work)
    DAMAGES[damage](work / "checkpoints" / "6")
    result = Trainer(_cfg(8, tokenizer_path), work, devices=ONE_DEVICE).run()
    err = capsys.readouterr().err
    assert f"{work / 'checkpoints' / '6'} cannot be restored" in err, err
    assert "resumed from step 4" in err
    assert result["steps"] == 8
    assert (work / "checkpoints.damaged" / "6").is_dir()
    assert _steps(work)[-1] == 8
    losses, before = _losses(work), _losses(interrupted_run)
    assert sorted(losses) == list(range(1, 9))  # each step once
    assert [losses[s] for s in (5, 6)] == [before[s] for s in (5, 6)]  # steps 5-6 again, bitwise


def test_resume_skips_a_junk_step_directory(tmp_path, interrupted_run, tokenizer_path, capsys):
    work = tmp_path / "run"
    shutil.copytree(interrupted_run, work)
    (work / "checkpoints" / "999").mkdir()
    result = Trainer(_cfg(8, tokenizer_path), work, devices=ONE_DEVICE).run()
    err = capsys.readouterr().err
    assert f"{work / 'checkpoints' / '999'} cannot be restored" in err and "step 6" in err
    assert result["steps"] == 8 and (work / "checkpoints.damaged" / "999").is_dir()
    assert sorted(_losses(work)) == list(range(1, 9))


def test_no_restorable_checkpoint_is_one_error_and_moves_nothing(tmp_path, interrupted_run,
                                                                 tokenizer_path):
    work = tmp_path / "run"
    shutil.copytree(interrupted_run, work)
    for s in (2, 4, 6):
        (work / "checkpoints" / str(s) / "meta" / "metadata").unlink()
    metrics_before = (work / "metrics.jsonl").read_bytes()
    with pytest.raises(InputError, match="no checkpoint in .* can be restored .*step 6.*step 2"):
        Trainer(_cfg(8, tokenizer_path), work, devices=ONE_DEVICE).run()
    assert _steps(work) == [2, 4, 6] and not (work / "checkpoints.damaged").exists()
    assert (work / "metrics.jsonl").read_bytes() == metrics_before


# --------------------------------------------------------------------------- #
# Run files: torn metrics.jsonl, config.json after a failed data load
# --------------------------------------------------------------------------- #


def test_metrics_logger_tolerates_a_torn_last_line_and_an_empty_file(tmp_path, capsys):
    cfg = _cfg()
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "loss": 1.5}\n{"step": 3, "lo')
    MetricsLogger(tmp_path, cfg, resume_step=2).close()
    assert "metrics.jsonl: its last line (3) is torn" in capsys.readouterr().err
    assert path.read_text() == '{"step": 1, "loss": 2.0}\n{"step": 2, "loss": 1.5}\n'
    path.write_text("")
    logger = MetricsLogger(tmp_path, cfg, resume_step=0)
    logger.log({"step": 1, "loss": 1.0})
    logger.close()
    assert read_records(path) == [{"step": 1, "loss": 1.0}]
    assert not list(tmp_path.glob(".metrics.jsonl.*"))  # the rewrite's temporary file is gone


def test_resume_with_a_torn_metrics_line(tmp_path, interrupted_run, tokenizer_path, capsys):
    work = tmp_path / "run"
    shutil.copytree(interrupted_run, work)
    with open(work / "metrics.jsonl", "a") as fh:
        fh.write('{"step": 7, "stage": "main", "loss": 3.1')
    Trainer(_cfg(8, tokenizer_path), work, devices=ONE_DEVICE).run()
    assert "metrics.jsonl: its last line" in capsys.readouterr().err
    assert sorted(_losses(work)) == list(range(1, 9))


def test_an_unreadable_config_json_is_named(tmp_path, interrupted_run, tokenizer_path):
    work = tmp_path / "run"
    shutil.copytree(interrupted_run, work)
    (work / "config.json").write_text('{"name": "t", "mod')
    with pytest.raises(InputError, match=r"config.json is not a readable config"):
        Trainer(_cfg(8, tokenizer_path), work, devices=ONE_DEVICE)


def test_retry_after_a_failed_data_load_takes_a_corrected_config(tmp_path, tokenizer_path):
    """Before: the retry was refused ("was trained with 'text'") although nothing trained."""
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    cfg = _cfg(2, tokenizer_path)
    text = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, source="text",
                                                             path=str(empty), tokenizer=None))
    with pytest.raises(InputError):
        Trainer(text, tmp_path / "run", devices=ONE_DEVICE)
    assert not (tmp_path / "run" / "config.json").exists()  # refused: written only to train
    Trainer(cfg, tmp_path / "run", devices=ONE_DEVICE).run()  # no ConfigError
    assert json.loads((tmp_path / "run" / "config.json").read_text())["data"]["source"] \
        == "synthetic"


# --------------------------------------------------------------------------- #
# Memory checked before the first step
# --------------------------------------------------------------------------- #


def test_a_step_that_cannot_fit_is_refused_before_training(tmp_path, tokenizer_path,
                                                           monkeypatch):
    """A test double reports 1 MiB available: refused with the numbers, nothing trained."""
    monkeypatch.setattr(loop, "memory_available", lambda device: 1 << 20)
    with pytest.raises(RuntimeFault) as e:
        Trainer(_cfg(4, tokenizer_path), tmp_path / "run", devices=ONE_DEVICE).run()
    msg = str(e.value)
    assert "does not fit" in msg and "data.batch_size (now 8)" in msg
    assert "data.seq_len (now 64)" in msg and "0.000977 GiB of host memory" in msg
    assert _losses(tmp_path / "run") == {} and _steps(tmp_path / "run") == []


class _Tiled:
    """Data double: the real batches tiled to a long sequence (host arrays only; the
    step that would need them is refused before it runs)."""

    replayed = 0

    def __init__(self, data, seq_len):
        self.tokenizer, self._data, self._reps = data.tokenizer, data, seq_len // 64
        self.train = self

    def batch_at(self, step):
        return {k: np.tile(v, (1, self._reps)) for k, v in self._data.train.batch_at(step).items()}

    def valid_batches(self, n=None):
        return self._data.valid_batches(n)

    def state_at(self, step):
        return self._data.train.state_at(step)


def test_a_huge_seq_len_is_refused_from_the_compiled_estimate(tmp_path, tokenizer_path):
    """No double on the memory: XLA's estimate for dense attention at 2^17 tokens (batch 8,
    ~TiB of scores) exceeds any CPU host here; refused before the step allocates anything."""
    seq = 1 << 17
    cfg = _cfg(2, tokenizer_path)
    small = prepare_data(cfg.data, tmp_path / "data")
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, max_seq_len=seq,
                                                             attention="dense"),
                              data=dataclasses.replace(cfg.data, seq_len=seq))
    with pytest.raises(RuntimeFault, match=rf"does not fit.*data.seq_len \(now {seq}\)"):
        Trainer(cfg, tmp_path / "run", data=_Tiled(small, seq), devices=ONE_DEVICE).run()


# --------------------------------------------------------------------------- #
# The sweep records each run's outcome
# --------------------------------------------------------------------------- #


class _FakeWorker:
    """Worker double: each run raises what `outcomes[run_id]` says (or finishes)."""

    eval_tasks = ()
    teacher_loads = 0

    def __init__(self, workdir, outcomes):
        self.workdir, self.outcomes, self.seen = Path(workdir), outcomes, []

    def run(self, run, **kwargs):
        from hldstudy.sweep.worker import mark_running, record_outcome

        self.seen.append(run.run_id)
        mark_running(self.workdir / run.run_id)
        exc = self.outcomes.get(run.run_id)
        if exc is not None:
            raise exc
        record_outcome(self.workdir / run.run_id, "done", 0)
        return {}


def _run_ids(*ids):
    return [SimpleNamespace(run_id=i) for i in ids]


def test_sweep_records_each_runs_exit_code(tmp_path):
    from hldstudy.sweep.executors import run_many
    from hldstudy.sweep.worker import read_outcome

    worker = _FakeWorker(tmp_path, {"nan": RuntimeFault("the loss became nan at step 3"),
                                    "bad": ConfigError("train.lr", "must be > 0"),
                                    "bug": KeyError("x")})
    out = run_many(_run_ids("ok", "nan", "bad", "bug"), {"workdir": str(tmp_path)},
                   worker=worker)
    assert out.done == ["ok"] and set(out.failed) == {"nan", "bad", "bug"}
    assert out.exit_codes == {"nan": 3, "bad": 2, "bug": 1}
    assert read_outcome(tmp_path / "ok")["status"] == "done"
    for rid, code in out.exit_codes.items():
        rec = read_outcome(tmp_path / rid)
        assert (rec["status"], rec["exit_code"]) == ("failed", code)
        assert (tmp_path / rid / "error.txt").exists()
    assert out.exit_code == 1

    stop = _FakeWorker(tmp_path, {"s": Interrupted(4, 15)})
    out = run_many(_run_ids("s", "later"), {"workdir": str(tmp_path)}, worker=stop)
    assert out.interrupted == ["s"] and out.exit_codes == {"s": 143} and out.exit_code == 143
    assert read_outcome(tmp_path / "s") == {**read_outcome(tmp_path / "s"),
                                            "status": "interrupted", "exit_code": 143, "step": 4}
    assert stop.seen == ["s"]


def test_a_run_left_running_by_a_killed_process_is_recognised(tmp_path):
    from hldstudy.sweep.executors import run_many
    from hldstudy.sweep.worker import read_outcome

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    (tmp_path / "r").mkdir()
    (tmp_path / "r" / "outcome.json").write_text(json.dumps(
        {"status": "running", "pid": gone.pid, "host": socket.gethostname(),
         "started": "2026-01-01T00:00:00"}))
    events = []
    out = run_many(_run_ids("r"), {"workdir": str(tmp_path)}, worker=_FakeWorker(tmp_path, {}),
                   report=lambda *e: events.append(e))
    assert out.killed_earlier == ["r"] and out.done == ["r"]
    assert events[0][0] == "killed earlier" and str(gone.pid) in events[0][2]
    assert read_outcome(tmp_path / "r")["status"] == "done"
    # A live process on this host is not "killed".
    (tmp_path / "r" / "outcome.json").write_text(json.dumps(
        {"status": "running", "pid": os.getppid(), "host": socket.gethostname()}))
    from hldstudy.sweep.worker import killed_earlier

    assert killed_earlier(tmp_path / "r") is None


def _baseline_sweep(tmp_path: Path, tokenizer_path: str, steps: int) -> Path:
    f = tmp_path / "kill_sweep.py"
    f.write_text(f'''"""One baseline run, long enough to be killed mid-way."""
from hldstudy.config import Config, DataConfig, TrainConfig
from hldstudy.model import preset
from hldstudy.sweep import Sweep


def get_sweep():
    base = Config(name="k", model=preset("tiny", vocab_size=384),
                  data=DataConfig(seq_len=64, batch_size=8, tokenizer_vocab_size=384,
                                  synthetic_docs=600, synthetic_valid_docs=50,
                                  tokenizer={tokenizer_path!r}),
                  train=TrainConfig(warmup_steps=1, log_every=1, checkpoint_every=10,
                                    eval_batches=1))
    return Sweep(name="kill", base=base, methods=("baseline",), lr=(3e-3,),
                 budget_baseline_steps={steps}, eval_tasks=())
''')
    return f


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_sweep_run_killed_with_sigkill_is_reported_and_resumed(tmp_path, tokenizer_path):
    """A real kill -9 mid-run leaves outcome.json 'running'; the next sweep says the run was
    killed, resumes it from its checkpoint, and records it done."""
    import signal
    import time

    sweep = _baseline_sweep(tmp_path, tokenizer_path, steps=60)
    runs = tmp_path / "runs"
    cmd = [sys.executable, "-m", "hldstudy.sweep", str(sweep), "--workdir", str(runs),
           "--no-progress"]
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=1"}
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        ck = list(runs.glob("*/checkpoints/1[0-9]"))
        if ck:
            break
        time.sleep(0.2)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    (run_dir,) = [p for p in runs.iterdir() if (p / "outcome.json").exists()]
    assert json.loads((run_dir / "outcome.json").read_text())["status"] == "running"
    again = _run(cmd, timeout=400)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"{run_dir.name}: killed earlier" in again.stderr
    assert json.loads((run_dir / "outcome.json").read_text())["status"] == "done"
    launch = json.loads((runs / ".sweep" / "last_launch.json").read_text())
    assert launch["killed_earlier"] == [run_dir.name]
    assert sorted(_losses(run_dir)) == list(range(1, 61))


# --------------------------------------------------------------------------- #
# One restore path for readers (eval, served teacher, compress): load_model
# --------------------------------------------------------------------------- #


def _truncate_every_data_file(step_dir: Path) -> None:
    """Every array file of the step cut short: the restore fails on many reads at once
    (what made Orbax's asyncio teardown print its tracebacks)."""
    for p in (step_dir / "state").rglob("*"):
        if p.is_file() and "/d/" in str(p):
            with open(p, "r+b") as fh:
                fh.truncate(10)


def _file_hashes(root: Path) -> dict[str, str]:
    import hashlib

    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def _eval(run_dir: Path) -> subprocess.CompletedProcess:
    return _run([sys.executable, "-m", "hldstudy.eval", "--checkpoint", str(run_dir),
                 "--tasks", "valid_ppl", "--limit", "2", "--no-progress"], timeout=300)


def _quiet(proc: subprocess.CompletedProcess) -> None:
    for noise in ("Traceback", "Event loop is closed", "Exception ignored"):
        assert noise not in proc.stderr, proc.stderr[-3000:]


@pytest.mark.timeout(320)
def test_eval_falls_back_from_a_damaged_checkpoint_quietly(tmp_path, interrupted_run):
    work = tmp_path / "run"
    shutil.copytree(interrupted_run, work)
    _truncate_every_data_file(work / "checkpoints" / "6")
    before = _file_hashes(work)
    proc = _eval(work)
    assert proc.returncode == 0, proc.stderr[-3000:]
    _quiet(proc)
    warnings = [ln for ln in proc.stderr.splitlines() if "warning:" in ln]
    assert len(warnings) == 1, proc.stderr[-3000:]
    assert f"checkpoint {work / 'checkpoints' / '6'} cannot be restored" in warnings[0]
    assert "using step 4 instead" in warnings[0]
    assert "valid_ppl" in proc.stdout
    assert _file_hashes(work) == before  # a reader moves and rewrites nothing


@pytest.mark.slow
@pytest.mark.timeout(320)
def test_eval_with_every_checkpoint_damaged_is_one_line_not_blaming_config(tmp_path,
                                                                          interrupted_run):
    work = tmp_path / "run"
    shutil.copytree(interrupted_run, work)
    for step in _steps(work):
        _truncate_every_data_file(work / "checkpoints" / str(step))
    before = _file_hashes(work)
    proc = _eval(work)
    assert proc.returncode == EXIT_INPUT, proc.stderr[-3000:]
    _quiet(proc)
    line = _assert_one_line(proc, "no checkpoint in", "damaged or missing", "step 6:",
                            "step 2:")
    assert "config.json" not in line
    assert _file_hashes(work) == before


def test_a_checkpoint_of_another_model_blames_config_json(tmp_path, interrupted_run, capsys):
    from hldstudy.model.loading import load_model

    work = tmp_path / "run"
    shutil.copytree(interrupted_run, work)
    raw = json.loads((work / "config.json").read_text())
    raw["model"]["d_ff"] *= 2
    (work / "config.json").write_text(json.dumps(raw))
    with pytest.raises(InputError, match="config.json describes.*step 6:.*check that "
                                         "config.json belongs to this checkpoint"):
        load_model(work)
    assert "warning" not in capsys.readouterr().err  # no fall-back to an older step


def test_an_explicit_damaged_step_does_not_fall_back(tmp_path, interrupted_run):
    from hldstudy.model.loading import load_model

    work = tmp_path / "run"
    shutil.copytree(interrupted_run, work)
    _truncate_every_data_file(work / "checkpoints" / "4")
    with pytest.raises(InputError, match="step 4: .*damaged or missing|damaged or missing.*"
                                         "step 4:"):
        load_model(work, step=4)
    assert load_model(work).model is not None  # the latest (6) is intact


# --------------------------------------------------------------------------- #
# teacher.timeout_s is honoured by the prefetch ring
# --------------------------------------------------------------------------- #


class _HangingLink:
    """A replica whose handshake always answers (so it rejoins every time it is dropped)
    and whose streams never answer a step."""

    name = "hanging"

    def __init__(self):
        self.opened = 0

    def connect(self):
        pass

    def open(self, on_result, on_error):
        self.opened += 1
        return SimpleNamespace(request=lambda step: None, close=lambda: None)


def test_a_replica_that_rejoins_and_hangs_gives_up_near_the_timeout(caplog):
    """Before: every drop reset the ring's "no replica" clock when the replica rejoined,
    so the trainer waited timeout after timeout (109 s and 31 warnings for 5 s)."""
    from hldstudy.teacher.ring import PrefetchRing, TeacherUnavailable

    link = _HangingLink()
    ring = PrefetchRing([link], start=0, end=8, ring_size=2, timeout_s=1.0, rejoin_s=0.05)
    t0 = time.monotonic()
    try:
        with pytest.raises(TeacherUnavailable, match=r"answered for 1 s \(teacher.timeout_s\)"):
            ring.get(0)
    finally:
        ring.close()
    elapsed = time.monotonic() - t0
    assert 1.0 <= elapsed < 2.0, elapsed
    drops = [r for r in caplog.records if "dropped" in r.getMessage()]
    assert len(drops) <= 2, [r.getMessage() for r in caplog.records]
