"""The memory planner validated on compiled programs it was not fitted to (issue 44): a fit
list (the programs its GPU and TPU constants were fitted on) and a disjoint validation
list spanning GPU kinds of different memory sizes and TPU, dense and MoE, train steps
(colocated, disaggregated, a cohort, accumulated micro-batches) and replicas, 123M to 35B;
each program's planner / compiled (`hldstudy.plan.compiled_peak`: libtpu's peak on a TPU,
the total on a GPU), and per compiler the validation band (`hldstudy.plan.compilers`).

    JAX_PLATFORMS=cpu PYTHONPATH=<the aot extra> python benchmarks/planner_validation.py \\
        [--compile] [--only NAME,...]

Each program is lowered now (`python -m hldstudy.aot ... --lower-only`: seconds; the
planner's figure as the code reads it today and the lowered program's sha256) and read
against its kept compile (benchmarks/results/planner_validation.json), current when it
compiled the same lowered program with this host's tools (`hldstudy.aot.fingerprint`). A
refitted constant thus needs no compile; a changed program does: `--compile` compiles the
missing and stale ones (one process each, up to ~15 GiB and minutes on 2 cores), else they
are shown as such. Writes benchmarks/results/planner_validation.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from hldstudy.aot.fingerprint import stale_reason, toolchain
from hldstudy.aot.process import run_aot
from hldstudy.aot.targets import parse_target
from hldstudy.fileio import write_json_atomic, write_text_atomic
from hldstudy.plan.compilers import COMPILERS, PROGRAM_KINDS
from hldstudy.plan.step_memory import compiled_peak

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "benchmarks" / "results"
GiB = 2**30
Q35, Q122 = "experiments/disaggkd_qwen35.py", "experiments/disaggkd_qwen35_122b.py"
C4 = "experiments/c4_123m_kd.py"
DIS = ["--layout", "disaggregated"]


def _aot(config: str, target: str, parts: str, *extra: str) -> list[str]:
    return ["--config", config, "--target", target, "--parts", parts, *extra]


def MB(k: int) -> list[str]:  # noqa: N802 - a train step's micro-batches, always explicit
    return ["--set", f"train.microbatches={k}"]  # (auto may compile another count)


def RB(m: int) -> list[str]:  # noqa: N802 - a replica's sequences per forward
    return ["--set", f"teacher.replica_batch={m}"]


# What the GPU and TPU rows' constants were fitted on (hldstudy.plan.compilers): the
# DisaggKD student, its replica and the study's 123M step on one node of each, as committed.
# tests/test_plan.py pins more fitted programs (the 3.4B replica at several micro-batches,
# libtpu's v5e train steps); they are the fit's, never the validation's.
FIT = {
    "student@h100:8": _aot(Q35, "h100:8", "train", *DIS, *MB(4)),
    "replica@h100:8": _aot(Q35, "h100:8", "teacher", *DIS, *RB(128)),
    "study-123m@h100:8": _aot(C4, "h100:8", "train", *MB(1)),
    "student@v5p:2x2x2": _aot(Q35, "v5p:2x2x2", "train", *DIS, *MB(4)),
    "replica@v5p:2x2x2": _aot(Q35, "v5p:2x2x2", "teacher", *DIS, *RB(256)),
    "study-123m@v5p:2x2x2": _aot(C4, "v5p:2x2x2", "train", *MB(1)),
}
# Programs no constant was fitted on: other chips (A100 40 GB, H200 141 GB, v6e 32 GB),
# other micro-batch counts and replica sizes, a cohort, the other pair, a colocated MoE
# teacher, the 3.4B dense replica on another GPU.
VALIDATION = {
    "study-123m@a100:8": _aot(C4, "a100:8", "train", *MB(1)),
    "study-123m accumulated@h200:8": _aot(C4, "h200:8", "train", *MB(4)),
    "study-123m cohort of 4@h100:8": _aot(C4, "h100:8", "train", "--cohort", "4", *MB(4)),
    "study-123m@v6e:2x4": _aot(C4, "v6e:2x4", "train", *MB(2)),
    "3.4b replica@h200:1": _aot(C4, "h200:1", "teacher", *DIS, *RB(32)),
    "replica@h200:4": _aot(Q35, "h200:4", "teacher", *DIS, *RB(64)),
    "replica@v5p:2x2x1": _aot(Q35, "v5p:2x2x1", "teacher", *DIS, *RB(64)),
    "122b replica@v5p:2x2x1": _aot(Q122, "v5p:2x2x1", "teacher", *DIS, *RB(16)),
    "student colocated@h200:8": _aot(Q35, "h200:8", "train", "--layout", "colocated", *MB(4)),
    "student mb 8@v5p:2x2x2": _aot(Q35, "v5p:2x2x2", "train", *DIS, *MB(8)),
    "35b student@h200:8": _aot(Q122, "h200:8", "train", *DIS, *MB(32)),
    "35b student@v5p:2x2x2": _aot(Q122, "v5p:2x2x2", "train", *DIS, *MB(32)),
}
assert not set(FIT) & set(VALIDATION)


def _backend(args: list[str]) -> str:
    return parse_target(args[args.index("--target") + 1]).backend


def _one_row(run: dict) -> dict | None:
    try:
        (row,) = run["report"]["rows"]
        return row
    except (KeyError, TypeError, ValueError):
        return None


def compile_record(args: list[str]) -> dict:
    """One compile in a process of its own: the compiler's figures, the lowered program's
    sha256 and the tools that compiled it, or its error."""
    load = round(os.getloadavg()[0], 2)
    run = run_aot(args)
    rec = {"args": args, "seconds": run["seconds"], "load_at_start": load,
           "compiled_on": time.strftime("%Y-%m-%d")}
    row = _one_row(run)
    if row is None:
        return {**rec, "error": run.get("error", "no single row in the report")}
    rec.update(step=row["step"], program_sha256=row.get("program_sha256"),
               toolchain=run["report"].get("toolchain"), compiled=row["compiled"],
               device_memory_bytes=row["device_memory_bytes"], refused=row.get("refused"))
    return rec


def read_program(name: str, args: list[str], kept: dict, compile_missing: bool) -> dict:
    """The program's row: the planner now (lowered), its kept compile if current (compiled
    now with `compile_missing`), and planner / compiled."""
    backend = _backend(args)
    low = run_aot([*args, "--lower-only"])
    row = _one_row(low)
    out = {"name": name, "args": args, "backend": backend}
    if row is None or "planner" not in row:
        return {**out, "error": low.get("error", "no planner figure")}
    out.update(step=row["step"], planner_bytes=row["planner"]["total_bytes"],
               program_sha256=row["program_sha256"])
    rec = kept.get(name)
    why = "never compiled" if rec is None or rec.get("args") != args else \
        stale_reason(rec, toolchain(backend), row["program_sha256"])
    if why is not None and compile_missing:
        print(f"  compiling ({why}) ...", flush=True)
        rec = compile_record(args)
        kept[name] = rec
        why = rec.get("error") or stale_reason(rec, toolchain(backend), row["program_sha256"])
    if why is not None:
        return {**out, "stale": why}
    if rec.get("refused") or not rec["compiled"].get("total_bytes"):
        return {**out, "stale": "refused by the compiler: no figure to read"}
    compiled = compiled_peak(rec["compiled"], backend)
    return {**out, "compiled_bytes": compiled, "ratio": out["planner_bytes"] / compiled,
            "device_memory_bytes": rec["device_memory_bytes"],
            "compiled_on": rec["compiled_on"], "load_at_start": rec["load_at_start"]}


def kind_of(args: list[str]) -> str:
    """The planner's kind of program (`hldstudy.plan.compilers.PROGRAM_KINDS`)."""
    return "replica" if args[args.index("--parts") + 1] == "teacher" else "train"


def bands(rows: list[dict]) -> dict[str, dict]:
    """Per compiler and kind of program ("gpu train", ...), the validation programs'
    planner / compiled span (their residuals)."""
    out = {}
    for backend in ("gpu", "tpu"):
        for kind in PROGRAM_KINDS:
            ratios = [r["ratio"] for r in rows if r["backend"] == backend and "ratio" in r
                      and kind_of(r["args"]) == kind]
            if ratios:
                out[f"{backend} {kind}"] = {
                    "low": min(ratios), "high": max(ratios), "programs": len(ratios),
                    "within_15": all(0.85 <= x <= 1.15 for x in ratios)}
    return out


def markdown(fit: list[dict], val: list[dict], band: dict) -> str:
    def table(rows):
        lines = ["| program | target | step | planner GiB | compiled GiB | device GiB | "
                 "**planner / compiled** | compiled (load) |",
                 "|---|---|---|---:|---:|---:|---:|---|"]
        for r in rows:
            target = r["args"][r["args"].index("--target") + 1]
            if "ratio" not in r:
                lines.append(f"| {r['name']} | {target} | {r.get('step', '-')} | "
                             f"{r.get('planner_bytes', 0) / GiB:.2f} | "
                             f"({r.get('stale') or r.get('error')}) | | | |")
                continue
            flag = "" if 0.85 <= r["ratio"] <= 1.15 else " (outside 15%)"
            lines.append(f"| {r['name']} | {target} | {r['step']} | "
                         f"{r['planner_bytes'] / GiB:.2f} | {r['compiled_bytes'] / GiB:.2f} | "
                         f"{r['device_memory_bytes'] / GiB:.2f} | **{r['ratio']:.3f}**{flag} | "
                         f"{r['compiled_on']} ({r['load_at_start']}) |")
        return lines

    out = ["# The memory planner on the programs it was fitted on, and on others", "",
           "`python benchmarks/planner_validation.py` (each program: `python -m hldstudy.aot "
           "<args> --json`, its arguments in the JSON). GiB per device; compiled: the "
           "figure `fits` reads (`hldstudy.plan.compiled_peak`: libtpu's peak on a TPU, "
           "the total on a GPU); planner: aot's (`hldstudy.aot.report`), as the code reads "
           "it now. A row without a figure was not compiled from the program as this "
           "checkout lowers it, and says why. The load beside a compile is the machine's "
           "when it began; it does not change a compile's figures (they are the "
           "compiler's, not timings).", "", "## Fit list (in-sample)", "",
           *table(fit), "", "## Validation list (not fitted on)", "", *table(val), "",
           "## Validation band per compiler and kind of program", "",
           "| compiler, programs | validated on | planner / compiled, lowest | highest | "
           "all within 15% | band in hldstudy.plan.compilers |", "|---|---:|---:|---:|---|---|"]
    for name, b in band.items():
        backend, kind = name.split()
        kept = dict(COMPILERS[backend].validated_band).get(kind, (1.0, 1.0))
        out.append(f"| {name} | {b['programs']} | {b['low']:.3f} | {b['high']:.3f} | "
                   f"{'yes' if b['within_15'] else 'no'} | "
                   f"{kept[0]:.3f}-{kept[1]:.3f} |")
    out += ["", "Where a compiler's validation programs leave 0.85-1.15, the planner carries "
            "their span as its band (`validated_band`): aot's rows give `planner_band` (the "
            "compiled figure the planner's implies, bytes, low-high) and its `planner_fits`, "
            "like the decision map's planner-only cells, reads the band's pessimistic end "
            "(`hldstudy.plan.compilers.validation_band`)."]
    return "\n".join(out) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--compile", action="store_true",
                    help="compile the programs whose kept compile is missing or stale")
    ap.add_argument("--only", default="", help="comma-separated names to read (others kept)")
    a = ap.parse_args()
    everything = {**FIT, **VALIDATION}
    only = [n.strip() for n in a.only.split(",") if n.strip()]
    bad = [n for n in only if n not in everything]
    if bad:
        ap.error(f"--only: {', '.join(bad)} not among {', '.join(everything)}")
    path = OUT / "planner_validation.json"
    last = json.loads(path.read_text()) if path.exists() else {"records": {}, "rows": {}}
    kept, rows = last["records"], last["rows"]
    for name in only or everything:
        print(f"{name} ...", flush=True)
        rows[name] = read_program(name, everything[name], kept, a.compile)
        got = rows[name]
        print(f"  {got.get('ratio', got.get('stale') or got.get('error'))}", flush=True)
        fit = [rows[n] for n in FIT if n in rows]
        val = [rows[n] for n in VALIDATION if n in rows]
        band = bands(val)
        OUT.mkdir(parents=True, exist_ok=True)  # written after each program: none lost
        write_json_atomic(path, {"records": kept, "rows": rows, "band": band})
        write_text_atomic(OUT / "planner_validation.md", markdown(fit, val, band))
    print((OUT / "planner_validation.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
