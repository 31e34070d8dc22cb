"""Distillation with Qwen3.5 teachers (issue 19, item 6).

- Slow: KD, HLDF, HLDC and Patient KD from a tiny random Qwen3.5 teacher, dense and MoE,
  into a Gemma-style or a Qwen3.5 student sharing its tokenizer, each end to end (every
  method meets both teachers and both students); a MoE student distilled from the MoE
  teacher resumes bitwise (routing is a function of the inputs).
- Default: a teacher whose vocabulary differs from the student's is refused through the
  CLI in one line naming `model.vocab_size`, exit 2, for Qwen -> Gemma, Qwen -> Qwen and
  Gemma -> Qwen pairs; a student tokenizing differently from its Qwen teacher is refused
  naming `data.tokenizer`.
"""

from __future__ import annotations

import json
import math

import jax
import pytest
from helpers.qwen_pair import FIXTURES, TOKENIZER, VOCAB, export_teacher, student_config
from helpers.runs import losses, records

pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def qwen_teachers(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen-teachers")
    return {kind: export_teacher(kind, root / kind) for kind in ("dense", "moe")}


# --------------------------------------------------------------------------- #
# Every method, both teachers, both student families


CASES = [  # (method, teacher, student preset): each method meets both teachers and students
    ("kd", "moe", "tiny"),
    ("kd", "dense", "tiny-qwen"),
    ("hldf", "dense", "tiny"),
    ("hldf", "moe", "tiny-qwen"),
    ("hldc", "moe", "tiny-qwen"),  # the run that deadlocked (DeltaNet student backward)
    ("hldc", "dense", "tiny"),
    ("patient", "dense", "tiny-qwen"),
    ("patient", "moe", "tiny"),
]


@pytest.mark.slow
@pytest.mark.parametrize("method,teacher,student", CASES,
                         ids=[f"{m}-{t}-{s}" for m, t, s in CASES])
def test_each_method_runs_end_to_end_with_a_qwen_teacher(tmp_path, qwen_teachers, method,
                                                         teacher, student):
    from hldstudy.train.loop import Trainer

    cfg = student_config(method, qwen_teachers[teacher], student=student, steps=4)
    result = Trainer(cfg, tmp_path / "run", devices=jax.devices()[:1]).run()
    assert result["status"] == "done" and result["steps"] == 4
    assert math.isfinite(result["valid_nll"])
    recs = [r for r in records(tmp_path / "run") if "loss" in r]
    assert [r["step"] for r in recs] == [1, 2, 3, 4]
    assert all(math.isfinite(r["loss"]) for r in recs)
    if method == "hldf":  # stage 1 aligns hidden states only, stage 2 is KD
        assert [r["stage"] for r in recs] == ["stage1", "stage1", "stage2", "stage2"]
        assert "nmse" in recs[0] and "kl" in recs[-1]
    elif method in ("hldc", "patient"):
        assert all("kl" in r and "nmse" in r for r in recs)
    else:
        assert all("kl" in r for r in recs)


@pytest.mark.slow
def test_moe_student_of_the_moe_teacher_resumes_bitwise(tmp_path, qwen_teachers):
    from hldstudy.train.loop import Interrupted, Trainer

    cfg = student_config("kd", qwen_teachers["moe"], student="tiny-qwen-moe", steps=4,
                         train={"checkpoint_every": 2}, model={"router_aux_weight": 0.05})
    one = jax.devices()[:1]
    Trainer(cfg, tmp_path / "full", devices=one).run()
    with pytest.raises(Interrupted):
        Trainer(cfg, tmp_path / "split", devices=one).run(stop_at_step=2)
    Trainer(cfg, tmp_path / "split", devices=one).run()
    full, split = losses(tmp_path / "full"), losses(tmp_path / "split")
    assert sorted(full) == [1, 2, 3, 4]
    assert full == split  # bitwise: routing depends on the inputs only
    assert all("router_aux" in r for r in records(tmp_path / "full") if "loss" in r)


# --------------------------------------------------------------------------- #
# Bad pairs through the CLI: one line, exit 2


EXPERIMENT = '''\
from hldstudy.config import Config, DataConfig, TrainConfig
from hldstudy.model.presets import preset


def get_config():
    return Config(name="student", model=preset({preset!r}, vocab_size={vocab}),
                  data=DataConfig(seq_len=64, batch_size=8, tokenizer={tokenizer!r},
                                  tokenizer_vocab_size=384, synthetic_docs=200,
                                  synthetic_valid_docs=20),
                  train=TrainConfig(steps=2, eval_batches=1, progress=False))
'''


def _refused(tmp_path, capsys, *, preset, vocab, tokenizer, teacher, method="kd"):
    from hldstudy.train.__main__ import main

    exp = tmp_path / "exp.py"
    exp.write_text(EXPERIMENT.format(preset=preset, vocab=vocab,
                                     tokenizer=None if tokenizer is None else str(tokenizer)))
    capsys.readouterr()
    with pytest.raises(SystemExit) as exc:
        main(["--config", str(exp), "--workdir", str(tmp_path / "run"), "--method", method,
              "--set", f"teacher.checkpoint={teacher}"])
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert exc.value.code == 2, err
    assert len(err) == 1 and "Traceback" not in err[0], err
    return err[0]


@pytest.mark.parametrize("method", ["kd", "hldc"])
def test_a_qwen_teacher_of_another_vocabulary_is_refused_for_a_gemma_student(
        tmp_path, capsys, method):
    # The committed MoE fixture: a 128-entry vocabulary, no tokenizer of its own.
    line = _refused(tmp_path, capsys, preset="tiny", vocab=VOCAB, tokenizer=TOKENIZER,
                    teacher=FIXTURES / "moe", method=method)
    assert "model.vocab_size" in line and "384" in line and "128" in line


def test_a_qwen_teacher_of_another_vocabulary_is_refused_for_a_qwen_student(tmp_path, capsys):
    line = _refused(tmp_path, capsys, preset="tiny-qwen", vocab=VOCAB, tokenizer=TOKENIZER,
                    teacher=FIXTURES / "dense")
    assert "model.vocab_size" in line and "128" in line


def test_a_gemma_teacher_of_another_vocabulary_is_refused_for_a_qwen_student(
        tmp_path, capsys, teacher_dir):
    # The session's Gemma teacher (384 entries, SentencePiece): its tokenizer is taken.
    line = _refused(tmp_path, capsys, preset="tiny-qwen-moe", vocab=512, tokenizer=None,
                    teacher=teacher_dir)
    assert "model.vocab_size" in line and "512" in line and "384" in line


def test_a_student_tokenizing_differently_from_its_qwen_teacher_is_refused(
        tmp_path, capsys, tokenizer_path):
    teacher = export_teacher("dense", tmp_path / "teacher")
    line = _refused(tmp_path, capsys, preset="tiny-qwen", vocab=VOCAB, tokenizer=tokenizer_path,
                    teacher=teacher)
    assert "data.tokenizer" in line and "300 pieces" in line


def test_the_exported_teacher_carries_its_tokenizer(tmp_path):
    teacher = export_teacher("moe", tmp_path / "teacher")
    assert (teacher / "tokenizer.json").read_bytes() == TOKENIZER.read_bytes()
    raw = json.loads((teacher / "config.json").read_text())
    assert raw["model_type"] == "qwen3_5_moe_text" and raw["vocab_size"] == VOCAB


def test_dropped_expert_slots_are_reported_in_the_step_metrics():
    """Capacity dispatch drops routed rows past an expert's buffer: never silently. A
    teacher's dropped share reaches the student step's metrics (teacher_expert_drop_rate),
    an MoE student's its own (expert_drop_rate); dropless dispatch reports 0."""
    import jax.numpy as jnp
    import numpy as np
    import optax
    from flax import nnx

    from hldstudy.config import Config, DataConfig, DistillConfig
    from hldstudy.distill.base import make_strategy
    from hldstudy.model import Transformer, preset
    from hldstudy.teacher.colocated import teacher_forward_fn
    from hldstudy.train.program import train_program
    from hldstudy.train.step import split_params

    b, t = 4, 32
    for dispatch, factor in (("capacity", 0.5), ("ragged", 0.5)):
        moe = dict(moe_dispatch=dispatch, moe_capacity_factor=factor)
        cfg = Config(model=preset("tiny-qwen-moe", **moe), data=DataConfig(batch_size=b, seq_len=t),
                     distill=DistillConfig(method="kd", loss_impl="materialized"))
        teacher_cfg = preset("tiny-qwen-moe", d_model=64, **moe)
        strategy = make_strategy(cfg, cfg.model, teacher_cfg)
        (st,) = strategy.stages()
        graphdefs, params = split_params(Transformer(cfg.model, rngs=nnx.Rngs(0)),
                                         strategy.init_aux(st, nnx.Rngs(1)))
        t_gd, t_params = nnx.split(Transformer(teacher_cfg, rngs=nnx.Rngs(2)), nnx.Param)
        forward = teacher_forward_fn(t_gd, strategy.teacher_layers(st),
                                     strategy.teacher_needs_head(st))
        tokens = jnp.asarray(np.random.default_rng(0).integers(0, 512, (b, t), dtype=np.int32))
        batch = {"tokens": tokens, "targets": jnp.roll(tokens, -1, 1),
                 "positions": jnp.tile(jnp.arange(t, dtype=jnp.int32), (b, 1)),
                 "segment_ids": jnp.ones((b, t), jnp.int32), "mask": jnp.ones((b, t), bool)}
        teacher_drop = forward(t_params, batch).expert_drop_rate
        assert teacher_drop.shape == (b,)
        opt = optax.sgd(0.0)
        state = {"params": params, "opt_state": opt.init(params), "step": jnp.int32(0)}
        _, metrics, _ = jax.jit(train_program(strategy, st, graphdefs, opt, forward))(
            state, batch, t_params, {}, jnp.int32(0))
        assert float(metrics["teacher_expert_drop_rate"]) == pytest.approx(
            float(jnp.mean(teacher_drop)), rel=1e-6)
        if dispatch == "capacity":  # buffers of 8 rows for 64 per sequence: some dropped
            assert float(metrics["teacher_expert_drop_rate"]) > 0.05
            assert float(metrics["expert_drop_rate"]) > 0.05
        else:
            assert float(metrics["teacher_expert_drop_rate"]) == 0.0
            assert float(metrics["expert_drop_rate"]) == 0.0
