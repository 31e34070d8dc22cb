"""The quickstart: the study in miniature, offline on a CPU.

synthetic corpus -> tokenizer -> tiny teacher pretraining -> students at one
FLOP budget (baseline and logit KD, plus HLDF and HLDC with --methods) ->
DIR/results.json and DIR/results.md with every loss.

    hldstudy quickstart --workdir runs/quickstart
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

from hldstudy.config import Config, apply_overrides, load_experiment, validate
from hldstudy.errors import ConfigError

EXPERIMENTS = Path(__file__).resolve().parent.parent / "experiments"
SIZES = {
    # size: (teacher steps, student steps)
    "small": (200, 120),
    "medium": (800, 400),
    "large": (3000, 1500),
}


def _experiment(name: str) -> Config:
    path = EXPERIMENTS / f"{name}.py"
    return load_experiment(path)


def run_quickstart(workdir: Path, size: str = "small", methods=("baseline", "kd"),
                   overrides: tuple[str, ...] = (), progress: bool = True) -> dict:
    from hldstudy.flops import step_flops
    from hldstudy.train.loop import train

    if size not in SIZES:
        raise ConfigError("--size", f"unknown size {size!r}", f"choose one of {', '.join(SIZES)}")
    teacher_steps, student_steps = SIZES[size]
    workdir = Path(workdir)
    t0 = time.time()

    teacher_cfg = _experiment("tiny_teacher")
    teacher_cfg = apply_overrides(teacher_cfg, [f"train.steps={teacher_steps}",
                                                f"train.progress={str(progress).lower()}"])
    teacher_dir = workdir / "teacher"
    teacher_result = train(validate(teacher_cfg), teacher_dir)

    student_cfg = _experiment("tiny_distill")
    student_cfg = apply_overrides(student_cfg, [f"teacher.checkpoint={teacher_dir}",
                                                f"train.progress={str(progress).lower()}",
                                                *overrides])
    # One FLOP budget for every method: what the baseline spends in `student_steps`.
    base = dataclasses.replace(student_cfg, distill=dataclasses.replace(
        student_cfg.distill, method="baseline"))
    budget = student_steps * step_flops(base, method="baseline").total
    results = {"teacher": {k: teacher_result[k] for k in ("steps", "valid_nll", "valid_ppl")},
               "budget_flops": budget, "count_teacher": student_cfg.budget.count_teacher,
               "students": {}}
    for method in methods:
        cfg = dataclasses.replace(
            student_cfg, name=f"quickstart-{method}",
            distill=dataclasses.replace(student_cfg.distill, method=method),
            budget=dataclasses.replace(student_cfg.budget, flops=budget))
        r = train(validate(cfg), workdir / method)
        results["students"][method] = {k: r[k] for k in ("steps", "valid_nll", "valid_ppl",
                                                        "flops_spent")}
    results["seconds"] = round(time.time() - t0, 1)
    (workdir / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    (workdir / "results.md").write_text(render(results))
    return results


def render(results: dict) -> str:
    lines = ["# hldstudy quickstart", "",
             f"Teacher: {results['teacher']['steps']} steps, validation NLL "
             f"{results['teacher']['valid_nll']:.4f} (ppl {results['teacher']['valid_ppl']:.2f}).",
             "",
             f"Students at one budget of {results['budget_flops']:.3e} FLOPs "
             f"(teacher forward {'counted' if results['count_teacher'] else 'not counted'}):", "",
             "| method | steps | FLOPs spent | valid NLL | valid ppl |",
             "|---|---:|---:|---:|---:|"]
    for method, r in results["students"].items():
        lines.append(f"| {method} | {r['steps']} | {r['flops_spent']:.3e} | "
                     f"{r['valid_nll']:.4f} | {r['valid_ppl']:.2f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    from hldstudy.cli_common import quiet_libraries
    from hldstudy.errors import user_errors

    parser = argparse.ArgumentParser(prog="hldstudy quickstart", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", default="runs/quickstart")
    parser.add_argument("--size", default="small", choices=sorted(SIZES))
    parser.add_argument("--methods", default="baseline,kd",
                        help="comma-separated student methods (baseline,kd,hldf,hldc,patient)")
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        help="override a student config field")
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("--debug", action="store_true")
    args = parser.parse_args(argv)
    quiet_libraries()
    with user_errors(args.debug, prog="hldstudy quickstart"):
        results = run_quickstart(Path(args.workdir), args.size,
                                 tuple(m.strip() for m in args.methods.split(",") if m.strip()),
                                 tuple(args.overrides), progress=not args.no_progress)
        print(render(results))
        print(f"written: {Path(args.workdir) / 'results.json'} ({results['seconds']} s)")
    return 0
