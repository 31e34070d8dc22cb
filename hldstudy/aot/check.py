"""One run, or a grid's runs, compiled for a target and reported: what
`python -m hldstudy.aot` and `hldstudy plan --sweep S --check-compile T` do."""

from __future__ import annotations

import dataclasses
import os

import jax
from jax._src import xla_bridge

from hldstudy.aot.compile import compile_run, resolve_for_target
from hldstudy.aot.fingerprint import source_sha256, toolchain
from hldstudy.aot.report import (
    flops_note,
    format_table,
    fsdp_size,
    largest_terms,
    planner_of,
    step_rows,
)
from hldstudy.aot.targets import devices, parse_target
from hldstudy.cli_common import EXPERIMENTS, find_builtin
from hldstudy.config import apply_overrides, load_experiment, validate
from hldstudy.distill import methods
from hldstudy.errors import ConfigError, note, warn
from hldstudy.model.loading import teacher_model_config
from hldstudy.model.presets import preset
from hldstudy.sweep.cohorts import group
from hldstudy.teacher_source import LAYOUTS, layout_of

PARTS = ("train", "teacher", "eval")


def use_cpu_host() -> None:
    """The host compiles on the CPU backend: the CUDA plugin initialises only so, and
    libtpu must not look for a TPU. Set before JAX picks its backends (a process that
    already chose them, or JAX_PLATFORMS set by the user, is left as it is)."""
    if not os.environ.get("JAX_PLATFORMS") and not xla_bridge.backends_are_initialized():
        jax.config.update("jax_platforms", "cpu")


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
                   else teacher_model_config(cfg.teacher.checkpoint, cfg.teacher.preset))
        if teacher is None:
            raise ConfigError("--teacher-preset", f"method {spec.name!r} needs the teacher's "
                              "shape and neither teacher.checkpoint nor teacher.preset gives it",
                              "name one, e.g. --teacher-preset paper-teacher-3.4b, or set "
                              "teacher.preset in the experiment")
    return cfg, spec.name, teacher


def next_knobs(cfg, row: dict, n_devices: int) -> str:
    """The knobs to try next for a step that does not fit, naming only what is not on
    already (remat on, scanned layers, micro-batches at their most, a bf16 teacher are not
    suggested)."""
    if row["kind"] == "teacher":
        knobs = [f"lower teacher.replica_batch (sequences per forward, now "
                 f"{cfg.teacher.replica_batch or 'auto'})"]
        if cfg.teacher.dtype not in ("bfloat16", "float16"):
            knobs.append(f"serve in bfloat16 (teacher.dtype, now {cfg.teacher.dtype})")
        return ("a replica runs the whole batch on one device: " + ", ".join(knobs)
                + ", or use a device with more memory")
    if row["kind"] == "eval":  # forward only: no micro-batches, no backward to remat
        return (f"the evaluation step runs a whole batch forward: lower data.batch_size "
                f"(now {cfg.data.batch_size}), scan the layers (model.scan_layers)"
                if not cfg.model.scan_layers else
                f"the evaluation step runs a whole batch forward: lower data.batch_size "
                f"(now {cfg.data.batch_size})") + " or use more devices"
    knobs = []
    micro = row.get("microbatches", 1)
    if micro < cfg.data.batch_size // n_devices:
        knobs.append(f"train in more micro-batches (train.microbatches, now "
                     f"{cfg.train.microbatches or f'auto: {micro}'})")
    if not cfg.model.remat:
        knobs.append("turn on model.remat")
    if not cfg.model.scan_layers:
        knobs.append("scan the layers (model.scan_layers: the backward's buffers one group's)")
    if cfg.teacher.preset or cfg.teacher.checkpoint:
        if cfg.teacher.dtype not in ("bfloat16", "float16"):
            knobs.append(f"run the teacher in bfloat16 (teacher.dtype, now {cfg.teacher.dtype})")
    knobs.append(f"lower data.batch_size (now {cfg.data.batch_size}) or use more devices")
    return "; ".join(knobs)


def check_compile(cfg, method: str, teacher, target_text: str, *, cohort: int | None = None,
                  parts: tuple[str, ...] = PARTS, layout: str | None = None,
                  lower_only: bool = False) -> dict:
    """Compiles the run for the target, its teacher in `layout` (LAYOUTS; None: the one
    teacher.checkpoint gives); returns {"target", "choices", "rows", "text", "toolchain"}
    (`lower_only`: lowers its programs only, {"target", "rows", "toolchain"}, each row
    the step's name and `program_sha256`: what a kept record is checked against).
    Raises RuntimeFault (exit 3) after building the report when a step does not fit."""
    target = parse_target(target_text)
    if cohort is not None and cohort < 1:
        raise ConfigError("--cohort", f"must be >= 1, got {cohort}")
    unknown = [p for p in parts if p not in PARTS]
    if unknown or not parts:
        raise ConfigError("--parts", f"{','.join(parts)!r} names none or unknown parts",
                          f"comma-separated of {', '.join(PARTS)}")
    if layout not in (None, "colocated") and not methods.get(method).needs_teacher:
        warn(f"--layout {layout}: {method} trains without a teacher, so the teacher's layout "
             "changes nothing; ignored", "hldstudy.aot")
    layout = layout or layout_of(cfg.teacher.checkpoint)
    if layout not in LAYOUTS:
        raise ConfigError("--layout", f"{layout!r} is not a layout", f"one of {', '.join(LAYOUTS)}")
    use_cpu_host()
    cfg, teacher, choices = resolve_for_target(cfg, teacher, target)
    devs = devices(target)
    steps = compile_run(cfg, teacher, method, devs, cohort=cohort, mode=choices.cohort_mode,
                        parts=parts, layout=layout, lower_only=lower_only)
    fsdp = fsdp_size(cfg, len(devs))
    if lower_only:  # each program's hash and the planner's figures: no compiler's
        rows = [{"step": s.name, "program_sha256": s.program_sha256,
                 "planner": planner_of(s, cfg, teacher, choices, len(devs), fsdp, cohort,
                                       target.backend)} for s in steps]
        return {"target": target.spec, "toolchain": toolchain(target.backend), "rows": rows,
                "source_sha256": source_sha256(),
                "text": "\n".join(f"{s.program_sha256}  {s.name}" for s in steps)}
    rows = step_rows(cfg, teacher, target, choices, steps, len(devs), fsdp, cohort)
    teacher_where = f", teacher {layout}" if methods.get(method).needs_teacher else ""
    head = (f"**{cfg.name}** ({method}{f', cohort of {cohort}' if cohort else ''}"
            f"{teacher_where}) on "
            f"**{target.spec}** ({len(devs)} x {devs[0].device_kind}, mesh data x fsdp = "
            f"{len(devs) // fsdp} x {fsdp}, batch {cfg.data.batch_size} x {cfg.data.seq_len}, "
            f"model {cfg.model.dtype}, teacher {cfg.teacher.dtype})")
    text = format_table(head, rows, choices, flops_note(cfg, choices, steps), target.platform)
    report = {"target": target.spec, "device_kind": devs[0].device_kind, "devices": len(devs),
              "config": cfg.name, "method": method, "cohort": cohort, "layout": layout,
              "choices": dataclasses.asdict(choices), "rows": rows, "text": text,
              "toolchain": toolchain(target.backend), "source_sha256": source_sha256()}
    over = [r for r in rows if not r["fits"]]
    if over:
        r = over[0]
        need = r["compiled"].get("total_bytes", r["compiled"].get("temp_bytes"))
        what = (f"it needs {need / 2**30:.2f} GiB per device" if need is not None
                else "its compiler refused it")
        if r.get("refused") and need is not None:
            what += " (its compiler refused it)"
        if "peak" in r:  # the compiler's own: what is live at the compiled peak
            largest = "largest buffers at the compiled peak: " + ", ".join(
                f"{g['op']} {g['bytes'] / 2**30:.2f} GiB" for g in r["peak"]["largest"][:3])
        else:
            terms = largest_terms(cfg, teacher, r, len(devs), choices, cohort,
                                  compiler=target.backend)
            largest = f"largest buffers by the planner: {terms}"
        fix = next_knobs(cfg, r, len(devs))
        report["does_not_fit"] = (
            f"the {r['step']} step does not fit {target.spec}: {what}, the device has "
            f"{target.chip.device_memory_bytes / 2**30:.2f} GiB ({largest}); {fix}")
    return report


def check_grid(runs, teacher, cohort: int, target_text: str) -> list[dict]:
    """The grid's programs compiled for the target in the layout the planner counts
    (`hldstudy.sweep.cohorts.group`: cohorts of at most `cohort` compatible runs; a
    cohort of one trains alone). Runs of one cohort shape differ only in member
    hyperparameters, which do not change the program: one compile per (method, cohort
    size). Returns one report (`check_compile`) per compile, with the run ids it covers."""
    todo: dict[tuple[str, int], list[str]] = {}
    first = {}
    for members in group(runs, cohort):
        key = (members[0].config.distill.method, len(members))
        todo.setdefault(key, []).extend(r.run_id for r in members)
        first.setdefault(key, members[0])
    reports = []
    for i, ((method, k), ids) in enumerate(todo.items()):
        cfg = first[(method, k)].config
        needs = methods.get(method).needs_teacher
        note(f"[{i + 1}/{len(todo)}] compiling {method}{f', cohort of {k}' if k > 1 else ''} "
             f"for {target_text} ({len(ids)} run(s))", "hldstudy plan")
        rep = check_compile(cfg, method, teacher if needs else None, target_text,
                            cohort=k if k > 1 else None)
        rep["runs"] = ids
        reports.append(rep)
    return reports
