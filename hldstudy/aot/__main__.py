"""`python -m hldstudy.aot`: compile a run's steps for a TPU or NVIDIA target on this
machine, without the target, and say what the target's compiler reports per device.

    python -m hldstudy.aot --config experiments/c4_123m_kd.py --set data.path=/x \\
        --teacher-preset paper-teacher-3.4b --target v5e:2x4 [--cohort 4] [--json]

Targets: v4 / v5e / v5p / v6e with a topology (v5e:2x4, v4:2x2x1, v6e:2x2), h100:N,
a100:N, h200:N (or Nxh100). Needs the `aot` extra (pip install -e '.[aot]'); runs the
host on the CPU backend (JAX_PLATFORMS=cpu). Exit 2: bad input (unknown target, a
topology libtpu refuses, the extra missing); exit 3: a step does not fit the device.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from hldstudy.aot.compile import compile_run, resolve_for_target
from hldstudy.aot.report import flops_note, format_table, largest_terms, step_rows
from hldstudy.aot.targets import devices, parse_target
from hldstudy.cli_common import EXPERIMENTS, find_builtin
from hldstudy.config import apply_overrides, load_experiment, validate
from hldstudy.distill import methods
from hldstudy.errors import ConfigError, RuntimeFault, user_errors
from hldstudy.model.presets import preset
from hldstudy.sweep.spec import teacher_model_config

PROG = "hldstudy.aot"
PARTS = ("train", "teacher", "eval")


def use_cpu_host() -> None:
    """The host compiles on the CPU backend: the CUDA plugin initialises only so, and
    libtpu must not look for a TPU. Set before JAX picks its backends (a process that
    already chose them, or JAX_PLATFORMS set by the user, is left as it is)."""
    import os

    import jax
    from jax._src import xla_bridge

    if not os.environ.get("JAX_PLATFORMS") and not xla_bridge.backends_are_initialized():
        jax.config.update("jax_platforms", "cpu")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=f"python -m {PROG}", description=__doc__.split("\n")[0])
    ap.add_argument("--config", required=True, help="experiment file or built-in name")
    ap.add_argument("--method", default=None, help="method (default: the config's)")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="K=V")
    ap.add_argument("--target", required=True, help="v5e:2x4, v4:2x2x1, h100:8, a100:8, ...")
    ap.add_argument("--cohort", type=int, default=None, metavar="K",
                    help="compile the cohort step of K students instead of the solo step")
    ap.add_argument("--teacher-preset", default=None,
                    help="the teacher's model preset (default: read teacher.checkpoint)")
    ap.add_argument("--parts", default=",".join(PARTS),
                    help=f"which programs to compile, comma-separated of {', '.join(PARTS)}")
    ap.add_argument("--json", action="store_true", help="one JSON object instead of the table")
    ap.add_argument("--debug", action="store_true", help="show tracebacks")
    return ap


def load_run(config: str, overrides: list[str], method: str | None,
             teacher_preset: str | None):
    """(cfg, method, teacher ModelConfig or None) of the run to compile: the config with
    its overrides, validated without reading data or teacher files."""
    cfg = apply_overrides(load_experiment(find_builtin(config, EXPERIMENTS)), overrides)
    spec = methods.get(method or cfg.distill.method)
    cfg = dataclasses.replace(cfg, distill=dataclasses.replace(cfg.distill, method=spec.name))
    validate(cfg, check_paths=False, need_teacher=False)
    teacher = None
    if spec.needs_teacher:
        teacher = (preset(teacher_preset) if teacher_preset
                   else teacher_model_config(cfg.teacher.checkpoint, None))
        if teacher is None:
            raise ConfigError("--teacher-preset", f"method {spec.name!r} needs the teacher's "
                              "shape and teacher.checkpoint gives none",
                              "name one, e.g. --teacher-preset paper-teacher-3.4b")
    return cfg, spec.name, teacher


def check_compile(cfg, method: str, teacher, target_text: str, *, cohort: int | None = None,
                  parts: tuple[str, ...] = PARTS) -> dict:
    """Compiles the run for the target; returns {"target", "choices", "rows", "text"}.
    Raises RuntimeFault (exit 3) after building the report when a step does not fit."""
    target = parse_target(target_text)
    if cohort is not None and cohort < 1:
        raise ConfigError("--cohort", f"must be >= 1, got {cohort}")
    unknown = [p for p in parts if p not in PARTS]
    if unknown or not parts:
        raise ConfigError("--parts", f"{','.join(parts)!r} names none or unknown parts",
                          f"comma-separated of {', '.join(PARTS)}")
    use_cpu_host()
    cfg, teacher, choices = resolve_for_target(cfg, teacher, target)
    devs = devices(target)
    steps = compile_run(cfg, teacher, method, devs, cohort=cohort, mode=choices.cohort_mode,
                        parts=parts)
    fsdp = cfg.train.mesh_fsdp if cfg.train.mesh_fsdp > 0 else len(devs) // cfg.train.mesh_data
    rows = step_rows(cfg, teacher, target, choices, steps, len(devs), fsdp, cohort)
    head = (f"**{cfg.name}** ({method}{f', cohort of {cohort}' if cohort else ''}) on "
            f"**{target.spec}** ({len(devs)} x {devs[0].device_kind}, mesh data x fsdp = "
            f"{len(devs) // fsdp} x {fsdp}, batch {cfg.data.batch_size} x {cfg.data.seq_len}, "
            f"model {cfg.model.dtype}, teacher {cfg.teacher.dtype})")
    text = format_table(head, rows, choices, flops_note(cfg, choices))
    report = {"target": target.spec, "device_kind": devs[0].device_kind, "devices": len(devs),
              "config": cfg.name, "method": method, "cohort": cohort,
              "choices": dataclasses.asdict(choices), "rows": rows, "text": text}
    over = [r for r in rows if not r["fits"]]
    if over:
        r = over[0]
        report["does_not_fit"] = (
            f"the {r['step']} step does not fit {target.spec}: it needs "
            f"{r['compiled']['total_bytes'] / 2**30:.2f} GiB per device of the "
            f"{target.chip.device_memory_bytes / 2**30:.2f} GiB device memory (largest "
            f"buffers by the planner: "
            f"{largest_terms(cfg, teacher, r, len(devs), choices, cohort)}); lower "
            f"data.batch_size (now {cfg.data.batch_size}), turn on model.remat, or use more "
            "devices")
    return report


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    with user_errors(a.debug, prog=PROG):
        parts = tuple(p.strip() for p in a.parts.split(",") if p.strip())
        cfg, method, teacher = load_run(a.config, a.overrides, a.method, a.teacher_preset)
        report = check_compile(cfg, method, teacher, a.target, cohort=a.cohort, parts=parts)
        if a.json:
            print(json.dumps({k: v for k, v in report.items() if k != "text"}, sort_keys=True))
        else:
            print(report["text"])
        sys.stdout.flush()
        if "does_not_fit" in report:
            raise RuntimeFault(report["does_not_fit"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
