"""The tiny runs the tests share: one data setup, one training setup, the teacher and
student configs built on them, and readers of what a run leaves behind.

`tests/conftest.py` trains the tokenizer and the teacher once per test session from
these builders (fixtures `tokenizer_path` and `teacher_dir`); a module that needs a
variant passes overrides rather than spelling a config of its own.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from hldstudy.config import Config, DataConfig, DistillConfig, TrainConfig
from hldstudy.model import preset

VOCAB = 384
# The synthetic corpus every tiny run trains on (the tokenizer is trained on it too).
DATA = dict(seq_len=64, batch_size=8, tokenizer_vocab_size=VOCAB, synthetic_docs=600,
            synthetic_valid_docs=50)
# The session's teacher: long enough to hold two checkpoints (steps 4 and 8, so tests can
# serve an older one), short enough to train in seconds. No test needs a good teacher:
# they compare a run with another run from the same teacher (member == solo,
# remote == colocated, resumed == uninterrupted, fused == materialized).
TEACHER_STEPS = 8
TEACHER_CHECKPOINT_EVERY = 4


def data_config(tokenizer: str | Path | None = None, **overrides) -> DataConfig:
    """The shared synthetic data section; `tokenizer` a trained tokenizer file (None: the
    run trains its own, or takes its teacher's)."""
    return DataConfig(**{**DATA, "tokenizer": None if tokenizer is None else str(tokenizer),
                         **overrides})


def train_config(steps: int, **overrides) -> TrainConfig:
    """The shared training section: a short warmup, a loss record every step, a checkpoint
    every 4 steps, no progress bar."""
    base = dict(steps=steps, lr=3e-3, warmup_steps=2, log_every=1, checkpoint_every=4,
                eval_batches=2, progress=False)
    return TrainConfig(**{**base, **overrides})


def teacher_config(tokenizer: str | Path | None = None) -> Config:
    """The tiny teacher every distillation test distills from."""
    return Config(name="teacher", model=preset("tiny-teacher", vocab_size=VOCAB),
                  data=data_config(tokenizer),
                  train=train_config(TEACHER_STEPS, checkpoint_every=TEACHER_CHECKPOINT_EVERY,
                                     eval_batches=1))


def student_config(method: str, teacher: str | Path, *, name: str | None = None, steps: int = 6,
                   tokenizer: str | Path | None = None, train: dict | None = None,
                   teacher_fields: dict | None = None, **distill) -> Config:
    """A tiny student distilled by `method` from `teacher` (a run directory or a
    `remote://` spec); `train` overrides training fields, `teacher_fields` the teacher
    section's, the rest are distill fields."""
    return Config(name=name or method, model=preset("tiny", vocab_size=VOCAB),
                  data=data_config(tokenizer), train=train_config(steps, **(train or {})),
                  distill=DistillConfig(method=method, **distill),
                  teacher=dataclasses.replace(Config().teacher, checkpoint=str(teacher),
                                              **(teacher_fields or {})))


def train_teacher(workdir: str | Path, tokenizer: str | Path | None = None) -> Path:
    """Trains `teacher_config` into `workdir` and returns it."""
    import jax

    from hldstudy.train.loop import Trainer

    Trainer(teacher_config(tokenizer), workdir, devices=jax.devices()[:1]).run()
    return Path(workdir)


def prepare_tokenizer(workdir: str | Path) -> str:
    """Trains the shared data's tokenizer into `workdir`; returns its file's path."""
    from hldstudy.data import prepare_data

    prepare_data(data_config(), workdir)
    return str(Path(workdir) / "tokenizer.model")


def records(workdir: str | Path) -> list[dict]:
    """Every record of a run's metrics.jsonl, in order."""
    return [json.loads(line) for line in (Path(workdir) / "metrics.jsonl").read_text().splitlines()]


def losses(workdir: str | Path) -> dict[int, float]:
    """{step: training loss} of a run."""
    return {r["step"]: r["loss"] for r in records(workdir) if "loss" in r}


def teacher_steps(workdir: str | Path) -> list[int]:
    """The steps a run asked its remote teacher for, in order (teacher_steps.log)."""
    return [json.loads(line)["step"] for line in
            (Path(workdir) / "teacher_steps.log").read_text().splitlines()]


def train_and_kill(script: str, cfgs, dirs, step: int) -> None:
    """Runs `script` (given the run directories, each holding its config as want.json) in
    a subprocess and kills it with SIGKILL once every run has saved `step` or later."""
    import os
    import subprocess
    import sys

    from hldstudy.config import save_config

    for c, d in zip(cfgs, dirs, strict=True):
        Path(d).mkdir(parents=True)
        save_config(c, Path(d) / "want.json")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    proc = subprocess.Popen([sys.executable, "-c", script, *map(str, dirs)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    kill_after_checkpoint(proc, dirs, step)
    assert not any((Path(d) / "results.json").exists() for d in dirs)


def kill_after_checkpoint(proc, dirs, step: int, timeout_s: float = 600) -> None:
    """Kills `proc` (a training subprocess) with SIGKILL once every run directory in `dirs`
    holds a checkpoint at `step` or later; fails if the process ended first."""
    import os
    import signal
    import time

    from hldstudy.rundir import checkpoint_steps

    deadline = time.time() + timeout_s
    while time.time() < deadline and proc.poll() is None:
        if all((checkpoint_steps(d) or [0])[-1] >= step for d in dirs):
            break
        time.sleep(0.01)
    assert proc.poll() is None, "the run finished before it could be killed"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
