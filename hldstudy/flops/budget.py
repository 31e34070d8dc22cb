"""Compute matching: a FLOP budget (or a step count) split into each stage's steps.

The one stage planner of the suite: the trainer, the sweep (grid accounting
before anything runs) and the FLOP CLI all call `plan_stages`, so the steps a
run is planned for and the steps it trains can never disagree. It sits in
`flops/`, below `train/`: it needs nothing but the FLOP counts.

With `budget.flops = C > 0`, stage s of a method gets
`floor(C * share_s / flops_per_step_s)` steps (`hldstudy.flops.step_flops`,
model FLOPs). Without a budget, `train.steps` is split by share: every stage
but the last gets `round(steps * share)`, the last the rest.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from hldstudy.config import Config, ModelConfig
from hldstudy.distill import methods
from hldstudy.distill.methods import Stage
from hldstudy.errors import ConfigError
from hldstudy.flops import step_flops


@dataclass(frozen=True)
class StagePlan:
    stage: Stage
    steps: int
    start: int  # global step at which the stage begins
    flops_per_step: float

    @property
    def end(self) -> int:
        return self.start + self.steps


def plan_stages(cfg: Config, teacher_model: ModelConfig | None = None,
                method: str | None = None, *,
                budget_flops: float | None = None) -> tuple[StagePlan, ...]:
    """Steps of every stage of `method` (default `cfg.distill.method`).

    budget_flops overrides `cfg.budget.flops` (0 -> split `train.steps`).
    Raises ConfigError naming the budget (or train.steps) when a stage gets no step.
    """
    spec = methods.get(method or cfg.distill.method)
    budget = cfg.budget.flops if budget_flops is None else budget_flops
    if budget < 0 or math.isnan(budget):
        raise ConfigError("budget.flops", f"a FLOP budget must be >= 0, got {budget}")
    stages = spec.resolve_stages(cfg)
    plans, start = [], 0
    for i, stage in enumerate(stages):
        fps = step_flops(cfg, spec.name, stage.name, teacher_model).total
        if budget > 0:
            steps = int(math.floor(budget * stage.share / fps))
        elif i == len(stages) - 1:
            steps = cfg.train.steps - start
        else:
            steps = int(round(cfg.train.steps * stage.share))
        if steps <= 0:
            raise ConfigError("budget.flops" if budget > 0 else "train.steps",
                              f"stage {stage.name!r} of {spec.name} gets no steps "
                              f"({fps:.3e} FLOPs per step)", "raise the budget / step count")
        plans.append(StagePlan(stage, steps, start, fps))
        start += steps
    return tuple(plans)


def total_steps(plans: tuple[StagePlan, ...]) -> int:
    return plans[-1].end
