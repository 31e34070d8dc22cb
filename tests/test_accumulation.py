"""Gradient accumulation (`train.microbatches`): K micro-batches give the whole batch's
gradient and loss, for KD, HLDF stage 1 and HLDC, one run and a cohort, with the
teacher colocated (its forward run per micro-batch) or streamed."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers.programs import keep_grads, program_pieces

from hldstudy.config import Config, DataConfig, TrainConfig, validate
from hldstudy.errors import ConfigError
from hldstudy.model import preset
from hldstudy.train.program import Members, microbatch_candidates, train_program

B, T, VOCAB = 8, 32, 256
CASES = [("kd", "main"), ("hldf", "stage1"), ("hldc", "main")]


def _setup(method: str, stage: str):
    # Micro-batches with different numbers of valid tokens: the weighting must count them.
    return program_pieces(method, stage, preset("tiny", vocab_size=VOCAB),
                          preset("tiny-teacher", vocab_size=VOCAB), batch_size=B, seq_len=T,
                          uneven_mask=True)


def _close(a, b, rtol=1e-5):
    num = optax.global_norm(jax.tree_util.tree_map(lambda x, y: x - y, a, b))
    return float(num) <= rtol * float(optax.global_norm(b)), float(num / optax.global_norm(b))


@pytest.mark.parametrize("method,stage", CASES)
@pytest.mark.parametrize("layout", ["colocated", "streamed"])
def test_micro_batches_give_the_whole_batch_gradient(method, stage, layout):
    strategy, st, graphdefs, params, forward, t_params, batch = _setup(method, stage)
    opt = keep_grads()
    state = {"params": params, "opt_state": opt.init(params), "step": jnp.int32(0)}
    if layout == "colocated":
        teacher_in, fwd = t_params, forward
    else:  # what a replica streams: the teacher's outputs for the whole batch
        teacher_in, fwd = forward(t_params, batch), None
    out = {}
    for k in (1, 4):
        program = jax.jit(train_program(strategy, st, graphdefs, opt, fwd, microbatches=k))
        new, metrics, bad = program(state, batch, teacher_in, {}, jnp.int32(0))
        out[k] = (new["opt_state"], metrics)
        assert int(bad) == 0
    ok, rel = _close(out[4][0], out[1][0])
    assert ok, f"accumulated gradient differs from the whole batch's by {rel:.2e} (relative)"
    for name, value in out[1][1].items():
        assert float(out[4][1][name]) == pytest.approx(float(value), rel=1e-5, abs=1e-7), name


@pytest.mark.parametrize("method,stage", CASES)
def test_a_cohort_accumulates_each_member_like_its_solo_run(method, stage):
    strategy, st, graphdefs, params, forward, t_params, batch = _setup(method, stage)
    opt = keep_grads()
    state = {"params": params, "opt_state": opt.init(params), "step": jnp.int32(0)}
    solo = jax.jit(train_program(strategy, st, graphdefs, opt, forward))
    want, want_metrics, _ = solo(state, batch, t_params, {}, jnp.int32(0))
    states = jax.tree_util.tree_map(lambda x: jnp.stack([x, x]), state)
    cohort = jax.jit(train_program(strategy, st, graphdefs, opt, forward,
                                   Members(lambda lr: opt, "map"), microbatches=2))
    got, metrics, bad = cohort(states, batch, t_params, {}, jnp.zeros((2,), jnp.int32))
    for j in range(2):
        ok, rel = _close(jax.tree_util.tree_map(lambda x, j=j: x[j], got["opt_state"]),
                         want["opt_state"])
        assert ok, f"member {j}: {rel:.2e}"
        assert float(metrics["loss"][j]) == pytest.approx(float(want_metrics["loss"]), rel=1e-5)


def test_one_micro_batch_is_the_step_as_it_was():
    """microbatches=1 builds the program as before accumulation existed: bitwise."""
    strategy, st, graphdefs, params, forward, t_params, batch = _setup("hldc", "main")
    opt = optax.adamw(1e-3)
    state = {"params": params, "opt_state": opt.init(params), "step": jnp.int32(0)}
    a = jax.jit(train_program(strategy, st, graphdefs, opt, forward))
    b = jax.jit(train_program(strategy, st, graphdefs, opt, forward, microbatches=1))
    ta, tb = (jax.make_jaxpr(p)(state, batch, t_params, {}, jnp.int32(0)) for p in (a, b))
    assert str(ta) == str(tb)


def test_micro_batches_that_do_not_divide_the_batch_are_refused():
    cfg = Config(data=DataConfig(batch_size=8), train=TrainConfig(microbatches=3))
    with pytest.raises(ConfigError) as e:
        validate(cfg)
    assert e.value.field == "train.microbatches" and "divide" in str(e.value)


def test_auto_tries_the_fewest_micro_batches_that_split_over_the_devices():
    assert microbatch_candidates(0, 16, 4) == [1, 2, 4]  # 4 rows per device
    assert microbatch_candidates(0, 8, 1) == [1, 2, 4, 8]
    assert microbatch_candidates(2, 16, 4) == [2]


def test_micro_batches_that_do_not_split_over_the_devices_are_refused():
    """8 sequences over 8 devices in 4 micro-batches: 2 sequences each, so 6 devices would
    compute rows that are not theirs. Refused, naming the field and the divisors."""
    with pytest.raises(ConfigError) as e:
        microbatch_candidates(4, 8, 8)
    assert e.value.field == "train.microbatches"
    assert "2 sequences each for 8 devices" in str(e.value) and "divisor of 1" in str(e.value)


def test_a_strategy_without_micro_batches_is_named():
    """A method's own strategy whose loss() takes no `whole` is refused for K > 1."""
    strategy, st, graphdefs, params, forward, _, _ = _setup("kd", "main")

    class WholeOnly(type(strategy)):
        def loss(self, stage, student, aux, batch, teacher):
            return super().loss(stage, student, aux, batch, teacher)

    strategy.__class__ = WholeOnly
    with pytest.raises(ConfigError) as e:
        train_program(strategy, st, graphdefs, keep_grads(), forward, microbatches=2)
    assert e.value.field == "train.microbatches" and "WholeOnly" in str(e.value)


def _metric(workdir, key):
    recs = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    return [r[key] for r in recs if key in r and "stage" in r]


@pytest.mark.slow
def test_a_run_in_micro_batches_trains_like_the_whole_batch(tmp_path, teacher_dir,
                                                           tokenizer_path):
    """HLDC through the trainer, colocated teacher: the losses of 2 micro-batches a step
    follow the whole batch's (the same gradients, up to float32 sums in another order).
    Slow (two trainer runs); the default suite covers the same programs in
    test_micro_batches_give_the_whole_batch_gradient and the trainer's path in
    test_auto_trains_in_micro_batches_when_the_whole_batch_does_not_fit."""
    from helpers.runs import student_config

    from hldstudy.train.loop import Trainer

    losses = {}
    for k in (1, 2):
        cfg = student_config("hldc", teacher_dir, steps=4, tokenizer=tokenizer_path,
                             train={"microbatches": k})
        Trainer(cfg, tmp_path / f"k{k}", devices=jax.devices()[:1]).run()
        losses[k] = _metric(tmp_path / f"k{k}", "loss")
    assert len(losses[1]) == len(losses[2]) > 0
    np.testing.assert_allclose(losses[2], losses[1], rtol=1e-4)


def test_auto_trains_in_micro_batches_when_the_whole_batch_does_not_fit(
        tmp_path, teacher_dir, tokenizer_path, monkeypatch, capsys):
    """A test double of the fit check refuses the one-micro-batch step: auto compiles the
    next candidate, says so, and the run trains; a fixed count is refused in one line."""
    from helpers.runs import student_config

    from hldstudy.errors import RuntimeFault
    from hldstudy.train import loop

    tried = []
    real = loop.check_fits

    def refuse_the_whole_batch(compiled, mesh, cfg, stage="", hint=""):
        tried.append(hint)
        if len(tried) == 1:
            raise RuntimeFault(f"the train step ({stage}) does not fit{hint}")
        return real(compiled, mesh, cfg, stage, hint)

    monkeypatch.setattr(loop, "check_fits", refuse_the_whole_batch)
    cfg = student_config("kd", teacher_dir, steps=2, tokenizer=tokenizer_path)
    result = loop.Trainer(cfg, tmp_path / "auto", devices=jax.devices()[:1]).run()
    assert result["status"] == "done" and len(tried) == 2
    assert "in 2 micro-batches of" in capsys.readouterr().err

    tried.clear()
    fixed = student_config("kd", teacher_dir, steps=2, tokenizer=tokenizer_path,
                           train={"microbatches": 2})
    with pytest.raises(RuntimeFault) as e:
        loop.Trainer(fixed, tmp_path / "fixed", devices=jax.devices()[:1]).run()
    assert "train.microbatches, now 2" in str(e.value) and len(tried) == 1
