"""The teacher a run's config names: a local checkpoint (colocated) or remote:// replicas."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from hldstudy import rundir
from hldstudy.config import Config
from hldstudy.distill import methods
from hldstudy.errors import ConfigError
from hldstudy.model.loading import load_model
from hldstudy.teacher.base import Teacher
from hldstudy.teacher.colocated import ColocatedTeacher
from hldstudy.teacher.remote import RemoteTeacher
from hldstudy.teacher_source import is_remote


def with_teacher_tokenizer(cfg: Config) -> Config:
    """A distillation run without its own tokenizer uses its teacher's (they must match)."""
    ckpt = cfg.teacher.checkpoint
    if cfg.data.tokenizer or not ckpt or is_remote(ckpt) or not rundir.is_run_dir(ckpt) \
            or not methods.get(cfg.distill.method).needs_teacher:
        return cfg
    tok = rundir.tokenizer_path(ckpt)
    if tok is None:
        return cfg
    return dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, tokenizer=str(tok)))


def load_teacher(cfg: Config, student_tokenizer=None) -> Teacher:
    """Loads `cfg.teacher.checkpoint` and checks it against the student's tokenizer."""
    spec = cfg.teacher.checkpoint
    if not spec:
        raise ConfigError("teacher.checkpoint", f"method {cfg.distill.method!r} needs a teacher",
                          "pass --set teacher.checkpoint=RUN_DIR (an hldstudy run) or a Gemma path")
    teacher: Teacher
    if is_remote(spec):
        teacher = RemoteTeacher.connect(cfg)
    else:
        if not Path(spec).exists():
            raise ConfigError("teacher.checkpoint", f"{spec} does not exist",
                              "give an hldstudy run directory, a .gguf file or an HF directory")
        loaded = load_model(spec)
        teacher = ColocatedTeacher(loaded.model, loaded.tokenizer, teacher=cfg.teacher,
                                   source=spec)
    if student_tokenizer is not None:
        teacher.check_tokenizer(student_tokenizer)
    return teacher
