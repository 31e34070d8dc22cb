"""Cohorts: runs of a grid that can share one teacher forward per step, and what the
whole study costs with and without them.

Design notes: `docs/sweeps.md`, under this file's name.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

from hldstudy.config import ModelConfig, config_to_dict, field_rules, flatten
from hldstudy.distill import methods
from hldstudy.distill.base import make_strategy
from hldstudy.flops import step_flops
from hldstudy.plan.layouts import grid_teacher_flops
from hldstudy.plan.step_memory import cohort_memory, largest_cohort
from hldstudy.plan.terms import dtype_bytes, fanout_window_bytes
from hldstudy.sweep.spec import Run
from hldstudy.teacher.base import method_needs

LAYOUTS = ("colocated", "disaggregated", "cohort", "grid")


def _shared_fields() -> frozenset[str]:
    """Fields every member of a cohort must agree on: all that change results, except
    the per-member ones and the run's name."""
    return frozenset(k for k, r in field_rules().items()
                     if r["drift"] and not r["member"] and k != "name")


def cohort_key(run: Run) -> str:
    """Runs with equal keys can train as one cohort."""
    shared = _shared_fields()
    flat = {k: v for k, v in flatten(config_to_dict(run.config)).items() if k in shared}
    return json.dumps({"method": run.method, "stages": run.stage_steps, "config": flat},
                      sort_keys=True, default=str)


def group(runs: list[Run], k: int) -> list[list[Run]]:
    """Compatible runs in cohorts of at most `k`, in grid order (k = 1: every run alone)."""
    if k < 1:
        raise ValueError(f"a cohort has at least one member, got {k}")
    by_key: dict[str, list[Run]] = {}
    for run in runs:
        by_key.setdefault(cohort_key(run), []).append(run)
    cohorts = []
    for members in by_key.values():
        cohorts += [members[i:i + k] for i in range(0, len(members), k)]
    order = {r.run_id: i for i, r in enumerate(runs)}
    return sorted(cohorts, key=lambda c: order[c[0].run_id])


def auto_cohort(runs: list[Run], teacher_model: ModelConfig | None, limit_bytes: float,
                devices: int = 1, mode: str = "vmap") -> dict:
    """`--cohort auto`: the largest K such that every cohort of the grid (each method's
    compatible runs, each of its stages) fits `limit_bytes` of one device per
    `cohort_memory`, the run's batch split over `devices` data-parallel devices (each
    holding the whole cohort's state: FSDP would need less). Returns {"k", "limit_bytes",
    "largest_group", "bytes_at_k", "bytes_at_k_plus_1"} (the worst cohort's predicted total; k = 0: not even one
    student fits; k = largest_group: every compatible run fits in one cohort)."""
    groups = group(runs, max(len(runs), 1))

    def need(k: int) -> float:
        worst = 0.0
        for members in groups:
            run = members[0]
            t = teacher_model if methods.get(run.method).needs_teacher else None
            cfg = run.config
            if devices > 1:
                cfg = dataclasses.replace(cfg, data=dataclasses.replace(
                    cfg.data, batch_size=max(cfg.data.batch_size // devices, 1)))
            for stage in run.stage_steps:
                mem = cohort_memory(cfg, t, min(k, len(members)), method=run.method,
                                    stage=stage, mode=mode)
                worst = max(worst, mem["total_bytes"])
        return worst

    largest = max((len(g) for g in groups), default=0)
    k = largest_cohort(lambda n: need(n) <= limit_bytes, largest)
    return {"k": k, "limit_bytes": limit_bytes, "largest_group": largest,
            "bytes_at_k": need(k) if k else need(1),
            "bytes_at_k_plus_1": need(k + 1) if k < largest else None}


@dataclass(frozen=True)
class RunFlops:
    """Model FLOPs of one whole run: its student side and its teacher forwards."""

    run_id: str
    student: float
    teacher: float


def run_flops(run: Run, teacher_model) -> RunFlops:
    student = teacher = 0.0
    for stage, steps in run.stage_steps.items():
        b = step_flops(run.config, run.method, stage, teacher_model)
        student += steps * (b.student + b.regressor)
        teacher += steps * b.teacher
    return RunFlops(run.run_id, student, teacher)


def teacher_segments(run: Run, teacher_model) -> list[tuple[int, int, float]]:
    """(first step, end step, teacher FLOPs per step) of each of the run's stages that
    needs the teacher, in the run's step numbering."""
    out, pos = [], 0
    for stage, steps in run.stage_steps.items():
        b = step_flops(run.config, run.method, stage, teacher_model)
        if b.teacher > 0:
            out.append((pos, pos + steps, float(b.teacher)))
        pos += steps
    return out


def grid_window_bytes(runs: list[Run], teacher_model, window: int) -> float:
    """Host memory of one grid replica's window (`plan.terms.fanout_window_bytes`): `window`
    steps of the union of every method's streamed tensors, in the teacher's dtype."""
    taught = [r for r in runs if methods.get(r.method).needs_teacher]
    if not taught or teacher_model is None:
        return 0.0
    final, layers = False, set()
    for r in {r.method: r for r in taught}.values():
        needs = method_needs(make_strategy(r.config, r.config.model, teacher_model),
                             teacher_model)
        final |= needs.final
        layers |= set(needs.layers)
    cfg = taught[0].config
    return fanout_window_bytes(window, cfg.data.batch_size * cfg.data.seq_len,
                               int(final) + len(layers), teacher_model.d_model,
                               dtype_bytes(cfg.teacher.dtype))


def study_flops(runs: list[Run], teacher_model, cohort: int, window: int = 4) -> dict:
    """{"layouts": {layout: {"teacher_flops", "student_flops", "total_flops"}}, "cohorts": n,
    "grid": {...}}.

    In the cohort layout a cohort pays for one member's teacher forwards: its
    members run the same stages for the same steps on the same batches. In the grid
    layout (`python -m hldstudy.sweep --teacher-replicas`) one replica set serves every
    cohort of every method: one forward per step of the longest schedule, for the
    union of the layers the runs still training need (`plan.layouts.grid_teacher_flops`,
    with its bound); "grid" also gives a replica's window memory for `window` steps.
    """
    per_run = {r.run_id: run_flops(r, teacher_model) for r in runs}
    student = sum(f.student for f in per_run.values())
    teacher = sum(f.teacher for f in per_run.values())
    cohorts = group(runs, cohort)
    teacher_cohort = sum(max(per_run[r.run_id].teacher for r in c) for c in cohorts)
    grid = grid_teacher_flops([seg for r in runs for seg in teacher_segments(r, teacher_model)])
    layouts = {}
    for layout, t in (("colocated", teacher), ("disaggregated", teacher),
                      ("cohort", teacher_cohort), ("grid", grid["teacher_flops"])):
        layouts[layout] = {"teacher_flops": t, "student_flops": student,
                           "total_flops": t + student}
    grid.update(window=window,
                replica_window_bytes=grid_window_bytes(runs, teacher_model, window))
    return {"layouts": layouts, "runs": len(runs), "cohorts": len(cohorts),
            "cohort_size": cohort, "grid": grid,
            "cohort_members": [[r.run_id for r in c] for c in cohorts]}


def device_hours(flops: float, mfu: float, peak_tflops: float) -> float:
    """Hours of one device at `mfu` of a `peak_tflops` peak to execute `flops`."""
    return flops / (mfu * peak_tflops * 1e12) / 3600.0
