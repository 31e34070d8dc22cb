"""The package works without the checkout: a wheel built from it, installed into a bare
folder, runs `hldstudy quickstart --size tiny` from another directory.

Nothing is downloaded: the wheel is built without build isolation (setuptools and
wheel from the venv) and installed without its dependencies, which come from the venv.
"""

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PIP = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--no-input"]


def _run(cmd, **kw):
    proc = subprocess.run(cmd, capture_output=True, text=True, **kw)
    assert proc.returncode == 0, f"{' '.join(map(str, cmd))}\n{proc.stdout[-3000:]}\n" \
                                 f"{proc.stderr[-6000:]}"
    return proc


def build_and_install(tmp_path: Path) -> Path:
    """Builds the wheel from a copy of the sources (an in-tree build would leave build/
    behind, and a stale build/lib could hide a file missing from the package data) and
    installs it into tmp_path/site; returns that folder."""
    src = tmp_path / "src"
    # the library and the top-level folders the build maps into it (pyproject package-dir)
    for folder in ("hldstudy", "experiments", "sweeps", "eval"):
        shutil.copytree(ROOT / folder, src / folder,
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    wheels = tmp_path / "wheels"
    _run(PIP + ["wheel", "--no-deps", "--no-build-isolation", "--no-index", "-w", str(wheels),
                str(src)], timeout=600)
    (wheel,) = wheels.glob("hldstudy-*.whl")
    site = tmp_path / "site"
    _run(PIP + ["install", "--no-deps", "--no-index", "--target", str(site), str(wheel)],
         timeout=600)
    return site


@pytest.mark.slow
def test_wheel_runs_the_quickstart_without_the_checkout(tmp_path):
    site = build_and_install(tmp_path)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {**os.environ, "PYTHONPATH": str(site), "JAX_PLATFORMS": "cpu",
           "WANDB_MODE": "disabled"}

    # The installed copy is the one imported (the venv's editable finder comes after
    # PYTHONPATH), and it carries the checkout's experiments/, sweeps/ and eval/.
    probe = _run([sys.executable, "-c",
                  "import hldstudy, hldstudy.cli_common as c, hldstudy.eval.tasks as t; "
                  "import hldstudy.sweeps._c4 as c4; "
                  "print(hldstudy.__file__); print(c.SWEEPS / 'cpu.py'); print(c4.__file__); "
                  "print(c.EXPERIMENTS / 'c4_123m_kd.py'); "
                  "print(t.OVERRIDES_DIR / 'synth_mc.yaml'); print(t.FIXTURES_DIR / 'piqa.jsonl'); "
                  "print(t.OVERRIDES_DIR.parent / 'README.md')"], cwd=elsewhere, env=env)
    for line in probe.stdout.split():
        path = Path(line)
        assert path.is_file() and path.is_relative_to(site), (line, probe.stdout)

    # Built-in names resolve inside the package: a C4 run (importing hldstudy.sweeps._c4)
    # counts its FLOPs, and the CPU grid expands.
    module = [sys.executable, "-m"]
    _run(module + ["hldstudy", "flops", "--config", "c4_123m_kd", "--set",
                   "data.path=/nonexistent/tfds", "--teacher-preset", "paper-teacher-3.4b"],
         cwd=elsewhere, env=env)
    _run(module + ["hldstudy.sweep", "cpu", "--dry-run"], cwd=elsewhere, env=env)

    script = site / "bin" / "hldstudy"  # the console script the wheel installs
    _run([str(script), "quickstart", "--size", "tiny", "--workdir", "qs", "--no-progress"],
         cwd=elsewhere, env=env, timeout=1500)

    res = json.loads((elsewhere / "qs" / "results.json").read_text())
    assert res["size"] == "tiny" and not res["failed"]
    assert math.isfinite(res["teacher"]["valid_nll"])
    assert res["students"] and res["best"]
    for rid, s in res["students"].items():
        assert s["status"] == "done", rid
        assert math.isfinite(s["valid_nll"]), rid
    assert (elsewhere / "qs" / res["report"]).is_file()
    assert not (ROOT / "qs").exists() and not (ROOT / "build").exists()
