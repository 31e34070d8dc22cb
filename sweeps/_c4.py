"""The study's C4 setting, written once: the data and training recipe, the 3.4B
teacher's pretraining, and for each student size its grid and its single runs.

sweeps/c4_123m.py and sweeps/c4_735m.py (the grids) and experiments/c4_*.py (the
teacher and one run per student size and method) all read their values from here.
Not a sweep file itself (no get_sweep); the leading underscore keeps it out of the
listings of sweep files.
"""

import dataclasses
import os

from hldstudy.config import (
    BudgetConfig,
    Config,
    DataConfig,
    DistillConfig,
    TeacherConfig,
    TrainConfig,
    apply_overrides,
)
from hldstudy.distill.methods import BASELINE
from hldstudy.distill.methods import STUDY as STUDY_METHODS
from hldstudy.model.presets import preset
from hldstudy.sweep import Sweep
from hldstudy.sweep.spec import base_config

# The study's downstream suite (hldstudy.eval names) plus C4 perplexity.
EVAL_TASKS = ("c4_ppl", "wikitext", "hellaswag", "winogrande", "lambada_openai", "piqa",
              "arc_easy")
SEQ_LEN = 2048


@dataclasses.dataclass(frozen=True)
class Student:
    preset: str           # model layout (hldstudy.model.presets)
    batch_size: int       # sequences of SEQ_LEN tokens per step
    baseline_steps: int   # the FLOP budget of every method: this many baseline steps
    warmup_steps: int
    # Devices its state is sharded over (train.mesh_fsdp; the rest is data parallel).
    mesh_fsdp: int = 1


# 40k baseline steps: ~21B tokens for the 123M student, ~42B for the 735M one.
STUDENTS = {
    "123m": Student("paper-123m", batch_size=256, baseline_steps=40_000, warmup_steps=2000),
    # FSDP over 8: replicated, its float32 weights and Adam's moments (8.2 GiB) beside the
    # teacher leave no room for a micro-batch on a 16 GiB v5e chip (benchmarks/aot_study.md).
    "735m": Student("paper-735m", batch_size=512, baseline_steps=40_000, warmup_steps=2000,
                    mesh_fsdp=8),
}

# The teacher (Gemma 3 4B layout, ~32k vocabulary), pretrained on 106B C4 tokens as in the
# paper. The paper gives the token count; the batch and the recipe (TrainConfig below, the
# students' own) are this file's choice: 512 x 2048 tokens per step.
TEACHER_PRESET = "paper-teacher-3.4b"
TEACHER_TOKENS = 106e9
TEACHER_BATCH_SIZE = 512
TEACHER_WARMUP_STEPS = 2000

# The point of each grid that the single runs (experiments/c4_<size>_<method>.py) train:
# the grid's middle learning rate, temperature 1, NLL weight 0.5, HLD weight 1.
LR, TEMPERATURE, ALPHA, HIDDEN_WEIGHT = 1e-3, 1.0, 0.5, 1.0


def _data(batch_size: int) -> DataConfig:
    return DataConfig(source="tfds", tfds_name="c4/en", seq_len=SEQ_LEN, batch_size=batch_size,
                      add_bos=True)


def _train(warmup_steps: int, steps: int | None = None, mesh_fsdp: int = 1) -> TrainConfig:
    extra = {} if steps is None else {"steps": steps}
    return TrainConfig(lr=LR, warmup_steps=warmup_steps, schedule="cosine", min_lr_ratio=0.1,
                       weight_decay=0.1, log_every=100, eval_every=5000, eval_batches=64,
                       checkpoint_every=1000, keep_checkpoints=2, mesh_fsdp=mesh_fsdp, **extra)


def teacher_config() -> Config:
    """The 3.4B teacher's pretraining run (no teacher of its own: method baseline)."""
    steps = round(TEACHER_TOKENS / (TEACHER_BATCH_SIZE * SEQ_LEN))
    return Config(
        name="c4-teacher-3.4b",
        model=preset(TEACHER_PRESET, dtype="bfloat16", remat=True, scan_layers=True),
        data=_data(TEACHER_BATCH_SIZE),
        train=_train(TEACHER_WARMUP_STEPS, steps),
        distill=DistillConfig(method=BASELINE),
    )


def c4_sweep(size: str) -> Sweep:
    """The grid of student `size` ("123m", "735m"): baseline / kd / hldf / hldc x lr x
    temperature x NLL weight at one FLOP budget."""
    student = STUDENTS[size]
    base = Config(
        name=f"c4-{size}",
        # Scanned in groups of Gemma 3's pattern (five local layers, one global): in
        # float32 the unrolled stack's bits, in bf16 its gradient to bf16 rounding (as
        # remat moves it; tests/test_scan_layers.py). On a GPU the backward then holds
        # one group's recomputation, not most layers' (XLA GPU hoists an unrolled
        # stack's: the 123M step needs 46.8 GiB per H100 unrolled, 27.3 scanned).
        model=preset(student.preset, dtype="bfloat16", remat=True, scan_layers=True),
        data=_data(student.batch_size),
        train=_train(student.warmup_steps, mesh_fsdp=student.mesh_fsdp),
        distill=DistillConfig(alpha=ALPHA, temperature=TEMPERATURE, hidden_weight=HIDDEN_WEIGHT,
                              loss_impl="fused", fused_backend="auto"),
        # The 3.4B teacher's forward in bf16, as it was trained: in float32 its weights
        # alone (12.3 GiB) nearly fill a v5e chip beside the student's step.
        teacher=TeacherConfig(dtype="bfloat16"),
        budget=BudgetConfig(count_teacher=False),
    )
    return Sweep(
        name=f"c4-{size}",
        base=base,
        methods=STUDY_METHODS,
        lr=(3e-4, LR, 3e-3),
        temperature=(TEMPERATURE, 2.0),
        alpha=(0.1, ALPHA),
        hidden_weight=(HIDDEN_WEIGHT,),
        seeds=(0,),
        budget_baseline_steps=student.baseline_steps,
        # --set teacher.checkpoint=RUN_DIR (a c4_teacher_3p4b run) or an imported Gemma
        # checkpoint (GGUF file / HF directory); the preset counts FLOPs until then.
        teacher=None,
        teacher_preset=TEACHER_PRESET,
        eval_tasks=EVAL_TASKS,
        eval_limit=None,
        eval_batch_size=16,
        eval_offline_data=os.environ.get("HLDSTUDY_EVAL_DATA"),
    )


def student_config(size: str, method: str) -> Config:
    """One run of student `size` with `method`: the grid's base point at the grid's FLOP
    budget (the trainer plans each stage's steps from budget.flops)."""
    sweep = c4_sweep(size)
    cfg = apply_overrides(base_config(sweep), [f"distill.method={method}"])
    # base_config silences progress bars for the sweep's workers; a single run keeps them.
    return dataclasses.replace(cfg, name=f"c4-{size}-{method}",
                               train=dataclasses.replace(cfg.train,
                                                         progress=sweep.base.train.progress))
