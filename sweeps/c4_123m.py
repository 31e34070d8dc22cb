"""The study's grid for the 123M student (Gemma 3 270M layout, 18 layers, ~32k vocab) on
C4 English via TFDS, distilled from the 3.4B teacher (paper-teacher-3.4b layout), at one
FLOP budget: 40k baseline steps of 256 x 2048 tokens (~21B tokens), teacher forward not
counted. baseline / kd / hldf / hldc x lr {3e-4, 1e-3, 3e-3} x temperature {1, 2} x NLL
weight {0.1, 0.5}, HLD weight 1, one seed: 39 runs (the baseline
has no temperature or NLL weight).

    python -m hldstudy.sweep c4_123m --executor slurm --cohort 12 --teacher-replicas 8 --slurm slurm_partition=gpu --slurm gpus_per_node=8 --teacher-slurm slurm_partition=gpu --teacher-slurm gpus_per_node=1 --set data.path=/data/tensorflow_datasets --set data.tokenizer=/data/spm32k.model --set teacher.checkpoint=runs/c4-teacher-3.4b

One SLURM job per cohort of at most 12 students of a method (4 cohorts: baseline, kd,
hldf, hldc), and 8 teacher replicas (one GPU each) that the sweep starts, serves every
cohort from and stops: the teacher runs once per step of the longest schedule (HLDF's
50,466) for the whole grid, 28.7x fewer teacher FLOPs than every run with its own
teacher (`hldstudy plan --sweep c4_123m`). 8 replicas is a sizing estimate:
a 3.4B forward per step on one GPU against a cohort of 12 123M students on 8 GPUs is
about 6x the cohort's per-GPU work. Without the replica set, every run alone:

    python -m hldstudy.sweep c4_123m --executor slurm --parallel 16 --slurm slurm_partition=gpu --slurm gpus_per_node=8 --set data.path=/data/tensorflow_datasets --set data.tokenizer=/data/spm32k.model --set teacher.checkpoint=runs/c4-teacher-3.4b

`--dry-run --json` works without the data, tokenizer or teacher. The teacher may
be an hldstudy run (its tokenizer is then every run's) or an imported Gemma
checkpoint (GGUF file / HF directory; pass its tokenizer with data.tokenizer).
Downstream data for lm-eval tasks: HLDSTUDY_EVAL_DATA=/path/to/offline/eval/data.
"""

from hldstudy.sweeps._c4 import c4_sweep


def get_sweep():
    return c4_sweep("123m")
