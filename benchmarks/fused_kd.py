"""Fused exact KD loss vs the materialized reference: memory and time.

    python benchmarks/fused_kd.py            # CPU cases, incl. (8192, 640, 262144)
    python benchmarks/fused_kd.py --quick    # small shapes, about a minute
    python benchmarks/fused_kd.py --gpu      # Pallas vs XLA-fused vs materialized, (8192, 2304, 256000, bf16)

Every (shape, implementation) runs in its own subprocess so that the process
peak RSS (`ru_maxrss`) and, on GPU, the allocator's peak belong to that case
alone. Each case measures forward+backward of the loss w.r.t. the student
(`jax.value_and_grad` over h_s and W_s):

- temp memory: XLA's `jit(...).lower(...).compile().memory_analysis()`
  `temp_size_in_bytes` (scratch beyond arguments and outputs);
- time: median of `--reps` timed calls after one warm-up call;
- peak RSS of the process (CPU) / `peak_bytes_in_use` of the device (GPU).

The two implementations of a shape run back to back, so they see the same
machine; the 1-minute load average at the start of each case is recorded
because a shared CPU box makes timings noisy. A materialized case whose
compiled footprint exceeds the free RAM is compiled (memory analysis) but not
run. The model part compiles one whole distillation training step of the
paper-123m student (its hidden states into each loss, tied head `W_s = E^T`)
and reports its temp memory.

Writes benchmarks/results/fused_kd.json and benchmarks/results/fused_kd.md.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"

CPU_CASES = [  # (T, d, V)
    (2048, 640, 32768),
    (8192, 640, 32768),
    (1024, 640, 262144),
    (8192, 640, 262144),
]
QUICK_CASES = [(256, 64, 4096), (512, 128, 16384)]
GPU_CASES = [(8192, 2304, 256000)]
GPU_QUICK_CASES = [(1024, 512, 32768)]


# ---------------------------------------------------------------------------
# Worker: one (shape, implementation) in a fresh process.


def _inputs(T, d, V, dtype):
    import jax
    import jax.numpy as jnp

    k = jax.random.split(jax.random.PRNGKey(0), 5)
    h_s = jax.random.normal(k[0], (T, d), jnp.float32).astype(dtype)
    h_t = jax.random.normal(k[1], (T, d), jnp.float32).astype(dtype)
    w_s = (jax.random.normal(k[2], (d, V), jnp.float32) * d**-0.5).astype(dtype)
    w_t = (jax.random.normal(k[3], (d, V), jnp.float32) * d**-0.5).astype(dtype)
    labels = jax.random.randint(k[4], (T,), 0, V)
    mask = jnp.ones((T,), bool)
    return h_s, w_s, h_t, w_t, labels, mask


def _impl(name):
    from hldstudy.losses import fused_kd_loss, materialized_kd_loss

    if name == "materialized":
        return materialized_kd_loss, {}
    if name == "fused":  # backend "auto": XLA on CPU, Pallas on GPU/TPU
        return fused_kd_loss, {}
    if name == "fused_xla":  # the XLA path with vocabulary chunks (accelerator sizes)
        return fused_kd_loss, {"backend": "xla", "row_block": 1024, "vocab_block": 32768}
    if name == "fused_pallas":
        return fused_kd_loss, {"backend": "pallas"}
    raise ValueError(f"--impl: unknown {name!r}")


def _available_bytes() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 1 << 62


def run_loss_case(impl: str, T: int, d: int, V: int, dtype: str, reps: int) -> dict:
    import jax
    import jax.numpy as jnp

    dtype = jnp.dtype(dtype)
    fn, kw = _impl(impl)
    h_s, w_s, h_t, w_t, labels, mask = _inputs(T, d, V, dtype)

    def loss(hs, ws):
        return fn(hs, ws, h_t, w_t, labels, mask, temperature=2.0, alpha=0.5, **kw)[0]

    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
    t0 = time.perf_counter()
    compiled = step.lower(h_s, w_s).compile()
    compile_s = time.perf_counter() - t0
    mem = compiled.memory_analysis()
    out = {
        "impl": impl, "T": T, "d": d, "V": V, "dtype": str(dtype), "backend": jax.default_backend(),
        "compile_s": compile_s,
        "temp_bytes": int(mem.temp_size_in_bytes),
        "argument_bytes": int(mem.argument_size_in_bytes),
        "output_bytes": int(mem.output_size_in_bytes),
        "load_avg_1m": os.getloadavg()[0],
    }
    footprint = out["temp_bytes"] + out["argument_bytes"] + out["output_bytes"]
    if jax.default_backend() == "cpu" and footprint > 0.85 * _available_bytes():
        out["skipped_run"] = (
            f"needs {footprint / 2**30:.1f} GiB, {_available_bytes() / 2**30:.1f} GiB available"
        )
    else:
        jax.block_until_ready(compiled(h_s, w_s))  # warm-up
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            jax.block_until_ready(compiled(h_s, w_s))
            times.append(time.perf_counter() - t0)
        out["times_s"] = times
        out["time_s"] = statistics.median(times)
    out["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    if jax.default_backend() != "cpu":
        stats = jax.devices()[0].memory_stats() or {}
        out["device_peak_bytes"] = stats.get("peak_bytes_in_use")
    return out


def run_model_case(impl: str, preset_name: str, vocab: int, batch: int, seq: int, d_teacher: int) -> dict:
    """Compiles one KD training step of the student (loss + grads w.r.t. all params)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from hldstudy.model import Transformer
    from hldstudy.model.presets import preset

    cfg = preset(preset_name, vocab_size=vocab)
    fn, kw = _impl(impl)
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model)
    k = jax.random.split(jax.random.PRNGKey(1), 3)
    tokens = jax.random.randint(k[0], (batch, seq), 0, vocab)
    h_t = jax.random.normal(k[1], (batch, seq, d_teacher), jnp.float32)
    w_t = jax.random.normal(k[2], (d_teacher, vocab), jnp.float32) * d_teacher**-0.5
    mask = jnp.ones((batch, seq), bool)

    def loss(params):
        student = nnx.merge(graphdef, params)
        out = student(tokens, return_logits=False)
        # Next-token labels: the batch's tokens shifted by one (last position masked).
        labels = jnp.roll(tokens, -1, axis=1)
        valid = mask.at[:, -1].set(False)
        return fn(out.final_hidden, student.head_weight(), h_t, w_t, labels, valid,
                  temperature=2.0, alpha=0.5, softcap=cfg.final_softcap, **kw)[0]

    t0 = time.perf_counter()
    compiled = jax.jit(jax.value_and_grad(loss)).lower(params).compile()
    mem = compiled.memory_analysis()
    return {
        "impl": impl, "preset": preset_name, "vocab": vocab, "batch": batch, "seq": seq,
        "d_teacher": d_teacher, "compile_s": time.perf_counter() - t0,
        "temp_bytes": int(mem.temp_size_in_bytes),
        "argument_bytes": int(mem.argument_size_in_bytes),
        "output_bytes": int(mem.output_size_in_bytes),
    }


# ---------------------------------------------------------------------------
# Driver.


def _spawn(args: list[str], timeout: float) -> dict:
    env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    cmd = [sys.executable, __file__, "--worker", *args]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    if proc.returncode != 0:
        return {"error": (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["failed"]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _gib(n):
    return "-" if n is None else f"{n / 2**30:.2f}"


def _fmt_time(r):
    if "time_s" in r:
        return f"{r['time_s']:.2f}"
    return "not run" if "skipped_run" in r else "error"


def write_markdown(results: dict, path: Path) -> None:
    lines = [f"# Fused KD loss benchmark ({results['mode']})", ""]
    lines.append(f"Machine: {results['machine']}. Forward+backward of the loss w.r.t. (h_s, W_s), "
                 f"float32 unless stated; temperature 2, alpha 0.5; teacher d = student d.")
    lines.append("")
    impls = results["impls"]
    ref = impls[-1]  # materialized
    header = ["T", "d", "V", "dtype"]
    for impl in impls:
        header += [f"{impl} temp GiB", f"{impl} peak GiB", f"{impl} time s"]
    header += [f"temp ratio ({ref} / fused)", f"time ratio (fused / {ref})"]
    lines.append("| " + " | ".join(header) + " |")
    lines.append("|" + "---|" * len(header))
    for row in results["cases"]:
        cells = [str(row["T"]), str(row["d"]), str(row["V"]), row["dtype"]]
        for impl in impls:
            r = row["runs"].get(impl, {"error": "missing"})
            # A case that was only compiled has no meaningful peak.
            peak = None if "skipped_run" in r else (r.get("device_peak_bytes") or r.get("peak_rss_bytes"))
            cells += [_gib(r.get("temp_bytes")), _gib(peak), _fmt_time(r)]
        fused, mat = row["runs"].get(impls[0], {}), row["runs"].get(ref, {})
        ratio_mem = (f"{mat['temp_bytes'] / max(fused['temp_bytes'], 1):.1f}x"
                     if "temp_bytes" in mat and "temp_bytes" in fused else "-")
        ratio_t = (f"{fused['time_s'] / mat['time_s']:.2f}x"
                   if "time_s" in mat and "time_s" in fused else "-")
        cells += [ratio_mem, ratio_t]
        lines.append("| " + " | ".join(cells) + " |")
    notes = []
    for row in results["cases"]:
        for impl, r in row["runs"].items():
            if "skipped_run" in r:
                notes.append(f"- ({row['T']}, {row['d']}, {row['V']}) {impl}: not run, {r['skipped_run']}.")
            if "error" in r:
                notes.append(f"- ({row['T']}, {row['d']}, {row['V']}) {impl}: error {r['error']}.")
            if "load_avg_1m" in r and "times_s" in r:
                notes.append(f"- ({row['T']}, {row['d']}, {row['V']}) {impl}: load average "
                             f"{r['load_avg_1m']:.1f} at start, times {[f'{t:.2f}' for t in r['times_s']]}.")
    if results.get("model"):
        lines += ["", "Whole KD training step (student forward+backward incl. the loss), XLA temp memory:", ""]
        lines.append("| student | V | B x T | d_teacher | impl | temp GiB | args GiB |")
        lines.append("|---|---|---|---|---|---|---|")
        for r in results["model"]:
            if "error" in r:
                lines.append(f"| - | - | - | - | {r.get('impl', '?')} | error: {r['error']} | - |")
                continue
            lines.append(f"| {r['preset']} | {r['vocab']} | {r['batch']} x {r['seq']} | {r['d_teacher']} | "
                         f"{r['impl']} | {_gib(r['temp_bytes'])} | {_gib(r['argument_bytes'])} |")
    if notes:
        lines += ["", "Notes:", "", *notes]
    path.write_text("\n".join(lines) + "\n")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="small shapes only")
    p.add_argument("--gpu", action="store_true", help="Pallas GPU kernels vs XLA paths at Gemma-2-2B shape")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--big-reps", type=int, default=2, help="reps for cases with T*V >= 2^31")
    p.add_argument("--no-model", action="store_true", help="skip the training-step memory part")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per case")
    p.add_argument("--out-dir", type=Path, default=RESULTS)
    p.add_argument("--worker", nargs="+", help=argparse.SUPPRESS)
    args = p.parse_args(argv)

    if args.worker:
        kind, *rest = args.worker
        if kind == "loss":
            impl, T, d, V, dtype, reps = rest
            out = run_loss_case(impl, int(T), int(d), int(V), dtype, int(reps))
        else:
            impl, preset_name, vocab, batch, seq, d_teacher = rest
            out = run_model_case(impl, preset_name, int(vocab), int(batch), int(seq), int(d_teacher))
        print(json.dumps(out))
        return 0

    if args.gpu:
        cases, dtype = (GPU_QUICK_CASES if args.quick else GPU_CASES), "bfloat16"
        impls = ["fused_pallas", "fused_xla", "materialized"]
        machine = "GPU"
    else:
        cases, dtype = (QUICK_CASES if args.quick else CPU_CASES), "float32"
        impls = ["fused", "materialized"]
        machine = f"CPU, {os.cpu_count()} cores (shared)"
    results = {"mode": ("gpu" if args.gpu else "cpu") + (" quick" if args.quick else ""),
               "machine": machine, "impls": impls, "cases": [], "model": []}
    for T, d, V in cases:
        reps = args.big_reps if T * V >= 2**31 else args.reps
        row = {"T": T, "d": d, "V": V, "dtype": dtype, "runs": {}}
        for impl in impls:  # back to back: same machine state for both
            r = _spawn(["loss", impl, str(T), str(d), str(V), dtype, str(reps)], args.timeout)
            row["runs"][impl] = r
            print(f"({T}, {d}, {V}) {impl}: {json.dumps(r)}", flush=True)
        results["cases"].append(row)

    if not args.no_model:
        if args.quick:
            model_cases = [("tiny", 512, 2, 128, 128)]
        else:
            model_cases = [("paper-123m", 32768, 8, 1024, 2560), ("paper-123m", 262144, 8, 1024, 2560)]
        for preset_name, vocab, batch, seq, d_teacher in model_cases:
            for impl in (impls[0], impls[-1]):
                r = _spawn(["model", impl, preset_name, str(vocab), str(batch), str(seq), str(d_teacher)],
                           args.timeout)
                r.setdefault("impl", impl)
                results["model"].append(r)
                print(f"model {preset_name} V={vocab} {impl}: {json.dumps(r)}", flush=True)

    args.out_dir.mkdir(parents=True, exist_ok=True)
    stem = "fused_kd" + ("_gpu" if args.gpu else "") + ("_quick" if args.quick else "")
    (args.out_dir / f"{stem}.json").write_text(json.dumps(results, indent=2) + "\n")
    write_markdown(results, args.out_dir / f"{stem}.md")
    print((args.out_dir / f"{stem}.md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
