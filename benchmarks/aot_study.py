"""The study's committed experiments compiled for a TPU and an NVIDIA target on this CPU,
with no flags beyond `--config` and `--target` (the teacher's shape from teacher.preset, no
data path, micro-batches chosen as the trainer chooses them): does each step fit?

    JAX_PLATFORMS=cpu python benchmarks/aot_study.py [--targets v5e:2x4,h100:8]
        [--configs c4_123m_kd,...] [--parts train,eval]

Each (experiment, target) runs `python -m hldstudy.aot --config experiments/X.py --target T
--json` in its own process (compiles need up to ~15 GiB of RAM; minutes each on 2 cores).
Needs the `aot` extra. Writes benchmarks/results/aot_study.{json,md}.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from hldstudy.aot.process import run_aot

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "benchmarks" / "results"
CONFIGS = ("c4_123m_kd", "c4_123m_hldf", "c4_123m_hldc", "c4_735m_kd", "c4_735m_hldf",
           "c4_735m_hldc")
GiB = 2 ** 30


def compile_one(config: str, target: str, parts: str) -> dict:
    run = run_aot(["--config", f"experiments/{config}.py", "--target", target, "--parts", parts])
    rec = {"config": config, **run.pop("report", {}), **run}
    rec.update(experiment=config, target=target)
    return rec


def markdown(records: list[dict]) -> str:
    lines = ["# The study's experiments compiled for their targets (no flags)", "",
             "`python -m hldstudy.aot --config experiments/X.py --target T` per row "
             "(`benchmarks/aot_study.py`). GiB per device.", "",
             "| experiment | target | step | micro-batches | tokens / step | compiled total | "
             "device | fits | free | planner / compiled |",
             "|---|---|---|---:|---:|---:|---:|---|---:|---:|"]
    for r in records:
        if "rows" not in r:
            lines.append(f"| {r['experiment']} | {r['target']} | (failed: {r.get('error')}) "
                         "| | | | | | | |")
            continue
        for row in r["rows"]:
            total = row["compiled"].get("total_bytes")
            dev = row["device_memory_bytes"]
            free = "" if total is None else f"{100 * (1 - total / dev):.0f}%"
            poc = row.get("planner_over_compiled")
            lines.append(
                f"| {r.get('experiment', r['config'])} | {r['target']} | {row['step']} | "
                f"{row.get('microbatches', '')} | {row['tokens_per_step']:,} | "
                f"{'' if total is None else f'{total / GiB:.2f}'} | {dev / GiB:.2f} | "
                f"{'yes' if row.get('fits') else '**no**'} | {free} | "
                f"{'' if poc is None else f'{poc:.3f}'} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--targets", default="v5e:2x4,h100:8")
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--parts", default="train,eval")
    args = ap.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    todo = [(c, t) for c in args.configs.split(",") for t in args.targets.split(",")]
    # Rows of an earlier run for pairs not compiled again are kept (one table for all).
    path = OUT / "aot_study.json"
    earlier = json.loads(path.read_text()) if path.exists() else []
    records = [r for r in earlier
               if (r.get("experiment", r["config"].replace("-", "_")), r["target"]) not in todo]
    for config, target in todo:
        records.append(compile_one(config, target, args.parts))
        print(f"{config} {target}: exit {records[-1]['exit']} "
              f"({records[-1]['seconds']} s)", flush=True)
        (OUT / "aot_study.json").write_text(json.dumps(records, indent=2) + "\n")
        (OUT / "aot_study.md").write_text(markdown(records))
    print(markdown(records))


if __name__ == "__main__":
    main()
