"""The real-text study's two phases, written down before they run: HLD vs KD on the World
English Bible (hldstudy/study/corpus.py: training, validation and task text from disjoint
books), a 6-layer student distilled from an 8-layer teacher, every run FLOP-matched.

    hldstudy study real-text --workdir runs/real_text
    hldstudy study real-text --workdir /tmp/rt_smoke --size smoke

Phase 1, exploratory (seed 0, its picks never judge themselves):
  a. KD over learning rate x temperature at NLL weight 0.5 (KD_LR x KD_TEMPERATURE);
  b. at KD's pick (its lr and T): HLDF over stage-1 share x stage boundary, and HLDC over
     two hidden weights, at NLL weight 0.5.
  PICK RULE: each grid's lowest validation perplexity at the exploratory seed; a tie goes
  to the configuration listed first. KD's pick fixes (lr, T) for everything after it.
Phase 2, confirmatory (CONFIRM_SEEDS, fresh: each sets the initialisation and the data
  order), every arm at KD's (lr, T) so that the arms pair by seed: ARMS below. The runs of
  one seed read one data order and stream one teacher (`--teacher-replicas 1`): cohorts
  group that seed's arms of one method.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from hldstudy.config import load_experiment
from hldstudy.sweep import Sweep
from hldstudy.sweep.spec import AXES

# experiments/ is this folder's sibling in a checkout and inside an installed package alike.
EXPERIMENTS = Path(__file__).resolve().parent.parent / "experiments"
EXPLORATORY_SEED = 0
NLL_STRONG, NLL_WEAK = 0.5, 0.9  # distill.alpha: KD at its pick, and KD weak (mostly NLL)
KD_LR = (3e-3, 1e-2)
KD_TEMPERATURE = (1.0, 2.0, 4.0)
HLDF_SHARE = (0.1, 0.2)
HLDF_BOUNDARY = ("restart", "continue")
HLDC_HIDDEN_WEIGHT = (0.5, 2.0)
HLDF_DEFAULT = {"distill.hldf_stage1_share": 0.2, "train.stage_boundary": "restart"}
TASKS = ("hellaswag", "lambada_openai")  # built from the task books (eval/web_tasks.py)
PICKED = ("kd", "hldf", "hldc")  # the grids phase 1 picks from, KD's first


@dataclass(frozen=True)
class Size:
    """teacher_steps: the teacher's training steps; budget_steps: every student's FLOP
    budget in baseline steps; confirm_seeds: phase 2's seeds; vocab: the tokenizer's
    pieces (trained on the training books); train_chapters: > 0 keeps the first chapters
    only, valid_chapters > 0 the first validation chapters only; task_items: items per
    downstream task; batch_size: sequences of 128 tokens."""

    teacher_steps: int
    budget_steps: int
    confirm_seeds: tuple[int, ...]
    vocab: int = 4096
    train_chapters: int = 0
    valid_chapters: int = 0
    task_items: int = 250
    batch_size: int = 16


SIZES = {
    # 1500 teacher steps x 2048 tokens (3.1M tokens, ~3.4 epochs); 480 baseline steps x
    # 2048 tokens per student (983k tokens: 4x the HLDF ablation's 245,760).
    "full": Size(teacher_steps=1500, budget_steps=480, confirm_seeds=tuple(range(1, 11))),
    # every step of the study on a slice, in a few minutes: its numbers mean nothing.
    "smoke": Size(teacher_steps=10, budget_steps=6, confirm_seeds=(1, 2), vocab=512,
                  train_chapters=40, valid_chapters=6, task_items=12, batch_size=4),
}


@dataclass(frozen=True)
class Arm:
    """One confirmatory arm: a name, a method and its values (besides the seed)."""

    name: str
    method: str
    params: dict


def size_overrides(size: Size) -> tuple[str, ...]:
    """What a size sets in the student and teacher configs alike."""
    return (f"model.vocab_size={size.vocab}", f"data.tokenizer_vocab_size={size.vocab}",
            f"data.batch_size={size.batch_size}")


def _sweep(name: str, size: Size, teacher: str, shards: str, tasks: str, **grid) -> Sweep:
    return Sweep(
        name=name,
        base=load_experiment(EXPERIMENTS / "real_text_student.py"),
        budget_baseline_steps=size.budget_steps,
        teacher=teacher,
        overrides=size_overrides(size) + (f"data.path={shards}",
                                          f"train.checkpoint_every={max(size.budget_steps // 4, 5)}"),
        eval_tasks=TASKS,
        eval_offline_data=tasks,
        eval_batch_size=32,
        launch="hldstudy study real-text --workdir DIR",
        **grid,
    )


def get_sweep(size: str = "full", teacher: str | None = None, shards: str = "DIR/shards",
              tasks: str = "DIR/corpus/tasks") -> Sweep:
    """Phase 1a as a sweep file's grid (`python -m hldstudy.sweep real_text --dry-run`
    shows its runs and budgets); the study itself runs every phase."""
    return dataclasses.replace(explore_kd(SIZES[size], teacher, shards, tasks),
                               teacher_preset="text-teacher")


def explore_kd(size: Size, teacher: str, shards: str, tasks: str) -> Sweep:
    """Phase 1a: KD over lr x T at NLL weight 0.5."""
    return _sweep("real-text-explore-kd", size, teacher, shards, tasks, methods=("kd",),
                  lr=KD_LR, temperature=KD_TEMPERATURE, alpha=(NLL_STRONG,),
                  seeds=(EXPLORATORY_SEED,))


def explore_hld(size: Size, teacher: str, shards: str, tasks: str, kd_pick: dict) -> Sweep:
    """Phase 1b: at KD's (lr, T), HLDF over share x boundary and HLDC over hidden weights."""
    return _sweep("real-text-explore-hld", size, teacher, shards, tasks,
                  methods=("hldf", "hldc"), lr=(kd_pick["train.lr"],),
                  temperature=(kd_pick["distill.temperature"],), alpha=(NLL_STRONG,),
                  hldf_stage1_share=HLDF_SHARE, stage_boundary=HLDF_BOUNDARY,
                  hidden_weight=HLDC_HIDDEN_WEIGHT, seeds=(EXPLORATORY_SEED,))


def arms(kd_pick: dict, hldf_pick: dict, hldc_pick: dict) -> list[Arm]:
    """Phase 2's arms, all at KD's (lr, T)."""
    at = {"train.lr": kd_pick["train.lr"], "distill.temperature": kd_pick["distill.temperature"]}
    strong, weak = {"distill.alpha": NLL_STRONG}, {"distill.alpha": NLL_WEAK}
    return [
        Arm("baseline", "baseline", {"train.lr": at["train.lr"]}),
        Arm("kd", "kd", {**at, **strong}),
        Arm("kd_weak", "kd", {**at, **weak}),
        Arm("hldf_default", "hldf", {**at, **strong, **HLDF_DEFAULT}),
        Arm("hldf_default_weak", "hldf", {**at, **weak, **HLDF_DEFAULT}),
        Arm("hldf", "hldf", {**at, **strong, **_only(hldf_pick, HLDF_DEFAULT)}),
        Arm("hldc", "hldc", {**at, **strong, **_only(hldc_pick, {"distill.hidden_weight": 0})}),
    ]


# The arms each of the paper's claims reads (hldstudy.analysis.arms.ClaimArms), and the
# perplexity contrasts the report tabulates (arm, reference), paired by seed.
CLAIM_ARMS = dict(kd="kd", kd_weak="kd_weak", hldf="hldf", hld=("hldf", "hldc"),
                  hldf_default="hldf_default", hldf_default_weak="hldf_default_weak")
CONTRASTS = (("hldf", "kd"), ("hldf_default", "kd"), ("hldc", "kd"),
             ("hldf_default_weak", "kd_weak"), ("kd", "baseline"), ("kd_weak", "baseline"))


def _only(params: dict, like: dict) -> dict:
    return {k: params[k] for k in like}


def confirm_sweep(arm: Arm, size: Size, teacher: str, shards: str, tasks: str) -> Sweep:
    """One arm at the confirmatory seeds (its values as one-point axes)."""
    axes = {AXES[k]["column"]: (v,) for k, v in arm.params.items()}
    return _sweep("real-text-confirm", size, teacher, shards, tasks, methods=(arm.method,),
                  seeds=size.confirm_seeds, **axes)
