"""SparseGPT 2:4 at the paper-123m shape: time per layer and peak memory.

    python benchmarks/compress.py                  # 6 blocks, 8 x 256 calibration tokens
    python benchmarks/compress.py --layers 18 --out compress_all_layers  # every block
    python benchmarks/compress.py --quick          # 2 blocks, 4 x 128 tokens

The model is `paper-123m` (Gemma 3 270M layout, 18 blocks, d 640, 4 heads x
256, 1 KV head, d_ff 2048, vocab 32768) with random weights; the calibration
set is fixed (random token ids, seed 0), so runs are comparable. Two figures:

- **layer**: one block of `hldstudy.compress.prune.prune_model` end to end
  (block forwards on the calibration tokens, the Hessians 2 X^T X / n in
  float64, the seven SparseGPT solves q, k, v, o, gate, up, down, true
  sequential), wall time per block;
- **solve**: `sparsegpt_prune` alone on each matrix shape with a random SPD
  Hessian (blocked lazy updates, blocksize 128), median of `--reps` after a
  warm-up (compilation excluded).

Peak memory is the process peak RSS (`ru_maxrss`) on CPU, the allocator's
`peak_bytes_in_use` on GPU. Writes benchmarks/results/compress.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"


def _peak_mib() -> float:
    import jax

    dev = jax.devices()[0]
    if dev.platform != "cpu":
        stats = dev.memory_stats() or {}
        return stats.get("peak_bytes_in_use", 0) / 2 ** 20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def render(r: dict) -> str:
    load0, load = r.get("load_avg_1min_start"), r.get("load_avg_1min_end")
    cal = r["calibration"]
    md = [f"# SparseGPT 2:4 at paper-123m ({r['backend']}, {r['cpu_count']} cores)", "",
          f"Calibration: {cal['sequences']} x {cal['seq_len']} = {cal['tokens']} tokens; "
          f"{r['layers_pruned']} of {r['n_layers_model']} blocks pruned (random weights).", "",
          "| block | seconds |", "|---:|---:|"]
    md += [f"| {i} | {s:.2f} |" for i, s in enumerate(r["layer_seconds"])]
    total = (f"{sum(r['layer_seconds']):.0f} s measured" if r["layers_pruned"] ==
             r["n_layers_model"] else f"~{r['projected_all_layers_seconds']:.0f} s projected")
    md += ["", f"Median {r['layer_seconds_median']:.2f} s per block (the first includes "
           f"compilation) -> {total} for all "
           f"{r['n_layers_model']} blocks. Peak RSS {r['peak_mib']:.0f} MiB (after model init "
           f"{r['peak_mib_after_model_init']:.0f} MiB); the largest Hessian (d_ff^2, float64) "
           f"is {r['largest_hessian_mib_float64']:.0f} MiB.", "",
           "| matrix | in x out | solve s, median | solve s, min |", "|---|---|---:|---:|"]
    md += [f"| {k} | {v['shape'][0]} x {v['shape'][1]} | {v['seconds']:.3f} | "
           f"{v['seconds_min']:.3f} |" for k, v in r["solve"].items()]
    loads = (f"1-minute load average {load0:.1f} at the start, {load:.1f} at the end"
             if load0 is not None and load is not None else "load unknown")
    md += ["", "v has k's shape and up has gate's; they are not timed twice. The machine is "
           f"shared ({loads} on {r['cpu_count']} cores): the per-block times and medians are "
           "inflated by other processes; read the solve minimum as the unloaded figure."]
    return "\n".join(md) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--sequences", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=None, help="results name (default compress[_quick])")
    ap.add_argument("--render", action="store_true",
                    help="only rewrite the markdown from the existing JSON")
    args = ap.parse_args(argv)
    if args.render:
        name = args.out or ("compress_quick" if args.quick else "compress")
        r = json.loads((RESULTS / f"{name}.json").read_text())
        (RESULTS / f"{name}.md").write_text(render(r))
        return 0
    if args.quick:
        args.layers, args.sequences, args.seq_len = 2, 4, 128

    import jax
    import numpy as np
    from flax import nnx

    from hldstudy.compress import sparse
    from hldstudy.compress.layout import input_dims
    from hldstudy.compress.prune import prune_model
    from hldstudy.model.presets import preset

    cfg = preset("paper-123m", max_seq_len=max(args.seq_len, 512))
    rng = np.random.default_rng(0)
    batches = []
    per = 4
    for i in range(0, args.sequences, per):
        b = min(per, args.sequences - i)
        batches.append({"tokens": rng.integers(0, cfg.vocab_size, (b, args.seq_len)),
                        "positions": np.tile(np.arange(args.seq_len), (b, 1)),
                        "segment_ids": np.ones((b, args.seq_len), np.int32),
                        "mask": np.ones((b, args.seq_len), np.int32)})
    load0 = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    rss0 = _peak_mib()
    from hldstudy.model import Transformer

    model = Transformer(cfg, rngs=nnx.Rngs(0))
    rss_model = _peak_mib()

    # -- solver alone, per matrix shape ------------------------------------
    dims = input_dims(cfg)
    outs = {"q": cfg.n_heads * cfg.head_dim, "k": cfg.n_kv_heads * cfg.head_dim,
            "v": cfg.n_kv_heads * cfg.head_dim, "o": cfg.d_model, "gate": cfg.d_ff,
            "up": cfg.d_ff, "down": cfg.d_model}
    solve = {}
    for name in ("q", "k", "o", "gate", "down"):
        n_in, n_out = dims[name], outs[name]
        x = rng.normal(size=(2 * n_in, n_in))
        h = sparse.hessian(x)
        w = rng.normal(size=(n_in, n_out)).astype(np.float32) / np.sqrt(n_in)
        jax.block_until_ready(sparse.sparsegpt_prune(w, h)[0])  # compile
        times = []
        for _ in range(args.reps):
            t0 = time.perf_counter()
            jax.block_until_ready(sparse.sparsegpt_prune(w, h)[0])
            times.append(time.perf_counter() - t0)
        solve[name] = {"shape": [n_in, n_out], "seconds": statistics.median(times),
                       "seconds_min": min(times)}
        print(f"solve {name:5s} {n_in}x{n_out}: {solve[name]['seconds']:.3f} s "
              f"(min {min(times):.3f})", flush=True)

    # -- whole blocks -------------------------------------------------------
    marks = [time.perf_counter()]

    def on_layer(layer):
        jax.block_until_ready(model.blocks[layer].mlp.down[...])
        marks.append(time.perf_counter())
        print(f"layer {layer}: {marks[-1] - marks[-2]:.2f} s", flush=True)

    prune_model(model, "sparsegpt", batches, progress=False, max_layers=args.layers,
                on_layer=on_layer)
    layer_s = [b - a for a, b in zip(marks[:-1], marks[1:], strict=True)]
    peak = _peak_mib()
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    result = {
        "model": "paper-123m", "n_layers_model": cfg.n_layers, "layers_pruned": args.layers,
        "calibration": {"sequences": args.sequences, "seq_len": args.seq_len,
                        "tokens": args.sequences * args.seq_len},
        "layer_seconds": layer_s,
        "layer_seconds_median": statistics.median(layer_s),
        "layer_seconds_first": layer_s[0],
        "projected_all_layers_seconds": statistics.median(layer_s) * cfg.n_layers,
        "solve": solve,
        "peak_mib": peak, "peak_mib_before_model": rss0, "peak_mib_after_model_init": rss_model,
        "largest_hessian_mib_float64": cfg.d_ff ** 2 * 8 / 2 ** 20,
        "backend": jax.default_backend(), "device": str(jax.devices()[0]),
        "cpu_count": os.cpu_count(), "load_avg_1min_start": load0, "load_avg_1min_end": load,
        "python": platform.python_version(), "jax": jax.__version__,
    }
    name = args.out or ("compress_quick" if args.quick else "compress")
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{name}.json").write_text(json.dumps(result, indent=2) + "\n")
    (RESULTS / f"{name}.md").write_text(render(result))
    print(render(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
