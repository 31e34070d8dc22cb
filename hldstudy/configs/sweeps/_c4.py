"""Shared pieces of the study's C4 grids (c4_123m.py, c4_735m.py).

Not a sweep file itself (no get_sweep); the leading underscore keeps it out of
the listings of sweep files.
"""

import os

from hldstudy.config import BudgetConfig, Config, DataConfig, DistillConfig, TrainConfig
from hldstudy.configs import STUDY_METHODS
from hldstudy.model.presets import preset
from hldstudy.sweep import Sweep

# The study's downstream suite (hldstudy.eval names) plus C4 perplexity.
EVAL_TASKS = ("c4_ppl", "wikitext", "hellaswag", "winogrande", "lambada_openai", "piqa",
              "arc_easy")


def c4_sweep(name: str, student: str, *, batch_size: int, baseline_steps: int,
             warmup_steps: int) -> Sweep:
    base = Config(
        name=name,
        model=preset(student, dtype="bfloat16", remat=True),
        data=DataConfig(source="tfds", tfds_name="c4/en", seq_len=2048, batch_size=batch_size,
                        add_bos=True),
        train=TrainConfig(lr=1e-3, warmup_steps=warmup_steps, schedule="cosine",
                          min_lr_ratio=0.1, weight_decay=0.1, log_every=100, eval_every=5000,
                          eval_batches=64, checkpoint_every=1000, keep_checkpoints=2),
        distill=DistillConfig(alpha=0.5, temperature=1.0, hidden_weight=1.0,
                              loss_impl="fused", fused_backend="auto"),
        budget=BudgetConfig(count_teacher=False),
    )
    return Sweep(
        name=name,
        base=base,
        methods=STUDY_METHODS,
        lr=(3e-4, 1e-3, 3e-3),
        temperature=(1.0, 2.0),
        alpha=(0.1, 0.5),
        hidden_weight=(1.0,),
        seeds=(0,),
        budget_baseline_steps=baseline_steps,
        # --set teacher.checkpoint=RUN_DIR (a paper-teacher-3.4b run) or an imported Gemma
        # checkpoint (GGUF file / HF directory); the preset counts FLOPs until then.
        teacher=None,
        teacher_preset="paper-teacher-3.4b",
        eval_tasks=EVAL_TASKS,
        eval_limit=None,
        eval_batch_size=16,
        eval_offline_data=os.environ.get("HLDSTUDY_EVAL_DATA"),
    )
