"""Bad configs and inputs fail before any compute with one line naming the field or file."""

import pytest

from hldstudy.train.__main__ import main as train_main

TINY = "tiny"  # the built-in hldstudy/configs/experiments/tiny.py, by name


def _fail(capsys, argv, *needles):
    with pytest.raises(SystemExit) as exc:
        train_main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err  # one line, no traceback
    assert "Traceback" not in err
    for needle in needles:
        assert needle in err, err
    return err


CASES = [
    (["--set", "model.nonsense=3"], ["model.nonsense", "unknown key"]),
    (["--set", "nosection.x=1"], ["nosection", "unknown section"]),
    (["--set", "train.steps=many"], ["train.steps", "integer"]),
    (["--set", "model.d_model=65"], ["model.d_model", "divisible by n_heads"]),
    (["--set", "model.n_kv_heads=3"], ["model.n_kv_heads"]),
    (["--set", "data.source=jsonl", "--set", "data.path=/no/such/file.jsonl"],
     ["data.path", "/no/such/file.jsonl"]),
    (["--set", "data.source=text"], ["data.path", "needs a path"]),
    (["--set", "data.source=parquet"], ["data.source", "parquet"]),
    (["--set", "data.tokenizer=/no/tok.model"], ["data.tokenizer", "does not exist"]),
    (["--set", "data.seq_len=4096"], ["data.seq_len", "max_seq_len"]),
    (["--set", "train.lr=-1"], ["train.lr", "> 0"]),
    (["--set", "train.schedule=step"], ["train.schedule"]),
    (["--method", "kd"], ["teacher.checkpoint", "needs a teacher"]),
    (["--method", "kd", "--set", "teacher.checkpoint=/tmp/none", "--set", "distill.alpha=1.5"],
     ["distill.alpha", "[0, 1]"]),
    (["--method", "kd", "--set", "teacher.checkpoint=/x", "--set", "distill.temperature=0"],
     ["distill.temperature", "> 0"]),
    (["--method", "hldf", "--set", "teacher.checkpoint=/x", "--set", "distill.hldf_stage1_share=1"],
     ["distill.hldf_stage1_share", "(0, 1)"]),
    (["--set", "distill.layer_pairs=3-4"], ["distill.layer_pairs", "student:teacher"]),
    (["--set", "model.dtype=float8"], ["model.dtype"]),
    (["--set", "data.batch_size=6"], ["data.batch_size", "divisible"]),
    (["--method", "kd", "--set", "teacher.checkpoint=/definitely/missing"],
     ["teacher.checkpoint", "does not exist"]),
]


@pytest.mark.parametrize("extra,needles", CASES, ids=[c[1][0] + f"-{i}" for i, c in enumerate(CASES)])
def test_bad_config_names_the_field(capsys, tmp_path, extra, needles):
    _fail(capsys, ["--config", TINY, "--workdir", str(tmp_path / "w"), *extra], *needles)


def test_missing_experiment_file(capsys, tmp_path):
    _fail(capsys, ["--config", str(tmp_path / "nope.py")], "nope.py", "does not exist")


def test_experiment_without_get_config(capsys, tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("x = 1\n")
    _fail(capsys, ["--config", str(bad)], "bad.py", "get_config")


def test_debug_shows_the_traceback(tmp_path):
    from hldstudy.errors import ConfigError

    with pytest.raises(ConfigError):
        train_main(["--config", TINY, "--debug", "--set", "train.lr=-1"])
