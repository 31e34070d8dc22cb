"""benchmarks/device.sh, tested as far as a CPU allows, so that it runs first time on a GPU.

- without a GPU it prints one line and exits 0 (no traceback);
- the report writer turns a GPU-shaped result (every section, with errors and
  skips) into the markdown tables, MFU against the measured peak included;
- (slow) the dry run: every section at tiny shapes on CPU, the Pallas kernel in
  interpret mode, the peer wheels unpacked, and grain / lm-eval / wandb /
  tensorflow(-datasets) blocked in sys.modules (an import of one would fail a
  section).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "benchmarks" / "device.sh"


def _suite():
    spec = importlib.util.spec_from_file_location("device_suite",
                                                  REPO / "benchmarks" / "device_suite.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _env(**extra):
    env = {k: v for k, v in os.environ.items() if k not in ("HLDSTUDY_DEVICE_DRY", "PYTHONPATH")}
    env["PYTHON"] = sys.executable
    env.update(extra)
    return env


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="this machine has nvidia-smi")
def test_without_gpu_one_line_and_exit_0():
    proc = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, env=_env(),
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    lines = (proc.stdout + proc.stderr).strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("device.sh: no NVIDIA GPU"), lines


def test_report_from_gpu_shaped_results(tmp_path):
    suite = _suite()
    peak = 800e12
    T, d, V = 8192, 2304, 256000
    out = {
        "dry_run": False, "started": "now", "total_s": 240.0, "torch_version": "2.x",
        "jax": {"version": "0.x", "backend": "gpu", "device": "NVIDIA H200"},
        "peak": {"n": 8192, "flops_per_s": peak},
        "loss": [{"impl": "ours-pallas", "T": T, "d": d, "V": V, "time_s": 0.2,
                  "extra_bytes": 2**30, "loss": 6.1},
                 {"impl": "ours-xla", "T": T, "d": d, "V": V, "error": "XlaRuntimeError: OOM"}],
        "peers": [{"impl": "liger-jsd(beta=0)", "T": T, "d": d, "V": V, "time_s": 0.4,
                   "extra_bytes": 3 * 2**30, "loss": 6.1},
                  {"impl": "cce(nll only)", "T": T, "d": d, "V": V,
                   "skipped": "ModuleNotFoundError: No module named 'cut_cross_entropy'"}],
        "attention": [{"impl": "cudnn", "T": 8192, "window": None, "time_s": 0.01,
                       "temp_bytes": 0, "executed_flops": 1e12},
                      {"impl": "dense", "T": 8192, "window": 512, "error": "OOM"}],
        "kd_step": {"student": "paper-123m", "teacher": "paper-teacher-3.4b", "batch": 8,
                    "seq": 2048, "step_s": 0.5, "tokens_per_s": 32768, "compile_s": 60,
                    "executed_flops": 200e12, "model_flops_with_teacher": 150e12},
        "fp8": {"skipped": "hldstudy.compress has no FP8 matmul path (fp8_dot)"},
        "aot": {"case": "experiments/c4_123m_kd.py", "step": "train kd", "target": "h200:1",
                "device": "NVIDIA H200", "batch": 8, "seq": 2048, "step_s": 0.25,
                "compile_s": 50.0, "peak_bytes": 30 * 2**30, "device_memory_bytes": 140 * 2**30,
                "aot": {"argument_bytes": 2**30, "output_bytes": 2**29, "temp_bytes": 20 * 2**30,
                        "alias_bytes": 2**29, "total_bytes": 21 * 2**30},
                "compiled_here": {"argument_bytes": 2**30, "output_bytes": 2**29,
                                  "temp_bytes": 2**34, "alias_bytes": 2**29,
                                  "total_bytes": 17 * 2**30},
                "planner": {"argument_bytes": 2**30, "output_bytes": 2**29,
                            "temp_bytes": 18 * 2**30, "alias_bytes": 2**29,
                            "total_bytes": 19 * 2**30}},
    }
    md = suite.write_report(out, tmp_path, "device")
    # The compile tier's step: the compile-only figure, this device's and the planner's.
    assert "| hldstudy.aot --target h200:1 (compile-only) | 1.00 | 0.50 | 20.00 | 0.50 | 21.00 |" in md
    assert "| compiled on this device | 1.00 | 0.50 | 16.00 | 0.50 | 17.00 |" in md
    assert "| planner | 1.00 | 0.50 | 18.00 | 0.50 | 19.00 |" in md
    assert "peak 30.00 GiB" in md and "step 250.0 ms" in md
    assert json.loads((tmp_path / "device.json").read_text())["peak"]["flops_per_s"] == peak
    mfu = 8 * T * d * V / 0.2 / peak
    assert f"| {T} x {d} x {V} | ours-pallas | 200.0 | 1.00 | {100 * mfu:.1f}% |" in md
    assert "XlaRuntimeError: OOM" in md and "No module named 'cut_cross_entropy'" in md
    assert "| 8192 | global | cudnn | 10.00 |" in md and "| 8192 | 512 | dense | - |" in md
    assert f"| 0.500 | 32768 | {100 * 200e12 / 0.5 / peak:.1f}% | {100 * 150e12 / 0.5 / peak:.1f}% |" in md
    assert "no FP8 matmul path" in md


def test_heavy_modules_are_blocked():
    suite = _suite()
    code = ("import importlib.util, sys; sys.path.insert(0, 'benchmarks');"
            "spec = importlib.util.spec_from_file_location('s', 'benchmarks/device_suite.py');"
            "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m);"
            "m.block_heavy_imports()\n"
            "for name in m.BLOCKED_MODULES:\n"
            "    try:\n        __import__(name)\n    except ImportError:\n        continue\n"
            "    raise SystemExit(name + ' imported')\n"
            "import hldstudy.losses, hldstudy.train.step, hldstudy.teacher.colocated, hldstudy.flops\n"
            "import hldstudy.compress.fp8\n"
            "print('ok')")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                          env=_env(PYTHONPATH=str(REPO), JAX_PLATFORMS="cpu"), timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-2000:]
    assert set(suite.BLOCKED_MODULES) >= {"grain", "lm_eval", "wandb", "tensorflow_datasets"}


@pytest.mark.slow
def test_dry_run_every_section(tmp_path):
    proc = subprocess.run(["bash", str(SCRIPT), "--dry-run", "--out-dir", str(tmp_path)],
                          capture_output=True, text=True, env=_env(), timeout=900)
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-3000:])
    res = json.loads((tmp_path / "device_dry.json").read_text())
    assert res["dry_run"] and res["peak"]["flops_per_s"] > 0
    ours = [r for r in res["loss"] if r["impl"].startswith("ours")]
    assert len(ours) == 6 and all("error" not in r for r in ours), ours
    by_shape = {}
    for r in ours:  # the three implementations agree on the loss value
        by_shape.setdefault((r["T"], r["V"]), []).append(r["loss"])
    for values in by_shape.values():
        assert max(values) - min(values) < 2e-2 * abs(values[0]), values
    att = res["attention"]
    assert all("time_s" in r for r in att if r["impl"] != "cudnn"), att
    assert all("skipped" in r for r in att if r["impl"] == "cudnn")
    assert res["kd_step"]["step_s"] > 0 and res["kd_step"]["executed_flops"] > 0
    assert res["aot"]["step_s"] > 0 and res["aot"]["compiled_here"]["total_bytes"] > 0
    assert "fp8_time_s" in res["fp8"] or "skipped" in res["fp8"]
    peers = res["peers"]
    for r in peers:  # each peer either ran or says in one line why not
        assert "time_s" in r or r.get("skipped") or r.get("error"), r
        assert "\n" not in (r.get("skipped") or r.get("error") or "")
    if importlib.util.find_spec("torch") is not None:
        assert any(r["impl"] == "torch-materialized" and "time_s" in r for r in peers), peers
    md = (tmp_path / "device_dry.md").read_text()
    assert "Fused KD loss" in md and "KD train step" in md and "Attention paths" in md
