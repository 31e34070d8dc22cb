"""Mixed precision: bfloat16 parameters train on float32 master weights and optimizer
state, and an optimizer handed bfloat16 parameters (no master copy) is refused."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers.runs import VOCAB, data_config, losses, train_config

from hldstudy.config import Config, TrainConfig
from hldstudy.errors import ConfigError
from hldstudy.model import Transformer, preset
from hldstudy.train.loop import Trainer
from hldstudy.train.optim import make_optimizer
from hldstudy.train.step import split_params

STEPS = 6
# bfloat16 keeps 8 bits of mantissa (relative rounding 2^-8 = 3.9e-3): over 6 steps of
# the tiny model the loss of a bfloat16-parameter, bfloat16-compute run stays within
# 5e-3 of the float32 run's (measured 3.6e-4).
RTOL = 5e-3


def _cfg(tokenizer=None, **model) -> Config:
    return Config(name="mp", model=preset("tiny", vocab_size=VOCAB, **model),
                  data=data_config(tokenizer), train=train_config(STEPS, checkpoint_every=0))


def _losses(workdir) -> list[float]:
    return [loss for _, loss in sorted(losses(workdir).items())]


def _dtypes(tree) -> set[str]:
    return {str(x.dtype) for x in jax.tree_util.tree_leaves(tree)
            if jnp.issubdtype(x.dtype, jnp.floating)}


def test_bf16_params_keep_float32_masters_and_track_float32(tmp_path, tokenizer_path):
    f32 = _cfg(tokenizer_path)
    bf16 = _cfg(tokenizer_path, dtype="bfloat16", param_dtype="bfloat16")
    one = jax.devices()[:1]
    Trainer(f32, tmp_path / "f32", devices=one).run()
    trainer = Trainer(bf16, tmp_path / "bf16", devices=one)
    seen = {}
    finish = trainer._finish

    def spy(graphdefs, state, *args):  # the trained state, as the loop hands it to _finish
        seen["graphdefs"], seen["state"] = graphdefs, state
        return finish(graphdefs, state, *args)

    trainer._finish = spy
    result = trainer.run()
    assert seen["graphdefs"].param_dtype == "bfloat16"
    state = seen["state"]
    assert _dtypes(state["params"]) == {"float32"}  # the master copy
    assert _dtypes(state["opt_state"]) == {"float32"}  # Adam's moments
    # The forward ran in bfloat16: the losses differ from float32's, but track them.
    lf32, lbf16 = _losses(tmp_path / "f32"), _losses(tmp_path / "bf16")
    assert len(lf32) == len(lbf16) == STEPS
    assert lf32 != lbf16
    rel = np.max(np.abs(np.subtract(lbf16, lf32)) / np.abs(lf32))
    print(f"bf16 params + compute vs float32, {STEPS} steps: max relative loss difference "
          f"{rel:.2e} (tolerance {RTOL:g})")
    np.testing.assert_allclose(lbf16, lf32, rtol=RTOL)
    assert lbf16[-1] < lbf16[0]
    assert np.isfinite(result["valid_nll"])

    # The checkpoint holds the float32 masters; a bfloat16 model loads from it.
    from hldstudy.model.loading import load_run_model

    cfg, model, _, _ = load_run_model(tmp_path / "bf16")
    assert cfg.model.param_dtype == "bfloat16"
    assert _dtypes(nnx.state(model, nnx.Param)) == {"bfloat16"}


def test_optimizer_refuses_bf16_params_without_a_master_copy():
    cfg = dataclasses.replace(preset("tiny", vocab_size=VOCAB), param_dtype="bfloat16")
    student = Transformer(cfg, rngs=nnx.Rngs(0))
    raw = nnx.split(student, nnx.Param)[1]  # bfloat16, as the model declares them
    assert _dtypes(raw) == {"bfloat16"}
    optimizer = make_optimizer(TrainConfig(steps=4))
    with pytest.raises(ConfigError) as e:
        optimizer.init({"student": raw, "aux": None})
    msg = str(e.value)
    assert "model.param_dtype" in msg and "master" in msg and "float32" in msg
    assert len(msg.splitlines()) == 1
    # Through split_params the same model trains on float32 masters.
    graphdefs, params = split_params(student, None)
    assert graphdefs.param_dtype == "bfloat16" and _dtypes(params) == {"float32"}
    assert _dtypes(optimizer.init(params)) == {"float32"}
