"""`python -m hldstudy.eval --checkpoints`: many checkpoints of one shape in one process
compile the scorers once (counted by jax's backend-compile events and the scorers'
jit caches, not by timing), each run's results written as a single evaluation
writes them, one table for all, and one-line errors for bad checkpoint paths."""

import json
import shutil
from pathlib import Path

import jax
import jax.monitoring
import pytest

from hldstudy.eval.__main__ import main
from hldstudy.eval.adapter import compiled_scorers
from hldstudy.eval.multi import evaluate_checkpoints, expand_checkpoints
from hldstudy.eval.tasks import FIXTURES_DIR
from hldstudy.eval.testing import tiny_config, tiny_run_dir

BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
TASKS = ["hellaswag", "synthetic_ppl"]  # loglikelihood (gathered head) and corpus scorers


@pytest.fixture(autouse=True)
def _local_hf_cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path_factory.getbasetemp() / "hf"))
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("HLDSTUDY_EVAL_DATA", raising=False)


class BackendCompiles:
    """Counts XLA backend compilations (every jit cache miss of any function) while active."""

    def __init__(self):
        self.count = 0

    def _listen(self, event, duration, **kwargs):
        if event == BACKEND_COMPILE_EVENT:
            self.count += 1

    def __enter__(self):
        jax.monitoring.register_event_duration_secs_listener(self._listen)
        return self

    def __exit__(self, *exc):
        jax.monitoring.unregister_event_duration_listener(self._listen)


def _sweep_folder(root: Path, n: int) -> Path:
    cfg = tiny_config()
    for i in range(n):
        tiny_run_dir(root / f"run{i:02d}", cfg, seed=i)
    (root / "notes.txt").write_text("not a run\n")  # other files in a sweep folder are skipped
    return root


def _compiles_once(tmp_path, n):
    runs = _sweep_folder(tmp_path / "sweep", n)
    kw = dict(limit=2, offline_data=FIXTURES_DIR, progress=False, batch_size=4)
    # Another test in this process may have compiled the same tiny shapes already: start
    # from empty jit caches, so that the first checkpoint compiles here.
    jax.clear_caches()
    with BackendCompiles() as probe:  # the listener sees a compile (a shape no test uses)
        jax.jit(lambda x: x * 3.0)(jax.numpy.ones((1, 4099 + n)))
    before = compiled_scorers()
    first = evaluate_checkpoints([runs / "run00"], TASKS, **kw)
    first_scorers = compiled_scorers() - before
    # The rest of the folder (run00 again, by path resolution, is not evaluated twice).
    with BackendCompiles() as later:
        table = evaluate_checkpoints([runs, runs / "run00"], TASKS, out_dir=tmp_path / "out", **kw)
    assert probe.count >= 1 and first_scorers >= 2  # the counters do see compiles
    assert first.rows[0]["compiled_scorers"] == first_scorers
    assert [r["label"] for r in table.rows] == [f"run{i:02d}" for i in range(n)]
    assert [r["compiled_scorers"] for r in table.rows] == [0] * n
    assert later.count == 0, f"{later.count} backend compiles after the first checkpoint"
    # Different weights, different scores; every run's results written like one evaluation.
    ppl = {r["results"]["synthetic_ppl"]["perplexity"] for r in table.rows}
    assert len(ppl) == n
    for r in table.rows:
        res = json.loads((tmp_path / "out" / r["label"] / "results.json").read_text())
        assert res == r["results"] and set(res) == set(TASKS)
        assert (tmp_path / "out" / r["label"] / "results.md").is_file()
    saved = json.loads((tmp_path / "out" / "table.json").read_text())
    assert [r["label"] for r in saved["rows"]] == [r["label"] for r in table.rows]
    md = (tmp_path / "out" / "table.md").read_text()
    assert "| run00 |" in md and "hellaswag acc" in md and "synthetic_ppl perplexity" in md


def test_three_checkpoints_compile_once(tmp_path):
    _compiles_once(tmp_path, 3)


@pytest.mark.slow
def test_twelve_checkpoints_compile_once(tmp_path):
    _compiles_once(tmp_path, 12)


def test_cli_writes_each_run_and_the_table(tmp_path, capsys):
    runs = _sweep_folder(tmp_path / "sweep", 2)
    assert main(["--checkpoints", str(runs / "run00"), str(runs / "run01"), "--tasks",
                 "synthetic_ppl", "--limit", "2", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "| run00 |" in out and "| run01 |" in out
    for run in ("run00", "run01"):  # without --out-dir: where a sweep puts them
        assert "synthetic_ppl" in json.loads((runs / run / "eval" / "results.json").read_text())


def _error_line(capsys, argv) -> str:
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[-1].startswith("python -m hldstudy.eval: error: ")
    return lines[-1]


def test_bad_checkpoint_paths_are_one_line(tmp_path, capsys):
    runs = _sweep_folder(tmp_path / "sweep", 1)
    err = _error_line(capsys, ["--checkpoints", str(runs), str(tmp_path / "nope"),
                               "--tasks", "synthetic_ppl"])
    assert f"{tmp_path / 'nope'} does not exist" in err
    empty = tmp_path / "empty"
    empty.mkdir()
    err = _error_line(capsys, ["--checkpoints", str(empty), "--tasks", "synthetic_ppl"])
    assert "nor a folder of runs" in err
    untrained = tmp_path / "untrained"
    untrained.mkdir()
    shutil.copy(runs / "run00" / "config.json", untrained / "config.json")
    err = _error_line(capsys, ["--checkpoints", str(untrained), "--tasks", "synthetic_ppl"])
    assert "run without a checkpoint" in err
    junk = tmp_path / "model.gguf"
    junk.write_bytes(b"not a gguf file")
    err = _error_line(capsys, ["--checkpoints", str(junk), "--tasks", "synthetic_ppl"])
    assert str(junk) in err
    err = _error_line(capsys, ["--checkpoints", str(runs), "--tasks", "synthetic_ppl",
                               "--out", str(tmp_path / "r.json")])
    assert "--out-dir" in err
    err = _error_line(capsys, ["--checkpoint", str(runs / "run00"), "--tasks", "synthetic_ppl",
                               "--out-dir", str(tmp_path / "o")])
    assert "--out-dir is for --checkpoints" in err
    assert not (tmp_path / "o").exists()
    assert expand_checkpoints([runs, runs / "run00"]) == [runs / "run00"]
