"""Cohort vs solo training: K = 4 students sharing one teacher forward per step.

Two arms side by side in one process run, with the same --parallel:

(a) `pair`: a KD teacher/student pair with the study's cost ratio (a CPU teacher
    whose forward costs >= 6x the student's training step), training only: the
    solo arm runs K runs' compiled steps one after another (each step: teacher
    forward + student step), the cohort arm one compiled cohort step (one teacher
    forward, K students vmapped) per step. Measured: S (student step with the
    teacher's outputs given), T (teacher forward), the solo step, the cohort step;
    the bound is K (S + T) / (K S + T).
(b) `quickstart`: the quickstart grid's distillation runs (the `cpu` sweep at
    --size, its teacher trained first, outside the timing), end to end with
    evaluation: `python -m hldstudy.sweep` with --cohort 1 vs --cohort K.

    python benchmarks/cohort.py [--arms pair,quickstart] [--k 4] [--steps 20] [--parallel 1]

Writes benchmarks/results/cohort.json and cohort.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "benchmarks" / "results"


def _time(fn, n: int) -> float:
    """Median seconds of fn() (blocking) over n calls, after 2 warm-up calls."""
    import jax

    for _ in range(2):
        jax.block_until_ready(fn())
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    times.sort()
    return times[len(times) // 2]


def bench_pair(k: int, steps: int, work: Path) -> dict:
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from hldstudy import sharding as mesh_lib
    from hldstudy.config import Config, DataConfig, DistillConfig, TrainConfig
    from hldstudy.model import Transformer, preset
    from hldstudy.teacher.colocated import ColocatedTeacher
    from hldstudy.train.cohort import HPARAMS, make_cohort_step, stack
    from hldstudy.train.loop import Trainer
    from hldstudy.train.optim import make_optimizer
    from hldstudy.train.step import make_train_step

    vocab = 512
    student = preset("tiny", vocab_size=vocab)
    # A teacher whose forward costs >= 6x the student's KD training step on this CPU
    # (the study's 3.4B teacher costs 8x its 123M student).
    teacher_cfg = dataclasses.replace(preset("tiny-teacher", vocab_size=vocab), d_model=512,
                                      n_layers=10, head_dim=128, d_ff=2048)
    teacher = ColocatedTeacher(Transformer(teacher_cfg, rngs=nnx.Rngs(0)), None)
    cfg = Config(name="pair", model=student,
                 data=DataConfig(seq_len=128, batch_size=8, tokenizer_vocab_size=vocab,
                                 synthetic_docs=400, synthetic_valid_docs=20),
                 train=TrainConfig(steps=100, progress=False),
                 distill=DistillConfig(method="kd"),
                 teacher=dataclasses.replace(Config().teacher, checkpoint="(in memory)"))
    trainer = Trainer(cfg, work / "pair", teacher=teacher, devices=jax.devices()[:1])
    plan = trainer.plans[0]
    graphdefs, optimizer, state, _ = trainer._init_state(plan)
    feed = trainer._teacher_feed(plan)
    strategy, stage = trainer.strategy, plan.stage
    batch = mesh_lib.put_batch(trainer.data.train.batch_at(0), trainer.mesh)
    t_in = feed.inputs(0, batch)

    forward = jax.jit(feed.forward)
    outputs = forward(t_in, batch)
    solo = jax.jit(make_train_step(strategy, stage, graphdefs, optimizer, feed.forward))
    student_only = jax.jit(make_train_step(strategy, stage, graphdefs, optimizer, None))

    def make_opt(lr):
        return make_optimizer(cfg.train, plan.steps, lr=lr)

    cohort = jax.jit(make_cohort_step(strategy, stage, graphdefs, optimizer, make_opt,
                                      feed.forward))
    states = stack([state] * k)
    hps = {"lr": jnp.linspace(1e-3, 3e-3, k).astype(jnp.float32),
           "temperature": jnp.linspace(1.0, 2.0, k).astype(jnp.float32)}
    assert set(hps) <= set(HPARAMS)
    bad = jnp.zeros((k,), jnp.int32)

    T = _time(lambda: forward(t_in, batch), steps)
    S = _time(lambda: student_only(state, batch, outputs), steps)
    solo_step = _time(lambda: solo(state, batch, t_in), steps)
    cohort_step = _time(lambda: cohort(states, batch, t_in, hps, bad), steps)
    solo_arm = k * solo_step  # K runs' steps, one after another (parallel 1)
    return {"K": k, "teacher": {"d_model": teacher_cfg.d_model, "n_layers": teacher_cfg.n_layers},
            "student": {"d_model": student.d_model, "n_layers": student.n_layers},
            "tokens_per_step": cfg.data.batch_size * cfg.data.seq_len,
            "S_s": S, "T_s": T, "T_over_S": T / S, "solo_step_s": solo_step,
            "cohort_step_s": cohort_step, "solo_arm_s_per_step": solo_arm,
            "speedup": solo_arm / cohort_step, "bound": k * (S + T) / (k * S + T)}


def _sweep(args: list[str], env) -> float:
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "hldstudy.sweep", "cpu", "--no-progress", *args],
                   cwd=ROOT, env=env, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - t0


def bench_quickstart(k: int, parallel: int, size: str, work: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    teacher = work / "teacher"
    subprocess.run([sys.executable, "-c",
                    "from pathlib import Path; from hldstudy.quickstart import SIZES, "
                    f"train_teacher; train_teacher(Path({str(work)!r}), SIZES[{size!r}], "
                    "False, {})"],
                   cwd=ROOT, env=env, check=True, stdout=subprocess.DEVNULL)
    common = ["--parallel", str(parallel), "--set", f"teacher.checkpoint={teacher}",
              "--methods", "kd,hldf,hldc"]
    out = {}
    for arm, kk in (("solo", 1), ("cohort", k)):
        wd = work / arm
        out[f"{arm}_s"] = _sweep(["--workdir", str(wd), "--cohort", str(kk), *common], env)
        out[f"{arm}_runs"] = {p.name: json.loads((p / "results.json").read_text())["valid_nll"]
                              for p in sorted(wd.iterdir()) if (p / "results.json").exists()}
    diffs = [abs(out["cohort_runs"][r] - v) / abs(v) for r, v in out["solo_runs"].items()]
    out.update({"K": k, "parallel": parallel, "size": size, "speedup": out["solo_s"] /
                out["cohort_s"], "runs": len(out["solo_runs"]),
                "max_rel_valid_nll_diff": max(diffs) if diffs else None})
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arms", default="pair,quickstart")
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--parallel", type=int, default=1)
    p.add_argument("--size", default="tiny")
    p.add_argument("--out", default=str(OUT))
    args = p.parse_args(argv)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    work = Path(tempfile.mkdtemp(prefix="hldstudy-cohort-bench-"))
    res = {"machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
           "loadavg_start": os.getloadavg()[0], "parallel": args.parallel}
    try:
        arms = args.arms.split(",")
        if "pair" in arms:
            res["pair"] = bench_pair(args.k, args.steps, work)
            print(json.dumps(res["pair"], indent=1))
        if "quickstart" in arms:
            res["quickstart"] = bench_quickstart(args.k, args.parallel, args.size, work)
            print(json.dumps(res["quickstart"], indent=1))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    res["loadavg_end"] = os.getloadavg()[0]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "cohort.json").write_text(json.dumps(res, indent=1) + "\n")
    lines = ["# Cohort benchmark (CPU)", "",
             f"{res['cpus']} CPUs (shared), load average {res['loadavg_start']:.1f} -> "
             f"{res['loadavg_end']:.1f}, --parallel {args.parallel}, K = {args.k}.", ""]
    if "pair" in res:
        r = res["pair"]
        lines += ["## (a) teacher/student pair, training only", "",
                  "| S (student step) | T (teacher fwd) | T/S | K x solo step | cohort step | "
                  "speedup | bound K(S+T)/(KS+T) |", "|---|---|---|---|---|---|---|",
                  f"| {r['S_s']*1e3:.1f} ms | {r['T_s']*1e3:.1f} ms | {r['T_over_S']:.1f} | "
                  f"{r['solo_arm_s_per_step']*1e3:.1f} ms | {r['cohort_step_s']*1e3:.1f} ms | "
                  f"**{r['speedup']:.2f}x** | {r['bound']:.2f}x |", ""]
    if "quickstart" in res:
        r = res["quickstart"]
        lines += ["## (b) quickstart grid's distillation runs, end to end (with evaluation)", "",
                  "| runs | solo arm | cohort arm | speedup | max rel. valid_nll diff |",
                  "|---|---|---|---|---|",
                  f"| {r['runs']} | {r['solo_s']:.0f} s | {r['cohort_s']:.0f} s | "
                  f"**{r['speedup']:.2f}x** | {r['max_rel_valid_nll_diff']:.2e} |", ""]
    (out / "cohort.md").write_text("\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
