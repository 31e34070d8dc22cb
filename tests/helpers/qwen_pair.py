"""Tiny Qwen3.5 teachers and the students distilled from them.

A teacher is a random `tiny-qwen` / `tiny-qwen-moe` model exported as a Hugging Face
directory (`Qwen3_5ForCausalLM` / `Qwen3_5MoeForCausalLM`, untied head) with the
committed byte-level BPE `tests/fixtures/qwen35/tokenizer.json`, so the student reads its
teacher's tokenizer exactly as it would a released Qwen checkpoint's. No test needs a good
teacher: they compare a run with another run from the same teacher.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from helpers.runs import data_config, train_config
from hldstudy.config import Config, DistillConfig

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "qwen35"
TOKENIZER = FIXTURES / "tokenizer.json"  # 300 pieces
VOCAB = 384  # the models' vocabulary: the tokenizer's 300 pieces, padded
TEACHERS = {"dense": "tiny-qwen", "moe": "tiny-qwen-moe"}


def export_teacher(kind: str, out: str | Path, seed: int = 0) -> Path:
    """A random Qwen3.5 teacher of `kind` ("dense" | "moe") exported to `out` with the
    fixture tokenizer; returns the directory."""
    from flax import nnx

    from hldstudy.data.tokenizer import JsonTokenizer
    from hldstudy.model import preset
    from hldstudy.model.importers import export_hf
    from hldstudy.model.transformer import Transformer

    model = Transformer(preset(TEACHERS[kind], vocab_size=VOCAB), rngs=nnx.Rngs(seed))
    return export_hf(model, out, tokenizer=JsonTokenizer.load(TOKENIZER))


def student_config(method: str, teacher: str | Path, *, student: str = "tiny",
                   name: str | None = None, steps: int = 4, train: dict | None = None,
                   teacher_fields: dict | None = None, model: dict | None = None,
                   **distill) -> Config:
    """A tiny student (`student` preset: "tiny" Gemma-style, "tiny-qwen", "tiny-qwen-moe")
    distilled by `method` from the Qwen3.5 `teacher` (a directory or a `remote://` spec),
    tokenized by the teacher's tokenizer.json."""
    from hldstudy.model import preset

    if method == "hldf":
        distill.setdefault("hldf_stage1_share", 0.5)
    if method == "patient":
        distill.setdefault("patient_pairs", 2)
    return Config(name=name or method,
                  model=preset(student, vocab_size=VOCAB, **(model or {})),
                  data=data_config(TOKENIZER, tokenizer_vocab_size=VOCAB),
                  train=train_config(steps, **{"eval_batches": 1, **(train or {})}),
                  distill=DistillConfig(method=method, **distill),
                  teacher=dataclasses.replace(Config().teacher, checkpoint=str(teacher),
                                              **(teacher_fields or {})))
