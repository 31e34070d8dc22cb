"""The MoE teacher's forward compiled for each target with each expert dispatch: what the
target makes of ragged dispatch (dropless: libtpu's grouped matmul on TPU, JAX's Mosaic
GPU kernels on Hopper, `hldstudy.model.grouped_matmul`) and of capacity buffers, in FLOPs
(counted from the optimized HLO, loop bodies times their trips, kernels by their declared
cost, against the FLOP model's active-expert count) and memory per device. The evidence
`model.moe_dispatch=auto` reads.

    JAX_PLATFORMS=cpu python benchmarks/aot_moe.py [--runs h100:8=ragged,h100:8=capacity,...]

`--runs` with a subset recompiles those rows and keeps the others of the last results
(each row says when it was compiled and the load then).

Each run is `python -m hldstudy.aot --config experiments/disaggkd_qwen35.py --layout
disaggregated --parts teacher --set teacher.moe_dispatch=D --set teacher.replica_devices=1
--set teacher.attention=dense --target T --json` in its own process (the replica's forward of Qwen3.5-35B-A3B in bf16 for
256 x 4096 tokens, on one device, in the micro-batches the replica picks there; attention
held dense, as these figures were measured: the experiment's own is auto, and the
dispatch, not the attention, is what this compares). Needs the `aot` extra. Writes
benchmarks/results/aot_moe.{json,md}.
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
CONFIG = "experiments/disaggkd_qwen35.py"
RUNS = ("h100:8=ragged", "h100:8=capacity", "h200:8=ragged", "h200:8=capacity",
        "v5p:2x2x2=auto")
GiB = 2 ** 30


def compile_one(target: str, dispatch: str) -> dict:
    load = round(os.getloadavg()[0], 2)  # before the compile, which loads the machine itself
    run = run_aot(["--config", CONFIG, "--layout", "disaggregated", "--parts", "teacher",
                   "--target", target, "--set", f"teacher.moe_dispatch={dispatch}",
                   "--set", "teacher.replica_devices=1", "--set", "teacher.attention=dense"])
    rec = {"target": target, "dispatch": dispatch, "exit": run["exit"],
           "seconds": run["seconds"], "load_at_start": load,
           "compiled_on": time.strftime("%Y-%m-%d")}
    if "error" in run:
        return {**rec, "error": run["error"]}
    report = run["report"]
    (row,) = report["rows"]
    rec.update({k: row.get(k) for k in ("step", "fits", "xla_flops", "xla_flops_from",
                                         "hlo_flops", "model_flops", "xla_over_model",
                                         "device_memory_bytes", "tokens")})
    rec["compiled"] = row["compiled"]
    rec["peak"] = row.get("peak", {}).get("largest", [])[:3]
    return rec


def markdown(records: list[dict]) -> str:
    lines = ["# The MoE teacher's forward per target and expert dispatch", "",
             f"`{CONFIG}`, `--parts teacher` (Qwen3.5-35B-A3B in bf16, dense attention, "
             "256 x 4096 tokens on one device), per run `--set teacher.moe_dispatch=D --target T` "
             "(`benchmarks/aot_moe.py`). Ragged is dropless: libtpu's grouped matmul on the "
             "TPU, JAX's Mosaic GPU kernels on the Hopper GPUs (`hldstudy.model."
             "grouped_matmul`). FLOPs per call: the "
             "XLA count (counted from the optimized HLO, the replica's micro-batch loop "
             "times its trips, the kernels by their declared cost: `xla_flops_from: hlo` on "
             "every target) against "
             "the FLOP model's active experts (top-k + shared). GiB per device.", "",
             "| target | dispatch | XLA FLOPs | model FLOPs | XLA / model | temporaries | "
             "total | device | fits | largest at the peak | compiled (load) |",
             "|---|---|---:|---:|---:|---:|---:|---:|---|---|---|"]
    for r in records:
        if "error" in r:
            lines.append(f"| {r['target']} | {r['dispatch']} | (failed: {r['error']}) "
                         "| | | | | | | | |")
            continue
        c = r["compiled"]
        peak = ", ".join(f"{g['op'][:40]} {g['bytes'] / GiB:.2f}" for g in r["peak"])
        ratio = r.get("xla_over_model")
        lines.append(
            f"| {r['target']} | {r['dispatch']} | {r['xla_flops']:.3g} | {r['model_flops']:.3g} "
            f"| {'' if ratio is None else f'**{ratio:.2f}**'} | "
            f"{c.get('temp_bytes', 0) / GiB:.2f} | {c.get('total_bytes', 0) / GiB:.2f} | "
            f"{r['device_memory_bytes'] / GiB:.2f} | {'yes' if r['fits'] else '**no**'} | "
            f"{peak} | {r.get('compiled_on', '')} ({r.get('load_at_start', '')}) |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", default=",".join(RUNS), help="TARGET=DISPATCH,...")
    args = ap.parse_args()
    previous = OUT / "aot_moe.json"
    kept = {}
    if previous.exists():  # rows not rerun stay (a subset of --runs updates its rows)
        old = json.loads(previous.read_text())
        for r in old.get("records", []):
            r.setdefault("load_at_start", old.get("load_at_start"))
            kept[(r["target"], r["dispatch"])] = r
    runs = [tuple(run.split("=")) for run in args.runs.split(",")]
    order = list(dict.fromkeys([tuple(r.split("=")) for r in RUNS] + list(kept) + runs))
    for target, dispatch in runs:
        kept[(target, dispatch)] = compile_one(target, dispatch)
        print(json.dumps({k: kept[(target, dispatch)].get(k) for k in
                          ("target", "dispatch", "exit", "xla_over_model", "fits")}), flush=True)
        records = [kept[k] for k in order if k in kept]
        OUT.mkdir(parents=True, exist_ok=True)
        write_json_atomic(OUT / "aot_moe.json", {"records": records})
        write_text_atomic(OUT / "aot_moe.md", markdown(records))
    print(markdown([kept[k] for k in order if k in kept]))


if __name__ == "__main__":
    main()
