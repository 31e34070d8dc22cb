"""HLDF's stage boundary (`train.stage_boundary`) and the alignment loss's form
(`distill.nmse`): restart (each stage its own optimizer and schedule) or continue (one
schedule, Adam's moments carried); batch or per-token NMSE."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from hldstudy.config import TrainConfig
from hldstudy.losses.hidden import normalized_mse
from hldstudy.train.optim import carry_moments, lr_schedule, make_optimizer


def _records(workdir):
    return [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]


def _params():
    return {"student": {"blocks": {"0": {"w": jnp.ones((2, 2))}, "1": {"w": jnp.ones((2, 2))}},
                        "final_norm": {"scale": jnp.ones(2)}},
            "aux": {"kernel": jnp.ones((2, 3))}}


def test_carry_keeps_the_trained_moments_and_the_count():
    """Stage 1 trains block 0 and the regressor; stage 2 everything. The carried state has
    stage 1's moments for block 0, zeros for what stage 1 froze, no regressor, its count."""
    params = _params()
    stage1 = make_optimizer(TrainConfig(), 10, trainable_layers=1)
    state = stage1.init(params)
    grads = jax.tree_util.tree_map(lambda x: 0.5 * jnp.ones_like(x), params)
    for _ in range(3):
        _, state = stage1.update(grads, state, params)
    params2 = {"student": params["student"], "aux": None}
    fresh = make_optimizer(TrainConfig(), 10).init(params2)
    carried = carry_moments(state, fresh)
    (_, mu), = optax.tree_utils.tree_get_all_with_path(carried, "mu")
    assert float(jnp.abs(mu["student"]["blocks"]["0"]["w"]).min()) > 0
    assert float(jnp.abs(mu["student"]["blocks"]["1"]["w"]).max()) == 0
    assert float(jnp.abs(mu["student"]["final_norm"]["scale"]).max()) == 0
    assert mu["aux"] is None
    counts = [int(c) for _, c in optax.tree_utils.tree_get_all_with_path(carried, "count")]
    assert counts and set(counts) == {3}
    assert jax.tree_util.tree_structure(carried) == jax.tree_util.tree_structure(fresh)


def _hldf(teacher_dir, tokenizer_path, boundary, steps=10):
    from helpers.runs import student_config

    return student_config("hldf", teacher_dir, steps=steps, tokenizer=tokenizer_path,
                          train={"stage_boundary": boundary, "warmup_steps": 2,
                                 "checkpoint_every": 1})


def test_continue_is_one_schedule_and_carries_the_moments(tmp_path, teacher_dir, tokenizer_path,
                                                          monkeypatch):
    from hldstudy.train import loop

    seen = []

    def spy(prev, fresh):  # test double: records what stage 2 starts from
        out = loop_carry(prev, fresh)
        seen.append(out)
        return out

    loop_carry = loop.carry_moments
    monkeypatch.setattr(loop, "carry_moments", spy)
    cfg = _hldf(teacher_dir, tokenizer_path, "continue")
    trainer = loop.Trainer(cfg, tmp_path / "c", devices=jax.devices()[:1])
    s1, s2 = trainer.plans
    trainer.run()
    recs = [r for r in _records(tmp_path / "c") if "lr" in r]
    lr = {r["step"]: r["lr"] for r in recs}
    assert set(lr) == set(range(1, s2.end + 1))  # logged at every step (log_every 1)
    schedule = lr_schedule(cfg.train, s2.end)
    steps_change = max(abs(float(schedule(c + 1)) - float(schedule(c))) for c in range(s2.end))
    assert abs(lr[s1.end + 1] - lr[s1.end]) <= steps_change + 1e-12
    assert lr[s1.end + 1] == pytest.approx(float(schedule(s1.end)))
    assert max(lr.values()) == pytest.approx(cfg.train.lr)  # one warm-up, one peak
    (_, mu), = optax.tree_utils.tree_get_all_with_path(seen[0], "mu")
    trained = trainer.strategy.trainable_student_layers(s1.stage)
    for path, leaf in jax.tree_util.tree_flatten_with_path(mu["student"]["blocks"])[0]:
        layer = path[0].key if hasattr(path[0], "key") else path[0].idx
        moved = float(jnp.abs(leaf).max()) > 0
        assert moved == (layer < trained), (jax.tree_util.keystr(path), trained)

    # restart: the second stage warms up again from zero, with fresh moments
    monkeypatch.setattr(loop, "carry_moments", loop_carry)
    loop.Trainer(_hldf(teacher_dir, tokenizer_path, "restart"), tmp_path / "r",
                 devices=jax.devices()[:1]).run()
    lr_r = {r["step"]: r["lr"] for r in _records(tmp_path / "r") if "lr" in r}
    assert lr_r[s1.end + 1] == pytest.approx(0.0)


def test_restart_is_the_default_and_trains_as_before(tmp_path, teacher_dir, tokenizer_path):
    """The default (restart) and an explicit restart train bitwise alike: the boundary
    option adds no operation to the run that does not ask for it."""
    from helpers.runs import student_config

    from hldstudy.train.loop import Trainer

    default = student_config("hldf", teacher_dir, steps=6, tokenizer=tokenizer_path)
    assert default.train.stage_boundary == "restart" and default.distill.nmse == "batch"
    Trainer(default, tmp_path / "d", devices=jax.devices()[:1]).run()
    Trainer(_hldf(teacher_dir, tokenizer_path, "restart", steps=6), tmp_path / "e",
            devices=jax.devices()[:1]).run()
    loss = [[r["loss"] for r in _records(tmp_path / w) if "loss" in r] for w in ("d", "e")]
    assert loss[0] and loss[0] == loss[1]


def test_token_nmse_is_the_mean_of_each_positions_ratio():
    rng = np.random.default_rng(0)
    pred, target = rng.normal(size=(2, 5, 4)), rng.normal(size=(2, 5, 4))
    target[0, 0] *= 100.0  # one high-norm position: it dominates the batch form only
    mask = np.ones((2, 5), bool)
    mask[1, 4] = False
    ratios = [np.sum((pred[b, t] - target[b, t]) ** 2) / np.sum(target[b, t] ** 2)
              for b in range(2) for t in range(5) if mask[b, t]]
    got = normalized_mse(jnp.asarray(pred), jnp.asarray(target), jnp.asarray(mask), form="token")
    assert float(got) == pytest.approx(np.mean(ratios), rel=1e-5)
    batch = normalized_mse(jnp.asarray(pred), jnp.asarray(target), jnp.asarray(mask))
    assert float(batch) == pytest.approx(np.sum((pred - target)[mask] ** 2)
                                         / np.sum(target[mask] ** 2), rel=1e-5)


def test_the_new_factors_are_sweep_axes():
    """Stage-1 share, stage boundary, NMSE form and hidden weight are grid axes, each
    applying to the methods it changes."""
    from hldstudy.config import grid_axes
    from hldstudy.distill.methods import applies

    axes = set(grid_axes())
    assert {"distill.hldf_stage1_share", "train.stage_boundary", "distill.nmse",
            "distill.hidden_weight"} <= axes
    assert applies("train.stage_boundary", "hldf") and not applies("train.stage_boundary", "kd")
    assert applies("distill.nmse", "hldc") and not applies("distill.nmse", "kd")
    assert applies("distill.hldf_stage1_share", "hldf")
    assert not applies("distill.hldf_stage1_share", "hldc")


def test_the_ablation_sweep_lists_its_grid(capsys):
    """sweeps/hldf_ablation.py: KD and 16 HLDF configurations (share x boundary x NMSE),
    3 seeds, 2 KD regimes: 102 runs, 17 configurations."""
    from hldstudy.sweep.__main__ import main as sweep_main

    assert sweep_main(["hldf_ablation", "--dry-run", "--json"]) == 0
    runs = json.loads(capsys.readouterr().out)
    assert len(runs) == 17 * 3 * 2
    configs = {(r["method"], *sorted((k, str(v)) for k, v in r["params"].items()
                                      if k not in ("train.seed", "distill.alpha")))
               for r in runs}
    assert len(configs) == 17
    assert {r["params"]["distill.alpha"] for r in runs} == {0.5, 0.9}
    assert {r["params"]["train.seed"] for r in runs} == {0, 1, 2}
