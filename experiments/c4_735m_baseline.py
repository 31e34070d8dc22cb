"""The 735M student (Gemma 3 1B layout, 26 layers, ~32k vocab) on C4 English, method
baseline (self-supervised NLL only, no teacher): one point of the grid sweeps/c4_735m.py
(learning rate 1e-3, temperature 1, NLL weight 0.5, HLD weight 1) at that grid's FLOP
budget, 40k baseline steps of 512 x 2048 tokens, teacher forward not counted. Its values
come from sweeps/_c4.py.

    python -m hldstudy.train --config experiments/c4_735m_baseline.py --set data.path=/data/tensorflow_datasets --set data.tokenizer=/data/spm32k.model

Steps per stage at the budget, without data, tokenizer or teacher weights (the FLOP
count reads no data; data.path only has to be set):

    hldstudy flops --config experiments/c4_735m_baseline.py --set data.path=/data/tensorflow_datasets
"""

from hldstudy.sweeps._c4 import student_config


def get_config():
    return student_config("735m", "baseline")
