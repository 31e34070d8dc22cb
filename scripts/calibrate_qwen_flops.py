"""Fit the Qwen3.5 blocks' elementwise FLOP constants (`hldstudy.flops.layers_qwen._EW_QWEN`)
to XLA's CPU cost analysis.

For random small dense Qwen3.5 models (mixed gated-attention / Gated DeltaNet layers,
T = the chunk size, one sequence), the trainer's baseline step (`abstract_train_program`) and
the teacher's forward alone (`teacher_forward_fn`, final hidden states) are compiled; XLA's
count (`hldstudy.flops.xla_count`; complete since the DeltaNet's system is inverted with
matmuls; the one-trip chunk loop kept as a loop: `KEEP_LOOPS`) minus everything
`hldstudy.flops.step_flops` counts without these constants (matmuls including the
DeltaNet's inverse, the loss's and the optimizer's elementwise work) is the blocks'
elementwise work. It is fitted per token as a linear function of the features in
`layers_qwen.EW_FEATURES`, summed over the layers, by least squares.

    python scripts/calibrate_qwen_flops.py [--models 12] [--seed 0] [--out fit.json]

Prints the constants (forward, train) and each model's residual as a share of XLA's count.
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from hldstudy.config import BudgetConfig, Config, DataConfig
from hldstudy.flops import elementwise_per_token, flops_per_token, step_flops
from hldstudy.flops.layers_qwen import EW_FEATURES, elementwise_features
from hldstudy.flops.xla_count import KEEP_LOOPS, completed_flops
from hldstudy.model.presets import preset
from hldstudy.model.transformer import Transformer
from hldstudy.shapes import ModelShape
from hldstudy.teacher.colocated import teacher_forward_fn
from hldstudy.train.probe import cost_analysis
from hldstudy.train.program import abstract_train_program


def xla_count(fn, *args) -> float:
    compiled = jax.jit(fn).lower(*args).compile(compiler_options=KEEP_LOOPS)
    return completed_flops(cost_analysis(compiled)["flops"], compiled.as_text())


def features(m, t: int) -> np.ndarray:
    shape = ModelShape.from_model_config(m)
    return sum(np.array(elementwise_features(
        shape, t, "linear_attention" if shape.is_linear(i) else "full_attention"))
        for i in range(shape.n_layers))


def random_model(rng):
    hk = int(rng.choice([1, 2]))
    pattern = [str(rng.choice(["linear_attention", "full_attention"])) for _ in range(3)]
    return preset("tiny-qwen", layer_types=",".join(pattern), n_layers=3,
                  vocab_size=int(rng.choice([256, 512])),
                  d_model=int(rng.choice([32, 64, 96, 128])),
                  d_ff=int(rng.choice([64, 128, 192, 256])),
                  n_heads=int(rng.choice([2, 4, 8])), n_kv_heads=int(rng.choice([1, 2])),
                  head_dim=int(rng.choice([16, 32])), linear_k_heads=hk,
                  linear_v_heads=hk * int(rng.choice([1, 2, 4])),
                  linear_k_head_dim=int(rng.choice([16, 32])),
                  linear_v_head_dim=int(rng.choice([16, 32, 48])),
                  deltanet_chunk=int(rng.choice([16, 32, 64])))


def measure(m) -> dict:
    t = m.deltanet_chunk
    cfg = Config(model=m, data=DataConfig(batch_size=1, seq_len=t), budget=BudgetConfig())
    program, args = abstract_train_program(cfg, "baseline", None)
    train = xla_count(program, *args)
    bd = step_flops(cfg)
    blocks = elementwise_per_token(m, t, train=True) - \
        elementwise_per_token(m, t, n_layers=0, train=True)
    rest_train = bd.hardware_total - t * blocks
    graphdef, params = nnx.split(nnx.eval_shape(lambda: Transformer(m, rngs=nnx.Rngs(0))),
                                 nnx.Param)
    i32 = jax.ShapeDtypeStruct((1, t), jnp.int32)
    forward = xla_count(teacher_forward_fn(graphdef, (), True), params,
                        {"tokens": i32, "positions": i32, "segment_ids": i32})
    f = flops_per_token(m, t, attention="dense", head=False)
    rest_forward = t * f["total"]
    return {"features": features(m, t).tolist(), "t": t,
            "train": train, "train_rest": rest_train,
            "forward": forward, "forward_rest": rest_forward}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", type=int, default=12)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="also write the measurements (JSON)")
    ap.add_argument("--fit", nargs="*", default=None, help="fit measurement files instead")
    args = ap.parse_args()
    if args.fit is None:
        rng = np.random.default_rng(args.seed)
        rows = []
        for _ in range(args.models):
            rows.append(measure(random_model(rng)))
            print(json.dumps(rows[-1]), flush=True)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(rows, f)
    else:
        rows = [r for path in args.fit for r in json.load(open(path))]
    a = np.array([np.array(r["features"]) for r in rows])
    for name in ("forward", "train"):
        y = np.array([(r[name] - r[f"{name}_rest"]) / r["t"] for r in rows])
        coef, *_ = np.linalg.lstsq(a, y, rcond=None)
        resid = (a @ coef - y) * np.array([r["t"] for r in rows]) / \
            np.array([r[name] for r in rows])
        print(name, {k: round(float(c), 2) for k, c in zip(EW_FEATURES, coef, strict=True)})
        print(f"  residual / XLA count: max {np.abs(resid).max():.4f}, "
              f"rms {np.sqrt(np.mean(resid ** 2)):.4f}")


if __name__ == "__main__":
    main()
