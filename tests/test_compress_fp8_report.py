"""The compression report scores its FP8 stage through the FP8 forward
(`fp8_forward.fp8_model`): on CPU the simulated path (the dequantized model's numbers),
where the chip has FP8 matmuls the real FP8 dot, whose program lowered for CUDA has FP8
dots in it. And `compress.save_stages` leaves every stage's model where eval can read it."""

from __future__ import annotations

import json
import re

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from hldstudy.compress import export, fp8, pipeline
from hldstudy.compress.config import CompressConfig
from hldstudy.compress.fp8_forward import FP8Weight, fp8_model
from hldstudy.compress.layout import targets
from hldstudy.config import Config, DataConfig, TrainConfig
from hldstudy.data import prepare_data
from hldstudy.model import Transformer, preset
from hldstudy.model.loading import load_model

DATA = DataConfig(source="synthetic", seq_len=64, batch_size=4, tokenizer_vocab_size=512,
                  synthetic_docs=400, synthetic_valid_docs=40)


def _fp8_dots(model, quantized) -> int:
    """FP8 dots in the CUDA lowering of the program that scores a stage's perplexity."""
    f, state = pipeline.nll_program(pipeline.evaluated_model(model, quantized))
    batch = [jnp.zeros((1, 16), jnp.int32)] * 4 + [jnp.ones((1, 16), jnp.int32)]
    text = f.trace(state, *batch).lower(lowering_platforms=("cuda",)).as_text()
    return sum("dot_general" in ln and "f8E4M3FN" in ln for ln in text.splitlines())


def _quantized_tiny():
    model = Transformer(preset("tiny"), rngs=nnx.Rngs(0))
    names = tuple({t.name for t in targets(model)})
    return model, pipeline.quantize_model(model, names, "e4m3", "channel")


def test_fp8_stage_program_has_fp8_dots_where_the_chip_has_fp8(monkeypatch):
    model, quantized = _quantized_tiny()
    evaluated = pipeline.evaluated_model(model, quantized)
    assert sum(isinstance(v.get_value(), FP8Weight) for _, v in nnx.iter_graph(evaluated)
               if isinstance(v, nnx.Param)) == len(quantized)
    assert not fp8.backend_has_fp8_matmul()  # this CPU: the simulated path, no FP8 dots
    assert _fp8_dots(model, quantized) == 0
    monkeypatch.setattr(fp8, "backend_has_fp8_matmul", lambda: True)  # an H100's answer
    assert _fp8_dots(model, quantized) == len(quantized)
    assert pipeline.evaluated_model(model, {}) is model  # unquantized stages: the model itself


@pytest.fixture(scope="module")
def student(tmp_path_factory):
    from hldstudy.data.synthetic import generate_documents
    from hldstudy.data.tokenizer import train_tokenizer

    root = tmp_path_factory.mktemp("fp8_report")
    tok = train_tokenizer(generate_documents(DATA.synthetic_docs, seed=0), 512, root / "tok")
    cfg = Config(name="student", model=preset("tiny"), data=DATA,
                 train=TrainConfig(steps=1, eval_batches=2, progress=False))
    model = Transformer(cfg.model, rngs=nnx.Rngs(5))
    return export.save_run_dir(model, cfg, root / "student", tokenizer_file=tok.model_path)


def _compress(student, out, **fields):
    return pipeline.run(CompressConfig(checkpoint=str(student), out=str(out),
                                       prune="magnitude-2:4", quantize="fp8", eval_batches=2,
                                       progress=False, **fields))


def _valid(run_dir, work):
    cfg = load_model(run_dir).config
    return prepare_data(cfg.data, work).valid_batches(2)


@pytest.mark.slow  # ~80 s on a shared 2-core CPU: three compress runs of a tiny model
def test_report_fp8_stage_is_the_fp8_forward_and_every_stage_is_saved(student, tmp_path,
                                                                      monkeypatch):
    out = tmp_path / "sim"
    report = _compress(student, out, save_stages=True)
    assert [s["stage"] for s in report["stages"]] == ["dense", "magnitude-2:4",
                                                      "fp8-e4m3-channel"]
    assert report["stage_models"] == {"dense": str(student.absolute()),
                                      "magnitude-2:4": "stages/magnitude-2:4",
                                      "fp8-e4m3-channel": "model"}
    assert json.loads((out / "report.json").read_text())["stage_models"] == \
        report["stage_models"]
    valid = _valid(out / "model", tmp_path / "w")
    # every saved stage reads back with the perplexity the report gave it
    pruned = load_model(out / "stages" / "magnitude-2:4").model
    assert pipeline.valid_perplexity(pruned, valid)["valid_ppl"] == pytest.approx(
        report["stages"][1]["valid_ppl"], rel=1e-6)
    final = load_model(out / "model").model  # dequantized FP8 values, float32
    names = tuple({t.name for t in targets(final)})
    quantized = pipeline.quantize_model(final, names, "e4m3", "channel")  # on-grid: same q
    sim = report["stages"][-1]["valid_ppl"]
    # on CPU the FP8 forward is the simulation: the dequantized model's perplexity
    assert pipeline.valid_perplexity(final, valid)["valid_ppl"] == pytest.approx(sim, rel=1e-4)
    real = pipeline.valid_perplexity(fp8_model(final, quantized, real=True), valid)["valid_ppl"]
    assert real != sim  # W8A8 differs from W8A32 ...
    assert real == pytest.approx(sim, rel=0.05)  # ... by the activations' FP8 rounding
    # a chip with FP8 matmuls: the report's FP8 stage is the real FP8 dot's number
    monkeypatch.setattr(fp8, "backend_has_fp8_matmul", lambda: True)
    on_fp8 = _compress(student, tmp_path / "fp8")
    # (up to the activations' FP8 rounding flipping on the reloaded model's recomputed
    # scales, float32 rounding apart from the pipeline's: far closer to the real dot's
    # number than to the simulation's)
    got = on_fp8["stages"][-1]["valid_ppl"]
    assert abs(got - real) < abs(got - sim) / 5
    assert on_fp8["stages"][1]["valid_ppl"] == report["stages"][1]["valid_ppl"]
    assert not (tmp_path / "fp8" / "stages").exists()  # saved only when asked
    assert np.isfinite(real)


def test_example_web_tasks_are_deterministic_local_lm_eval_files(tmp_path):
    """analysis/compression/web_tasks.py: the same text and seed give the same files, in
    the schemas `python -m hldstudy.eval --offline-data` checks, from held-out text only."""
    import importlib.util
    from pathlib import Path

    from hldstudy.eval.tasks import check_offline_file

    path = Path(__file__).parents[1] / "analysis" / "compression" / "web_tasks.py"
    spec = importlib.util.spec_from_file_location("web_tasks", path)
    web_tasks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(web_tasks)
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda".split()
    docs = [" ".join(f"{words[(d + s) % 11].capitalize()} {' '.join(words[:4 + (d * s) % 6])} "
                     f"doc{d} {words[(3 * d + s) % 11]}." for s in range(8)) for d in range(40)]
    (tmp_path / "web.txt").write_text("\n\n".join(docs) + "\n")
    outs = []
    for k in range(2):
        out = tmp_path / f"t{k}"
        assert web_tasks.main(["--text", str(tmp_path), "--out", str(out), "--holdout", "20",
                               "--cloze-items", "6", "--choice-items", "6",
                               "--cloze-words", "12", "--choice-words", "10"]) == 0
        outs.append({f: (out / f).read_bytes() for f in ("lambada_openai.jsonl",
                                                         "hellaswag.jsonl")})
        for task in ("lambada_openai", "hellaswag"):
            check_offline_file(task, out)
    assert outs[0] == outs[1]
    cloze = [json.loads(ln) for ln in outs[0]["lambada_openai.jsonl"].splitlines()]
    choice = [json.loads(ln) for ln in outs[0]["hellaswag.jsonl"].splitlines()]
    assert len(cloze) == len(choice) == 6
    held = set(range(20, 40))  # the last 20 documents only

    def doc_ids(text):
        return {int(n) for n in re.findall(r"doc(\d+)", text)}

    for r in cloze:
        assert len(doc_ids(r["text"])) == 1 and doc_ids(r["text"]) <= held
        assert r["text"].split()[-1].isalpha()  # the final period dropped
    for r in choice:
        own = {20 + r["ind"]}
        true = r["endings"][int(r["label"])]
        assert doc_ids(r["ctx_a"]) == own == doc_ids(true)
        others = [e for i, e in enumerate(r["endings"]) if i != int(r["label"])]
        assert len(set(others)) == 3
        assert all(doc_ids(e) <= held - own for e in others)
