"""`python -m hldstudy.aot ... --json` in a process of its own, for what compiles many
full-size programs one after another (the decision map, the compile benchmarks): such a
compile needs up to ~15 GiB of RAM, which a fresh process returns."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

# Experiment paths (experiments/...) are relative to the repository's root.
ROOT = Path(__file__).resolve().parents[2]


def run_aot(args: list[str]) -> dict:
    """{"exit", "seconds", "command"} and the JSON report ("report") or the last line the
    command wrote to stderr ("error"). `--json` is added unless `args` has it."""
    cmd = [sys.executable, "-m", "hldstudy.aot", *args]
    if "--json" not in args:
        cmd.append("--json")
    t0 = time.perf_counter()
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT,
                         env={**os.environ, "JAX_PLATFORMS": "cpu"})
    rec = {"exit": out.returncode, "seconds": round(time.perf_counter() - t0, 1),
           "command": " ".join(["python", *cmd[1:]])}
    try:
        rec["report"] = json.loads(out.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        rec["error"] = (out.stderr.strip().splitlines() or ["?"])[-1][:400]
    return rec
