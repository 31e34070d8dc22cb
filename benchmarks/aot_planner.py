"""The planner beside each target compiler on the programs it is held to (issue 28): the
DisaggKD student step, its teacher replica and the study's 123M KD step, each as
committed, on h100:8 and v5p:2x2x2: the compiler's total (what `fits` reads), its own peak
(`memory_analysis().peak_memory_in_bytes`), the planner, and the planner over the peak
aot holds it to (`hldstudy.aot.report.compiled_peak`: libtpu's peak on a TPU, the total
elsewhere) and over the total.

    JAX_PLATFORMS=cpu python benchmarks/aot_planner.py [--runs student@v5p:2x2x2,...]

`--runs` with a subset recompiles those rows and keeps the others of the last results
(each row says when it was compiled and the load then). Each run is `python -m
hldstudy.aot --config C --target T --parts P [--layout disaggregated] --json` in its own
process (up to ~15 GiB of RAM, minutes each on 2 cores). Needs the `aot` extra. Writes
benchmarks/results/aot_planner.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from hldstudy.aot.process import run_aot
from hldstudy.fileio import write_json_atomic, write_text_atomic

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "benchmarks" / "results"
DISAGG = ["--config", "experiments/disaggkd_qwen35.py", "--layout", "disaggregated"]
PROGRAMS = {
    "student": [*DISAGG, "--parts", "train"],
    "replica": [*DISAGG, "--parts", "teacher"],
    "study-123m": ["--config", "experiments/c4_123m_kd.py", "--parts", "train"],
}
TARGETS = ("h100:8", "v5p:2x2x2")
RUNS = tuple(f"{p}@{t}" for t in TARGETS for p in PROGRAMS)
GiB = 2 ** 30


def compile_one(program: str, target: str) -> dict:
    load = round(os.getloadavg()[0], 2)  # before the compile, which loads the machine itself
    run = run_aot([*PROGRAMS[program], "--target", target])
    rec = {"program": program, "target": target, "exit": run["exit"],
           "seconds": run["seconds"], "command": run["command"], "load_at_start": load,
           "compiled_on": time.strftime("%Y-%m-%d")}
    if "error" in run:
        return {**rec, "error": run["error"]}
    (row,) = run["report"]["rows"]
    c = row["compiled"]
    rec.update({k: row.get(k) for k in ("step", "fits", "planner_fits", "microbatches",
                                         "tokens_per_step", "device_memory_bytes",
                                         "planner_over_compiled")})
    rec.update(compiled=c, planner_bytes=row["planner"]["total_bytes"],
               planner_over_total=row["planner"]["total_bytes"] / c["total_bytes"])
    return rec


def markdown(records: list[dict]) -> str:
    lines = ["# The planner beside each compiler on the programs it is held to", "",
             "Per row `python -m hldstudy.aot --config C --target T --parts P --json`, as "
             "committed (`benchmarks/aot_planner.py`). GiB per device. Total: arguments + "
             "outputs - aliased + temporaries (what `fits` reads); peak: the compiler's own "
             "(`peak_memory_in_bytes`); the planner is held to libtpu's peak on a TPU and "
             "to the total on a GPU (`hldstudy.aot.report.compiled_peak`), within 15% "
             "(docs/planner.md).", "",
             "| program | target | step | total | peak | device | fits | planner | "
             "**planner / compiled** | planner / total | compiled (load) |",
             "|---|---|---|---:|---:|---:|---|---:|---:|---:|---|"]
    for r in records:
        if "error" in r:
            lines.append(f"| {r['program']} | {r['target']} | (failed: {r['error']}) "
                         "| | | | | | | | |")
            continue
        c = r["compiled"]
        peak = f"{c['peak_memory_bytes'] / GiB:.2f}" if c.get("peak_memory_bytes") else "-"
        lines.append(
            f"| {r['program']} | {r['target']} | {r['step']} | {c['total_bytes'] / GiB:.2f} "
            f"| {peak} | {r['device_memory_bytes'] / GiB:.2f} | "
            f"{'yes' if r['fits'] else '**no**'} | {r['planner_bytes'] / GiB:.2f} | "
            f"**{r['planner_over_compiled']:.3f}** | {r['planner_over_total']:.3f} | "
            f"{r['compiled_on']} ({r['load_at_start']}) |")
    lines += ["", "On the TPU libtpu's temporaries exceed its peak by what its code "
              "generation allocates beyond its buffer assignment; it compiles programs whose "
              "total exceeds the chip while the peak does not (docs/planner.md, libtpu)."]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", default=",".join(RUNS),
                    help="comma-separated program@target, of: " + ", ".join(RUNS))
    args = ap.parse_args()
    asked = [r.strip() for r in args.runs.split(",") if r.strip()]
    bad = [r for r in asked if r not in RUNS]
    if bad:
        ap.error(f"--runs: {', '.join(bad)} not among {', '.join(RUNS)}")
    path = OUT / "aot_planner.json"
    kept = {}
    if path.exists():  # rows not rerun stay (a subset of --runs updates its rows)
        kept = {f"{r['program']}@{r['target']}": r
                for r in json.loads(path.read_text())["records"]}
    for run in asked:
        program, target = run.split("@")
        print(f"compiling {run} ...", flush=True)
        kept[run] = compile_one(program, target)
        records = [kept[r] for r in RUNS if r in kept]  # written after each: none lost
        OUT.mkdir(parents=True, exist_ok=True)
        write_json_atomic(path, {"records": records})
        write_text_atomic(OUT / "aot_planner.md", markdown(records))
    print(markdown([kept[r] for r in RUNS if r in kept]))


if __name__ == "__main__":
    main()
