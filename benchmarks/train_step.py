"""Training throughput and MFU on this machine's CPU.

For the tiny student and a paper-123m-shaped student (reduced vocabulary),
times the jitted baseline train step and measures this machine's matmul peak
in the same run (a 2048^3 float32 matmul), so MFU = achieved model FLOP/s
(analytic count, hldstudy.flops: causal attention) / measured peak. The box is
shared, so the peak is re-measured right before every timed step and each
step's MFU is taken against its own peak; the reported MFU is the median of
those per-step ratios (plus the step and peak medians). Writes
benchmarks/results/train_step.json and .md.

    python benchmarks/train_step.py [--steps 5] [--vocab 8192]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from hldstudy.config import Config, DataConfig, TrainConfig
from hldstudy.distill.base import make_strategy
from hldstudy.flops import step_flops
from hldstudy.model import Transformer, preset
from hldstudy.train.optim import make_optimizer
from hldstudy.train.program import train_program
from hldstudy.train.step import split_params

OUT = Path(__file__).resolve().parent / "results"


def matmul_peak(n: int = 2048, reps: int = 5) -> float:
    """FLOP/s of a float32 n x n matmul: the attainable peak for this backend."""
    a = jnp.ones((n, n), jnp.float32)
    f = jax.jit(lambda x: x @ x)
    f(a).block_until_ready()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        f(a).block_until_ready()
        times.append(time.perf_counter() - t)
    return 2 * n**3 / float(np.median(times))


def bench(name: str, cfg: Config, steps: int) -> dict:
    """Times `steps` train steps, each right after a fresh matmul-peak measurement."""
    strategy = make_strategy(cfg, cfg.model)
    stage = strategy.stages()[0]
    optimizer = make_optimizer(cfg.train, 1000)
    student = Transformer(cfg.model, rngs=nnx.Rngs(0))
    graphdefs, params = split_params(student, None)
    state = {"params": params, "opt_state": optimizer.init(params), "step": jnp.int32(0)}
    step = jax.jit(train_program(strategy, stage, graphdefs, optimizer), donate_argnums=(0,))
    b, t = cfg.data.batch_size, cfg.data.seq_len
    rng = np.random.default_rng(0)
    batch = {"tokens": jnp.asarray(rng.integers(0, cfg.model.vocab_size, (b, t)), jnp.int32),
             "targets": jnp.asarray(rng.integers(0, cfg.model.vocab_size, (b, t)), jnp.int32),
             "positions": jnp.tile(jnp.arange(t, dtype=jnp.int32), (b, 1)),
             "segment_ids": jnp.ones((b, t), jnp.int32), "mask": jnp.ones((b, t), jnp.float32)}
    t0 = time.perf_counter()
    state, m = step(state, batch, None, {}, 0)[:2]
    jax.block_until_ready(m)
    compile_s = time.perf_counter() - t0
    flops = step_flops(cfg, method="baseline").total
    times, peaks = [], []
    for _ in range(steps):
        peaks.append(matmul_peak(reps=3))
        t0 = time.perf_counter()
        state, m = step(state, batch, None, {}, 0)[:2]
        jax.block_until_ready(m)
        times.append(time.perf_counter() - t0)
    step_s = float(np.median(times))
    mfus = [flops / s / pk for s, pk in zip(times, peaks, strict=True)]
    return {"model": name, "batch": b, "seq_len": t, "vocab": cfg.model.vocab_size,
            "params": sum(x.size for x in jax.tree_util.tree_leaves(params)),
            "step_s": step_s, "compile_s": compile_s, "tokens_per_s": b * t / step_s,
            "model_flops_per_step": flops, "achieved_flops_per_s": flops / step_s,
            "matmul_peak_flops_per_s": float(np.median(peaks)), "mfu": float(np.median(mfus)),
            "times_s": times, "peaks_flops_per_s": peaks, "mfu_per_step": mfus,
            "load_avg_1m": os.getloadavg()[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--vocab", type=int, default=8192,
                        help="vocabulary of the paper-123m-shaped student (CPU memory)")
    args = parser.parse_args()
    cases = [
        ("tiny", Config(model=preset("tiny"), data=DataConfig(seq_len=128, batch_size=8),
                        train=TrainConfig())),
        (f"paper-123m (V={args.vocab})",
         Config(model=preset("paper-123m", vocab_size=args.vocab, max_seq_len=512),
                data=DataConfig(seq_len=256, batch_size=4), train=TrainConfig())),
    ]
    rows = []
    for name, cfg in cases:
        r = bench(name, cfg, args.steps)
        rows.append(r)
        print(json.dumps(r))
    OUT.mkdir(parents=True, exist_ok=True)
    meta = {"backend": jax.default_backend(), "devices": len(jax.devices()),
            "jax": jax.__version__}
    (OUT / "train_step.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    lines = [f"Backend {meta['backend']}, {os.cpu_count()} cores (shared). The float32 matmul "
             "peak (2048^3) is measured right before each timed step; MFU = median over steps "
             "of model FLOP/s / that step's peak.", "",
             "| model | params | batch x seq | step (s) | tokens/s | model GFLOP/s | "
             "peak GFLOP/s | MFU | load |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['params'] / 1e6:.1f}M | {r['batch']}x{r['seq_len']} | "
                     f"{r['step_s']:.3f} | {r['tokens_per_s']:.0f} | "
                     f"{r['achieved_flops_per_s'] / 1e9:.1f} | "
                     f"{r['matmul_peak_flops_per_s'] / 1e9:.1f} | {100 * r['mfu']:.1f}% | "
                     f"{r['load_avg_1m']:.1f} |")
    (OUT / "train_step.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
