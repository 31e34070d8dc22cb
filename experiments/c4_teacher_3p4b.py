"""The study's teacher: the 3.4B model (Gemma 3 4B layout, 34 layers, d 2560, ~32k
vocab) pretrained on 106B tokens of C4 English, the teacher of every C4 student run
(experiments/c4_*.py, sweeps/c4_*.py: `--set teacher.checkpoint=runs/c4-teacher-3.4b`).

    python -m hldstudy.train --config experiments/c4_teacher_3p4b.py --workdir runs/c4-teacher-3.4b --set data.path=/data/tensorflow_datasets --set data.tokenizer=/data/spm32k.model --set train.mesh_fsdp=8

FLOPs per step and in all, without data or weights (the FLOP count reads no data;
data.path only has to be set):

    hldstudy flops --config experiments/c4_teacher_3p4b.py --set data.path=/data/tensorflow_datasets
"""

from hldstudy.sweeps._c4 import teacher_config


def get_config():
    return teacher_config()
