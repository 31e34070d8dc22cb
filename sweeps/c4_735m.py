"""The study's grid for the 735M student (Gemma 3 1B layout, 26 layers, ~32k vocab) on
C4 English via TFDS, distilled from the 3.4B teacher (paper-teacher-3.4b layout), at one
FLOP budget: 40k baseline steps of 512 x 2048 tokens (~42B tokens), teacher forward not
counted. baseline / kd / hldf / hldc x lr {3e-4, 1e-3, 3e-3} x temperature {1, 2} x NLL
weight {0.1, 0.5}, HLD weight 1, one seed: 39 runs (the baseline
has no temperature or NLL weight).

    python -m hldstudy.sweep c4_735m --executor slurm --cohort 12 --teacher-replicas 8 --slurm slurm_partition=gpu --slurm gpus_per_node=8 --slurm nodes=2 --teacher-slurm slurm_partition=gpu --teacher-slurm gpus_per_node=1 --set data.path=/data/tensorflow_datasets --set data.tokenizer=/data/spm32k.model --set teacher.checkpoint=runs/c4-teacher-3.4b --set train.mesh_fsdp=8

One job per cohort and one teacher replica set for the grid, as in c4_123m.py; every run
alone (its own teacher, 16 jobs):

    python -m hldstudy.sweep c4_735m --executor slurm --parallel 16 --slurm slurm_partition=gpu --slurm gpus_per_node=8 --slurm nodes=2 --set data.path=/data/tensorflow_datasets --set data.tokenizer=/data/spm32k.model --set teacher.checkpoint=runs/c4-teacher-3.4b --set train.mesh_fsdp=8

`--dry-run --json` works without the data, tokenizer or teacher; see c4_123m.py.
"""

from hldstudy.sweeps._c4 import c4_sweep


def get_sweep():
    return c4_sweep("735m")
