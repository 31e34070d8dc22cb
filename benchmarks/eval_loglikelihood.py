"""`HLDStudyLM.loglikelihood` throughput (requests/s) on this machine's CPU.

Requests are HellaSwag-shaped: synthetic multiple-choice items
(`hldstudy.data.synthetic.make_multiple_choice`), one request per ending, so
a run scores contexts of ~60-120 tokens with 4 endings each, as lm-eval sends
them. For the tiny model and a paper-123m-shaped model (reduced vocabulary,
random weights: speed does not depend on them) it reports the first call
(which compiles one scorer per length bucket) and the steady state
(median of repeats), in requests/s and scored tokens/s. For the tiny model it
also times the same requests padded to the full model length (one bucket),
which is what length bucketing saves. Writes
benchmarks/results/eval_loglikelihood.json and .md.

    python benchmarks/eval_loglikelihood.py [--items 16] [--vocab 8192] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import jax
import numpy as np

from hldstudy.data.synthetic import make_multiple_choice
from hldstudy.eval.adapter import HLDStudyLM, compiled_scorers
from hldstudy.eval.testing import init_model, tiny_tokenizer
from hldstudy.model import preset
from hldstudy.model.transformer import count_params

OUT = Path(__file__).resolve().parent / "results"


def requests(n_items: int) -> list[SimpleNamespace]:
    out = []
    for it in make_multiple_choice(n_items, seed=0):
        ctx = f"{it['activity_label']}: {it['ctx_a']} {it['ctx_b'].capitalize()}"
        out += [SimpleNamespace(args=(ctx, " " + e)) for e in it["endings"]]
    return out


def bench(name: str, model_cfg, tokenizer, reqs, *, max_length: int, batch_size: int,
          repeats: int, single_bucket: bool = False) -> dict:
    model = init_model(model_cfg, 0)
    lm = HLDStudyLM(model=model, tokenizer=tokenizer, max_length=max_length,
                    batch_size=batch_size, progress=False)
    if single_bucket:
        lm.scorer.buckets = [max_length]
    rows = [lm._row(*lm.encode_pair(*r.args)) for r in reqs]
    scored = sum(len(toks) - 1 for toks, _ in rows)
    compiled = compiled_scorers()
    t = time.perf_counter()
    first = lm.loglikelihood(reqs)
    first_s = time.perf_counter() - t
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        again = lm.loglikelihood(reqs)
        times.append(time.perf_counter() - t)
    assert np.allclose([a for a, _ in first], [a for a, _ in again])
    steady = float(np.median(times))
    lengths = [len(toks) - 1 for toks, _ in rows]
    return {
        "model": name, "params": count_params(model_cfg)["total"],
        "vocab": model_cfg.vocab_size, "max_length": max_length, "batch_size": batch_size,
        "buckets": lm.scorer.buckets, "requests": len(reqs),
        "tokens_per_request": float(np.mean(lengths)),
        "compiled_shapes": compiled_scorers() - compiled,
        "first_call_s": first_s, "steady_s": steady,
        "requests_per_s": len(reqs) / steady, "tokens_per_s": scored / steady,
        "single_bucket": single_bucket,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--items", type=int, default=16, help="multiple-choice items (4 requests each)")
    ap.add_argument("--items-123m", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=8192, help="paper-123m vocabulary")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--skip-123m", action="store_true")
    args = ap.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        tok = tiny_tokenizer(tmp, 512)
    results = []
    tiny = preset("tiny")
    reqs = requests(args.items)
    results.append(bench("tiny", tiny, tok, reqs, max_length=512, batch_size=args.batch_size,
                         repeats=args.repeats))
    results.append(bench("tiny", tiny, tok, reqs, max_length=512, batch_size=args.batch_size,
                         repeats=args.repeats, single_bucket=True))
    if not args.skip_123m:
        p123 = preset("paper-123m", vocab_size=args.vocab)
        results.append(bench(f"paper-123m (V={args.vocab})", p123, tok, requests(args.items_123m),
                             max_length=1024, batch_size=args.batch_size,
                             repeats=max(1, args.repeats - 1)))

    meta = {"backend": jax.default_backend(), "devices": len(jax.devices()),
            "cpu": platform.processor() or platform.machine(), "jax": jax.__version__,
            "cpu_count": os.cpu_count(), "load_avg_1min": round(os.getloadavg()[0], 2)}
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "eval_loglikelihood.json").write_text(json.dumps({"meta": meta, "results": results},
                                                            indent=2) + "\n")
    lines = [f"Backend {meta['backend']} ({meta['cpu']}, {meta['cpu_count']} cores, load average "
             f"{meta['load_avg_1min']} when it finished), jax {meta['jax']}. HellaSwag-shaped "
             "requests (synthetic items, 4 endings each); steady state = median of repeats "
             "after the first (compiling) call.", "",
             "| model | params | max len | padding | batch | requests | tok/request | "
             "compiled shapes | first call (s) | requests/s | tokens/s |",
             "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        pad = "full length" if r["single_bucket"] else f"buckets {r['buckets']}"
        lines.append(f"| {r['model']} | {r['params'] / 1e6:.1f}M | {r['max_length']} | {pad} | "
                     f"{r['batch_size']} | {r['requests']} | {r['tokens_per_request']:.0f} | "
                     f"{r['compiled_shapes']} | {r['first_call_s']:.2f} | "
                     f"{r['requests_per_s']:.1f} | {r['tokens_per_s']:.0f} |")
    (OUT / "eval_loglikelihood.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
