"""CPU-scale grid on the synthetic corpus: the quickstart's comparison.

baseline / kd / hldf / hldc students (experiments/tiny_distill.py, 4 layers,
d 64) distilled from the quickstart teacher (experiments/tiny_teacher.py,
6 layers, d 128) at one FLOP budget, over learning rate x temperature with
the NLL weight and HLD weight fixed; evaluated on the synthetic HellaSwag-
and LAMBADA-style tasks. `hldstudy quickstart` trains the teacher and runs
this sweep; to run it by hand once a teacher exists:

    python -m hldstudy.sweep cpu --set teacher.checkpoint=runs/quickstart/teacher --workdir runs/cpu
    python -m hldstudy.analysis runs/cpu --out runs/cpu/report

The distilled methods as cohorts of 4 sharing one teacher replica that the sweep starts
and stops (each step computed once for kd, hldf and hldc; every loss as the run's alone):

    python -m hldstudy.sweep cpu --methods kd,hldf,hldc --cohort 4 --teacher-replicas 1 --set teacher.checkpoint=runs/quickstart/teacher --workdir runs/cpu
"""

from pathlib import Path

from hldstudy.config import load_experiment
from hldstudy.distill.methods import STUDY as STUDY_METHODS
from hldstudy.sweep import Sweep

# experiments/ is this folder's sibling in a checkout and inside an installed package alike.
EXPERIMENTS = Path(__file__).resolve().parent.parent / "experiments"

# size -> (student budget in baseline steps, eval items per task); "tiny": a smoke test.
# "double": twice small's budget, more eval items (hldstudy/quickstart.py re-runs its best configs
# with 3 seeds).
SIZES = {"tiny": (6, 8), "small": (120, 200), "double": (240, 300), "medium": (400, 500),
         "large": (1500, 1000)}


def get_sweep(size: str = "small", teacher: str = "runs/quickstart/teacher") -> Sweep:
    steps, eval_items = SIZES[size]
    return Sweep(
        name="cpu",
        base=load_experiment(EXPERIMENTS / "tiny_distill.py"),
        methods=STUDY_METHODS,
        lr=(3e-3, 1e-2),
        temperature=(1.0, 2.0),
        alpha=(0.5,),
        hidden_weight=(1.0,),
        seeds=(0,),
        budget_baseline_steps=steps,
        teacher=teacher,
        teacher_preset="tiny-teacher",
        overrides=("train.log_every=10", f"train.checkpoint_every={max(25, steps // 4)}"),
        eval_tasks=("synth_mc", "synth_cloze"),
        eval_limit=eval_items,
        eval_batch_size=16,
    )
