"""The Qwen3.5 experiments: the DisaggKD pair at its real shapes works with the dry run,
the FLOP CLI and the planner without weights or data; the tiny CPU pair is a Qwen3.5 MoE
teacher and a dense Qwen3.5 student sharing a vocabulary."""

from __future__ import annotations

import dataclasses
import json

import pytest

from hldstudy.cli_common import EXPERIMENTS
from hldstudy.commands.flops import main as flops_main
from hldstudy.commands.plan import main as plan_main
from hldstudy.config import apply_overrides, load_experiment, validate
from hldstudy.flops import step_flops, xla_count_is_complete
from hldstudy.model.presets import preset
from hldstudy.sweep.__main__ import main as sweep_main

DISAGG = EXPERIMENTS / "disaggkd_qwen35.py"
NO_DATA = "data.path=/nonexistent/tfds"


def test_disaggkd_pair_is_the_real_qwen35_shapes():
    cfg = load_experiment(DISAGG)
    assert cfg.model == preset("qwen3.5-9b", dtype="bfloat16", remat=True, scan_layers=True,
                               attention="auto")
    # Both sides run the target's fused attention: a dense layer of either holds its
    # 4096 x 4096 scores per head.
    assert cfg.teacher.attention == "auto" and cfg.teacher.dtype == "bfloat16"
    assert cfg.distill.method == "kd" and cfg.data.seq_len == 4096
    assert cfg.model.vocab_size == preset("qwen3.5-35b-a3b").vocab_size == 248320


def test_disaggkd_flop_cli_without_weights(capsys):
    assert flops_main(["--config", str(DISAGG), "--set", NO_DATA, "--teacher-preset",
                       "qwen3.5-35b-a3b", "--layout", "disaggregated", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    cfg = apply_overrides(load_experiment(DISAGG), [NO_DATA])
    bd = step_flops(cfg, "kd", "main", preset("qwen3.5-35b-a3b"))
    assert out["analytic_flops_per_step"] == bd.total
    assert out["hardware_flops_per_step"] == bd.hardware_flops("disaggregated")
    tokens = 256 * 4096
    # Student: ~6 x 8.95B parameters (embedding excluded, head included) per token, the
    # teacher's forward ~2 x its 3.45B active parameters (embedding excluded).
    assert 5.5 * 7.9e9 < bd.total / tokens < 6.5 * 8.0e9
    assert 2 * 2.9e9 < bd.teacher / tokens < 2 * 3.45e9 * 1.1


def test_disaggkd_dry_run_and_planner_without_weights(capsys):
    assert sweep_main([str(DISAGG), "--dry-run", "--json"]) == 0
    (run,) = json.loads(capsys.readouterr().out)
    assert run["method"] == "kd" and run["steps"] == 10_000
    # the file's docstring commands: its cell on 8 H200s (aot's planner), the link from presets
    assert plan_main(["--config", str(DISAGG), "--target", "h200:8", "--json"]) == 0
    cell = json.loads(capsys.readouterr().out)
    assert cell["colocated"]["fits"] and cell["disaggregated"]["verdict"] == "fits"
    assert cell["disaggregated"]["logits_need_gbps"] / cell["disaggregated"]["need_gbps"] == \
        pytest.approx(248320 / 2048)
    assert plan_main(["--teacher", "qwen3.5-35b-a3b", "--student", "qwen3.5-9b",
                      "--tokens-per-step", "1048576", "--seq-len", "4096", "--devices", "64",
                      "--link", "400", "--remat", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert not r["disaggregated"]["network_bound"]
    assert r["network_bytes_per_step"]["logits_over_hidden"] == pytest.approx(248320 / 2048)


def test_tiny_qwen_pair_shares_a_vocabulary():
    teacher = load_experiment(EXPERIMENTS / "tiny_qwen_teacher.py")
    student = load_experiment(EXPERIMENTS / "tiny_qwen_distill.py")
    assert teacher.model == preset("tiny-qwen-moe") and student.model == preset("tiny-qwen")
    assert teacher.model.n_experts and not student.model.n_experts
    assert teacher.model.vocab_size == student.model.vocab_size == \
        student.data.tokenizer_vocab_size
    for cfg in (teacher, student):
        validate(cfg, check_paths=False, need_teacher=False)


def test_tiny_qwen_flop_cli_warns_about_the_chunk_loop(capsys):
    path = str(EXPERIMENTS / "tiny_qwen_distill.py")
    assert flops_main(["--config", path, "--teacher-preset", "tiny-qwen-moe", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["method"] == "kd" and out["analytic_flops_per_step"] > 0
    cfg = load_experiment(path)  # seq_len 128 > chunk 32: XLA would count one chunk
    assert not xla_count_is_complete(cfg, "kd", "main", preset("tiny-qwen-moe"))
    one_chunk = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, seq_len=32,
                                                                  batch_size=1))
    assert xla_count_is_complete(one_chunk, "kd", "main", preset("tiny-qwen-moe"))
