"""Why HLDF trails KD here: its stage-1 share, stage boundary and NMSE form as factors.

KD against HLDF at the double-size quickstart budget (experiments/tiny_distill.py, 240
baseline steps, the quickstart teacher), in two regimes of the KD objective shared by
KD and HLDF's stage 2: KD strong (the quickstart's best KD setting, lr 1e-2, T 2, NLL
weight 0.5) and KD weak (NLL weight 0.9 at the same lr and T: the objective mostly NLL,
KD's gain over the baseline mostly gone). HLDF over stage-1 share {0.05, 0.1, 0.2, 0.4}
x stage boundary {restart, continue} x NMSE {batch, token}: 17 configurations x 3 seeds
x 2 regimes = 102 runs, judged on validation perplexity (no downstream tasks). The seeds
and the two regimes of one configuration differ only in member fields: one cohort of 6
per configuration, every cohort fed by one teacher replica:

    python -m hldstudy.sweep hldf_ablation --methods kd,hldf --cohort 6 --teacher-replicas 1 --set teacher.checkpoint=runs/quickstart/teacher --workdir runs/hldf_ablation
"""

from pathlib import Path

from hldstudy.config import load_experiment
from hldstudy.sweep import Sweep

# experiments/ is this folder's sibling in a checkout and inside an installed package alike.
EXPERIMENTS = Path(__file__).resolve().parent.parent / "experiments"
DOUBLE_BASELINE_STEPS = 240  # sweeps/cpu.py's "double" size
KD_STRONG, KD_WEAK = 0.5, 0.9  # distill.alpha (the NLL weight) of the two regimes


def get_sweep(teacher: str = "runs/quickstart/teacher") -> Sweep:
    return Sweep(
        name="hldf_ablation",
        base=load_experiment(EXPERIMENTS / "tiny_distill.py"),
        methods=("kd", "hldf"),
        lr=(1e-2,),
        temperature=(2.0,),
        alpha=(KD_STRONG, KD_WEAK),
        hldf_stage1_share=(0.05, 0.1, 0.2, 0.4),
        stage_boundary=("restart", "continue"),
        nmse=("batch", "token"),
        seeds=(0, 1, 2),
        budget_baseline_steps=DOUBLE_BASELINE_STEPS,
        teacher=teacher,
        teacher_preset="tiny-teacher",
        overrides=("train.log_every=10", "train.checkpoint_every=60"),
    )
