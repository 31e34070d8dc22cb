"""The design card's layout: experiments/, sweeps/ and eval/ beside hldstudy/, carried into
the package at build time, and the study's single runs as experiment files that take
their values from sweeps/_c4.py.

(tests/test_wheel.py, slow, builds the wheel and runs the quickstart from it.)
"""

import json
import math
import tomllib
from pathlib import Path

import pytest

from hldstudy import shipped
from hldstudy.cli_common import EXPERIMENTS, SWEEPS, find_builtin
from hldstudy.commands.flops import main as flops_main
from hldstudy.config import apply_overrides, config_to_dict, flatten, load_experiment, validate
from hldstudy.distill.methods import STUDY
from hldstudy.eval.tasks import FIXTURES_DIR, OVERRIDES_DIR
from hldstudy.model.presets import preset
from hldstudy.sweep import expand, load_sweep
from hldstudy.sweep.__main__ import main as sweep_main
from hldstudy.sweeps import _c4

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
C4_SIZES = ("123m", "735m")
NO_DATA = "data.path=/nonexistent/tfds"  # C4 configs need a path set; nothing reads it here


def test_the_checkout_resolves_the_top_level_folders():
    assert EXPERIMENTS == ROOT / "experiments" and SWEEPS == ROOT / "sweeps"
    assert OVERRIDES_DIR == ROOT / "eval" / "overrides"
    assert FIXTURES_DIR == ROOT / "eval" / "fixtures"
    assert (ROOT / "eval" / "README.md").is_file()
    assert not (ROOT / "hldstudy" / "configs").exists()


def test_pyproject_carries_every_package_and_the_shipped_folders():
    """A new hldstudy subpackage missing from the explicit list would be missing from the
    wheel; the package-dir mapping is the one hldstudy.shipped reads back."""
    on_disk = {".".join(p.parent.relative_to(ROOT).parts)
               for p in (ROOT / "hldstudy").rglob("__init__.py")}
    mapped = {f"hldstudy.{inside}": folder for folder, inside in shipped.IN_PACKAGE.items()}
    assert PYPROJECT["package-dir"] == {name: folder for name, folder in mapped.items()}
    assert set(PYPROJECT["packages"]) == on_disk | set(mapped)
    data = PYPROJECT["package-data"]["hldstudy.eval_files"]
    for pattern in data:
        assert list((ROOT / "eval").glob(pattern)), pattern


def test_the_sweep_helper_is_the_module_the_sweeps_and_experiments_import():
    assert Path(_c4.__file__).resolve() == SWEEPS / "_c4.py"


@pytest.mark.parametrize("path", sorted(EXPERIMENTS.glob("[!_]*.py")), ids=lambda p: p.stem)
def test_every_experiment_file_loads_and_names_its_launch_command(path):
    cfg = validate(apply_overrides(load_experiment(path), [NO_DATA]), check_paths=False,
                   need_teacher=False)
    doc = path.read_text().split('"""')[1]
    assert f"python -m hldstudy.train --config experiments/{path.name}" in doc \
        or f"python -m hldstudy.train --config {path.stem}" in doc, path
    assert cfg.name


@pytest.mark.parametrize("size", C4_SIZES)
@pytest.mark.parametrize("method", STUDY)
def test_a_c4_single_run_is_a_point_of_its_grid(size, method):
    """experiments/c4_<size>_<method>.py trains what the grid trains at the base point:
    same config field by field (only the name, the progress bar and the step count that
    the sweep fixes from the same budget differ), same FLOP budget."""
    single = load_experiment(EXPERIMENTS / f"c4_{size}_{method}.py")
    sweep = load_sweep(SWEEPS / f"c4_{size}.py")
    point = {"train.lr": _c4.LR, "distill.temperature": _c4.TEMPERATURE,
             "distill.alpha": _c4.ALPHA, "distill.hidden_weight": _c4.HIDDEN_WEIGHT,
             "train.seed": 0}
    (run,) = [r for r in expand(sweep) if r.method == method
              and all(point[k] == v for k, v in r.params.items())]
    a, b = flatten(config_to_dict(single)), flatten(config_to_dict(run.config))
    differ = {k for k in a if a[k] != b[k]}
    assert differ <= {"name", "train.progress", "train.steps"}, differ
    assert single.name == f"c4-{size}-{method}" and single.distill.method == method
    assert single.budget.flops == run.config.budget.flops > 0
    assert single.model == preset(_c4.STUDENTS[size].preset, dtype="bfloat16", remat=True,
                                  scan_layers=True)
    assert single.data.batch_size == _c4.STUDENTS[size].batch_size


def test_the_teacher_run_pretrains_the_paper_teacher_on_106b_c4_tokens():
    cfg = load_experiment(EXPERIMENTS / "c4_teacher_3p4b.py")
    assert cfg.model == preset("paper-teacher-3.4b", dtype="bfloat16", remat=True,
                               scan_layers=True)
    assert cfg.data.tfds_name == "c4/en" and cfg.distill.method == "baseline"
    tokens = cfg.train.steps * cfg.data.batch_size * cfg.data.seq_len
    assert math.isclose(tokens, 106e9, rel_tol=1e-4)
    # the students' data and recipe, apart from the batch and the step count
    student = load_experiment(EXPERIMENTS / "c4_123m_baseline.py")
    for section in ("data", "train"):
        a = flatten(config_to_dict(getattr(cfg, section)))
        b = flatten(config_to_dict(getattr(student, section)))
        assert {k for k in a if a[k] != b[k]} <= {"batch_size", "steps"}, section


def test_flop_cli_counts_a_c4_experiment_without_data_or_weights(capsys):
    assert flops_main(["--config", str(EXPERIMENTS / "c4_123m_hldf.py"), "--set", NO_DATA,
                       "--teacher-preset", "paper-teacher-3.4b", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    single = load_experiment(EXPERIMENTS / "c4_123m_hldf.py")
    assert out["budget"] == single.budget.flops
    assert len(out["stages"]) == 2  # hldf: alignment, then KD
    assert all(st["steps"] > 0 for st in out["stages"].values()), out["stages"]


def test_builtin_names_and_paths_are_the_same_files(monkeypatch, capsys):
    """`--config experiments/tiny.py` / `--config tiny`, `sweep sweeps/cpu.py` / `sweep cpu`."""
    monkeypatch.chdir(ROOT)
    assert find_builtin("tiny", EXPERIMENTS).resolve() == Path("experiments/tiny.py").resolve()
    outputs = []
    for arg in ("sweeps/cpu.py", "cpu"):
        assert sweep_main([arg, "--dry-run", "--json"]) == 0
        outputs.append(json.loads(capsys.readouterr().out))
    assert outputs[0] == outputs[1] and outputs[0]
