"""Cohort vs solo training: K = 4 students sharing one teacher forward per step.

Two arms side by side in one process run, with the same --parallel:

(a) `pair`: a KD teacher/student pair with the study's cost ratio (a CPU teacher
    whose forward costs >= 6x the student's training step), training only: the
    solo arm runs K runs' compiled steps one after another (each step: teacher
    forward + student step), the cohort arm one compiled cohort step (one teacher
    forward, K students vmapped) per step. Measured: S (student step with the
    teacher's outputs given), T (teacher forward), the solo step, the cohort step;
    the bound is K (S + T) / (K S + T).
(b) `quickstart`: the quickstart grid's distillation runs (kd, hldf, hldc of the
    `cpu` sweep at its default size, the quickstart's; the teacher, of --size,
    trained first, outside the timing), end to end with evaluation:
    `python -m hldstudy.sweep` with --cohort 1 vs --cohort K; the cohort arm's
    members run as --mode (map: one after the other inside the step, the CPU
    default; vmap: batched). Every logged loss and every number of each run's
    results.json are compared between the arms.

    python benchmarks/cohort.py [--arms pair,quickstart] [--k 4] [--steps 20] [--parallel 1]
        [--mode map|vmap] [--render-only]

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


def bench_pair(k: int, steps: int, work: Path, mode: str = "vmap") -> dict:
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from hldstudy import sharding as mesh_lib
    from hldstudy.config import Config, DataConfig, DistillConfig, TrainConfig
    from hldstudy.model import Transformer, preset
    from hldstudy.teacher.colocated import ColocatedTeacher
    from hldstudy.train.loop import Trainer, stack
    from hldstudy.train.optim import make_optimizer
    from hldstudy.train.program import HPARAMS, Members, train_program

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
    solo = jax.jit(train_program(strategy, stage, graphdefs, optimizer, feed.forward))
    student_only = jax.jit(train_program(strategy, stage, graphdefs, optimizer, None))

    def make_opt(lr):
        return make_optimizer(cfg.train, plan.steps, lr=lr)

    cohort = jax.jit(train_program(strategy, stage, graphdefs, optimizer, feed.forward,
                                   Members(make_opt, mode)))
    states = stack([state] * k)
    hps = {"lr": jnp.linspace(1e-3, 3e-3, k).astype(jnp.float32),
           "temperature": jnp.linspace(1.0, 2.0, k).astype(jnp.float32)}
    assert set(hps) <= set(HPARAMS)
    bad = jnp.zeros((k,), jnp.int32)

    T = _time(lambda: forward(t_in, batch), steps)
    S = _time(lambda: student_only(state, batch, outputs, {}, 0), steps)
    solo_step = _time(lambda: solo(state, batch, t_in, {}, 0), steps)
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


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-30)


def _numbers(tree, prefix=""):
    """{dotted key: float} of the numbers in a results.json (nested dicts)."""
    out = {}
    for k, v in (tree or {}).items():
        if isinstance(v, dict):
            out.update(_numbers(v, f"{prefix}{k}."))
        elif isinstance(v, (int, float)) and not isinstance(v, bool):
            out[f"{prefix}{k}"] = float(v)
    return out


# Fields of results.json that are timings or identities, not results.
_NOT_RESULTS = ("train_seconds", "eval_seconds", "seconds", "tokens_per_s", "time")


def compare_runs(solo: Path, cohort: Path) -> dict:
    """Per run: the largest relative difference between the arms over every logged loss
    (metrics.jsonl) and every number of results.json (valid_nll, eval scores, steps,
    FLOPs; timings excluded), and the keys that differ at all."""
    out = {}
    for d in sorted(p for p in solo.iterdir() if (p / "results.json").exists()):
        c = cohort / d.name
        rs, rc = (json.loads((x / "results.json").read_text()) for x in (d, c))
        ns, nc = _numbers(rs), _numbers(rc)
        keys = sorted(k for k in ns if not any(t in k for t in _NOT_RESULTS))
        diffs = {k: _rel(nc.get(k, float("nan")), ns[k]) for k in keys}

        def losses(x):
            recs = [json.loads(line) for line in (x / "metrics.jsonl").read_text().splitlines()]
            return {r["step"]: r["loss"] for r in recs if "loss" in r}

        ls, lc = losses(d), losses(c)
        loss_diff = max((_rel(lc[s], v) for s, v in ls.items()), default=0.0) \
            if sorted(ls) == sorted(lc) else float("inf")
        out[d.name] = {"status": [rs.get("status"), rc.get("status")],
                       "logged_steps": len(ls), "max_rel_loss_diff": loss_diff,
                       "max_rel_results_diff": max(diffs.values(), default=0.0),
                       "results_keys_compared": len(keys),
                       "differing_keys": {k: v for k, v in diffs.items() if v > 0},
                       "bitwise_losses": ls == lc}
    return out


def bench_quickstart(k: int, parallel: int, size: str, work: Path) -> dict:
    """The quickstart grid's distillation runs (kd, hldf, hldc of the `cpu` sweep at its
    default size, the quickstart's), end to end with evaluation, solo then cohort."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    teacher = work / "teacher"
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c",
                    "from pathlib import Path; from hldstudy.quickstart import SIZES, "
                    f"train_teacher; train_teacher(Path({str(work)!r}), SIZES[{size!r}], "
                    "False, {})"],
                   cwd=ROOT, env=env, check=True, stdout=subprocess.DEVNULL)
    teacher_s = time.perf_counter() - t0
    common = ["--parallel", str(parallel), "--set", f"teacher.checkpoint={teacher}",
              "--methods", "kd,hldf,hldc"]
    out = {"teacher_s": teacher_s}
    for arm, kk in (("solo", 1), ("cohort", k)):
        wd = work / arm
        out[f"{arm}_s"] = _sweep(["--workdir", str(wd), "--cohort", str(kk), *common], env)
        out[f"{arm}_runs"] = {p.name: json.loads((p / "results.json").read_text())["valid_nll"]
                              for p in sorted(wd.iterdir()) if (p / "results.json").exists()}
    cmp = compare_runs(work / "solo", work / "cohort")
    out.update({"K": k, "parallel": parallel, "teacher_size": size, "speedup": out["solo_s"] /
                out["cohort_s"], "runs": len(out["solo_runs"]), "compare": cmp,
                "max_rel_loss_diff": max((c["max_rel_loss_diff"] for c in cmp.values()),
                                         default=None),
                "max_rel_results_diff": max((c["max_rel_results_diff"] for c in cmp.values()),
                                            default=None),
                "max_rel_valid_nll_diff": max((_rel(out["cohort_runs"][r], v)
                                               for r, v in out["solo_runs"].items()),
                                              default=None),
                "all_done": all(c["status"] == ["done", "done"] for c in cmp.values())})
    return out


def render(res: dict) -> str:
    lines = ["# Cohort benchmark (CPU)", "",
             f"{res['cpus']} CPUs (shared with other work), K = 4.", ""]
    pairs = {k: v for k, v in res.items() if k.startswith("pair")}
    if pairs:
        lines += ["## (a) teacher/student pair, training only", "",
                  "Median step times, --parallel 1; each row is one run of the arm (S, T "
                  "measured again in each); mode: how the cohort step runs its members.", "",
                  "| cohort mode | load avg | S (student step) | T (teacher fwd) | T/S | "
                  "K x solo step | cohort step | speedup | bound K(S+T)/(KS+T) |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for r in pairs.values():
            lines.append(
                f"| {r.get('mode', 'vmap')} | "
                f"{r.get('loadavg_start', res.get('loadavg_start', 0)):.1f} | "
                f"{r['S_s']*1e3:.1f} ms | {r['T_s']*1e3:.1f} ms | {r['T_over_S']:.1f} | "
                f"{r['solo_arm_s_per_step']*1e3:.1f} ms | {r['cohort_step_s']*1e3:.1f} ms | "
                f"**{r['speedup']:.2f}x** | {r['bound']:.2f}x |")
        lines.append("")
    qs = {k: v for k, v in res.items() if k.startswith("quickstart")}
    if qs:
        r0 = next(iter(qs.values()))
        lines += ["## (b) quickstart grid's distillation runs, end to end (with evaluation)", "",
                  "`python -m hldstudy.sweep cpu --methods kd,hldf,hldc` (the quickstart's "
                  f"grid at its default size: 12 runs, 116-147 steps) with --cohort 1 vs "
                  f"--cohort {r0['K']} (3 cohorts), --parallel {r0['parallel']} in both arms; "
                  "the teacher trained first, outside the timing. Each row is one run of "
                  "both arms; mode: how the cohort step runs its members "
                  "(`hldstudy.train.program.default_mode`).", "",
                  "| cohort mode | load avg | solo arm | cohort arm | speedup | max rel. loss "
                  "diff (every logged step) | max rel. diff, numbers of results.json | "
                  "all done | runs with bitwise-equal losses |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for r in qs.values():
            same = sum(c["bitwise_losses"] for c in r["compare"].values())
            lines.append(f"| {r.get('mode', 'vmap')} | {r.get('loadavg_after', 0):.1f} | "
                         f"{r['solo_s']:.0f} s | {r['cohort_s']:.0f} s | "
                         f"**{r['speedup']:.2f}x** | {r['max_rel_loss_diff']:.2e} | "
                         f"{r['max_rel_results_diff']:.2e} | {r['all_done']} | "
                         f"{same} of {r['runs']} |")
        lines.append("")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arms", default="pair,quickstart")
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--parallel", type=int, default=1)
    p.add_argument("--size", default="tiny")
    p.add_argument("--mode", default="map", choices=("map", "vmap"),
                   help="the cohort arm's member mode (HLDSTUDY_COHORT_MODE)")
    p.add_argument("--out", default=str(OUT))
    p.add_argument("--render-only", action="store_true", help="rewrite cohort.md from the json")
    args = p.parse_args(argv)
    out = Path(args.out)
    if args.render_only:
        text = render(json.loads((out / "cohort.json").read_text()))
        (out / "cohort.md").write_text(text)
        print(text)
        return 0
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    work = Path(tempfile.mkdtemp(prefix="hldstudy-cohort-bench-"))
    res = {"machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
           "loadavg_start": os.getloadavg()[0], "parallel": args.parallel}
    try:
        arms = args.arms.split(",")
        if "pair" in arms:
            key = "pair" if args.mode == "vmap" else f"pair_{args.mode}"
            res[key] = {**bench_pair(args.k, args.steps, work, args.mode), "mode": args.mode,
                        "loadavg_start": os.getloadavg()[0], "parallel": args.parallel}
            print(json.dumps(res[key], indent=1))
        if "quickstart" in arms:
            os.environ["HLDSTUDY_COHORT_MODE"] = args.mode
            res[f"quickstart_{args.mode}"] = {
                **bench_quickstart(args.k, args.parallel, args.size, work), "mode": args.mode,
                "loadavg_after": os.getloadavg()[0]}
            print(json.dumps(res[f"quickstart_{args.mode}"], indent=1))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    res["loadavg_end"] = os.getloadavg()[0]
    out.mkdir(parents=True, exist_ok=True)
    if (out / "cohort.json").exists():  # arms not rerun keep their last measurement
        prev = json.loads((out / "cohort.json").read_text())
        for arm, v in prev.items():
            if arm.startswith(("pair", "quickstart_")) and arm not in res:
                res[arm] = v
    (out / "cohort.json").write_text(json.dumps(res, indent=1) + "\n")
    text = render(res)
    (out / "cohort.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
