"""The study's grid for the 123M student (Gemma 3 270M layout, 18 layers, ~32k vocab) on
C4 English via TFDS, distilled from the 3.4B teacher (paper-teacher-3.4b layout), at one
FLOP budget: 40k baseline steps of 256 x 2048 tokens (~21B tokens), teacher forward not
counted. baseline / kd / hldf / hldc x lr {3e-4, 1e-3, 3e-3} x temperature {1, 2} x NLL
weight {0.1, 0.5}, HLD weight 1, one seed: 39 runs (the baseline
has no temperature or NLL weight).

    python -m hldstudy.sweep c4_123m --executor slurm --parallel 16 --slurm slurm_partition=gpu --slurm gpus_per_node=8 --set data.path=/data/tensorflow_datasets --set data.tokenizer=/data/spm32k.model --set teacher.checkpoint=runs/c4-teacher-3.4b

`--dry-run --json` works without the data, tokenizer or teacher. The teacher may
be an hldstudy run (its tokenizer is then every run's) or an imported Gemma
checkpoint (GGUF file / HF directory; pass its tokenizer with data.tokenizer).
Downstream data for lm-eval tasks: HLDSTUDY_EVAL_DATA=/path/to/offline/eval/data.
"""

from hldstudy.sweeps._c4 import c4_sweep


def get_sweep():
    return c4_sweep("123m")
