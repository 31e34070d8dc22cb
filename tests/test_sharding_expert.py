"""The mesh's expert axis: MoE expert weights (and their optimizer moments) split along
their experts over it and FSDP over the fsdp axis; a tiny MoE student's training on a
1x2x2 (data x fsdp x expert) mesh gives the losses of one device; an expert axis that does
not divide the experts is refused naming train.mesh_expert."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from hldstudy.config import Config, DataConfig, TrainConfig, validate
from hldstudy.errors import ConfigError
from hldstudy.model.moe import MoE
from hldstudy.model.presets import preset
from hldstudy.sharding import batch_sharding, make_mesh, param_spec, tree_shardings
from hldstudy.train.loop import Trainer

EXPERT_WEIGHTS = ("gate", "up", "down")


def _cfg(**train) -> Config:
    # Two blocks (a DeltaNet and a gated-attention one), each with an 8-expert MoE.
    model = preset("tiny-qwen-moe", vocab_size=384, n_layers=2, deltanet_chunk=16,
                   router_aux_weight=0.05)
    return Config(
        name="moe-mesh", model=model,
        data=DataConfig(seq_len=32, batch_size=4, tokenizer_vocab_size=384, synthetic_docs=200,
                        synthetic_valid_docs=20),
        train=TrainConfig(steps=3, lr=3e-3, warmup_steps=1, log_every=1, checkpoint_every=0,
                          eval_batches=1, progress=False, **train))


def _losses(workdir: Path) -> list[float]:
    recs = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in sorted((r for r in recs if "loss" in r), key=lambda r: r["step"])]


def test_expert_weight_spec_puts_experts_on_the_expert_axis_and_fsdp_elsewhere():
    assert param_spec((8, 96, 64), fsdp_size=2, expert_size=2, expert_dim=0) == \
        P("expert", "fsdp", None)
    # FSDP never takes the expert dimension, even when it is the largest.
    assert param_spec((128, 6, 4), fsdp_size=2, expert_size=4, expert_dim=0) == \
        P("expert", "fsdp", None)
    assert param_spec((8, 96, 64), fsdp_size=1, expert_size=2, expert_dim=0) == \
        P("expert", None, None)
    # A dense weight ignores the expert axis (replicated over it); unchanged FSDP rule.
    assert param_spec((96, 64), fsdp_size=2, expert_size=2) == P("fsdp", None)
    assert param_spec((8, 96, 64), fsdp_size=1, expert_size=1, expert_dim=0) == P()
    with pytest.raises(ConfigError, match="train.mesh_expert"):
        param_spec((6, 96, 64), fsdp_size=1, expert_size=4, expert_dim=0)


def test_mesh_has_an_expert_axis_and_minus_one_takes_the_rest():
    devices = jax.devices()[:4]
    mesh = make_mesh(_cfg(mesh_expert=2).train, devices)
    assert mesh.shape == {"data": 2, "fsdp": 1, "expert": 2}
    assert make_mesh(_cfg().train, devices).shape == {"data": 4, "fsdp": 1, "expert": 1}
    with pytest.raises(ConfigError, match="train.mesh_data"):
        make_mesh(_cfg(mesh_data=1, mesh_fsdp=1, mesh_expert=2).train, devices)


@pytest.mark.parametrize("n_experts, axis", [(8, 3), (6, 4)])
def test_expert_axis_not_dividing_n_experts_is_refused_naming_the_field(n_experts, axis):
    cfg = _cfg(mesh_expert=axis)
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, n_experts=n_experts))
    with pytest.raises(ConfigError, match="train.mesh_expert") as err:
        validate(cfg)
    assert "model.n_experts" in str(err.value)


def test_moe_layer_loss_and_grads_on_an_expert_mesh_match_one_device():
    """The layer alone (quick): loss and every parameter's gradient, params placed by
    tree_shardings on a 1x2x2 mesh, against one device."""
    cfg = _cfg(mesh_data=1, mesh_fsdp=2, mesh_expert=2)
    graphdef, params = nnx.split(MoE(cfg.model, nnx.Rngs(0)), nnx.Param)
    x = jax.random.normal(jax.random.key(1), (4, 16, cfg.model.d_model), jnp.float32)

    def loss(params, x):
        out, aux, _ = nnx.merge(graphdef, params)(x)
        return jnp.mean(jnp.square(out)) + 0.05 * aux

    step = jax.jit(jax.value_and_grad(loss))
    ref_loss, ref_grads = step(params, x)
    mesh = make_mesh(cfg.train, jax.devices()[:4])
    placed = jax.device_put(params, tree_shardings(mesh, params))
    assert placed["gate"].sharding.spec == P("expert", "fsdp", None)
    assert placed["gate"].addressable_shards[0].data.shape == (4, cfg.model.d_model // 2,
                                                                 cfg.model.d_expert)
    got_loss, got_grads = step(placed, jax.device_put(x, batch_sharding(mesh)))
    np.testing.assert_allclose(float(got_loss), float(ref_loss), rtol=1e-5)
    for (path, g), r in zip(jax.tree_util.tree_leaves_with_path(got_grads),
                            jax.tree_util.tree_leaves(ref_grads), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-4,
                                   atol=1e-6 * float(np.max(np.abs(r))),
                                   err_msg=jax.tree_util.keystr(path))


@pytest.mark.slow  # ~60 s of CPU: two trainers of a Qwen3.5 MoE student
def test_moe_training_on_an_expert_mesh_matches_one_device(tmp_path):
    assert len(jax.devices()) >= 4, "conftest sets 4 host devices"
    cfg = _cfg()
    Trainer(cfg, tmp_path / "one", devices=jax.devices()[:1]).run()
    sharded = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, mesh_data=1,
                                                                 mesh_fsdp=2, mesh_expert=2))
    trainer = Trainer(sharded, tmp_path / "mesh", devices=jax.devices()[:4])
    assert trainer.mesh.shape == {"data": 1, "fsdp": 2, "expert": 2}

    # The placed training state: every expert weight and its Adam moments split over the
    # expert axis (each device holds 4 of the 8 experts) and FSDP over the fsdp axis.
    _, _, state, _ = trainer._init_state(trainer.plans[0])
    leaves = jax.tree_util.tree_leaves_with_path(state)
    experts = [(jax.tree_util.keystr(p), x) for p, x in leaves
               if any(f"['mlp']['{w}']" in jax.tree_util.keystr(p) for w in EXPERT_WEIGHTS)]
    assert len(experts) == 2 * 3 * 3  # 2 blocks x 3 weights x (param, mu, nu)
    for name, x in experts:
        spec = tuple(x.sharding.spec)
        assert spec[0] == "expert" and spec.count("fsdp") == 1, (name, spec)
        shard = [n // 2 if axis else n for n, axis in zip(x.shape, spec, strict=True)]
        assert x.addressable_shards[0].data.shape == tuple(shard) == (4, *shard[1:]), name
    router = [x for p, x in leaves if "['mlp']['router']" in jax.tree_util.keystr(p)]
    assert router and all("expert" not in x.sharding.spec for x in router)

    trainer.run()
    one, mesh = _losses(tmp_path / "one"), _losses(tmp_path / "mesh")
    assert len(one) == len(mesh) == 3
    # Reductions are split across devices, so float32 sums differ in order only.
    np.testing.assert_allclose(mesh, one, rtol=2e-5)
