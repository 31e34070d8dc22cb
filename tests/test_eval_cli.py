"""`python -m hldstudy.eval`: all six paper tasks offline on the fixtures, the Python
API, and one-line errors (exit 2) for what a user can get wrong."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from hldstudy.eval.__main__ import main
from hldstudy.eval.tasks import FIXTURES_DIR, PAPER_TASKS, SCHEMAS
from hldstudy.eval.testing import tiny_run_dir

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    return tiny_run_dir(tmp_path_factory.mktemp("evalrun") / "run")


@pytest.fixture(autouse=True)
def _local_hf_cache(tmp_path_factory, monkeypatch):
    # datasets' json builder writes Arrow caches; keep them out of the home directory.
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path_factory.getbasetemp() / "hf"))
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("HLDSTUDY_EVAL_DATA", raising=False)


def _error_line(capsys, argv) -> str:
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    # In-process, progress bars of libraries imported earlier may precede it.
    lines = capsys.readouterr().err.strip().splitlines()
    assert [ln for ln in lines if "error" in ln] == lines[-1:], lines
    assert lines[-1].startswith("python -m hldstudy.eval: error: ")
    return lines[-1]


def test_fixtures_are_in_each_tasks_schema():
    for task in PAPER_TASKS:
        lines = (FIXTURES_DIR / f"{task}.jsonl").read_text().splitlines()
        assert 2 <= len(lines) <= 10
        for line in lines:
            assert set(SCHEMAS[task]) <= set(json.loads(line))


def test_cli_runs_the_six_tasks_offline(run_dir, tmp_path):
    out = tmp_path / "eval" / "results.json"
    tasks = ",".join(PAPER_TASKS + ("synth_mc", "synth_cloze", "synthetic_ppl"))
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "WANDB_MODE": "disabled",
           "XLA_FLAGS": "--xla_force_host_platform_device_count=1"}
    proc = subprocess.run(
        [sys.executable, "-m", "hldstudy.eval", "--checkpoint", str(run_dir), "--tasks", tasks,
         "--limit", "4", "--batch-size", "4", "--offline-data", str(FIXTURES_DIR),
         "--out", str(out), "--no-progress"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(out.read_text())
    assert list(res) == list(tasks.split(","))
    for t in ("hellaswag", "piqa", "arc_easy", "synth_mc"):
        assert {"acc", "acc_stderr", "acc_norm", "acc_norm_stderr"} <= set(res[t])
        assert 0 <= res[t]["acc"] <= 1
    assert {"acc", "acc_stderr"} <= set(res["winogrande"])
    for t in ("lambada_openai", "synth_cloze"):
        assert {"acc", "perplexity"} <= set(res[t]) and res[t]["perplexity"] > 1
    assert {"word_perplexity", "byte_perplexity", "bits_per_byte"} <= set(res["wikitext"])
    assert res["synthetic_ppl"]["perplexity"] > 1 and res["synthetic_ppl"]["tokens"] > 0
    assert not any("," in m for ms in res.values() for m in ms)  # ",none" stripped
    md = (out.parent / "results.md").read_text()
    assert "| wikitext | word_perplexity |" in md and "| piqa | acc |" in md
    meta = json.loads((out.parent / "results.meta.json").read_text())
    assert meta["samples"]["hellaswag"] == 4 and meta["samples"]["wikitext"] == 2
    assert meta["max_length"] == 64 and meta["prefix_token_id"] == 1  # EOS: no add_bos
    assert "| hellaswag | acc |" in proc.stdout


def test_python_api_and_env_var(run_dir, tmp_path, monkeypatch):
    from hldstudy.eval import evaluate

    monkeypatch.setenv("HLDSTUDY_EVAL_DATA", str(FIXTURES_DIR))
    res = evaluate(run_dir, ["piqa", "synthetic_ppl"], limit=2, batch_size=4,
                   out=tmp_path / "r.json", wandb=True, progress=False)
    assert set(res) == {"piqa", "synthetic_ppl"}
    assert json.loads((tmp_path / "r.json").read_text()) == res
    assert all(isinstance(v, float) for ms in res.values() for v in ms.values())


def test_unknown_task_and_unavailable_corpus(capsys, monkeypatch, run_dir):
    err = _error_line(capsys, ["--checkpoint", str(run_dir), "--tasks", "hellaswag,nosuchtask",
                               "--offline-data", str(FIXTURES_DIR)])
    assert "'nosuchtask'" in err and "hellaswag" in err
    err = _error_line(capsys, ["--checkpoint", str(run_dir), "--tasks", "arc_challenge",
                               "--offline-data", str(FIXTURES_DIR)])
    assert "'arc_challenge': no eval/overrides/<task>.yaml" in err
    monkeypatch.delenv("HLDSTUDY_C4_DIR", raising=False)
    monkeypatch.delenv("TFDS_DATA_DIR", raising=False)
    err = _error_line(capsys, ["--checkpoint", str(run_dir), "--tasks", "c4_ppl"])
    assert "c4_ppl: no TFDS data_dir" in err


def test_missing_offline_file_and_bad_schema(capsys, tmp_path, run_dir):
    shutil.copy(FIXTURES_DIR / "piqa.jsonl", tmp_path / "piqa.jsonl")
    err = _error_line(capsys, ["--checkpoint", str(run_dir), "--tasks", "piqa,hellaswag",
                               "--offline-data", str(tmp_path)])
    assert f"{tmp_path / 'hellaswag.jsonl'}: missing offline data" in err
    (tmp_path / "hellaswag.jsonl").write_text(json.dumps({"ctx": "x", "endings": []}) + "\n")
    err = _error_line(capsys, ["--checkpoint", str(run_dir), "--tasks", "hellaswag",
                               "--offline-data", str(tmp_path)])
    assert "lacks ctx_a, ctx_b, activity_label, label" in err


def test_checkpoint_without_tokenizer(capsys, tmp_path, run_dir):
    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copy(run_dir / "config.json", bare / "config.json")
    shutil.copytree(run_dir / "checkpoints", bare / "checkpoints")
    err = _error_line(capsys, ["--checkpoint", str(bare), "--tasks", "synthetic_ppl"])
    assert "has no tokenizer" in err and "tokenizer.model" in err
    err = _error_line(capsys, ["--checkpoint", str(tmp_path / "nope"), "--tasks", "piqa"])
    assert "does not exist" in err


def test_sequence_longer_than_the_model(capsys, tmp_path, run_dir):
    # A LAMBADA item whose last word alone is longer than the model's 64 tokens.
    word = "".join(chr(0x4E00 + i) for i in range(80))  # byte-fallback: several tokens each
    (tmp_path / "lambada_openai.jsonl").write_text(json.dumps({"text": f"It was {word}"}) + "\n")
    err = _error_line(capsys, ["--checkpoint", str(run_dir), "--tasks", "lambada_openai",
                               "--offline-data", str(tmp_path), "--no-progress"])
    assert "does not fit the model length 64" in err and "loglikelihood_rolling" in err


@pytest.mark.slow
def test_valid_ppl_equals_the_trainers_validation(tmp_path):
    """A trained run's valid_ppl over the trainer's validation batches is its valid_nll."""
    import jax
    from helpers.runs import VOCAB, data_config, train_config

    from hldstudy.config import Config
    from hldstudy.eval import evaluate
    from hldstudy.model import preset
    from hldstudy.train.loop import Trainer

    cfg = Config(name="t", model=preset("tiny", vocab_size=VOCAB), data=data_config(),
                 train=train_config(4, warmup_steps=1))
    Trainer(cfg, tmp_path / "run", devices=jax.devices()[:1]).run()
    want = json.loads((tmp_path / "run" / "results.json").read_text())
    got = evaluate(tmp_path / "run", ["valid_ppl"], limit=16, progress=False)["valid_ppl"]
    assert got["tokens"] == want["valid_tokens"]
    assert got["nll"] == pytest.approx(want["valid_nll"], rel=1e-5)
