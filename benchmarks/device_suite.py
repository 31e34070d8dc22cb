"""The GPU benchmark suite (issue 14), run by benchmarks/device.sh.

    bash benchmarks/device.sh               # one NVIDIA GPU, < 5 minutes
    bash benchmarks/device.sh --dry-run     # every section at tiny shapes on this CPU

Sections, side by side in one run (the numbers of one device and one moment):

1. **peak**: the bf16 matmul peak of this device (an n x n x n `jnp.dot`,
   median of reps), the denominator of every MFU below.
2. **loss**: the fused KD loss, forward + backward (gradients w.r.t. the
   student's hidden states and head), bf16 inputs, `0.5 NLL + 0.5 KL(p_t||p_s)`
   at tau 1, at (T, d, V) = (8192, 2304, 256000) and (8192, 4096, 128256):
   ours `fused_kd_loss(backend="pallas")` (Triton kernels), ours
   `backend="xla"`, our `materialized_kd_loss`; and, in a PyTorch process,
   Liger-Kernel's `LigerFusedLinearJSDLoss` with beta = 0 (its forward-KL end,
   the same objective), Cut Cross-Entropy's `linear_cross_entropy` (NLL only: a
   floor, not a peer) and plain PyTorch with materialized logits. Time (median),
   memory beyond inputs and outputs (JAX: the compiled program's XLA temp bytes;
   PyTorch: peak allocated minus what was allocated before the call minus the
   gradients it returns) and MFU counting 8 T d V FLOPs (two heads forward, two
   gradients) against the measured peak.
3. **attention**: `benchmarks/attention.py`'s case runner in this process:
   dense / chunked / cudnn, bf16, T = 2048 and 8192, global and a 512 window
   (`python benchmarks/attention.py --gpu` runs the full 24-case grid).
4. **kd_step**: the paper-123m student's KD train step with the
   `paper-teacher-3.4b` teacher (34 layers, d 2560) colocated, bf16 compute
   (student parameters float32, teacher held in bf16), batch 8 x 2048, built
   from the trainer's own pieces: tokens/s and MFU of the executed FLOPs
   (`hldstudy.flops.step_flops(...).hardware_total`: student 3x forward with
   dense-attention matmuls, the teacher's forward, loss recompute, elementwise)
   and of the model FLOPs with the teacher counted.
5. **aot**: the compile tier's case (tests/test_aot_compile.py: experiments/c4_123m_kd.py,
   the 3.4B teacher, here at 8 x 2048 tokens on this one GPU, teacher in bf16) built by
   `hldstudy.aot.compile.train_program` (the trainer's own step): compiled here and
   run (time, peak memory), beside `python -m hldstudy.aot --target <this chip>:1`'s
   compile-only figure (a CPU process: JAX_PLATFORMS=cpu, the CUDA plugin with the
   shipped target config) and the planner's prediction, in one table.
6. **grouped_matmul**: the Hopper grouped matmul (`hldstudy.model.grouped_matmul`:
   JAX's Mosaic GPU kernels with our VJP) at one 35B-A3B expert layer's shapes (256
   experts, a 4,096-token sequence's 32,768 routed rows, 2,048 x 512), the product and
   both gradients against one float32 matmul per group (relative error), timed beside
   one bf16 matmul per group (XLA's own ragged_dot on GPU is a dense pass over every
   expert, ~25 s a call at these shapes); skipped with a line off Hopper.
   The dry run interprets the product kernel on the CPU.
7. **fp8**: `hldstudy.compress.fp8.fp8_dot` (real FP8 x FP8, per-tensor
   activation scale, per-channel weight scale) against a bf16 matmul of the
   same shape, where the device has FP8 matrix units; skipped with a line
   otherwise.

Every section is guarded: a failure becomes one `error` line in its row and the
run goes on; results are written after each section (a run cut short keeps
what it measured). Peers come from the wheels in benchmarks/wheels/ (unpacked
by device.sh onto PYTHONPATH); a peer that cannot be imported is skipped with a
line. Never imported on this path: grain, lm-eval, wandb, tensorflow(-datasets)
(blocked in sys.modules: an import of one fails the run).

Writes benchmarks/results/device.{json,md} (`--out-dir` to change; the dry run
writes device_dry.*).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
BLOCKED_MODULES = ("grain", "lm_eval", "wandb", "tensorflow", "tensorflow_datasets")

FULL = {
    "peak_n": 8192, "peak_reps": 10,
    "loss_shapes": [(8192, 2304, 256000), (8192, 4096, 128256)], "loss_reps": 5,
    "attention_T": (2048, 8192), "attention_window": 512, "attention_reps": 3,
    "step": {"student": "paper-123m", "teacher": "paper-teacher-3.4b", "batch": 8, "seq": 2048,
             "steps": 5},
    "fp8_n": 8192, "fp8_reps": 10,
    "grouped": {"groups": 256, "rows": 32768, "d_in": 2048, "d_out": 512, "reps": 5},
    "aot": {"config": "experiments/c4_123m_kd.py", "teacher": "paper-teacher-3.4b",
            "set": ["data.path=/nonexistent", "data.batch_size=8", "teacher.dtype=bfloat16"],
            "steps": 3},
}
DRY = {
    "peak_n": 256, "peak_reps": 3,
    "loss_shapes": [(256, 64, 1000), (128, 32, 515)], "loss_reps": 2,
    "attention_T": (256, 512), "attention_window": 96, "attention_reps": 2,
    "step": {"student": "tiny", "teacher": "tiny-teacher", "batch": 2, "seq": 64, "steps": 2},
    "fp8_n": 128, "fp8_reps": 2,
    "grouped": {"groups": 4, "rows": 256, "d_in": 64, "d_out": 128, "reps": 1},
    "aot": {"config": "experiments/tiny_distill.py", "teacher": "tiny-teacher",
            "set": ["distill.fused_backend=xla"], "steps": 2},
}
TEMPERATURE, ALPHA = 1.0, 0.5
# Wall-clock deadline (time.time()) of this run: a case that would start after it is
# skipped with a line, so the whole suite stays inside the device lease.
DEADLINE = [float("inf")]


def out_of_time() -> str | None:
    return "skipped: the run's time budget (--budget-s) is spent" if time.time() > DEADLINE[0] else None


def block_heavy_imports() -> None:
    for name in BLOCKED_MODULES:
        if name in sys.modules and sys.modules[name] is not None:
            raise RuntimeError(f"{name} was imported before the device suite started")
        sys.modules[name] = None  # `import name` now raises ImportError


def _err(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"[:300]


def _median_time(fn, reps: int, sync) -> tuple[float, list[float]]:
    sync(fn())  # warm-up
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        sync(fn())
        times.append(time.perf_counter() - t0)
    return statistics.median(times), times


# ---------------------------------------------------------------------------
# JAX sections.


def jax_peak(p: dict) -> dict:
    import jax
    import jax.numpy as jnp

    n = p["peak_n"]
    a = jax.random.normal(jax.random.PRNGKey(0), (n, n), jnp.bfloat16)
    f = jax.jit(lambda x, y: x @ y)
    s, times = _median_time(lambda: f(a, a), p["peak_reps"], jax.block_until_ready)
    return {"n": n, "dtype": "bfloat16", "time_s": s, "flops_per_s": 2 * n**3 / s}


def _loss_inputs(T: int, d: int, V: int, dtype):
    import jax
    import jax.numpy as jnp

    k = jax.random.split(jax.random.PRNGKey(0), 5)
    h_s = jax.random.normal(k[0], (T, d), jnp.float32).astype(dtype)
    h_t = jax.random.normal(k[1], (T, d), jnp.float32).astype(dtype)
    w_s = (d ** -0.5 * jax.random.normal(k[2], (d, V), jnp.float32)).astype(dtype)
    w_t = (d ** -0.5 * jax.random.normal(k[3], (d, V), jnp.float32)).astype(dtype)
    labels = jax.random.randint(k[4], (T,), 0, V, jnp.int32)
    return h_s, w_s, h_t, w_t, labels


def jax_loss(p: dict, dry: bool) -> list[dict]:
    import jax
    import jax.numpy as jnp

    from hldstudy.losses import fused_kd_loss, materialized_kd_loss

    impls = {
        "ours-pallas": lambda *a: fused_kd_loss(*a, temperature=TEMPERATURE, alpha=ALPHA,
                                                backend="pallas_triton" if dry else "pallas",
                                                interpret=dry),
        "ours-xla": lambda *a: fused_kd_loss(*a, temperature=TEMPERATURE, alpha=ALPHA,
                                             backend="xla"),
        "ours-materialized": lambda *a: materialized_kd_loss(*a, temperature=TEMPERATURE,
                                                             alpha=ALPHA),
    }
    rows = []
    for T, d, V in p["loss_shapes"]:
        h_s, w_s, h_t, w_t, labels = _loss_inputs(T, d, V, jnp.bfloat16)
        for name, loss in impls.items():
            row = {"impl": name, "T": T, "d": d, "V": V, "dtype": "bfloat16"}
            if out_of_time():
                row["skipped"] = out_of_time()
                rows.append(row)
                continue
            try:
                step = jax.jit(jax.value_and_grad(
                    lambda hs, ws, fn=loss, ht=h_t, wt=w_t, y=labels: fn(hs, ws, ht, wt, y)[0],
                    argnums=(0, 1)))
                t0 = time.perf_counter()
                compiled = step.lower(h_s, w_s).compile()
                row["compile_s"] = time.perf_counter() - t0
                row["extra_bytes"] = int(compiled.memory_analysis().temp_size_in_bytes)
                row["extra_bytes_kind"] = "XLA temp"
                row["time_s"], row["times_s"] = _median_time(
                    lambda c=compiled, hs=h_s, ws=w_s: c(hs, ws), p["loss_reps"],
                    jax.block_until_ready)
                value, _ = compiled(h_s, w_s)
                row["loss"] = float(value)
            except Exception as e:  # noqa: BLE001 - one line per failed case
                row["error"] = _err(e)
            rows.append(row)
            print(f"[loss] {json.dumps(row)}", flush=True)
    return rows


def _attention_module():
    spec = importlib.util.spec_from_file_location("hld_bench_attention",
                                                  REPO / "benchmarks" / "attention.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def jax_attention(p: dict, dry: bool) -> list[dict]:
    import jax

    bench = _attention_module()
    gpu = jax.default_backend() == "gpu"
    dtype = "bfloat16" if gpu else "float32"
    rows = []
    for T in p["attention_T"]:
        for window in (None, p["attention_window"]):
            for impl in ("dense", "chunked", "cudnn"):
                row = {"impl": impl, "T": T, "window": window, "dtype": dtype}
                if impl == "cudnn" and not gpu:
                    row["skipped"] = "cudnn needs an NVIDIA GPU"
                elif out_of_time():
                    row["skipped"] = out_of_time()
                else:
                    try:
                        r = bench.run_case(impl, T, window, False, None, dtype,
                                           p["attention_reps"])
                        r.pop("device_peak_bytes", None)  # cumulative in one process
                        row.update(r)
                    except Exception as e:  # noqa: BLE001
                        row["error"] = _err(e)
                rows.append(row)
                print(f"[attention] {json.dumps(row)}", flush=True)
    return rows


def _random_params(abstract_state, seed: int, dtype):
    """Parameters of an abstract nnx state: N(0, 1/fan_in) matrices, zero norm scales
    (values only need to be finite and of the right scale for a speed benchmark)."""
    import jax
    import jax.numpy as jnp

    leaves, treedef = jax.tree_util.tree_flatten(abstract_state)
    keys = jax.random.split(jax.random.PRNGKey(seed), len(leaves))

    def fill(key, leaf):
        if len(leaf.shape) < 2:
            return jnp.zeros(leaf.shape, dtype)
        return (leaf.shape[0] ** -0.5 * jax.random.normal(key, leaf.shape, jnp.float32)).astype(dtype)

    fills = {}
    out = []
    for key, leaf in zip(keys, leaves, strict=True):
        sig = tuple(leaf.shape)
        if sig not in fills:
            fills[sig] = jax.jit(lambda k, leaf=leaf: fill(k, leaf))
        out.append(fills[sig](key))
    return jax.tree_util.tree_unflatten(treedef, out)


def jax_kd_step(p: dict) -> dict:
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from hldstudy.config import Config, DataConfig, DistillConfig, TrainConfig
    from hldstudy.distill.base import make_strategy
    from hldstudy.flops import step_flops
    from hldstudy.model import Transformer, preset
    from hldstudy.teacher.colocated import teacher_forward_fn
    from hldstudy.train.optim import make_optimizer
    from hldstudy.train.program import train_program
    from hldstudy.train.step import split_params

    s = p["step"]
    b, t = s["batch"], s["seq"]
    student_cfg = preset(s["student"], dtype="bfloat16", attention="auto",
                         max_seq_len=max(t, 64))
    teacher_cfg = preset(s["teacher"], dtype="bfloat16", param_dtype="bfloat16",
                         attention="auto", max_seq_len=max(t, 64),
                         vocab_size=student_cfg.vocab_size)
    cfg = Config(model=student_cfg, data=DataConfig(seq_len=t, batch_size=b), train=TrainConfig(),
                 distill=DistillConfig(method="kd", temperature=TEMPERATURE, alpha=ALPHA))
    strategy = make_strategy(cfg, student_cfg, teacher_cfg)
    stage = strategy.stages()[0]
    t0 = time.perf_counter()
    student = Transformer(student_cfg, rngs=nnx.Rngs(0))
    graphdefs, params = split_params(student, None)
    gd_t, abstract_t = nnx.split(nnx.eval_shape(lambda: Transformer(teacher_cfg, rngs=nnx.Rngs(1))),
                                 nnx.Param)
    teacher_params = _random_params(abstract_t, 1, jnp.bfloat16)
    forward = teacher_forward_fn(gd_t, strategy.teacher_layers(stage),
                                 strategy.teacher_needs_head(stage))
    optimizer = make_optimizer(cfg.train, 1000)
    state = {"params": params, "opt_state": optimizer.init(params), "step": jnp.int32(0)}
    step = jax.jit(train_program(strategy, stage, graphdefs, optimizer, forward),
                   donate_argnums=(0,))
    rng = jax.random.PRNGKey(2)
    tokens = jax.random.randint(rng, (b, t), 0, student_cfg.vocab_size, jnp.int32)
    batch = {"tokens": tokens, "targets": jnp.roll(tokens, -1, axis=1),
             "positions": jnp.tile(jnp.arange(t, dtype=jnp.int32), (b, 1)),
             "segment_ids": jnp.ones((b, t), jnp.int32), "mask": jnp.ones((b, t), jnp.float32)}
    init_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    state, m = step(state, batch, teacher_params, {}, 0)[:2]
    first_loss = float(m["loss"])
    compile_s = time.perf_counter() - t0
    holder = {"state": state}

    def one():
        holder["state"], m = step(holder["state"], batch, teacher_params, {}, 0)[:2]
        return m

    step_s, times = _median_time(one, s["steps"], jax.block_until_ready)
    fl = step_flops(cfg, teacher_model=teacher_cfg, count_teacher=True)
    return {"student": s["student"], "teacher": s["teacher"], "batch": b, "seq": t,
            "dtype": "bfloat16", "attention": "auto", "loss_impl": cfg.distill.loss_impl,
            "init_s": init_s, "compile_s": compile_s, "first_loss": first_loss,
            "step_s": step_s, "times_s": times, "tokens_per_s": b * t / step_s,
            "executed_flops": fl.hardware_total, "model_flops_with_teacher": fl.total,
            "teacher_flops": fl.teacher}


def jax_fp8(p: dict, dry: bool) -> dict:
    import jax
    import jax.numpy as jnp

    try:
        from hldstudy.compress import fp8
    except ImportError as e:
        return {"skipped": f"hldstudy.compress.fp8 not importable ({_err(e)})"}
    if not hasattr(fp8, "fp8_dot"):
        return {"skipped": "hldstudy.compress has no FP8 matmul path (fp8_dot)"}
    hw = fp8.backend_has_fp8_matmul()
    if not hw and not dry:
        return {"skipped": f"{jax.devices()[0].device_kind} has no FP8 matrix units"}
    n = p["fp8_n"]
    k = jax.random.split(jax.random.PRNGKey(0), 2)
    x = jax.random.normal(k[0], (n, n), jnp.float32).astype(jnp.bfloat16)
    w = jax.random.normal(k[1], (n, n), jnp.float32) * n ** -0.5
    q, scale = fp8.quantize_fp8(w)
    w_bf16 = w.astype(jnp.bfloat16)
    f8 = jax.jit(lambda x, q, s: fp8.fp8_dot(x, q, s, real=True))
    bf = jax.jit(lambda x, w: x @ w)
    t8, _ = _median_time(lambda: f8(x, q, scale), p["fp8_reps"], jax.block_until_ready)
    tb, _ = _median_time(lambda: bf(x, w_bf16), p["fp8_reps"], jax.block_until_ready)
    ref = (x.astype(jnp.float32) @ w)
    rel = float(jnp.linalg.norm(f8(x, q, scale) - ref) / jnp.linalg.norm(ref))
    return {"n": n, "hardware_fp8": hw, "fp8_time_s": t8, "bf16_time_s": tb,
            "fp8_flops_per_s": 2 * n**3 / t8, "bf16_flops_per_s": 2 * n**3 / tb,
            "speedup_vs_bf16": tb / t8, "rel_error_vs_f32": rel}


def _per_group(x, w, d_out, bounds, dtype):
    """The product and both gradients by one matmul per group (static row ranges): the
    reference, and what one would write without a grouped matmul. XLA's own ragged_dot
    on GPU is a dense pass over every group (256x here: ~25 s a call on an H100)."""
    import jax.numpy as jnp

    x, w, d_out = (a.astype(dtype) for a in (x, w, d_out))
    out = jnp.concatenate([x[s:e] @ w[g] for g, (s, e) in enumerate(bounds)])
    d_x = jnp.concatenate([d_out[s:e] @ w[g].T for g, (s, e) in enumerate(bounds)])
    d_w = jnp.stack([x[s:e].T @ d_out[s:e] for s, e in bounds])
    return out, d_x, d_w


def jax_grouped_matmul(p: dict, dry: bool) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from hldstudy.model import grouped_matmul as gm

    g = p["grouped"]
    if not dry and not gm.hopper_kernels_run():
        return {"skipped": f"{jax.devices()[0].device_kind} is not a Hopper GPU"}
    n_groups, m, k, n = g["groups"], g["rows"], g["d_in"], g["d_out"]
    keys = jax.random.split(jax.random.PRNGKey(0), 4)
    # Rows over the groups as a router spreads them: uneven, some groups empty.
    share = np.asarray(jax.random.dirichlet(keys[0], jnp.full((n_groups,), 0.5)))
    sizes_np = np.floor(share * m).astype(np.int32)
    sizes_np[0] += m - sizes_np.sum()
    ends = np.cumsum(sizes_np)
    bounds = [(int(e - s), int(e)) for s, e in zip(sizes_np, ends, strict=True)]
    sizes = jnp.asarray(sizes_np)
    x = jax.random.normal(keys[1], (m, k), jnp.float32).astype(jnp.bfloat16)
    w = (jax.random.normal(keys[2], (n_groups, k, n), jnp.float32) * k ** -0.5
         ).astype(jnp.bfloat16)
    d_out = jax.random.normal(keys[3], (m, n), jnp.float32).astype(jnp.bfloat16)
    f32 = jnp.float32

    def rel(a, b):
        return float(jnp.linalg.norm(a.astype(f32) - b) / jnp.linalg.norm(b))

    reference = jax.jit(lambda x, w, d: _per_group(x, w, d, bounds, f32))
    want, want_dx, want_dw = reference(x, w, d_out)
    row = {"groups": n_groups, "rows": m, "d_in": k, "d_out": n,
           "empty_groups": int((sizes_np == 0).sum())}
    if dry:  # the product kernel in Mosaic GPU interpret mode (its gradients need a GPU)
        from jax._src.pallas.mosaic_gpu.interpret.params import force_gpu_interpret_mode

        with force_gpu_interpret_mode():
            row["rel_err_product"] = rel(gm.hopper_ragged_dot(x, w, sizes), want)
        return row
    fwd = jax.jit(gm.hopper_ragged_dot)
    train = jax.jit(lambda a, b, s, d: jax.vjp(lambda a, b: gm.hopper_ragged_dot(a, b, s),
                                               a, b)[1](d))
    loop = jax.jit(lambda x, w, d: _per_group(x, w, d, bounds, jnp.bfloat16))
    dx, dw = train(x, w, sizes, d_out)
    row.update(rel_err_product=rel(fwd(x, w, sizes), want), rel_err_d_rows=rel(dx, want_dx),
               rel_err_d_weights=rel(dw, want_dw))
    reps, sync = g["reps"], jax.block_until_ready
    row["kernel_fwd_s"], _ = _median_time(lambda: fwd(x, w, sizes), reps, sync)
    row["kernel_train_s"], _ = _median_time(lambda: train(x, w, sizes, d_out), reps, sync)
    row["loop_train_s"], _ = _median_time(lambda: loop(x, w, d_out), reps, sync)
    row["kernel_fwd_flops_per_s"] = 2 * m * k * n / row["kernel_fwd_s"]
    return row


def _aot_cli(case: dict, target: str) -> subprocess.Popen:
    """`python -m hldstudy.aot --json` for the case, compile-only in a CPU process (started
    first: it runs while this process compiles and runs the same step on the GPU)."""
    cmd = [sys.executable, "-m", "hldstudy.aot", "--config", case["config"], "--teacher-preset",
           case["teacher"], "--target", target, "--parts", "train", "--json"]
    for kv in case["set"]:
        cmd += ["--set", kv]
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def jax_aot(p: dict, dry: bool) -> dict:
    """The compile tier's case on this device: the target compiler's figures (compile-only,
    on the CPU), this device's compile of the same program, its measured peak and time,
    and the planner, side by side."""
    import jax
    import numpy as np

    from hldstudy.aot.check import load_run
    from hldstudy.aot.compile import mesh_for, resolve_for_target, stage_names, train_program
    from hldstudy.aot.report import predicted_train_memory
    from hldstudy.aot.targets import parse_target
    from hldstudy.chips import for_device_kind
    from hldstudy.flops import step_flops
    from hldstudy.plan.decision_map import ESTIMATE_MFU
    from hldstudy.plan.step_memory import xla_memory

    case = p["aot"]
    device = jax.devices()[0]
    chip = for_device_kind(device.device_kind)
    # The dry run (CPU) resolves `auto` for an H100 (its overrides pin the XLA loss).
    target = parse_target(f"{chip.name}:1" if chip else "h100:1")
    proc = None if dry else _aot_cli(case, target.spec)
    cfg, method, teacher = load_run(case["config"], case["set"], None, case["teacher"])
    cfg, teacher, choices = resolve_for_target(cfg, teacher, target)
    stage = stage_names(cfg, method, teacher)[0]
    mesh = mesh_for(cfg, [device])
    name, jitted, args = train_program(cfg, teacher, method, stage, mesh)
    t0 = time.perf_counter()
    with jax.set_mesh(mesh):
        compiled = jitted.trace(*args).lower().compile()
    compile_s = time.perf_counter() - t0
    here = xla_memory(compiled)

    def concrete(path, x):  # zeros everywhere (finite loss), every token counted
        fill = np.ones if jax.tree_util.keystr(path).endswith("['mask']") else np.zeros
        return jax.device_put(fill(x.shape, x.dtype), x.sharding)

    state, batch, teacher_in, hps, bad = jax.tree_util.tree_map_with_path(concrete, args)
    before = (device.memory_stats() or {}).get("bytes_in_use")
    holder = {"state": state}

    def one():
        holder["state"], metrics, _ = compiled(holder["state"], batch, teacher_in, hps, bad)
        return metrics

    step_s, times = _median_time(one, case["steps"], jax.block_until_ready)
    stats = device.memory_stats() or {}
    row = {"case": case["config"], "method": method, "step": name, "target": target.spec,
           "device": device.device_kind, "batch": cfg.data.batch_size, "seq": cfg.data.seq_len,
           "compiled_here": here, "compile_s": compile_s, "step_s": step_s, "times_s": times,
           "peak_bytes": stats.get("peak_bytes_in_use"), "bytes_before_run": before,
           "planner": predicted_train_memory(cfg, teacher, method, stage, 1, 1, choices),
           "device_memory_bytes": target.chip.device_memory_bytes}
    # The decision map's time for this step: its FLOPs at the map's MFU on the chip's peak
    # (docs/decision_map.md's speed column), beside the measured time.
    if target.chip.bf16_tflops:
        flops = step_flops(cfg, method, stage, teacher).hardware_flops("colocated")
        row["estimate_step_s"] = flops / (target.chip.bf16_tflops * 1e12 * ESTIMATE_MFU)
        row["estimate_mfu"] = ESTIMATE_MFU
    if proc is not None:
        out, err = proc.communicate(timeout=max(60.0, DEADLINE[0] - time.time()))
        if proc.returncode in (0, 3):
            rep = json.loads(out)
            row["aot"] = rep["rows"][0]["compiled"]
            row["aot_fits"] = rep["rows"][0]["fits"]
        else:
            row["aot_error"] = (err.strip().splitlines() or ["?"])[-1][:300]
    else:
        row["aot_error"] = "dry run: no CUDA plugin on the CPU path"
    return row


def run_jax(p: dict, dry: bool, sections: list[str], out: dict, save) -> None:
    import jax

    out["jax"] = {"version": jax.__version__, "backend": jax.default_backend(),
                  "device": jax.devices()[0].device_kind}
    # Most wanted first: a run cut by the budget loses the attention grid and FP8 first.
    # aot right after the peak: the device's peak memory is then this step's.
    steps = [("peak", lambda: jax_peak(p)), ("aot", lambda: jax_aot(p, dry)),
             ("loss", lambda: jax_loss(p, dry)),
             ("kd_step", lambda: jax_kd_step(p)), ("attention", lambda: jax_attention(p, dry)),
             ("grouped_matmul", lambda: jax_grouped_matmul(p, dry)),
             ("fp8", lambda: jax_fp8(p, dry))]
    for name, fn in steps:
        if name not in sections:
            continue
        if out_of_time() and name != "peak":
            out[name] = {"skipped": out_of_time()}
            continue
        t0 = time.perf_counter()
        try:
            out[name] = fn()
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            out[name] = {"error": _err(e)}
        out.setdefault("section_s", {})[name] = time.perf_counter() - t0
        print(f"[{name}] done in {out['section_s'][name]:.1f} s", flush=True)
        save()


# ---------------------------------------------------------------------------
# PyTorch peers (own process: torch and JAX would otherwise share the GPU's memory).


def torch_peers(p: dict, dry: bool) -> list[dict]:
    try:
        import torch
        import torch.nn.functional as F
    except ImportError as e:
        return [{"impl": "peers", "skipped": f"torch not importable ({_err(e)})"}]
    cuda = torch.cuda.is_available()
    dev = "cuda" if cuda else "cpu"
    # Torch with materialized logits, the same objective as ours (tau = 1).

    def torch_materialized(h_s, w_s, h_t, w_t, y):
        z_s = (h_s @ w_s.T).float()
        with torch.no_grad():
            z_t = (h_t @ w_t.T).float()
        nll = F.cross_entropy(z_s, y)
        kl = F.kl_div(F.log_softmax(z_s, -1), F.log_softmax(z_t, -1), log_target=True,
                      reduction="batchmean")
        return ALPHA * nll + (1 - ALPHA) * kl

    peers = {"torch-materialized": lambda: torch_materialized}
    try:
        from liger_kernel.chunked_loss import LigerFusedLinearJSDLoss

        # beta = 0: Liger's forward-KL end, KL(p_t || p_s); hard loss = NLL.
        liger = LigerFusedLinearJSDLoss(weight_hard_loss=ALPHA, weight_soft_loss=1 - ALPHA,
                                        beta=0.0, temperature=TEMPERATURE, compiled=cuda)
        peers["liger-jsd(beta=0)"] = lambda: (lambda h_s, w_s, h_t, w_t, y:
                                              liger(h_s, w_s, h_t, w_t, y))
    except Exception as e:  # noqa: BLE001 - missing wheel, or no triton on this machine
        peers["liger-jsd(beta=0)"] = _err(e)
    try:
        from cut_cross_entropy import linear_cross_entropy

        if not cuda:
            raise RuntimeError("Cut Cross-Entropy's kernels need CUDA")
        peers["cce(nll only)"] = lambda: (lambda h_s, w_s, h_t, w_t, y:
                                          linear_cross_entropy(h_s, w_s, y))
    except Exception as e:  # noqa: BLE001
        peers["cce(nll only)"] = _err(e)

    rows = []
    for T, d, V in p["loss_shapes"]:
        g = torch.Generator(device="cpu").manual_seed(0)

        def rnd(*shape, scale=1.0, g=g):
            return (torch.randn(*shape, generator=g) * scale).to(dev, torch.bfloat16)

        h_s, h_t = rnd(T, d), rnd(T, d)
        w_s, w_t = rnd(V, d, scale=d ** -0.5), rnd(V, d, scale=d ** -0.5)  # nn.Linear layout
        y = torch.randint(0, V, (T,), generator=g).to(dev)
        h_s.requires_grad_(True)
        w_s.requires_grad_(True)
        out_bytes = (h_s.numel() + w_s.numel()) * 2  # the two gradients it returns
        for name, make in peers.items():
            row = {"impl": name, "T": T, "d": d, "V": V, "dtype": "bfloat16"}
            if isinstance(make, str) or out_of_time():
                row["skipped"] = make if isinstance(make, str) else out_of_time()
                rows.append(row)
                print(f"[peers] {json.dumps(row)}", flush=True)
                continue
            fn = make()

            def call(fn=fn, h_s=h_s, w_s=w_s, h_t=h_t, w_t=w_t, y=y):
                h_s.grad = w_s.grad = None
                loss = fn(h_s, w_s, h_t, w_t, y)
                loss.backward()
                return loss

            def sync(_):
                if cuda:
                    torch.cuda.synchronize()

            try:
                t0 = time.perf_counter()
                call()
                sync(None)
                row["compile_s"] = time.perf_counter() - t0
                row["time_s"], row["times_s"] = _median_time(call, p["loss_reps"], sync)
                row["loss"] = float(call().detach())
                if cuda:
                    h_s.grad = w_s.grad = None
                    torch.cuda.synchronize()
                    torch.cuda.reset_peak_memory_stats()
                    base = torch.cuda.memory_allocated()
                    call()
                    torch.cuda.synchronize()
                    row["extra_bytes"] = int(torch.cuda.max_memory_allocated() - base - out_bytes)
                    row["extra_bytes_kind"] = "peak allocated - before - gradients"
            except Exception as e:  # noqa: BLE001
                row["error"] = _err(e)
            rows.append(row)
            print(f"[peers] {json.dumps(row)}", flush=True)
            h_s.grad = w_s.grad = None
            if cuda:
                torch.cuda.empty_cache()
    return rows


# ---------------------------------------------------------------------------
# Report.


def _gib(n):
    return "-" if n is None else f"{n / 2**30:.2f}"


def write_report(out: dict, out_dir: Path, stem: str) -> str:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{stem}.json").write_text(json.dumps(out, indent=2, default=str) + "\n")
    peak = (out.get("peak") or {}).get("flops_per_s")
    lines = [f"# Device suite ({'dry run, CPU' if out['dry_run'] else 'GPU'})", "",
             f"Device: {out.get('jax', {}).get('device', '?')} "
             f"({out.get('jax', {}).get('backend', '?')}), jax {out.get('jax', {}).get('version')}, "
             f"torch {out.get('torch_version', '-')}. Started {out['started']}, "
             f"{out.get('total_s', 0):.0f} s in all.", ""]
    if peak:
        lines += [f"Measured bf16 matmul peak: **{peak / 1e12:.1f} TFLOP/s** "
                  f"({out['peak']['n']}^3, same run).", ""]
    loss_rows = (out.get("loss") or []) + (out.get("peers") or [])
    if isinstance(out.get("loss"), dict) or isinstance(out.get("peers"), dict):
        loss_rows = [r for r in (out.get("loss"), out.get("peers")) if isinstance(r, dict)]
    if loss_rows:
        lines += ["## Fused KD loss, forward + backward (bf16)", "",
                  "MFU counts 8 T d V FLOPs (two heads forward, two gradients); memory is "
                  "beyond inputs and outputs. CCE computes NLL only (a floor, not a peer).", "",
                  "| T x d x V | implementation | time ms | extra memory GiB | MFU | loss | note |",
                  "|---|---|---:|---:|---:|---:|---|"]
        for r in sorted(loss_rows, key=lambda r: (-r.get("V", 0), r.get("impl", ""))):
            shape = f"{r.get('T')} x {r.get('d')} x {r.get('V')}"
            note = r.get("error") or r.get("skipped") or ""
            if "time_s" not in r:
                lines.append(f"| {shape} | {r.get('impl')} | - | - | - | - | {note} |")
                continue
            mfu = (8 * r["T"] * r["d"] * r["V"] / r["time_s"] / peak) if peak else None
            lines.append(f"| {shape} | {r['impl']} | {1e3 * r['time_s']:.1f} | "
                         f"{_gib(r.get('extra_bytes'))} | "
                         f"{'-' if mfu is None else f'{100 * mfu:.1f}%'} | "
                         f"{r.get('loss', float('nan')):.4f} | {note} |")
        lines.append("")
    att = out.get("attention")
    if att:
        lines += ["## Attention paths, forward + backward (one layer, batch 1, 4 heads, 1 KV head, "
                  "head_dim 256)", "",
                  "| T | window | path | time ms | XLA temp GiB | exec. GFLOP | note |",
                  "|---:|---|---|---:|---:|---:|---|"]
        for r in (att if isinstance(att, list) else [att]):
            note = r.get("error") or r.get("skipped") or ""
            if "time_s" not in r:
                lines.append(f"| {r.get('T')} | {r.get('window') or 'global'} | {r.get('impl')} "
                             f"| - | - | - | {note} |")
                continue
            lines.append(f"| {r['T']} | {r['window'] or 'global'} | {r['impl']} | "
                         f"{1e3 * r['time_s']:.2f} | {_gib(r['temp_bytes'])} | "
                         f"{r['executed_flops'] / 1e9:.1f} | {note} |")
        lines.append("")
    st = out.get("kd_step")
    if st:
        lines += ["## KD train step, colocated teacher (bf16 compute)", ""]
        if "step_s" in st:
            mfu_x = st["executed_flops"] / st["step_s"] / peak if peak else None
            mfu_m = st["model_flops_with_teacher"] / st["step_s"] / peak if peak else None
            lines += ["| student | teacher | batch x seq | step s | tokens/s | MFU (executed) | "
                      "MFU (model, teacher counted) | compile s |",
                      "|---|---|---|---:|---:|---:|---:|---:|",
                      f"| {st['student']} | {st['teacher']} | {st['batch']} x {st['seq']} | "
                      f"{st['step_s']:.3f} | {st['tokens_per_s']:.0f} | "
                      f"{'-' if mfu_x is None else f'{100 * mfu_x:.1f}%'} | "
                      f"{'-' if mfu_m is None else f'{100 * mfu_m:.1f}%'} | "
                      f"{st['compile_s']:.0f} |", ""]
        else:
            lines += [f"{st.get('error') or st.get('skipped')}", ""]
    ao = out.get("aot")
    if ao:
        lines += ["## The compile tier's step: target compiler (compile-only, CPU) vs this "
                  "device", ""]
        if "step_s" in ao:
            aot = ao.get("aot") or {}
            lines += [f"{ao['case']} ({ao['step']}), batch {ao['batch']} x {ao['seq']}, "
                      f"on {ao['device']}; GiB per device.", "",
                      "| figure | arguments | outputs | temporaries | aliased | total |",
                      "|---|---:|---:|---:|---:|---:|"]
            for label, m in ((f"hldstudy.aot --target {ao['target']} (compile-only)", aot),
                             ("compiled on this device", ao["compiled_here"]),
                             ("planner", ao["planner"])):
                lines.append(f"| {label} | " + " | ".join(
                    _gib(m.get(k)) for k in ("argument_bytes", "output_bytes", "temp_bytes",
                                             "alias_bytes", "total_bytes")) + " |")
            lines += ["", f"Measured: peak {_gib(ao.get('peak_bytes'))} GiB in use on the device "
                      f"(of {_gib(ao['device_memory_bytes'])}), step {1e3 * ao['step_s']:.1f} ms "
                      f"(median), compile {ao['compile_s']:.0f} s."
                      + (f" The decision map's estimate for this step (its FLOPs at "
                         f"{ao['estimate_mfu']:.0%} MFU): {1e3 * ao['estimate_step_s']:.1f} ms, "
                         f"measured / estimate {ao['step_s'] / ao['estimate_step_s']:.2f}."
                         if "estimate_step_s" in ao else "")
                      + (f" Compile-only: {ao['aot_error']}." if "aot_error" in ao else ""), ""]
        else:
            lines += [f"{ao.get('error') or ao.get('skipped')}", ""]
    gr = out.get("grouped_matmul")
    if gr:
        lines += ["## Grouped matmul (hldstudy.model.grouped_matmul: Mosaic GPU kernels)", ""]
        if "rel_err_product" in gr:
            lines.append(f"{gr['groups']} groups ({gr['empty_groups']} empty), {gr['rows']} rows, "
                         f"{gr['d_in']} x {gr['d_out']}, bf16; relative error vs one float32 "
                         f"matmul per group: product {gr['rel_err_product']:.2e}"
                         + (f", rows' gradient {gr['rel_err_d_rows']:.2e}, weights' gradient "
                            f"{gr['rel_err_d_weights']:.2e}" if "rel_err_d_rows" in gr else
                            " (interpret mode)") + ".")
            if "kernel_fwd_s" in gr:
                lines += ["", "| path | forward ms | forward + gradients ms |",
                          "|---|---:|---:|",
                          f"| kernels | {1e3 * gr['kernel_fwd_s']:.2f} | "
                          f"{1e3 * gr['kernel_train_s']:.2f} |",
                          f"| one matmul per group (XLA, bf16) | - | "
                          f"{1e3 * gr['loop_train_s']:.2f} |",
                          "", f"Kernel forward: {gr['kernel_fwd_flops_per_s'] / 1e12:.0f} "
                          "TFLOP/s."]
            lines.append("")
        else:
            lines += [f"{gr.get('error') or gr.get('skipped')}", ""]
    fp = out.get("fp8")
    if fp:
        lines += ["## FP8 matmul (hldstudy.compress.fp8.fp8_dot)", ""]
        if "fp8_time_s" in fp:
            lines += [f"n = {fp['n']}: FP8 {fp['fp8_flops_per_s'] / 1e12:.1f} TFLOP/s vs bf16 "
                      f"{fp['bf16_flops_per_s'] / 1e12:.1f} TFLOP/s ({fp['speedup_vs_bf16']:.2f}x), "
                      f"relative error vs float32 {fp['rel_error_vs_f32']:.2e}"
                      + ("" if fp["hardware_fp8"] else " (emulated: no FP8 units)") + ".", ""]
        else:
            lines += [f"{fp.get('error') or fp.get('skipped')}", ""]
    md = "\n".join(lines) + "\n"
    (out_dir / f"{stem}.md").write_text(md)
    return md


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry-run", action="store_true",
                    default=os.environ.get("HLDSTUDY_DEVICE_DRY") == "1",
                    help="every section at tiny shapes on CPU (Pallas in interpret mode)")
    ap.add_argument("--sections",
                    default="peak,aot,loss,peers,attention,kd_step,grouped_matmul,fp8")
    ap.add_argument("--out-dir", type=Path, default=RESULTS)
    ap.add_argument("--budget-s", type=float, default=270.0,
                    help="wall-clock seconds for the whole run; cases that would start later "
                         "are skipped with a line (default 270: the suite must fit 5 minutes)")
    ap.add_argument("--deadline", type=float, help=argparse.SUPPRESS)
    ap.add_argument("--part", choices=("jax", "torch"), help=argparse.SUPPRESS)
    ap.add_argument("--part-out", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    block_heavy_imports()
    p = DRY if args.dry_run else FULL
    sections = args.sections.split(",")

    if args.part:  # a worker process: one framework, results to --part-out
        DEADLINE[0] = args.deadline or float("inf")
        out: dict = {}

        def save():
            args.part_out.write_text(json.dumps(out, default=str))

        if args.part == "jax":
            if args.dry_run:
                os.environ["JAX_PLATFORMS"] = "cpu"
            run_jax(p, args.dry_run, sections, out, save)
        else:
            out["peers"] = torch_peers(p, args.dry_run)
            try:
                import torch

                out["torch_version"] = torch.__version__
            except ImportError:
                pass
        save()
        return 0

    env = {**os.environ, "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    if not args.dry_run:  # probed in a child: this process never holds the GPU
        probe = subprocess.run([sys.executable, "-c", "import jax; print(jax.default_backend())"],
                               env=env, capture_output=True, text=True)
        backend = (probe.stdout.strip().splitlines() or ["none"])[-1]
        if probe.returncode != 0 or backend != "gpu":
            print(f"device_suite: no GPU visible to JAX (backend: {backend}); nothing measured "
                  "(--dry-run runs every section on CPU at tiny shapes)")
            return 0
    stem = "device_dry" if args.dry_run else "device"
    out = {"dry_run": args.dry_run, "params": {k: v for k, v in p.items()},
           "started": time.strftime("%Y-%m-%d %H:%M:%S"), "sections": sections}
    t_start = time.perf_counter()
    # Started processes pay their imports and the GPU probe: leave the report 10 s. The
    # PyTorch peers (run first) get at most a third of the budget for starting cases.
    deadline = time.time() + args.budget_s - 10
    torch_deadline = time.time() + args.budget_s / 3
    parts = []
    if "peers" in sections:
        parts.append("torch")  # first: its process is gone before JAX takes the GPU
    if set(sections) - {"peers"}:
        parts.append("jax")
    for part in parts:
        part_out = args.out_dir / f".{stem}_{part}.json"
        args.out_dir.mkdir(parents=True, exist_ok=True)
        part_out.unlink(missing_ok=True)
        cmd = [sys.executable, __file__, "--part", part, "--part-out", str(part_out),
               "--sections", args.sections, "--out-dir", str(args.out_dir),
               "--deadline", str(deadline if part == "jax" else torch_deadline)]
        if args.dry_run:
            cmd.append("--dry-run")
        rc = subprocess.run(cmd, env=env).returncode
        if part_out.exists():
            out.update(json.loads(part_out.read_text()))
            part_out.unlink()
        if rc != 0:
            out.setdefault("errors", []).append(f"{part} process exited with {rc}")
        out["total_s"] = time.perf_counter() - t_start
        md = write_report(out, args.out_dir, stem)
    print(md)
    return 1 if out.get("errors") else 0


if __name__ == "__main__":
    raise SystemExit(main())
