"""Compressing imported checkpoints (Hugging Face directories) on a local text source:
text / JSONL files or folders and offline TFDS, tokenized with the checkpoint's own
tokenizer; and every bad source refused in one line, exit 2, nothing left behind."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from flax import nnx

from hldstudy.data.synthetic import generate_documents
from hldstudy.data.tokenizer import Tokenizer
from hldstudy.model import Transformer, preset
from hldstudy.model.importers import export_hf

FIXTURES = Path(__file__).parent / "fixtures" / "qwen35"
SMALL = ["--no-progress", "--set", "compress.calibration_seq_len=64",
         "--set", "compress.calibration_batch_size=4", "--set", "compress.eval_batches=2"]


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """A Qwen3.5 HF directory with its tokenizer.json, the same without it, and text."""
    root = tmp_path_factory.mktemp("compress_sources")
    tok = Tokenizer.load(FIXTURES / "tokenizer.json")
    model = Transformer(preset("tiny-qwen", vocab_size=304), rngs=nnx.Rngs(0))
    hf = export_hf(model, root / "qwen_hf", tokenizer=tok)
    bare = root / "qwen_no_tokenizer"
    shutil.copytree(hf, bare)
    (bare / "tokenizer.json").unlink()
    text = root / "text"
    text.mkdir()
    docs = generate_documents(240, seed=3)
    (text / "a.txt").write_text("\n\n".join(docs[:120]))
    (text / "b.txt").write_text("\n\n".join(docs[120:]))
    jsonl = root / "docs.jsonl"
    jsonl.write_text("".join(json.dumps({"body": d}) + "\n" for d in docs))
    return {"hf": hf, "bare": bare, "text": text, "jsonl": jsonl, "root": root}


def _cli(argv, capsys):
    from hldstudy.compress.__main__ import main

    try:
        code = main(argv)
    except SystemExit as e:
        code = e.code
    cap = capsys.readouterr()
    return code, cap.out, cap.err


@pytest.mark.slow  # ~30 s idle (136 s on a loaded 2-core machine): Wanda, FP8, 3 evaluations
def test_hf_qwen_directory_on_a_text_folder(sources, tmp_path, capsys):
    out = tmp_path / "out"
    code, _, err = _cli(["--checkpoint", str(sources["hf"]), "--prune", "wanda-2:4",
                         "--calibration-data", str(sources["text"]),
                         "--calibration-tokens", "600", "--quantize", "fp8",
                         "--out", str(out), *SMALL], capsys)
    assert code == 0, err
    report = json.loads((out / "report.json").read_text())
    assert [s["stage"] for s in report["stages"]] == ["dense", "wanda-2:4", "fp8-e4m3-channel"]
    for s in report["stages"]:
        assert s["valid_tokens"] > 0 and 1 < s["valid_ppl"] < 1e4
    assert report["stages"][-1]["is_2_4"] and report["stages"][-1]["sparsity"] == 0.5
    cfg = json.loads((out / "config.json").read_text())["compress"]
    assert cfg["calibration_tokens"] == 600 and cfg["calibration_data"] == str(sources["text"])
    # the compressed run directory reads back with the checkpoint's own tokenizer
    from hldstudy.model.loading import load_model

    got = load_model(out / "model")
    assert type(got.tokenizer).__name__ == "JsonTokenizer"
    assert got.config.data.source == "text"


@pytest.mark.slow  # ~60 s: an HF Gemma directory, a JSONL source and a 2-step recovery
def test_hf_gemma_directory_on_jsonl_with_recovery(sources, tmp_path, capsys):
    from hldstudy.data.tokenizer import train_tokenizer

    tok = train_tokenizer(generate_documents(300, seed=0), 512, tmp_path / "tok")
    model = Transformer(preset("tiny", attn_softcap=None), rngs=nnx.Rngs(1))
    hf = export_hf(model, tmp_path / "gemma_hf", tokenizer=tok)
    out = tmp_path / "out"
    code, _, err = _cli(["--checkpoint", str(hf), "--prune", "sparsegpt-2:4",
                         "--calibration-data", str(sources["jsonl"]),
                         "--set", "compress.calibration_text_field=body",
                         "--calibration-batches", "2", "--recover-steps", "2",
                         "--out", str(out), *SMALL], capsys)
    assert code == 0, err
    stages = json.loads((out / "report.json").read_text())["stages"]
    assert [s["stage"] for s in stages] == ["dense", "sparsegpt-2:4", "recovered-kd-forward_kl"]
    assert stages[-1]["masks_held"] and stages[-1]["recover_steps"] == 2
    assert stages[-1]["teacher"] == str(hf.absolute())  # the dense checkpoint teaches


@pytest.mark.slow  # ~40 s: builds an offline TFDS dataset in a subprocess
def test_offline_tfds_source_by_name_and_split(sources, tmp_path, capsys):
    from hldstudy.data.tfds_corpus import build_tfds

    data_dir = build_tfds(tmp_path / "tfds")
    out = tmp_path / "out"
    code, _, err = _cli(["--checkpoint", str(sources["hf"]), "--prune", "wanda-2:4",
                         "--calibration-data", str(data_dir),
                         "--calibration-tfds", "hld_tiny_c4/en",
                         "--calibration-tokens", "500", "--out", str(out), *SMALL], capsys)
    assert code == 0, err
    stages = json.loads((out / "report.json").read_text())["stages"]
    assert stages[0]["valid_tokens"] > 0 and stages[1]["is_2_4"]


def _one_line(code, err):
    lines = [ln for ln in err.strip().splitlines() if ln.strip()]
    assert code == 2, err
    assert "Traceback" not in err and len(lines) == 1, err
    assert lines[0].startswith("python -m hldstudy.compress: error:")
    return lines[0]


def _bad_source(kind: str, root: Path) -> Path:
    if kind == "missing":
        return root / "nowhere.txt"
    if kind == "empty file":
        (root / "empty.txt").write_text("")
        return root / "empty.txt"
    if kind == "folder without text":
        (root / "imgs").mkdir()
        (root / "imgs" / "a.png").write_bytes(b"\x89PNG")
        return root / "imgs"
    if kind == "not text":
        (root / "blob.txt").write_bytes(bytes(range(256)) * 8)
        return root / "blob.txt"
    raise ValueError(kind)


@pytest.mark.parametrize("kind, words", [
    ("missing", "does not exist"), ("empty file", "is empty"),
    ("folder without text", "has no .txt"), ("not text", "is not text")])
def test_bad_calibration_source_is_one_line(sources, tmp_path, capsys, kind, words):
    src = _bad_source(kind, tmp_path)
    out = tmp_path / "out"
    code, _, err = _cli(["--checkpoint", str(sources["hf"]), "--prune", "wanda-2:4",
                         "--calibration-data", str(src), "--out", str(out), *SMALL], capsys)
    line = _one_line(code, err)
    assert "compress.calibration_data" in line and words in line and str(src) in line
    assert not out.exists()


def test_too_few_tokens_and_no_tokenizer_and_busy_out(sources, tmp_path, capsys):
    before = set(tmp_path.iterdir())
    out = tmp_path / "out"
    code, _, err = _cli(["--checkpoint", str(sources["hf"]), "--prune", "wanda-2:4",
                         "--calibration-data", str(sources["text"]),
                         "--calibration-tokens", "10000000", "--out", str(out), *SMALL], capsys)
    line = _one_line(code, err)
    assert "compress.calibration_tokens" in line and "10,000,000" in line
    assert set(tmp_path.iterdir()) == before  # the partial output was removed
    code, _, err = _cli(["--checkpoint", str(sources["bare"]), "--prune", "magnitude-2:4",
                         "--calibration-data", str(sources["text"]), "--out", str(out),
                         *SMALL], capsys)
    line = _one_line(code, err)
    assert "compress.checkpoint" in line and "no tokenizer" in line and "tokenizer.json" in line
    assert set(tmp_path.iterdir()) == before
    out.mkdir()
    (out / "keep.txt").write_text("earlier output")
    code, _, err = _cli(["--checkpoint", str(sources["hf"]), "--prune", "magnitude-2:4",
                         "--calibration-data", str(sources["text"]), "--export",
                         "compressed-tensors", "--out", str(out), *SMALL], capsys)
    assert "compress.out" in _one_line(code, err) and "not empty" in err
    assert sorted(p.name for p in out.iterdir()) == ["keep.txt"]
    code, _, err = _cli(["--checkpoint", str(sources["hf"]), "--prune", "magnitude-2:4",
                         "--out", str(tmp_path / "o2"), *SMALL], capsys)
    assert "compress.calibration_data" in _one_line(code, err) and "imported" in err
