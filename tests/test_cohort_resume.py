"""A cohort resumed with its members at different points keeps every member's work.

A cohort is stopped mid-run (a real process killed with SIGKILL in the slow test; the
trainer's own stop, as a SIGTERM, in the fast one) and run again with one member
added. Every checkpoint file is snapshotted (path + sha256) before the rerun: every
intact one is still there after, byte for byte; a damaged one is moved to
checkpoints.damaged/, never deleted; and no step a member had saved is trained again
(its metrics.jsonl records up to that step, timings included, are untouched)."""

import dataclasses
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from helpers.runs import kill_after_checkpoint

from hldstudy.config import Config, DataConfig, DistillConfig, TrainConfig, save_config
from hldstudy.model import preset
from hldstudy.rundir import checkpoint_steps
from hldstudy.train.cohort import CohortTrainer
from hldstudy.train.loop import Interrupted, Trainer

ROOT = Path(__file__).resolve().parent.parent
VOCAB = 384
DEV = jax.devices()[:1]


def _cfg(name, method, steps, lr, seed, teacher=None, **train):
    # keep_checkpoints high: no save prunes an older step, so "every file is still there"
    # is exact (pruning to train.keep_checkpoints is the configured policy, tested elsewhere).
    return Config(
        name=name, model=preset("tiny", vocab_size=VOCAB),
        data=DataConfig(seq_len=64, batch_size=8, tokenizer_vocab_size=VOCAB,
                        synthetic_docs=600, synthetic_valid_docs=50),
        train=TrainConfig(steps=steps, lr=lr, seed=seed, warmup_steps=2, log_every=1,
                          checkpoint_every=2, keep_checkpoints=20, eval_batches=1,
                          progress=False, **train),
        distill=DistillConfig(method=method),
        teacher=dataclasses.replace(Config().teacher, checkpoint=str(teacher or "")))


def _snapshot(run_dirs) -> dict[str, str]:
    """sha256 of every file of every finished checkpoint step (orbax renames a step's
    directory into place only once it is complete)."""
    out = {}
    for d in run_dirs:
        for step in checkpoint_steps(d):
            for f in sorted((d / "checkpoints" / str(step)).rglob("*")):
                if f.is_file():
                    out[str(f)] = hashlib.sha256(f.read_bytes()).hexdigest()
    return out


def _records(run_dir) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _train_records(run_dir) -> dict[int, dict]:
    """step -> its training record (loss, tokens_per_s, ...); a step logged twice fails."""
    out = {}
    for rec in _records(run_dir):
        if "loss" in rec:
            assert rec["step"] not in out, f"{run_dir}: step {rec['step']} logged twice"
            out[rec["step"]] = rec
    return out


def _assert_kept(before_files, before_records, resumed_from, run_dirs, steps, moved=()):
    """Every intact checkpoint file is still there, unchanged; a step directory in `moved`
    (damaged) is in checkpoints.damaged/ with every file unchanged; each member's records
    up to the step it resumed from are the first run's (not retrained); after it, each
    step once, to the end."""
    after = _snapshot(run_dirs)
    for path, digest in before_files.items():
        src = next((m for m in moved if path.startswith(str(m) + os.sep)), None)
        if src is None:
            assert after.get(path) == digest, f"{path} was deleted or changed by the rerun"
            continue
        dest = Path(src).parent.parent / "checkpoints.damaged" / Path(src).name
        moved_to = dest / os.path.relpath(path, src)
        assert moved_to.is_file(), f"{path} was not moved to {dest}"
        assert hashlib.sha256(moved_to.read_bytes()).hexdigest() == digest, moved_to
    for d in run_dirs:
        recs = _train_records(d)
        assert sorted(recs) == list(range(1, steps + 1)), d
        kept = resumed_from.get(str(d), 0)
        old = before_records.get(str(d), {})
        for s in range(1, kept + 1):
            # tokens_per_s is a timing: a retrained step would not reproduce it
            assert recs[s] == old[s], f"{d}: step {s} was trained again"


def test_members_at_different_points_keep_their_work(tmp_path, capsys):
    """Fast, in one process: member a stopped at step 4 (checkpoints 2, 4), its step 4
    then truncated (a torn write); rerun with member b added. b trains 0 -> 2 alone,
    then both to the end; a's damaged step 4 is moved aside, every other file kept."""
    cfgs = [_cfg("a", "baseline", 6, 3e-3, 0), _cfg("b", "baseline", 6, 1e-3, 1)]
    dirs = [tmp_path / c.name for c in cfgs]
    with pytest.raises(Interrupted):
        CohortTrainer(cfgs[:1], dirs[:1], devices=DEV).run(stop_at_step=4)
    assert checkpoint_steps(dirs[0]) == [2, 4]
    step4 = dirs[0] / "checkpoints" / "4"
    files = [p for p in (step4 / "state").rglob("*") if p.is_file() and "/d/" in str(p)]
    biggest = max(files, key=lambda p: p.stat().st_size)
    with open(biggest, "r+b") as fh:
        fh.truncate(biggest.stat().st_size // 3)
    before_files = _snapshot(dirs)
    before = {str(dirs[0]): _train_records(dirs[0])}
    capsys.readouterr()

    out = CohortTrainer(cfgs, dirs, devices=DEV).run()
    err = capsys.readouterr().err
    assert f"{step4} cannot be restored" in err and "resumed from step 2" in err, err
    assert "b resume(s) from step 0" in err, err  # b is brought forward alone, and it says so
    assert all(out[c.name]["status"] == "done" and out[c.name]["steps"] == 6 for c in cfgs)
    _assert_kept(before_files, before, {str(dirs[0]): 2}, dirs, 6, moved=[step4])
    # a's steps 3-4 were trained again (its checkpoint was damaged): the same losses.
    a = _train_records(dirs[0])
    np.testing.assert_allclose([a[s]["loss"] for s in (3, 4)],
                               [before[str(dirs[0])][s]["loss"] for s in (3, 4)], rtol=1e-6)


_CHILD = """
import sys, jax
from hldstudy.config import read_config
from hldstudy.train.cohort import CohortTrainer
paths = sys.argv[1:]
CohortTrainer([read_config(p + "/want.json") for p in paths], paths,
              devices=jax.devices()[:1]).run()
"""


@pytest.mark.slow  # ~60-120 s on 2 shared cores: a teacher, a killed process, a rerun
def test_killed_cohort_rerun_with_a_member_added_keeps_every_checkpoint(tmp_path):
    """kd members a and b trained in a real process, killed with SIGKILL once both saved
    step 4 (a may hold a later step than b: the kill can land between their saves); the
    rerun adds member c. Each member resumes from its own newest checkpoint, every
    checkpoint file is kept, no saved step is retrained, and every member equals its
    solo run."""
    teacher = tmp_path / "teacher"
    Trainer(Config(name="teacher", model=preset("tiny-teacher", vocab_size=VOCAB),
                   data=_cfg("x", "baseline", 1, 1e-3, 0).data,
                   train=TrainConfig(steps=3, warmup_steps=1, log_every=1, checkpoint_every=0,
                                     eval_batches=1, progress=False)),
            teacher, devices=DEV).run()
    cfgs = [_cfg("a", "kd", 16, 3e-3, 0, teacher), _cfg("b", "kd", 16, 1e-3, 1, teacher),
            _cfg("c", "kd", 16, 5e-3, 2, teacher)]
    dirs = [tmp_path / "co" / c.name for c in cfgs]
    for c, d in zip(cfgs[:2], dirs[:2], strict=True):
        d.mkdir(parents=True)
        save_config(c, d / "want.json")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-c", _CHILD, *map(str, dirs[:2])], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    kill_after_checkpoint(proc, dirs[:2], 4)
    assert not any((d / "results.json").exists() for d in dirs)
    saved = {str(d): checkpoint_steps(d)[-1] for d in dirs[:2]}
    assert all(4 <= s < 16 for s in saved.values()), saved
    before_files = _snapshot(dirs)
    before = {str(d): _train_records(d) for d in dirs[:2]}

    out = CohortTrainer(cfgs, dirs, devices=DEV).run()
    assert all(out[c.name]["status"] == "done" and out[c.name]["steps"] == 16 for c in cfgs)
    _assert_kept(before_files, before, saved, dirs, 16)
    for c, d in zip(cfgs, dirs, strict=True):  # the work kept is the right work
        Trainer(c, tmp_path / "solo" / c.name, devices=DEV).run()
        solo, member = _train_records(tmp_path / "solo" / c.name), _train_records(d)
        np.testing.assert_allclose([member[s]["loss"] for s in sorted(member)],
                                   [solo[s]["loss"] for s in sorted(solo)], rtol=1e-5)
