"""Nothing lost, round three: the faults and messages of issue 32, one test each (the
disk-full save is in test_reliability.py, beside the other failed saves; the coordinator's
wait and the replica's counters beside theirs)."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from hldstudy.eval.testing import init_model, tiny_config, tiny_run_dir

ROOT = Path(__file__).resolve().parent.parent


# --------------------------------------------------------------------------- #
# A finite but huge loss: perplexity reported as inf (null in JSON) with a note
# --------------------------------------------------------------------------- #


def _huge_loss_run(directory: Path) -> Path:
    """A run whose checkpoint holds finite weights with a huge validation loss (the final
    norm's scale x 1e4: logits of ~1e4, NLL of thousands of nats a token)."""
    from flax import nnx

    from hldstudy.checkpoint import Checkpointer

    cfg = tiny_config()
    tiny_run_dir(directory, cfg)
    model = init_model(cfg.model, 0)
    state = nnx.state(model, nnx.Param)
    scale = state["final_norm"]["scale"]
    scale.value = (scale.value + 1.0) * 1e4
    shutil.rmtree(directory / "checkpoints")
    ck = Checkpointer(directory / "checkpoints", keep=2)
    ck.save(1, {"params": {"student": state}}, {"step": 1})
    ck.close()
    return directory


def test_a_huge_loss_checkpoint_reports_infinite_perplexity(tmp_path, capsys):
    from hldstudy.eval.__main__ import main

    run = _huge_loss_run(tmp_path / "run")
    out = tmp_path / "results.json"
    assert main(["--checkpoint", str(run), "--tasks", "valid_ppl", "--out", str(out),
                 "--limit", "2", "--no-progress"]) == 0
    saved = json.loads(out.read_text())["valid_ppl"]
    assert saved["perplexity"] is None and "inf" in saved["note"]
    assert saved["nll"] > 709 and math.isfinite(saved["nll"])
    assert "Traceback" not in capsys.readouterr().err


# --------------------------------------------------------------------------- #
# eval --checkpoints goes on past an entry it cannot evaluate
# --------------------------------------------------------------------------- #


def test_eval_checkpoints_evaluates_what_it_can_and_exits_non_zero(tmp_path, capsys):
    from hldstudy.eval.__main__ import main

    cfg = tiny_config()
    runs = [tiny_run_dir(tmp_path / "sweep" / f"run{i}", cfg, seed=i) for i in range(3)]
    shutil.rmtree(runs[1] / "checkpoints" / "1" / "state")  # a damaged entry in the middle
    with pytest.raises(SystemExit) as e:
        main(["--checkpoints", str(tmp_path / "sweep"), "--tasks", "synthetic_ppl",
              "--limit", "2", "--no-progress", "--out-dir", str(tmp_path / "out")])
    assert e.value.code == 2
    cap = capsys.readouterr()
    assert "| run0 |" in cap.out and "| run2 |" in cap.out and "run1 (failed" in cap.out
    err = [ln for ln in cap.err.splitlines() if ln.strip()]
    assert any("run1" in ln and "could not be evaluated" in ln and "going on" in ln
               for ln in err)
    assert err[-1].startswith("python -m hldstudy.eval: error: 1 of 3 checkpoints could not "
                              "be evaluated: run1: ")
    table = json.loads((tmp_path / "out" / "table.json").read_text())
    assert [("error" in r) for r in table["rows"]] == [False, True, False]
    for i in (0, 2):
        assert (tmp_path / "out" / f"run{i}" / "results.json").is_file()


# --------------------------------------------------------------------------- #
# Compression records the step it fell back to
# --------------------------------------------------------------------------- #


def test_compression_names_the_checkpoint_step_it_used(teacher_dir, tmp_path, capsys):
    from hldstudy.compress.__main__ import main

    run = tmp_path / "run"
    shutil.copytree(teacher_dir, run)
    shutil.rmtree(run / "checkpoints" / "8" / "state")  # the newest step is damaged
    out = tmp_path / "out"
    code = main(["--checkpoint", str(run), "--prune", "magnitude-2:4", "--out", str(out),
                 "--no-progress", "--set", "compress.eval_batches=1"])
    assert code in (0, None), capsys.readouterr().err
    report = json.loads((out / "report.json").read_text())
    assert report["checkpoint_step"] == 4 and list(report["skipped_steps"]) == ["8"]
    md = (out / "report.md").read_text()
    assert "From its checkpoint of step 4 (the newer: step 8 could not be read" in md


# --------------------------------------------------------------------------- #
# Messages that name the real cause
# --------------------------------------------------------------------------- #


def test_a_lone_surrogate_names_the_file_and_line(tmp_path):
    from hldstudy.data import sources
    from hldstudy.errors import InputError

    path = tmp_path / "c.jsonl"
    path.write_text('{"text": "fine"}\n{"text": "bad \\ud800 here"}\n')
    with pytest.raises(InputError, match=rf"{path}:2: field 'text' holds a lone surrogate"):
        sources.read_jsonl_files([path], "text")


def test_a_corpus_smaller_than_a_batch_is_said(tmp_path, tokenizer_path, capsys):
    from helpers.runs import data_config

    from hldstudy.data import prepare_data

    path = tmp_path / "c.jsonl"
    path.write_text("".join(json.dumps({"text": f"tiny document {i}"}) + "\n"
                            for i in range(6)))
    cfg = data_config(tokenizer_path, source="jsonl", path=str(path), valid_holdout_docs=1,
                      batch_size=8)
    prepare_data(cfg, tmp_path / "run")
    err = capsys.readouterr().err
    assert "the training data packs into 1 rows of 64 tokens, fewer than one batch of " \
           "data.batch_size=8: every batch repeats rows" in err


def test_an_unreadable_orbax_bookkeeping_file_is_named_once(tmp_path, capsys):
    from hldstudy.checkpoint import Checkpointer

    run = tiny_run_dir(tmp_path / "run", tiny_config())
    (run / "checkpoints" / "1" / "_CHECKPOINT_METADATA").write_text("garbage{")
    ck = Checkpointer(run / "checkpoints", keep=2)
    assert ck.restore_meta(1) == {"step": 1}  # the step itself restores
    ck.close()
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert f"checkpoint {run / 'checkpoints' / '1'}: Orbax's _CHECKPOINT_METADATA is " \
           "unreadable" in err[0] and "restored from its state and metadata" in err[0]


# --------------------------------------------------------------------------- #
# Plugin noise: with the aot extra installed, a CPU command prints only our lines
# --------------------------------------------------------------------------- #

_EXTRA = importlib.util.find_spec("jax_plugins") is not None


@pytest.mark.aot
@pytest.mark.skipif(not _EXTRA, reason="needs the aot extra (pip install -e '.[aot]')")
@pytest.mark.parametrize("platforms", [None, "cpu"])
def test_no_plugin_noise_on_a_cpu_machine(platforms, tmp_path):
    from hldstudy.platforms import accelerator_present

    if accelerator_present():
        pytest.skip("this machine has an accelerator: its plugins may speak")
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "XLA_FLAGS")}
    if platforms:
        env["JAX_PLATFORMS"] = platforms
    out = subprocess.run(
        [sys.executable, "-m", "hldstudy.train", "--config", "tiny", "--workdir",
         str(tmp_path / "run"), "--set", "train.steps=2", "--set", "train.progress=false",
         "--set", "data.synthetic_docs=200", "--set", "data.synthetic_valid_docs=20",
         "--set", "train.eval_batches=1"], capture_output=True, text=True, cwd=ROOT, env=env,
        timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stderr == "", out.stderr[-3000:]
    assert "done: 2 steps" in out.stdout


def test_an_accelerator_host_keeps_its_platform_choice(monkeypatch):
    """settle() picks the CPU only where no accelerator is attached and JAX_PLATFORMS is
    unset; a TPU VM (its settings in the environment) is left to JAX."""
    from hldstudy import platforms

    monkeypatch.setenv("TPU_ACCELERATOR_TYPE", "v5litepod-8")
    assert platforms.accelerator_present()
    monkeypatch.delenv("TPU_ACCELERATOR_TYPE")
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    assert platforms._cpu_only()
    monkeypatch.setenv("JAX_PLATFORMS", "cuda,cpu")
    assert not platforms._cpu_only()
    assert np.isfinite(1.0)


def test_an_unsupported_hf_model_type_lists_every_supported_one(tmp_path):
    from hldstudy.errors import HLDError
    from hldstudy.family import hf_model_types
    from hldstudy.model.loading import model_config_of

    d = tmp_path / "llama"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))
    with pytest.raises(HLDError) as e:
        model_config_of(d)
    for t in hf_model_types():
        assert t in str(e.value)
    assert {"gemma3_text", "qwen3_5_text", "qwen3_5_moe_text"} <= set(hf_model_types())


def test_python_m_quickstart_runs_the_quickstart():
    out = subprocess.run([sys.executable, "-m", "hldstudy.quickstart", "--help"],
                         capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0 and "--size" in out.stdout and "--workdir" in out.stdout
