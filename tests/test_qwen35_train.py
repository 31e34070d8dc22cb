"""A Qwen3.5 MoE student trains through the one loop: the router's load-balancing loss is
in its objective (model.router_aux_weight), and routing is deterministic so a resumed run
is bitwise the uninterrupted one."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import pytest

from hldstudy.config import Config, DataConfig, TrainConfig
from hldstudy.model.presets import preset
from hldstudy.train.loop import Interrupted, Trainer

WEIGHT = 0.05


def _cfg() -> Config:
    return Config(
        name="qwen", model=preset("tiny-qwen-moe", vocab_size=384, router_aux_weight=WEIGHT,
                                  deltanet_chunk=16),
        data=DataConfig(seq_len=48, batch_size=4, tokenizer_vocab_size=384, synthetic_docs=300,
                        synthetic_valid_docs=20),
        train=TrainConfig(steps=4, lr=3e-3, warmup_steps=1, log_every=1, checkpoint_every=2,
                          eval_batches=1, progress=False))


def _records(workdir: Path) -> dict[int, dict]:
    lines = (workdir / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r for r in map(json.loads, lines) if "loss" in r}


@pytest.mark.slow
def test_moe_student_trains_with_router_loss_and_resumes_bitwise(tmp_path):
    cfg = _cfg()
    one = jax.devices()[:1]
    Trainer(cfg, tmp_path / "full", devices=one).run()
    with pytest.raises(Interrupted):
        Trainer(cfg, tmp_path / "split", devices=one).run(stop_at_step=2)
    Trainer(cfg, tmp_path / "split", devices=one).run()
    full, split = _records(tmp_path / "full"), _records(tmp_path / "split")
    assert sorted(full) == [1, 2, 3, 4]
    assert {s: r["loss"] for s, r in full.items()} == {s: r["loss"] for s, r in split.items()}
    for r in full.values():
        assert r["router_aux"] >= 1.0 - 1e-6  # E sum f P >= 1 (1 = perfectly balanced)
        assert r["loss"] == pytest.approx(r["nll"] + WEIGHT * r["router_aux"], rel=1e-6)
