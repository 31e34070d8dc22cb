"""Our Gated DeltaNet layer against transformers' PyTorch reference path, on this CPU.

Forward + backward (gradients w.r.t. the input and every parameter of a cotangent-weighted
sum of the outputs) at T = 2048, batch 1, in one run (each implementation in its own
worker process), of:

- **layer**: hldstudy's `GatedDeltaNet` (jitted, chunked form, chunk 64) against
  transformers' `Qwen3_5GatedDeltaNet` (qwen3_5 modelling code), which without the `fla`
  kernels runs `torch_causal_conv1d` and `torch_chunk_gated_delta_rule` (chunk 64) in
  eager PyTorch; the same weights (ours exported by `hf_qwen.pure_to_hf`, the importer's
  own mapping);
- **rule**: the gated delta rule alone on the same q, k, v, g, beta: `delta_rule_chunked`
  (with the layer's L2 norm and 1/sqrt(K) scaling, jitted) against
  `torch_chunk_gated_delta_rule(use_qk_l2norm_in_kernel=True)`.

Shape: the linear-attention heads of transformers' default `Qwen3_5TextConfig` (16 key /
32 value heads of 128, conv kernel 4 -- the Qwen3.5 hybrid models' DeltaNet head layout)
with d_model 1024 (`--d-model`; the default config's 4096 makes the projections, not the
rule, dominate and takes minutes per step on 2 cores). Outputs and every gradient are
checked to agree first (max |diff| / max |reference| below `--tol`; exit 3 otherwise).
Then the two implementations are timed in interleaved rounds (ours, torch, ours, torch,
...; one warm-up each), the ratio torch / ours taken per round and its median reported,
with the 1-minute load average at each round (the box is shared). float32 throughout.
Writes benchmarks/results/deltanet_layer.{json,md}.

    /work/venv-torch/bin/python benchmarks/deltanet_layer.py [--rounds 5] [--seq-len 2048]

Needs torch and transformers >= 5.2 (the parity extra); without them: one line, exit 0.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
OUT = Path(__file__).resolve().parent / "results"
CHUNK = 64  # transformers' torch_chunk_gated_delta_rule default


def layer_config(d_model: int, seq_len: int):
    """A one-layer qwen3_5 model whose layer is a DeltaNet with Qwen3.5's head layout."""
    from hldstudy.model.presets import preset

    return dataclasses.replace(
        preset("tiny-qwen"), d_model=d_model, n_layers=1, layer_types="linear_attention",
        n_heads=8, n_kv_heads=2, head_dim=d_model // 8, d_ff=64, vocab_size=256,
        max_seq_len=max(seq_len, 512), linear_k_heads=16, linear_v_heads=32,
        linear_k_head_dim=128, linear_v_head_dim=128, linear_conv_kernel=4,
        deltanet_chunk=CHUNK)


def _rel_err(got, ref) -> float:
    import numpy as np

    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    return float(np.max(np.abs(got - ref)) / max(np.max(np.abs(ref)), 1e-30))


def inputs(cfg, seq_len: int, seed: int = 0) -> dict:
    """The layer's input and cotangent, and the rule's q, k, v, g, beta and cotangent:
    numpy, the same in both workers (same seed)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    t, d = seq_len, cfg.d_model
    hk, hv, dk, dv = (cfg.linear_k_heads, cfg.linear_v_heads, cfg.linear_k_head_dim,
                      cfg.linear_v_head_dim)
    out = {"x": rng.standard_normal((1, t, d)), "x_cot": rng.standard_normal((1, t, d)),
           "q": rng.standard_normal((1, t, hk, dk)), "k": rng.standard_normal((1, t, hk, dk)),
           "v": rng.standard_normal((1, t, hv, dv)),
           # log decay in [-2, 0) and beta in (0, 1), as the layer's gates produce them
           "g": -2.0 * rng.random((1, t, hv)), "beta": rng.random((1, t, hv)),
           "rule_cot": rng.standard_normal((1, t, hv, dv))}
    return {k: v.astype(np.float32) for k, v in out.items()}


def hf_layer_weights(cfg, seed: int = 0) -> tuple:
    """(model, {HF name without the layer prefix: array}): our layer's weights (a one-layer
    model, seed `seed`) in transformers' names, through the importer's own mapping."""
    from flax import nnx

    from hldstudy.model.hf_qwen import pure_to_hf
    from hldstudy.model.transformer import Transformer

    model = Transformer(cfg, rngs=nnx.Rngs(seed))
    weights = pure_to_hf(cfg, nnx.state(model, nnx.Param).to_pure_dict())
    return model, {k[len(PREFIX):]: v for k, v in weights.items() if k.startswith(PREFIX)}


PREFIX = "model.layers.0.linear_attn."


def ours_worker(cfg, seq_len: int) -> tuple[dict, dict, dict]:
    """({case: one forward+backward}, {quantity: array} for the agreement check, the
    layer's weights in transformers' names for the torch worker)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from hldstudy.model.deltanet import delta_rule_chunked, l2_normalize
    from hldstudy.model.hf_qwen import pure_to_hf

    model, weights = hf_layer_weights(cfg)
    graphdef, params = nnx.split(model.blocks[0].mixer, nnx.Param)
    ins = {k: jnp.asarray(v) for k, v in inputs(cfg, seq_len).items()}
    hk, hv, dk = cfg.linear_k_heads, cfg.linear_v_heads, cfg.linear_k_head_dim

    def layer_loss(params, x):
        out = nnx.merge(graphdef, params)(x)
        return jnp.sum(out * ins["x_cot"]), out

    def rule_loss(qkvgb):
        q, k, v, g, beta = qkvgb
        q, k = jnp.repeat(q, hv // hk, axis=2), jnp.repeat(k, hv // hk, axis=2)
        out = delta_rule_chunked(l2_normalize(q) * dk ** -0.5, l2_normalize(k), v, g, beta,
                                 chunk=CHUNK)
        return jnp.sum(out * ins["rule_cot"]), out

    layer_step = jax.jit(jax.value_and_grad(layer_loss, argnums=(0, 1), has_aux=True))
    rule_step = jax.jit(jax.value_and_grad(rule_loss, has_aux=True))
    rule_args = tuple(ins[n] for n in RULE_ARGS)
    # Each result is awaited before the next program starts: two XLA CPU programs in
    # flight at once (async dispatch) hung here, every thread waiting, on 2 cores.
    (_, out), (g_params, g_x) = jax.block_until_ready(layer_step(params, ins["x"]))
    grads = nnx.state(model, nnx.Param).to_pure_dict()  # the mixer's entry replaced below
    grads["blocks"][0]["mixer"] = nnx.State(g_params).to_pure_dict()
    g_hf = pure_to_hf(cfg, grads)  # gradients in HF names, as the weights are mapped
    result = {"layer out": out, "layer d/dx": g_x}
    result.update({f"layer d/d{k[len(PREFIX):]}": v for k, v in g_hf.items()
                   if k.startswith(PREFIX)})
    (_, out), g_rule = jax.block_until_ready(rule_step(rule_args))
    result["rule out"] = out
    result.update({f"rule d/d{n}": g for n, g in zip(RULE_ARGS, g_rule, strict=True)})
    calls = {"layer": lambda: jax.block_until_ready(layer_step(params, ins["x"])),
             "rule": lambda: jax.block_until_ready(rule_step(rule_args))}
    return calls, {k: np.asarray(v) for k, v in result.items()}, weights


RULE_ARGS = ("q", "k", "v", "g", "beta")


def torch_worker(cfg, seq_len: int, weights: dict) -> tuple[dict, dict]:
    """transformers' `Qwen3_5GatedDeltaNet` and `torch_chunk_gated_delta_rule` (eager
    PyTorch; the `fla` / `causal_conv1d` kernels are not installed, so the reference path
    runs -- transformers says so on stderr)."""
    import torch
    import transformers
    from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

    from hldstudy.model.hf_qwen import export_config

    config = {k: v for k, v in export_config(cfg, "float32").items()
              if k not in ("architectures", "model_type", "dtype")}
    layer = hf.Qwen3_5GatedDeltaNet(transformers.Qwen3_5TextConfig(**config), layer_idx=0)
    layer.load_state_dict({k: torch.from_numpy(v.copy()) for k, v in weights.items()},
                          strict=True)
    ins = {k: torch.from_numpy(v) for k, v in inputs(cfg, seq_len).items()}
    x = ins["x"].clone().requires_grad_(True)
    rule_args = [ins[n].clone().requires_grad_(True) for n in RULE_ARGS]

    def layer_step():
        layer.zero_grad(set_to_none=True)
        x.grad = None
        out = layer(x)
        (out * ins["x_cot"]).sum().backward()
        return out

    def rule_step():
        for a in rule_args:
            a.grad = None
        q, k, v, g, beta = rule_args
        out, _ = hf.torch_chunk_gated_delta_rule(q, k, v, g=g, beta=beta, chunk_size=CHUNK,
                                                 use_qk_l2norm_in_kernel=True)
        (out * ins["rule_cot"]).sum().backward()
        return out

    result = {"layer out": layer_step().detach().numpy(), "layer d/dx": x.grad.numpy()}
    result.update({f"layer d/d{n}": p.grad.numpy() for n, p in layer.named_parameters()})
    result["rule out"] = rule_step().detach().numpy()
    result.update({f"rule d/d{n}": a.grad.numpy() for n, a in zip(RULE_ARGS, rule_args,
                                                                  strict=True)})
    return {"layer": layer_step, "rule": rule_step}, result


def worker_main(kind: str, cfg, seq_len: int, check_path: str) -> None:
    """One implementation in its own process (JAX and torch running in one process hung,
    every thread waiting, on 2 cores: the JAX worker never imports torch, the torch worker
    runs no JAX and reads our weights from the file the JAX worker wrote). Writes its
    outputs and gradients to `check_path` (npz), then answers "CASE" with the seconds of one timed call of that case, until "quit"."""
    import numpy as np

    out = sys.stdout
    sys.stdout = sys.stderr  # library chatter must not corrupt the protocol
    if kind == "torch":
        import torch

        weights = dict(np.load(Path(check_path).with_name("weights.npz")))
        calls, result = torch_worker(cfg, seq_len, weights)
        info = {"torch": torch.__version__, "threads": torch.get_num_threads()}
    else:
        import jax

        t0 = time.perf_counter()
        calls, result, weights = ours_worker(cfg, seq_len)
        np.savez(Path(check_path).with_name("weights.npz"), **weights)
        info = {"jax": jax.__version__, "first_call_s": time.perf_counter() - t0}
    np.savez(check_path, **result)
    for fn in calls.values():
        fn()  # warm-up (ours: compiled already)
    print(json.dumps({"ready": True, **info}), file=out, flush=True)
    for line in sys.stdin:
        case = line.strip()
        if case not in calls:
            break
        print(json.dumps({"s": timed(calls[case])}), file=out, flush=True)


class Worker:
    def __init__(self, kind: str, args, check_path: Path):
        self.kind = kind
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--worker", kind, "--seq-len", str(args.seq_len),
             "--d-model", str(args.d_model), "--check-path", str(check_path)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, cwd=REPO)

    def read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"worker {self.kind} died (exit {self.proc.wait()})")
        return json.loads(line)

    def time(self, case: str) -> float:
        self.proc.stdin.write(case + "\n")
        self.proc.stdin.flush()
        return self.read()["s"]

    def close(self) -> None:
        try:
            self.proc.stdin.write("quit\n")
            self.proc.stdin.close()
        except BrokenPipeError:
            pass
        self.proc.wait(timeout=60)


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--d-model", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tol", type=float, default=1e-4,
                        help="max |ours - torch| / max |torch| for outputs and gradients")
    parser.add_argument("--out", default=str(OUT))
    parser.add_argument("--worker", choices=("ours", "torch"), help=argparse.SUPPRESS)
    parser.add_argument("--check-path", help=argparse.SUPPRESS)
    args = parser.parse_args()
    cfg = layer_config(args.d_model, args.seq_len)
    if args.worker:
        worker_main(args.worker, cfg, args.seq_len, args.check_path)
        return 0
    try:  # here, not above: the JAX worker never loads torch (see worker_main)
        import transformers
        from transformers.models.qwen3_5 import modeling_qwen3_5  # noqa: F401
    except ImportError as e:
        print(f"deltanet_layer: needs torch and transformers >= 5.2 ({e}); skipped")
        return 0
    import numpy as np

    from hldstudy.fileio import write_json_atomic, write_text_atomic

    workers, info = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        try:
            # Started one after the other (a compile would fight the other's setup).
            for kind in ("ours", "torch"):
                workers[kind] = Worker(kind, args, Path(tmp) / f"{kind}.npz")
                info[kind] = workers[kind].read()
                print(f"{kind} ready: {info[kind]}", flush=True)
            got, ref = np.load(Path(tmp) / "ours.npz"), np.load(Path(tmp) / "torch.npz")
            if set(got.files) != set(ref.files):
                print(f"deltanet_layer: compared quantities differ: {sorted(got.files)} vs "
                      f"{sorted(ref.files)}", file=sys.stderr)
                return 3
            checks = {name: _rel_err(got[name], ref[name]) for name in sorted(ref.files)}
            worst = max(checks, key=checks.get)
            print(f"agreement: worst {worst} {checks[worst]:.2e} (tol {args.tol:.0e})",
                  flush=True)
            if checks[worst] > args.tol:
                print(f"deltanet_layer: ours and transformers disagree ({worst}: "
                      f"{checks[worst]:.3e} > {args.tol:.0e}); nothing timed", file=sys.stderr)
                return 3
            rows = []
            for case in ("layer", "rule"):
                times = {"ours": [], "torch": []}
                loads = []
                for _ in range(args.rounds):
                    loads.append(os.getloadavg()[0])
                    for kind, w in workers.items():
                        times[kind].append(w.time(case))
                ratios = [r / o for o, r in zip(times["ours"], times["torch"], strict=True)]
                row = {"case": case, "ours_s": float(np.median(times["ours"])),
                       "torch_s": float(np.median(times["torch"])),
                       "torch_over_ours": float(np.median(ratios)),
                       "times_ours_s": times["ours"], "times_torch_s": times["torch"],
                       "ratios": ratios, "load_avg_1m": loads}
                rows.append(row)
                print(json.dumps(row), flush=True)
        finally:
            for w in workers.values():
                w.close()

    meta = {"seq_len": args.seq_len, "batch": 1, "d_model": args.d_model,
            "key_heads": cfg.linear_k_heads, "value_heads": cfg.linear_v_heads,
            "head_dim": cfg.linear_k_head_dim, "conv_kernel": cfg.linear_conv_kernel,
            "chunk": CHUNK, "dtype": "float32", "rounds": args.rounds,
            "checks_max_rel_err": checks, "ours": info["ours"], "torch": info["torch"],
            "transformers": transformers.__version__, "cpu_count": os.cpu_count(),
            "xla_flags": os.environ.get("XLA_FLAGS", ""),
            "omp_num_threads": os.environ.get("OMP_NUM_THREADS", ""),
            "machine": platform.processor() or platform.machine()}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_json_atomic(out / "deltanet_layer.json", {"meta": meta, "rows": rows})
    lines = [f"Gated DeltaNet forward+backward, T={args.seq_len}, batch 1, float32, CPU "
             f"({os.cpu_count()} cores, shared; torch {info['torch']['threads']} threads; each "
             f"implementation in its own process). Heads {cfg.linear_k_heads} key / "
             f"{cfg.linear_v_heads} value of {cfg.linear_k_head_dim}, conv "
             f"{cfg.linear_conv_kernel}, chunk {CHUNK}, d_model {args.d_model}. Outputs and "
             f"all gradients agree within {checks[worst]:.1e} of the largest magnitude "
             f"(worst: {worst}). Median of {args.rounds} interleaved rounds; ratio = median "
             "over rounds of torch / ours.", "",
             "| case | hldstudy (JAX, jit) s | transformers (PyTorch eager) s | torch / ours | "
             "load (1 min) |",
             "|---|---:|---:|---:|---:|"]
    labels = {"layer": "whole layer (projections, conv, gates, rule, gated norm, out)",
              "rule": "gated delta rule alone (chunked)"}
    for r in rows:
        lines.append(f"| {labels[r['case']]} | {r['ours_s']:.3f} | {r['torch_s']:.3f} | "
                     f"{r['torch_over_ours']:.2f}x | {min(r['load_avg_1m']):.1f}-"
                     f"{max(r['load_avg_1m']):.1f} |")
    write_text_atomic(out / "deltanet_layer.md", "\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
