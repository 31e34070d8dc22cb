"""Attention paths (hldstudy.model.attention): memory and time of forward+backward.

    python benchmarks/attention.py            # CPU: dense vs chunked, T = 2048, 4096 (+ blocks, short T)
    python benchmarks/attention.py --quick    # two small shapes, a minute
    python benchmarks/attention.py --gpu      # dense / chunked / cudnn in bf16, T = 2048, 8192

`--gpu` is chosen automatically when JAX's default backend is a GPU. One
attention layer of the paper-123m layout (4 query heads, 1 KV head, head_dim
256), batch 1, global or local (window 512). Each (shape, implementation)
runs in its own subprocess and measures `jax.value_and_grad` of
`sum(attention(q, k, v) * cotangent)` w.r.t. q, k, v:

- temp memory: XLA's `jit(...).lower(...).compile().memory_analysis()`
  `temp_size_in_bytes` (scratch beyond arguments and outputs: where dense
  keeps its T x T logits and probabilities);
- time: median of `--reps` calls after one warm-up call;
- executed attention FLOPs (analytic, module docstring of
  hldstudy/model/attention.py): dense 12 N H T^2, chunked 14 N H P with P
  the (query, key) pairs in the blocks it visits (`evaluated_blocks`), cudnn
  counted like chunked (it skips masked tiles; its internal tiling differs);
- GPU: the device allocator's `peak_bytes_in_use`.

The implementations of one shape run back to back; the 1-minute load average
at the start of each case is recorded because the CPU box is shared.

Writes benchmarks/results/attention[_gpu][_quick].{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
HEADS, KV_HEADS, HEAD_DIM = 4, 1, 256  # paper-123m / Gemma 3 270M attention
LOCAL_WINDOW = 512

# (T, window, packed, [(impl, block)])
CPU_CASES = [
    (2048, None, False, [("dense", None), ("chunked", None)]),
    (2048, LOCAL_WINDOW, False, [("dense", None), ("chunked", None)]),
    (4096, None, False, [("dense", None), ("chunked", None), ("chunked", 128), ("chunked", 512)]),
    (4096, LOCAL_WINDOW, False, [("dense", None), ("chunked", None), ("chunked", 128),
                                 ("chunked", 512)]),
    (4096, None, True, [("dense", None), ("chunked", None)]),
    # Where `auto` switches on CPU (AUTO_CHUNKED_MIN_T).
    (512, None, False, [("dense", None), ("chunked", None)]),
    (1024, None, False, [("dense", None), ("chunked", None)]),
]
QUICK_CASES = [
    (512, None, False, [("dense", None), ("chunked", 128)]),
    (1024, 256, False, [("dense", None), ("chunked", 128)]),
]
GPU_IMPLS = [("dense", None), ("chunked", None), ("cudnn", None)]
GPU_CASES = [(t, w, p, GPU_IMPLS) for t in (2048, 8192) for w in (None, LOCAL_WINDOW)
             for p in (False, True)]
GPU_QUICK_CASES = [(1024, None, False, GPU_IMPLS), (1024, 256, True, GPU_IMPLS)]


# ---------------------------------------------------------------------------
# Worker: one (shape, implementation) in a fresh process.


def _inputs(T: int, packed: bool, dtype):
    import jax
    import jax.numpy as jnp

    keys = jax.random.split(jax.random.PRNGKey(0), 4)
    q = (jax.random.normal(keys[0], (1, T, HEADS, HEAD_DIM)) * HEAD_DIM**-0.5).astype(dtype)
    k = jax.random.normal(keys[1], (1, T, KV_HEADS, HEAD_DIM)).astype(dtype)
    v = jax.random.normal(keys[2], (1, T, KV_HEADS, HEAD_DIM)).astype(dtype)
    cot = jax.random.normal(keys[3], q.shape, jnp.float32)
    seg = None
    if packed:  # four documents of equal length
        seg = (jnp.arange(T, dtype=jnp.int32)[None] * 4 // T) + 1
    return q, k, v, cot, seg


def executed_flops(impl: str, T: int, window: int | None, block: int | None) -> int:
    """Forward+backward attention matmul FLOPs actually executed (see module docstring)."""
    from hldstudy.model import attention as attn

    per_pair = HEADS * HEAD_DIM  # one (query, key) pair of one head: 2 FLOPs x H per matmul
    if impl == "dense":
        return 12 * per_pair * T * T
    b = block or attn.DEFAULT_BLOCK_Q
    blocks = attn.evaluated_blocks(T, window, b, b)
    pairs = len(blocks["forward"]) * blocks["block_q"] * blocks["block_k"]
    return 14 * per_pair * pairs


def run_case(impl: str, T: int, window: int | None, packed: bool, block: int | None,
             dtype: str, reps: int) -> dict:
    import jax
    import jax.numpy as jnp

    from hldstudy.model import attention as attn

    q, k, v, cot, seg = _inputs(T, packed, jnp.dtype(dtype))
    kw = {"window": window}
    if impl == "chunked":
        fn = attn.chunked_attention
        if block:
            kw.update(block_q=block, block_k=block)
    else:
        fn = {"dense": attn.dense_attention, "cudnn": attn.cudnn_attention}[impl]

    def loss(q, k, v):
        return jnp.sum(fn(q, k, v, seg, **kw).astype(jnp.float32) * cot)

    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
    t0 = time.perf_counter()
    compiled = step.lower(q, k, v).compile()
    compile_s = time.perf_counter() - t0
    mem = compiled.memory_analysis()
    out = {
        "impl": impl, "T": T, "window": window, "packed": packed, "dtype": dtype,
        "block": (block or attn.DEFAULT_BLOCK_Q) if impl == "chunked" else None,
        "backend": jax.default_backend(), "compile_s": compile_s,
        "temp_bytes": int(mem.temp_size_in_bytes),
        "argument_bytes": int(mem.argument_size_in_bytes),
        "executed_flops": executed_flops(impl, T, window, block),
        "load_avg_1m": os.getloadavg()[0],
    }
    jax.block_until_ready(compiled(q, k, v))  # warm-up
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(compiled(q, k, v))
        times.append(time.perf_counter() - t0)
    out["times_s"] = times
    out["time_s"] = statistics.median(times)
    if jax.default_backend() != "cpu":
        stats = jax.devices()[0].memory_stats() or {}
        out["device_peak_bytes"] = stats.get("peak_bytes_in_use")
    return out


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
        lines = (proc.stderr or proc.stdout).strip().splitlines()
        return {"error": lines[-1] if lines else "failed"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _mib(n):
    return "-" if n is None else f"{n / 2**20:.1f}"


def _label(r: dict) -> str:
    return r["impl"] + (f" (block {r['block']})" if r.get("block") else "")


def write_markdown(results: dict, path: Path) -> None:
    lines = [f"# Attention benchmark ({results['mode']})", "",
             f"Machine: {results['machine']}. One attention layer, forward+backward w.r.t. q, k, v; "
             f"batch 1, {HEADS} query heads, {KV_HEADS} KV head, head_dim {HEAD_DIM}, "
             f"{results['dtype']}. Packed rows: 4 equal documents. Ratios are against dense "
             f"of the same shape (memory: dense / path; time and FLOPs: path / dense).", ""]
    header = ["T", "window", "packed", "path", "temp MiB", "memory ratio", "time s", "time ratio",
              "exec. GFLOP", "FLOP ratio"]
    if results["mode"].startswith("gpu"):
        header.insert(5, "device peak MiB")
    lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    notes = []
    for row in results["cases"]:
        dense = next((r for r in row["runs"] if r.get("impl") == "dense" and "error" not in r), None)
        for r in row["runs"]:
            shape = [str(row["T"]), str(row["window"] or "global"), "yes" if row["packed"] else "no"]
            if "error" in r:
                lines.append("| " + " | ".join(shape + [r.get("impl", "?"), f"error: {r['error']}"]
                                               + ["-"] * (len(header) - 5)) + " |")
                continue
            mem_ratio = f"{dense['temp_bytes'] / max(r['temp_bytes'], 1):.1f}x" if dense else "-"
            time_ratio = f"{r['time_s'] / dense['time_s']:.2f}x" if dense else "-"
            flop_ratio = f"{r['executed_flops'] / dense['executed_flops']:.2f}x" if dense else "-"
            cells = shape + [_label(r), _mib(r["temp_bytes"]), mem_ratio, f"{r['time_s']:.3f}",
                             time_ratio, f"{r['executed_flops'] / 1e9:.1f}", flop_ratio]
            if results["mode"].startswith("gpu"):
                cells.insert(5, _mib(r.get("device_peak_bytes")))
            lines.append("| " + " | ".join(cells) + " |")
            notes.append(f"- T={row['T']} window={row['window']} packed={row['packed']} {_label(r)}: "
                         f"load {r['load_avg_1m']:.1f}, times {[f'{t:.3f}' for t in r['times_s']]}, "
                         f"compile {r['compile_s']:.1f} s.")
    lines += ["", "Per case (1-minute load average at the start, each timed call):", "", *notes]
    path.write_text("\n".join(lines) + "\n")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="small shapes only")
    p.add_argument("--gpu", action="store_true", help="dense / chunked / cudnn in bfloat16 "
                   "(default when JAX's backend is a GPU)")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--timeout", type=float, default=1200, help="seconds per case")
    p.add_argument("--out-dir", type=Path, default=RESULTS)
    p.add_argument("--worker", nargs="+", help=argparse.SUPPRESS)
    args = p.parse_args(argv)

    if args.worker:
        impl, T, window, packed, block, dtype, reps = args.worker
        out = run_case(impl, int(T), None if window == "none" else int(window), packed == "1",
                       None if block == "none" else int(block), dtype, int(reps))
        print(json.dumps(out))
        return 0

    if not args.gpu:
        import jax

        args.gpu = jax.default_backend() == "gpu"
    if args.gpu:
        cases, dtype = (GPU_QUICK_CASES if args.quick else GPU_CASES), "bfloat16"
        machine = "GPU"
    else:
        cases, dtype = (QUICK_CASES if args.quick else CPU_CASES), "float32"
        machine = f"CPU, {os.cpu_count()} cores (shared)"
    results = {"mode": ("gpu" if args.gpu else "cpu") + (" quick" if args.quick else ""),
               "machine": machine, "dtype": dtype, "cases": []}
    for T, window, packed, impls in cases:
        row = {"T": T, "window": window, "packed": packed, "runs": []}
        for impl, block in impls:  # back to back: same machine state
            r = _spawn([impl, str(T), str(window or "none"), "1" if packed else "0",
                        str(block or "none"), dtype, str(args.reps)], args.timeout)
            r.setdefault("impl", impl)
            row["runs"].append(r)
            print(f"T={T} window={window} packed={packed} {impl} block={block}: {json.dumps(r)}",
                  flush=True)
        results["cases"].append(row)

    args.out_dir.mkdir(parents=True, exist_ok=True)
    stem = "attention" + ("_gpu" if args.gpu else "") + ("_quick" if args.quick else "")
    (args.out_dir / f"{stem}.json").write_text(json.dumps(results, indent=2) + "\n")
    write_markdown(results, args.out_dir / f"{stem}.md")
    print((args.out_dir / f"{stem}.md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
