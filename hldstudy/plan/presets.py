"""Model shapes the planner knows: every model preset (`hldstudy.model.presets`), as
`ModelShape`s. The disaggregated experiment's pair is `qwen3.5-35b-a3b` (teacher: hybrid
3:1 Gated DeltaNet / gated attention, 256 experts, 8 routed + 1 shared per token, 248,320
vocabulary, untied head) and `qwen3.5-9b` (student); no planner-only approximations."""

from __future__ import annotations

from hldstudy.errors import ConfigError
from hldstudy.model.presets import PRESETS
from hldstudy.shapes import ModelShape as PlanModel


def plan_model(name: str) -> PlanModel:
    """The shape of model preset `name`."""
    if name in PRESETS:
        return PlanModel.from_model_config(PRESETS[name], name)
    raise ConfigError("preset", f"unknown model {name!r}",
                      f"choose one of {', '.join(sorted(PRESETS))}")
