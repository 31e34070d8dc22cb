"""Model shapes the planner knows: its own (MoE) presets and every model preset."""

from __future__ import annotations

from hldstudy.errors import ConfigError
from hldstudy.model.presets import PRESETS
from hldstudy.shapes import ModelShape as PlanModel

# Planner-local shapes (not model presets: hldstudy cannot train MoE layers).
# Plausible, documented numbers in the style of the named families, not
# official specifications.
PLAN_PRESETS: dict[str, PlanModel] = {
    # "35B-A3B" MoE teacher, Qwen3-MoE style: 40 layers, d 2048, 32 query / 4
    # KV heads of 256, 256 routed experts of width 512, 8 routed + 1 shared
    # per token, untied head, 151,936-token vocabulary: 34.5B total, 3.3B
    # active parameters.
    "moe-35b-a3b": PlanModel(name="moe-35b-a3b", vocab_size=151936, d_model=2048, n_layers=40,
                             n_heads=32, n_kv_heads=4, head_dim=256, d_ff=0, tied_head=False,
                             n_experts=256, experts_per_token=8, shared_experts=1, d_expert=512),
    # 9B dense student, Qwen3-8B-like: 36 layers, d 4096, 32 / 8 heads of 128,
    # d_ff 14336, untied head, same vocabulary: 9.1B parameters.
    "dense-9b": PlanModel(name="dense-9b", vocab_size=151936, d_model=4096, n_layers=36,
                          n_heads=32, n_kv_heads=8, head_dim=128, d_ff=14336, tied_head=False),
}



def plan_model(name: str) -> PlanModel:
    """A planner preset, or any `hldstudy.model.presets` name."""
    if name in PLAN_PRESETS:
        return PLAN_PRESETS[name]
    if name in PRESETS:
        return PlanModel.from_model_config(PRESETS[name], name)
    raise ConfigError("preset", f"unknown model {name!r}",
                      f"choose one of {', '.join(sorted({**PLAN_PRESETS, **PRESETS}))}")
