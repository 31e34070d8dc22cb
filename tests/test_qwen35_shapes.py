"""Qwen3.5 shapes: the closed-form parameter counts equal the modules' and transformers'."""

from __future__ import annotations

from pathlib import Path

import pytest
from flax import nnx

from hldstudy.config import validate_model
from hldstudy.model import Transformer, count_module_params, count_params, preset
from hldstudy.model.importers import hf_model_config
from hldstudy.shapes import ModelShape

FIXTURES = Path(__file__).parent / "fixtures" / "qwen35"
# Parameter counts transformers reported when it built the fixtures (make_qwen35_fixtures.py).
TRANSFORMERS_COUNTS = {"dense": 55152, "moe": 65008}


@pytest.mark.parametrize("kind", sorted(TRANSFORMERS_COUNTS))
def test_fixture_counts_equal_transformers_and_the_module(kind):
    cfg = hf_model_config(FIXTURES / kind)
    model = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
    assert count_params(cfg)["total"] == count_module_params(model) == TRANSFORMERS_COUNTS[kind]


@pytest.mark.parametrize("name", ["tiny-qwen", "tiny-qwen-moe"])
def test_tiny_presets_count_like_their_modules(name):
    cfg = preset(name)
    validate_model(cfg)
    model = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
    assert count_params(cfg)["total"] == count_module_params(model)


def test_real_presets_have_their_names_sizes():
    dense = ModelShape.from_model_config(preset("qwen3.5-9b"))
    moe = ModelShape.from_model_config(preset("qwen3.5-35b-a3b"))
    assert dense.total_params() == pytest.approx(8.95e9, rel=0.01)
    assert moe.total_params() == pytest.approx(34.66e9, rel=0.01)
    assert moe.active_params() == pytest.approx(3.45e9, rel=0.01)
    assert (dense.linear_layers, moe.linear_layers) == (24, 30)
    larger = ModelShape.from_model_config(preset("qwen3.5-122b-a10b"))
    assert larger.total_params() == pytest.approx(122e9, rel=0.01)
    assert larger.active_params() == pytest.approx(10e9, rel=0.03)
    assert (larger.n_layers, larger.linear_layers) == (48, 36)
