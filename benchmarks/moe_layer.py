"""Our MoE layer (dropless `jax.lax.ragged_dot`) against a dense loop over experts, on this CPU.

Both compute the same function of the same parameters: the router (`moe.route`: softmax,
top-k, weights renormalised), the routed SwiGLU experts, the sigmoid-gated shared expert
and the load-balancing loss. They differ only in how the routed experts run:

- **ours**: `hldstudy.model.moe.MoE` -- the (token, slot) rows sorted by expert and each
  expert's rows multiplied with `ragged_dot` (no capacity, nothing dropped);
- **dense loop**: the straightforward reference -- for each expert in turn, its SwiGLU on
  every token, masked by the token's combine weight for that expert (zero when not
  routed there), summed.

Timed jitted, forward and forward+backward (gradients w.r.t. the input and every
parameter of `sum(out * cotangent) + aux`), after checking that outputs, aux loss and
all gradients agree (max |diff| / max |reference| below `--tol`; exit 3 otherwise). Rounds
interleave the two (ours, loop, ours, loop, ...; one warm-up each); the ratio loop / ours
is taken per round and its median reported, with the 1-minute load average (shared box).

Shape (default): Qwen3.5-35B-A3B's MoE layer (d 2048, 256 experts of 512, top 8, a shared
expert of 512) scaled down 4x in width and experts: d_model 512, 64 experts of 128,
top 8, shared expert 128; batch 1 x 2048 tokens; float32. Note: XLA's CPU backend
lowers `ragged_dot` to a dense matmul over all experts (see flops/layers_qwen.py), so on
CPU ours does not skip the inactive experts' FLOPs; the ratio measures this backend.
Writes benchmarks/results/moe_layer.{json,md}.

    python benchmarks/moe_layer.py [--rounds 5] [--tokens 2048]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from hldstudy.fileio import write_json_atomic, write_text_atomic
from hldstudy.model.moe import MoE, load_balancing_loss, route
from hldstudy.model.presets import preset

OUT = Path(__file__).resolve().parent / "results"


def swiglu(x, gate, up, down):
    return (jax.nn.silu(x @ gate) * (x @ up)) @ down


def dense_loop_moe(params: dict, x_BxTxD: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """The reference: every expert on every token, weighted by its combine weight (0 when
    the token is not routed to it); same router, shared expert and aux loss as `MoE`."""
    b, t, d = x_BxTxD.shape
    x = x_BxTxD.reshape(b * t, d)
    probs, weights, experts = route(x @ params["router"], k)
    n_experts = params["router"].shape[1]
    combine = jnp.sum(jax.nn.one_hot(experts, n_experts, dtype=x.dtype) * weights[..., None],
                      axis=1)  # [M, E]
    out = jnp.zeros_like(x)
    for e in range(n_experts):
        out = out + combine[:, e:e + 1] * swiglu(x, params["gate"][e], params["up"][e],
                                                 params["down"][e])
    if "shared_gate" in params:
        shared = swiglu(x, params["shared_gate"], params["shared_up"], params["shared_down"])
        out = out + jax.nn.sigmoid(x @ params["shared_expert_gate"]) * shared
    return out.reshape(b, t, d), load_balancing_loss(probs, experts)


def _rel_err(got, ref) -> float:
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    return float(np.max(np.abs(got - ref)) / max(np.max(np.abs(ref)), 1e-30))


def build(cfg, tokens: int, seed: int = 0):
    """The four jitted callables ({ours,loop} x {forward, forward+backward}) on the same
    parameters and input, and their agreement (max relative error per quantity)."""
    layer = MoE(cfg, nnx.Rngs(seed))
    graphdef, params = nnx.split(layer, nnx.Param)
    pure = nnx.State(params).to_pure_dict()
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((1, tokens, cfg.d_model)), jnp.float32)
    cot = jnp.asarray(rng.standard_normal((1, tokens, cfg.d_model)), jnp.float32)

    def ours(p, x):
        return nnx.merge(graphdef, nnx.State(p))(x)

    def loop(p, x):
        return dense_loop_moe(p, x, cfg.experts_per_token)

    def loss(fn):
        def f(p, x):
            out, aux = fn(p, x)
            return jnp.sum(out * cot) + aux
        return jax.jit(jax.value_and_grad(f, argnums=(0, 1)))

    fwd = {"ours": jax.jit(ours), "loop": jax.jit(loop)}
    bwd = {"ours": loss(ours), "loop": loss(loop)}
    (o_ours, a_ours), (o_loop, a_loop) = fwd["ours"](pure, x), fwd["loop"](pure, x)
    checks = {"output": _rel_err(o_ours, o_loop), "aux": _rel_err(a_ours, a_loop)}
    (_, (gp_ours, gx_ours)), (_, (gp_loop, gx_loop)) = bwd["ours"](pure, x), bwd["loop"](pure, x)
    checks["d/dx"] = _rel_err(gx_ours, gx_loop)
    for name in sorted(pure):
        checks[f"d/d{name}"] = _rel_err(gp_ours[name], gp_loop[name])
    calls = {(impl, mode): (lambda f=f: jax.block_until_ready(f(pure, x)))
             for mode, fns in (("forward", fwd), ("forward+backward", bwd))
             for impl, f in fns.items()}
    return calls, checks


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--d-model", type=int, default=512)
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--top-k", type=int, default=4)
    parser.add_argument("--d-expert", type=int, default=128)
    parser.add_argument("--d-shared", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tol", type=float, default=1e-4,
                        help="max |ours - loop| / max |loop| for outputs and gradients")
    parser.add_argument("--out", default=str(OUT))
    args = parser.parse_args()
    cfg = dataclasses.replace(preset("tiny-qwen-moe"), d_model=args.d_model,
                              n_experts=args.experts, experts_per_token=args.top_k,
                              d_expert=args.d_expert, d_shared_expert=args.d_shared)
    calls, checks = build(cfg, args.tokens)
    worst = max(checks, key=checks.get)
    print(f"agreement: worst {worst} {checks[worst]:.2e} (tol {args.tol:.0e})", flush=True)
    if checks[worst] > args.tol:
        print(f"moe_layer: ours and the dense loop disagree ({worst}: {checks[worst]:.3e} > "
              f"{args.tol:.0e}); nothing timed", file=sys.stderr)
        return 3

    rows = []
    for mode in ("forward", "forward+backward"):
        ours, loop = calls["ours", mode], calls["loop", mode]
        compile_s = {"ours": timed(ours), "loop": timed(loop)}  # first calls compile
        t_ours, t_loop, loads = [], [], []
        for _ in range(args.rounds):
            loads.append(os.getloadavg()[0])
            t_ours.append(timed(ours))
            t_loop.append(timed(loop))
        ratios = [lp / o for o, lp in zip(t_ours, t_loop, strict=True)]
        row = {"mode": mode, "ours_s": float(np.median(t_ours)),
               "loop_s": float(np.median(t_loop)), "loop_over_ours": float(np.median(ratios)),
               "compile_s": compile_s, "times_ours_s": t_ours, "times_loop_s": t_loop,
               "ratios": ratios, "load_avg_1m": loads}
        rows.append(row)
        print(json.dumps(row), flush=True)

    meta = {"tokens": args.tokens, "d_model": args.d_model, "experts": args.experts,
            "top_k": args.top_k, "d_expert": args.d_expert, "d_shared": args.d_shared,
            "dtype": "float32", "rounds": args.rounds, "checks_max_rel_err": checks,
            "backend": jax.default_backend(), "jax": jax.__version__,
            "cpu_count": os.cpu_count()}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_json_atomic(out / "moe_layer.json", {"meta": meta, "rows": rows})
    lines = [f"MoE layer, {args.tokens} tokens, d_model {args.d_model}, {args.experts} experts "
             f"of {args.d_expert}, top {args.top_k}, shared expert {args.d_shared}, float32, "
             f"{jax.default_backend()} ({os.cpu_count()} cores, shared). Ours (ragged_dot, "
             "dropless) vs a dense loop over experts (every expert on every token, masked by "
             f"its combine weight); outputs, aux loss and all gradients agree within "
             f"{checks[worst]:.1e} of the largest magnitude (worst: {worst}). Median of "
             f"{args.rounds} interleaved rounds; ratio = median over rounds of loop / ours.", "",
             "| pass | ours (ragged_dot) s | dense loop s | loop / ours | load (1 min) |",
             "|---|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['mode']} | {r['ours_s']:.3f} | {r['loop_s']:.3f} | "
                     f"{r['loop_over_ours']:.2f}x | {min(r['load_avg_1m']):.1f}-"
                     f"{max(r['load_avg_1m']):.1f} |")
    write_text_atomic(out / "moe_layer.md", "\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
