"""The 735M student (Gemma 3 1B layout, 26 layers, ~32k vocab) on C4 English, method kd
(NLL + KL to the teacher's logits): one point of the grid sweeps/c4_735m.py (learning
rate 1e-3, temperature 1, NLL weight 0.5, HLD weight 1) at that grid's FLOP budget, 40k
baseline steps of 512 x 2048 tokens, teacher forward not counted. Its values come from
sweeps/_c4.py.

    python -m hldstudy.train --config experiments/c4_735m_kd.py --set data.path=/data/tensorflow_datasets --set data.tokenizer=/data/spm32k.model --set teacher.checkpoint=runs/c4-teacher-3.4b

Steps per stage at the budget, and the steps compiled for a target, without data,
tokenizer or teacher weights (the teacher's shape is teacher.preset):

    hldstudy flops --config experiments/c4_735m_kd.py
    JAX_PLATFORMS=cpu python -m hldstudy.aot --config experiments/c4_735m_kd.py --target v5e:2x4
"""

from hldstudy.sweeps._c4 import student_config


def get_config():
    return student_config("735m", "kd")
