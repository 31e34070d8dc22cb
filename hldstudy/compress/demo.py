"""The CPU-scale demonstration of the compression pipeline (analysis/compression/).

Design notes: `docs/compression.md`, under this file's name.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from hldstudy.compress.config import CompressConfig
from hldstudy.config import Config, DataConfig, DistillConfig, TrainConfig
from hldstudy.data.pipeline import make_batches
from hldstudy.distill import methods
from hldstudy.fileio import write_json_atomic
from hldstudy.model.loading import load_model

# The command's --help text.
HELP = """The CPU-scale demonstration of the compression pipeline (analysis/compression/).

    python -m hldstudy.compress.demo --workdir runs/compression --report analysis/compression

1. trains the quickstart teacher (tiny-teacher: 6 layers, d 128) and two
   quickstart-shaped students (tiny: 4 layers, d 64, d_ff 192) on the synthetic
   corpus with the suite's trainer: one distilled from the teacher (kd), one
   self-supervised (baseline), same steps;
2. compresses them with `hldstudy.compress.pipeline.run`:
   - distill -> prune (magnitude / Wanda / SparseGPT 2:4) -> recover (KD from the
     dense student, masks held) -> FP8 e4m3 per output channel;
   - the baseline student through the same SparseGPT path;
   - distill -> prune (SparseGPT) -> FP8 -> recover with FP8 in the loop
     (straight-through);
   - the SparseGPT path recovered with reverse KL, and with Patient KD from the
     6-layer teacher (hidden-layer pairs);
   - a control: the dense KD student through the same recovery steps and FP8,
     unpruned;
3. writes REPORT/results.json (every stage of every pipeline) and REPORT/report.md.

Reruns reuse finished training runs and compression outputs.
"""

DATA = DataConfig(source="synthetic", seq_len=128, batch_size=8, tokenizer_vocab_size=512,
                  synthetic_docs=4000, synthetic_valid_docs=200)


def _train(cfg: Config, workdir: Path) -> dict:
    from hldstudy.train.loop import train

    res = workdir / "results.json"
    if res.exists():
        done = json.loads(res.read_text())
        if done.get("status") == "done" and done.get("steps") == cfg.train.steps:
            return done
    return train(cfg, workdir)


def train_models(workdir: Path, teacher_steps: int, student_steps: int, progress: bool) -> dict:
    from hldstudy.model.presets import preset

    tcfg = Config(name="teacher", model=preset("tiny-teacher"),
                  data=dataclasses.replace(DATA, batch_size=16),
                  train=TrainConfig(steps=teacher_steps, lr=3e-3, warmup_steps=20,
                                    log_every=50, checkpoint_every=0, eval_batches=8,
                                    progress=progress))
    teacher_dir = workdir / "teacher"
    out = {"teacher": _train(tcfg, teacher_dir)}
    tok = str((teacher_dir / "tokenizer.model").absolute())
    data = dataclasses.replace(DATA, tokenizer=tok)  # one tokenizer for every model
    for method in (methods.REFERENCE, methods.BASELINE):
        scfg = Config(name=f"student-{method}", model=preset("tiny"), data=data,
                      train=TrainConfig(steps=student_steps, lr=3e-3, warmup_steps=10,
                                        log_every=50, checkpoint_every=0, eval_batches=8,
                                        progress=progress),
                      distill=DistillConfig(method=method, alpha=0.5, temperature=1.0))
        if methods.get(method).needs_teacher:
            scfg = dataclasses.replace(scfg, teacher=dataclasses.replace(
                scfg.teacher, checkpoint=str(teacher_dir.absolute())))
        out[method] = _train(scfg, workdir / f"student-{method}")
    return out


def pipelines(workdir: Path, recover_steps: int, calib: int, eval_tasks: str, eval_limit: int,
              progress: bool) -> dict[str, CompressConfig]:
    kd = str((workdir / "student-kd").absolute())
    base = str((workdir / "student-baseline").absolute())
    teacher = str((workdir / "teacher").absolute())
    common = dict(calibration_batches=calib, recover_steps=recover_steps, quantize="fp8",
                  eval=eval_tasks, eval_limit=eval_limit, progress=progress)
    out = {}
    for method in ("magnitude", "wanda", "sparsegpt"):
        out[f"kd/{method}"] = CompressConfig(checkpoint=kd, prune=f"{method}-2:4", **common)
    # control: the same recovery and FP8 without pruning (what the extra steps alone give)
    out["kd/dense-control"] = CompressConfig(checkpoint=kd, prune="", **common)
    out["baseline/sparsegpt"] = CompressConfig(checkpoint=base, prune="sparsegpt-2:4", **common)
    out["kd/sparsegpt/fp8-in-loop"] = CompressConfig(checkpoint=kd, prune="sparsegpt-2:4",
                                                     quantize_in_loop=True, **common)
    out["kd/sparsegpt/reverse-kl"] = CompressConfig(checkpoint=kd, prune="sparsegpt-2:4",
                                                    divergence="reverse_kl", **common)
    out["kd/sparsegpt/patient-teacher"] = CompressConfig(
        checkpoint=kd, prune="sparsegpt-2:4", method="patient", teacher=teacher,
        alpha=0.0, **common)
    return {k: dataclasses.replace(v, out=str(workdir / "compress" / k.replace("/", "__")))
            for k, v in out.items()}


def channel_norm_spread(run_dir: Path, n_batches: int = 4) -> list[dict]:
    """Per block: max / median of the input channels' L2 norms at the q/k/v input
    (pre-attention norm output) on calibration tokens. Wanda's |W| x ||x|| score differs
    from magnitude only as far as these norms differ; LLMs with outlier features have
    a few channels 10-100x the median."""
    loaded = load_model(run_dir)
    model, tok, cfg = loaded.model, loaded.tokenizer, loaded.config
    stream = make_batches(cfg.data, tok, cfg.data.train_split, run_dir / "data_cache_demo")
    sq = np.zeros((cfg.model.n_layers, cfg.model.d_model))
    for i in range(n_batches):
        b = stream.batch_at(i)
        out = model(jnp.asarray(b["tokens"]), jnp.asarray(b["positions"]),
                    jnp.asarray(b["segment_ids"]), hidden_layers=tuple(range(cfg.model.n_layers)),
                    return_logits=False)
        valid = np.asarray(b["mask"]).reshape(-1) > 0
        for layer in range(cfg.model.n_layers):
            x = np.asarray(model.blocks[layer].pre_attn_norm(out.hidden[layer]), np.float64)
            x = x.reshape(-1, x.shape[-1])[valid]
            sq[layer] += (x * x).sum(0)
    norms = np.sqrt(sq)
    return [{"layer": i, "max_over_median": float(n.max() / np.median(n)),
             "p99_over_median": float(np.quantile(n, 0.99) / np.median(n))}
            for i, n in enumerate(norms)]


def run_demo(workdir: Path, report_dir: Path, *, teacher_steps: int, student_steps: int,
             recover_steps: int, calib: int, eval_tasks: str, eval_limit: int,
             progress: bool, only: list[str] | None = None) -> dict:
    from hldstudy.compress.pipeline import run

    t0 = time.time()
    trained = train_models(workdir, teacher_steps, student_steps, progress)
    timings = {"train_seconds": round(time.time() - t0, 1)}
    results = {}
    for name, ccfg in pipelines(workdir, recover_steps, calib, eval_tasks, eval_limit,
                                progress).items():
        if only and name not in only:
            continue
        rep_file = Path(ccfg.out) / "report.json"
        cfg_file = Path(ccfg.out) / "config.json"
        t1 = time.time()
        if rep_file.exists() and cfg_file.exists() and json.loads(cfg_file.read_text()) == \
                {"compress": dataclasses.asdict(ccfg)} and (Path(ccfg.out) / "model").exists():
            results[name] = json.loads(rep_file.read_text())
            timings[name] = {"cached": True, **results[name].get("seconds", {})}
        else:
            print(f"== {name}", flush=True)
            results[name] = run(ccfg)
            timings[name] = {"wall": round(time.time() - t1, 1), **results[name]["seconds"]}
    summary = {"command": " ".join(["python -m hldstudy.compress.demo"] + sys.argv[1:]),
               "settings": {"teacher_steps": teacher_steps, "student_steps": student_steps,
                            "recover_steps": recover_steps, "calibration_batches": calib,
                            "calibration_tokens": calib * DATA.batch_size * DATA.seq_len,
                            "eval_tasks": eval_tasks, "eval_limit": eval_limit},
               "trained": {k: {f: v.get(f) for f in ("steps", "valid_nll", "valid_ppl")}
                           for k, v in trained.items()},
               "pipelines": results, "seconds": timings,
               "kd_student_qkv_input_channel_norm_spread":
                   channel_norm_spread(workdir / "student-kd")}
    report_dir.mkdir(parents=True, exist_ok=True)
    write_json_atomic(report_dir / "results.json", summary)
    (report_dir / "tables.md").write_text(render_tables(summary))
    return summary


def render_tables(summary: dict) -> str:
    lines = []
    for name, rep in summary["pipelines"].items():
        stages = rep["stages"]
        dense = stages[0]["valid_ppl"]
        tasks = sorted({k for s in stages for k in s if k.endswith(("/acc", "/acc_norm"))})
        lines += [f"### {name}", "",
                  "| stage | valid ppl | vs dense | weight bytes | 2:4 packed bytes | sparsity | "
                  + " | ".join(tasks) + (" |" if tasks else ""),
                  "|---|---:|---:|---:|---:|---:|" + "---:|" * len(tasks)]
        for s in stages:
            lines.append(f"| {s['stage']} | {s['valid_ppl']:.3f} | "
                         f"{100 * (s['valid_ppl'] / dense - 1):+.2f}% | {s['weight_bytes']:,} | "
                         f"{s['weight_bytes_packed']:,} | {s['sparsity']:.2f} | "
                         + " | ".join(f"{s.get(t, float('nan')):.3f}" for t in tasks)
                         + (" |" if tasks else ""))
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from hldstudy.cli_common import quiet_libraries
    from hldstudy.errors import user_errors

    p = argparse.ArgumentParser(prog="python -m hldstudy.compress.demo", description=HELP,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workdir", default="runs/compression")
    p.add_argument("--report", default="analysis/compression")
    p.add_argument("--teacher-steps", type=int, default=600)
    p.add_argument("--student-steps", type=int, default=400)
    p.add_argument("--recover-steps", type=int, default=100)
    p.add_argument("--calibration-batches", type=int, default=16)
    p.add_argument("--eval", default="synth_mc,synth_cloze")
    p.add_argument("--eval-limit", type=int, default=300)
    p.add_argument("--only", default=None, help="comma-separated pipeline names")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--debug", action="store_true")
    args = p.parse_args(argv)
    quiet_libraries()
    with user_errors(args.debug, prog="hldstudy.compress.demo"):
        summary = run_demo(Path(args.workdir), Path(args.report),
                           teacher_steps=args.teacher_steps, student_steps=args.student_steps,
                           recover_steps=args.recover_steps, calib=args.calibration_batches,
                           eval_tasks=args.eval, eval_limit=args.eval_limit,
                           progress=not args.no_progress,
                           only=args.only.split(",") if args.only else None)
        print(render_tables(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
