"""The teacher's attention path is the run's choice (`teacher.attention`), not only its
checkpoint's: a Qwen3.5-35B-A3B replica compiled with dense attention holds every layer's
4096 x 4096 scores per head (experiments/disaggkd_qwen35.py sets auto)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from hldstudy.config import Config, TeacherConfig, check_fields
from hldstudy.errors import ConfigError
from hldstudy.model import Transformer, preset
from hldstudy.teacher.colocated import ColocatedTeacher


def _inputs(b: int, t: int) -> dict:
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 512, (b, t), dtype=np.int32))
    return {"tokens": tokens, "positions": jnp.tile(jnp.arange(t, dtype=jnp.int32), (b, 1)),
            "segment_ids": jnp.ones((b, t), jnp.int32)}


def test_the_teacher_runs_the_attention_path_the_run_names():
    model = Transformer(preset("tiny-teacher", attention="dense"), rngs=nnx.Rngs(0))
    own = ColocatedTeacher(model, None)
    assert own.model_cfg.attention == "dense"  # unset: the checkpoint's own
    chunked = ColocatedTeacher(model, None, teacher=TeacherConfig(attention="chunked"))
    assert chunked.model_cfg.attention == "chunked"
    # Same weights, another path through the same math: the forward agrees to rounding
    # (T = 512 spans two of chunked's 256-token blocks, so its online softmax is exercised).
    inputs = _inputs(2, 512)
    want = jax.jit(own.forward_fn((), True))(own.params, inputs).final_hidden
    got = jax.jit(chunked.forward_fn((), True))(chunked.params, inputs).final_hidden
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-4, atol=2e-4)
    assert not np.array_equal(np.asarray(got), np.asarray(want))  # the chunked path did run


def test_a_teacher_attention_outside_the_choices_is_refused():
    with pytest.raises(ConfigError) as e:
        check_fields(Config(teacher=TeacherConfig(attention="flash")))
    assert "teacher.attention" in str(e.value) and "auto" in str(e.value)
