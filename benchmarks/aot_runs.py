"""`python -m hldstudy.aot ... --json` in a process of its own, for the compile benchmarks
(aot_study, aot_moe, scan_compile): a full-size compile needs up to ~15 GiB of RAM, which
a fresh process returns."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run_aot(args: list[str]) -> dict:
    """{"exit", "seconds", "command"} and the JSON report ("report") or the last line the
    command wrote to stderr ("error")."""
    cmd = [sys.executable, "-m", "hldstudy.aot", *args, "--json"]
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
