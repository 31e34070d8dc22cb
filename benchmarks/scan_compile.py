"""Scanned layers against unrolled ones, side by side in one run: the same train step
compiled for a target with `model.scan_layers=false` and `=true` (each in its own process,
one after the other), its compile time and the compiler's memory per device.

    JAX_PLATFORMS=cpu python benchmarks/scan_compile.py
        [--config experiments/disaggkd_qwen35.py] [--target h100:8]
        [--layout disaggregated] [--microbatches 4 32] [--set K=V ...]

The default is the DisaggKD experiment's 9B student step (Qwen3.5-9B, 32 layers in eight
groups of three DeltaNet layers and one attention layer) for 8 x H100, its teacher
streamed, at 4 micro-batches (what the committed run compiles: `train.microbatches=0`
picks 4 for the scanned step) and at 32 (one sequence per device per micro-batch: the
count where the unrolled step fits too). The count is pinned so that both programs are
the same accumulation loop. Needs the `aot` extra; the unrolled compile takes minutes
and up to ~15 GiB of RAM. Writes benchmarks/results/scan_compile.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from hldstudy.aot.process import run_aot
from hldstudy.fileio import write_json_atomic, write_text_atomic

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "benchmarks" / "results"
GiB = 2 ** 30


def compile_once(args, scan: bool, microbatches: int) -> dict:
    cmd = ["--config", args.config, "--target", args.target, "--layout", args.layout,
           "--parts", "train", "--set", f"model.scan_layers={str(scan).lower()}",
           "--set", f"train.microbatches={microbatches}"]
    for kv in args.overrides:
        cmd += ["--set", kv]
    run = run_aot(cmd)
    rec = {"scan_layers": scan, "microbatches": microbatches, "exit": run["exit"],
           "process_s": run["seconds"], "command": run["command"]}
    if "error" in run:
        return {**rec, "error": run["error"]}
    report = run["report"]
    (row,) = report["rows"]
    rec.update(step=row["step"], compile_s=row["compile_s"], fits=row["fits"],
               total_bytes=row["compiled"].get("total_bytes"),
               temp_bytes=row["compiled"].get("temp_bytes"),
               microbatches=row.get("microbatches"), tokens_per_step=row["tokens_per_step"],
               device_memory_bytes=row["device_memory_bytes"])
    return rec


def markdown(meta: dict, records: list[dict]) -> str:
    lines = ["# Scanned layers vs unrolled: compile time and memory", "",
             f"`{meta['config']}` for **{meta['target']}** ({meta['layout']} teacher), "
             f"overrides {meta['overrides'] or 'none'}; each compile in its own process, "
             f"one after the other (`benchmarks/scan_compile.py`), load average at start "
             f"{meta['load_at_start']}.", "",
             "| layers | step | micro-batches | compile (s) | total GiB / device | "
             "temporaries GiB | fits |", "|---|---|---:|---:|---:|---:|---|"]
    for r in records:
        name = "scanned" if r["scan_layers"] else "unrolled"
        if "error" in r:
            lines.append(f"| {name} | (failed: {r['error']}) | | | | | |")
            continue
        lines.append(f"| {name} | {r['step']} | {r['microbatches']} | {r['compile_s']:.1f} | "
                     f"{r['total_bytes'] / GiB:.2f} | {r['temp_bytes'] / GiB:.2f} | "
                     f"{'yes' if r['fits'] else '**no**'} |")
    lines.append("")
    for k in meta["microbatches"]:
        done = {r["scan_layers"]: r for r in records
                if "error" not in r and r["microbatches"] == k}
        if len(done) == 2:
            lines.append(f"Unrolled / scanned compile time at {k} micro-batches: "
                         f"**{done[False]['compile_s'] / done[True]['compile_s']:.2f}x**.")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="experiments/disaggkd_qwen35.py")
    ap.add_argument("--target", default="h100:8")
    ap.add_argument("--layout", default="disaggregated")
    ap.add_argument("--microbatches", type=int, nargs="+", default=[4, 32],
                    help="train.microbatches of each pair (unrolled, scanned)")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="K=V")
    ap.add_argument("--name", default="scan_compile", help="results file stem")
    args = ap.parse_args()
    meta = {"config": args.config, "target": args.target, "layout": args.layout,
            "microbatches": args.microbatches, "overrides": args.overrides,
            "load_at_start": round(os.getloadavg()[0], 2)}
    records = []
    for k in args.microbatches:
        for scan in (False, True):
            records.append(compile_once(args, scan, k))
            print(json.dumps(records[-1]), flush=True)
    OUT.mkdir(parents=True, exist_ok=True)
    write_json_atomic(OUT / f"{args.name}.json", {**meta, "records": records})
    text = markdown(meta, records)
    write_text_atomic(OUT / f"{args.name}.md", text)
    print(text)


if __name__ == "__main__":
    main()
