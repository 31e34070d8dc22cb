"""The data cursor: a run killed with kill -9 and resumed trains on the batches an
uninterrupted run trains on (its losses bitwise equal) and says `replayed 0 batches`, from
prepared shards and from the TFDS streaming path, solo and as a cohort; a remote teacher
replica started after the resume is handed the cursor and replays nothing.

Each kill test trains a tiny run twice (10-30 s on 2 cores); the default suite keeps
shards solo (and the TFDS cursor through a checkpoint, below), the other three are
`-m slow`."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import jax
import pytest
from helpers.runs import data_config, losses, student_config, train_and_kill, train_config

from hldstudy.config import Config, DistillConfig, save_config
from hldstudy.data.prepare import prepare
from hldstudy.data.tfds_corpus import NAME, build_tfds
from hldstudy.model import preset
from hldstudy.rundir import checkpoint_steps
from hldstudy.train.cohort import CohortTrainer
from hldstudy.train.loop import Interrupted, Trainer

ROOT = Path(__file__).resolve().parent.parent
DEV = jax.devices()[:1]
STEPS = 24


@pytest.fixture(scope="module")
def shards(tmp_path_factory, tokenizer_path):
    out = tmp_path_factory.mktemp("resume") / "shards"
    prepare(data_config(tokenizer_path), out, docs_per_shard=100, progress=False)
    return out


@pytest.fixture(scope="module")
def tfds_dir(tmp_path_factory):
    return build_tfds(tmp_path_factory.mktemp("tfds"))


def _data(kind: str, tokenizer_path: str, shards: Path, tfds_dir: Path):
    if kind == "shards":
        return data_config(None, source="shards", path=str(shards))
    return data_config(tokenizer_path, source="tfds", path=str(tfds_dir), tfds_name=NAME)


def _configs(kind, tokenizer_path, shards, tfds_dir, cohort: bool) -> list[Config]:
    data = _data(kind, tokenizer_path, shards, tfds_dir)
    base = Config(name="a", model=preset("tiny", vocab_size=384), data=data,
                  train=train_config(STEPS), distill=DistillConfig(method="baseline"))
    if not cohort:
        return [base]
    return [base, dataclasses.replace(base, name="b",
                                      train=dataclasses.replace(base.train, lr=1e-3, seed=1))]


_CHILD = r"""
import sys, jax
from hldstudy.config import read_config
from hldstudy.train.cohort import CohortTrainer
from hldstudy.train.loop import Trainer
paths = sys.argv[1:]
cfgs = [read_config(p + "/want.json") for p in paths]
if len(cfgs) == 1:
    Trainer(cfgs[0], paths[0], devices=jax.devices()[:1]).run()
else:
    CohortTrainer(cfgs, paths, devices=jax.devices()[:1]).run()
"""


def _train(cfgs, dirs):
    if len(cfgs) == 1:
        Trainer(cfgs[0], dirs[0], devices=DEV).run()
    else:
        CohortTrainer(cfgs, dirs, devices=DEV).run()


def _check(kind, cohort, tmp_path, tokenizer_path, shards, tfds_dir, capsys):
    cfgs = _configs(kind, tokenizer_path, shards, tfds_dir, cohort)
    full = [tmp_path / "full" / c.name for c in cfgs]
    split = [tmp_path / "split" / c.name for c in cfgs]
    _train(cfgs, full)
    train_and_kill(_CHILD, cfgs, split, 8)
    resumed_at = min(checkpoint_steps(d)[-1] for d in split)
    capsys.readouterr()
    _train(cfgs, split)
    err = capsys.readouterr().err
    assert f"resumed at step {resumed_at}: the data from the checkpoint's data cursor, " \
           "replayed 0 batches" in err, err
    for a, b in zip(full, split, strict=True):
        assert losses(a) == losses(b)  # bitwise: the same batches after the resume


def test_shards_solo_resumes_after_kill_9_replaying_nothing(tmp_path, tokenizer_path, shards,
                                                           tfds_dir, capsys):
    _check("shards", False, tmp_path, tokenizer_path, shards, tfds_dir, capsys)


@pytest.mark.slow
@pytest.mark.parametrize(("kind", "cohort"), [("shards", True), ("tfds", False), ("tfds", True)])
def test_other_paths_resume_after_kill_9_replaying_nothing(kind, cohort, tmp_path,
                                                           tokenizer_path, shards, tfds_dir,
                                                           capsys):
    _check(kind, cohort, tmp_path, tokenizer_path, shards, tfds_dir, capsys)


def test_checkpoint_metadata_holds_the_cursor_of_its_step(tmp_path, tokenizer_path, shards,
                                                          tfds_dir):
    from hldstudy.checkpoint import Checkpointer
    from hldstudy.data import prepare_data

    cfg = _configs("tfds", tokenizer_path, shards, tfds_dir, False)[0]
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, steps=8))
    Trainer(cfg, tmp_path / "run", devices=DEV).run()
    meta = Checkpointer(tmp_path / "run" / "checkpoints", 2).restore_meta(8)
    cursor = meta["data"]
    assert cursor["step"] == 8 and cursor["kind"] == "streaming"
    # A fresh stream positioned by it gives batch 8 of an uninterrupted stream.
    ref = prepare_data(cfg.data, tmp_path / "ref").train
    want = [ref.batch_at(i) for i in range(9)][8]
    fresh = prepare_data(cfg.data, tmp_path / "fresh").train
    fresh.restore(json.loads(json.dumps(cursor)))
    got = fresh.batch_at(8)
    assert all((got[k] == want[k]).all() for k in want) and fresh.replayed == 0


def test_a_replica_started_after_the_resume_is_handed_the_cursor(tmp_path, teacher_dir,
                                                                 tokenizer_path, shards):
    """KD from shards: the first replica serves steps 0-3, the trainer stops; a fresh
    replica (which never read the stream) serves the resumed run from step 4 on."""
    from test_disagg import Replica

    def cfg_with(teacher):
        c = student_config("kd", teacher, steps=8)
        return dataclasses.replace(c, data=data_config(None, source="shards", path=str(shards)))

    colocated = cfg_with(teacher_dir)
    Trainer(colocated, tmp_path / "colocated", devices=DEV).run()
    config = tmp_path / "student.json"
    save_config(colocated, config)
    first = Replica(config, tmp_path / "r1").start().ready()
    workdir = tmp_path / "remote"
    try:
        with pytest.raises(Interrupted):
            Trainer(cfg_with("remote://" + first.address), workdir,
                    devices=DEV).run(stop_at_step=4)
    finally:
        first.kill()
    second = Replica(config, tmp_path / "r2").start().ready()
    try:
        Trainer(cfg_with("remote://" + second.address), workdir, devices=DEV).run()
        stats = second.stats()
    finally:
        second.kill()
    assert losses(workdir) == losses(tmp_path / "colocated")
    assert stats["steps"] == 4 and stats["replayed_batches"] == 0, stats


def test_resuming_on_another_corpus_names_data_path_and_leaves_the_run_as_it_was(
        tmp_path, tokenizer_path, shards):
    """A shards run stopped at a checkpoint, resumed with data.path on another corpus's
    shards: refused in one line naming data.path, and config.json (with everything else
    in the run directory) byte-identical: the checks run before the run's files are
    written."""
    from hldstudy.errors import InputError

    other = tmp_path / "other_shards"
    prepare(data_config(tokenizer_path, synthetic_docs=300), other, docs_per_shard=100,
            progress=False)
    cfg = _configs("shards", tokenizer_path, shards, None, cohort=False)[0]
    run = tmp_path / "run"
    with pytest.raises(Interrupted):
        Trainer(cfg, run, devices=DEV).run(stop_at_step=4)
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    moved = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, path=str(other)))
    with pytest.raises(InputError, match=r"data\.path .*other_shards"):
        Trainer(moved, run, devices=DEV).run()
    after = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    assert after == before
    # Another run's checkpoints copied in: blamed on the checkpoints, not on a config change.
    other_run = tmp_path / "other_run"
    reseeded = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, seed=7))
    with pytest.raises(Interrupted):
        Trainer(reseeded, other_run, devices=DEV).run(stop_at_step=4)
    shutil.rmtree(other_run / "checkpoints")
    shutil.copytree(run / "checkpoints", other_run / "checkpoints")
    with pytest.raises(InputError, match="written by another run"):
        Trainer(reseeded, other_run, devices=DEV).run()
