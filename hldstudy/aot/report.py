"""The target compiler's figures beside the planner's and the FLOP model's, per device.

Pure arithmetic on `CompiledStep`s and configs (nothing compiles here): the planner's
prediction of a train step (`hldstudy.plan.predict_step_memory` / `cohort_memory`) is
for one device holding the whole batch, so it is asked for the batch one device holds
(`data.batch_size / devices`) and its sharded terms (state, gradients, the teacher's
params) are divided by the FSDP axis, as `hldstudy.sharding` places them. A teacher
replica's prediction comes with its compile (`CompiledStep.planner`: the micro-batch
compiled, the target compiler's row of `hldstudy.plan.compilers`). A step
"fits" when its total (arguments + outputs - aliased + temporaries) is at most the
chip's device memory (hldstudy.chips); the planner is compared with `compiled_peak`.
"""

from __future__ import annotations

import dataclasses
from collections import Counter

from hldstudy.aot.compile import Choices, CompiledStep, stage_names
from hldstudy.aot.targets import Target
from hldstudy.config import Config, ModelConfig
from hldstudy.flops import step_flops
from hldstudy.flops.hlo_count import COUNT_VERSION
from hldstudy.plan.compilers import validation_band
from hldstudy.plan.step_memory import (
    cohort_memory,
    compiled_peak,
    fits_device,
    predict_step_memory,
)

GiB = 2**30
KEYS = ("argument_bytes", "output_bytes", "temp_bytes", "alias_bytes", "total_bytes")
# The planner's attention terms: "dense" keeps the T x T scores, every other path is
# flash-like (blocks of scores, never the whole matrix).
PLANNER_ATTENTION = {"dense": "dense"}


def per_device_config(cfg: Config, n_devices: int) -> Config:
    """`cfg` with the batch one device holds (the batch is split over every device)."""
    return dataclasses.replace(cfg, data=dataclasses.replace(
        cfg.data, batch_size=max(1, cfg.data.batch_size // n_devices)))


def fsdp_size(cfg: Config, n_devices: int) -> int:
    """The FSDP axis the planner divides sharded terms by: train.mesh_fsdp, or (auto) the
    devices the data axis leaves."""
    return cfg.train.mesh_fsdp if cfg.train.mesh_fsdp > 0 else n_devices // cfg.train.mesh_data


def predicted_train_memory(cfg: Config, teacher_model: ModelConfig | None, method: str,
                           stage: str, n_devices: int, fsdp: int, choices: Choices,
                           cohort: int | None = None, compiler: str = "cpu",
                           layout: str = "colocated") -> dict[str, float]:
    """The planner's `memory_analysis()` of one device's share of the train step, as the
    target's compiler (`compiler`: its backend, hldstudy.plan.compilers) schedules it; in
    train.microbatches micro-batches, the activations are one micro-batch's and the
    gradient has an accumulator beside it."""
    micro = max(cfg.train.microbatches, 1)
    local = per_device_config(cfg, n_devices)
    if micro > 1:
        local = dataclasses.replace(local, data=dataclasses.replace(
            local.data, batch_size=max(local.data.batch_size // micro, 1)))
    attention = PLANNER_ATTENTION.get(choices.attention, "flash")
    kw = dict(method=method, stage=stage, layout=layout, attention=attention,
              compiler=compiler)
    if cohort is None:
        pred = predict_step_memory(local, teacher_model, **kw)
        terms = pred["terms"]
        state, grads = pred["state_bytes"], terms["grads"]
        teacher = terms.get("teacher_params", 0.0)
        k = 1
        if micro > 1:  # the summed gradient, beside the micro-batch's own
            pred = {**pred, "temp_bytes": pred["temp_bytes"] + grads,
                    "total_bytes": pred["total_bytes"] + grads}
            grads *= 2  # both sharded like the params (below)
    else:
        pred = cohort_memory(local, teacher_model, cohort, mode=choices.cohort_mode, **kw)
        one = predict_step_memory(local, teacher_model, **kw)
        k, terms = cohort, one["terms"]
        state, grads = one["state_bytes"], terms["grads"]
        teacher = terms.get("teacher_params", 0.0)
    out = {key: float(pred[key]) for key in KEYS}
    if fsdp > 1:  # sharded over the fsdp axis: the state (argument, output, alias), grads
        cut = 1.0 - 1.0 / fsdp
        live = k if choices.cohort_mode == "vmap" or cohort is None else 1
        out["argument_bytes"] -= cut * (k * state + teacher)
        out["output_bytes"] -= cut * k * state
        out["alias_bytes"] -= cut * k * state
        out["temp_bytes"] -= cut * live * grads
        out["total_bytes"] = (out["argument_bytes"] + out["output_bytes"]
                              - out["alias_bytes"] + out["temp_bytes"])
    return out


def flop_model(cfg: Config, teacher_model: ModelConfig | None, step: CompiledStep,
               n_devices: int, cohort: int | None = None, backend: str = "cpu") -> float | None:
    """The FLOP model's executed FLOPs of `step` per device (None for the eval step,
    which the model does not count), as the target's backend runs it (an MoE's experts:
    the active ones, top-k and shared, except on a CPU, which runs them densely). A cohort
    runs the teacher once, K students; a teacher replica's forward is the whole batch,
    split over its devices, without the de-embedding: a replica serves the final hidden
    states and the head's weight, and the student rebuilds the logits (its head is in
    the train step's count, `teacher_head`)."""
    if step.kind == "eval":
        return None
    dense = backend == "cpu"
    if step.kind == "teacher":  # a replica runs the whole global batch over its devices
        # and serves every stage's needs (HLDF: the partial stack of stage 1): the
        # deepest of them, as `compile_teacher_forward` compiles it
        hw = [step_flops(cfg, step.method, stage, teacher_model, grouped_dense=dense).hardware
              for stage in stage_names(cfg, step.method, teacher_model)]
        return max(h.get("teacher", 0.0) - h.get("teacher_head", 0.0)
                   for h in hw) / step.replica_devices
    bd = step_flops(cfg, step.method, step.stage, teacher_model, grouped_dense=dense)
    teacher = bd.hardware.get("teacher", 0.0)
    total = bd.hardware_flops(step.layout)
    if cohort:
        total = cohort * (total - teacher) + teacher
    return total / n_devices


def flops_note(cfg: Config, choices: Choices, steps=()) -> str:
    """Where XLA's count of a step is incomplete (it counts a loop body once and a
    Pallas kernel only by the cost it declares)."""
    notes = [f"the {s.name} runs its micro-batches in a loop (counted once: XLA / model "
             f"is about 1/{s.loop_trips})" for s in steps if s.loop_trips > 1]
    if choices.attention not in ("dense",):
        notes.append(f"attention {choices.attention} loops over blocks (counted once)")
    if cfg.distill.loss_impl == "fused":
        if choices.fused_backend.startswith("pallas"):
            notes.append("the fused KD loss is Pallas kernels: counted by their declared "
                         "pl.CostEstimate only")
        else:
            notes.append("the fused KD loss's XLA path loops over row windows (counted once)")
    return "; ".join(notes)


def planner_of(s: CompiledStep, cfg: Config, teacher_model, choices: Choices, n_devices: int,
               fsdp: int, cohort: int | None, backend: str) -> dict[str, float] | None:
    """The planner's figures for compiled (or lowered) step `s`: a train step's from its
    config at its micro-batches, a replica's as its compile asked them; None for eval."""
    if s.kind != "train":
        return s.planner  # a teacher replica's: the compile already asked the planner
    kcfg = dataclasses.replace(cfg, train=dataclasses.replace(
        cfg.train, microbatches=s.microbatches))
    return predicted_train_memory(kcfg, teacher_model, s.method, s.stage, n_devices, fsdp,
                                  choices, cohort, backend, s.layout)


def step_rows(cfg: Config, teacher_model, target: Target, choices: Choices, steps,
              n_devices: int, fsdp: int, cohort: int | None = None) -> list[dict]:
    """One JSON-ready row per compiled step: the compiler's figures, the planner's
    (train steps), the verdicts and the FLOPs."""
    limit = target.chip.device_memory_bytes
    rows = []
    for s in steps:
        row = {"step": s.name, "kind": s.kind, "method": s.method, "stage": s.stage,
               "compile_s": round(s.seconds, 2), "device_memory_bytes": limit,
               "compiled": dict(s.memory),
               # tokens_per_step: the run's step; tokens: what one call of this program
               # processes (a replica serves a whole step per call; eval one batch).
               "tokens_per_step": cfg.data.batch_size * cfg.data.seq_len,
               "tokens": (s.sequences or cfg.data.batch_size) * cfg.data.seq_len,
               "program_sha256": s.program_sha256}
        if s.kind == "train":
            row["microbatches"] = s.microbatches
            row["layout"] = s.layout
        if s.peak:
            row["peak"] = {"bytes": s.peak_bytes, "largest": [dataclasses.asdict(g)
                                                               for g in s.peak]}
        if s.refused:
            # The compiler refused it: it does not fit. libtpu's "memory required for HLO
            # temporaries (X)" counts the arguments too (the 123M step: 22.76 GiB =
            # arguments 13.62 + the buffer assignment's temporaries 9.14): X is the total.
            row.update(refused=s.refused, fits=False)
            if s.needs_bytes is not None:
                row["compiled"] = {"total_bytes": s.needs_bytes}
        else:
            row["fits"] = fits_device(s.memory, target.backend, limit)
        pred = planner_of(s, cfg, teacher_model, choices, n_devices, fsdp, cohort,
                          target.backend)
        if pred is not None:
            row["planner"] = pred
            # what the compiled figure may be, from the planner's validation (bytes), and
            # the planner's verdict read at its pessimistic end
            row["planner_band"] = list(validation_band(
                pred["total_bytes"], target.backend,
                "replica" if s.kind == "teacher" else "train"))
            row["planner_fits"] = row["planner_band"][1] <= limit
            if "total_bytes" in row["compiled"]:
                row["planner_over_compiled"] = pred["total_bytes"] / max(
                    compiled_peak(row["compiled"], target.backend), 1)
        if s.hlo is not None:
            row["hlo_flops"] = s.hlo.flops
            if s.hlo.uncounted_kernels:
                # {kernel: call sites}: a name per site repeated them by the hundred
                row["hlo_uncounted_kernels"] = dict(Counter(s.hlo.uncounted_kernels))
            if s.hlo.unknown_trip_loops:  # the TPU compiler records no trip counts
                row["hlo_unknown_trip_loops"] = s.hlo.unknown_trip_loops
            # bytes each device sends in collectives per call, and what crosses hosts
            row["collective_bytes"] = s.hlo.collective_bytes
            row["cross_host_bytes"] = s.hlo.cross_host_bytes
            if s.hlo.roofline_s:  # the ideal time on the target's chip (hlo_count)
                row["roofline_s"] = s.hlo.roofline_s
            row["hlo_count_version"] = COUNT_VERSION
        # XLA's cost analysis where the compiler gives one (TPU) and the program has no
        # loops (it counts a loop's body once); else the count from the optimized HLO
        # (hldstudy.flops.hlo_count: loops times their trips; the XLA GPU compiler's only).
        from_cost = s.flops is not None and (s.hlo is None or (
            s.hlo.loops == 0 or s.hlo.unknown_trip_loops))
        xla = s.flops if from_cost else (s.hlo.flops if s.hlo is not None else None)
        if xla is not None:
            model = flop_model(cfg, teacher_model, s, n_devices, cohort if s.kind == "train"
                               else None, target.backend)
            row["xla_flops"] = xla
            row["xla_flops_from"] = "cost_analysis" if from_cost else "hlo"
            if model:
                row["model_flops"] = model
                row["xla_over_model"] = xla / model
        rows.append(row)
    return rows


def _g(x: float) -> str:
    return f"{x / GiB:.2f}"


def format_table(head: str, rows: list[dict], choices: Choices, note: str,
                 platform: str) -> str:
    lines = [head, "",
             "| step | arguments | outputs | temporaries | aliased | **total** | peak "
             "| device memory | fits | planner total | planner / compiled | planner fits | "
             "XLA FLOPs | FLOP model | XLA / model |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---|---:|---:|---:|"]
    for r in rows:
        c = r["compiled"]
        p = r.get("planner")

        def cell(key, c=c):
            return _g(c[key]) if key in c else "-"

        ratio = ("-" if not p else f"{r['planner_over_compiled']:.3f}"
                 if "planner_over_compiled" in r else "-")
        temp = cell("temp_bytes") + (" (refused)" if r.get("refused") else "")
        cells = [r["step"], cell("argument_bytes"), cell("output_bytes"), temp,
                 cell("alias_bytes"), f"**{cell('total_bytes')}**", cell("peak_memory_bytes"),
                 _g(r["device_memory_bytes"]), "yes" if r["fits"] else "**no**",
                 _g(p["total_bytes"]) if p else "-", ratio,
                 ("yes" if r["planner_fits"] else "no") if p else "-",
                 f"{r['xla_flops']:.4g}" if "xla_flops" in r else "-",
                 f"{r['model_flops']:.4g}" if "model_flops" in r else "-",
                 f"{r['xla_over_model']:.3f}" if "xla_over_model" in r else "-"]
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    lines.append("GiB per device (2^30 bytes). Fits: the total at most the device memory. "
                 "Peak: the compiler's own (its buffer assignment's worst point); on a TPU "
                 "the planner is compared with it (libtpu reserves its code generation's "
                 "allocations beyond it), elsewhere with the total.")
    lines.append("Resolved for the target: attention "
                 f"{choices.attention} (teacher {choices.teacher_attention}), fused KD "
                 f"{choices.fused_backend}, cohort mode {choices.cohort_mode}.")
    for n in choices.notes:
        lines.append(f"Note: {n}.")
    for r in rows:
        if r.get("refused"):
            lines.append(f"The compiler refused {r['step']}: {r['refused']}")
    lines.extend(where_the_memory_goes(rows))
    if platform == "cuda":
        uncounted = sorted({k for r in rows for k in r.get("hlo_uncounted_kernels", [])})
        lines.append("FLOPs: the GPU compiler gives no cost analysis: XLA FLOPs are counted "
                     "from the optimized HLO (dots, convolutions, loop bodies times their "
                     "trips)" + (f"; kernels with no declared cost not counted: "
                                 f"{', '.join(uncounted)}" if uncounted else "") + ".")
    elif any("xla_flops" in r for r in rows) and note:
        lines.append(f"FLOPs: {note}.")
    return "\n".join(lines)


def where_the_memory_goes(rows: list[dict], top: int = 5) -> list[str]:
    """Per step, the largest groups of buffers live at the compiled program's peak, by the
    JAX operation that made them (`transpose(...)`: the backward; `checkpoint/
    rematted_computation`: a remat recomputation); none where the compiler gave none."""
    out = []
    for r in rows:
        if "peak" not in r:
            continue
        if not out:
            out += ["", "Where the memory goes (buffers live at the peak, by the JAX "
                        "operation that made them; GiB per device):"]
        groups = "; ".join(f"{g['op']} {_g(g['bytes'])} ({g['values']})"
                           for g in r["peak"]["largest"][:top])
        out.append(f"- {r['step']}: peak {_g(r['peak']['bytes'])}: {groups}")
    return out


def largest_terms(cfg: Config, teacher_model, row: dict, n_devices: int, choices: Choices,
                  cohort: int | None, top: int = 3, compiler: str = "cpu") -> str:
    """The largest buffers of a step per device by the planner's terms (XLA's memory
    analysis gives totals only), for the message of a step that does not fit. A teacher
    replica's are its own forward's (`CompiledStep.planner`), not a train step's."""
    if row["kind"] == "teacher" and "planner" in row:
        p = row["planner"]
        named = {"teacher params and batch": p["argument_bytes"],
                 "served hidden states": p["output_bytes"],
                 "one micro-batch's working set": p["temp_bytes"]}
        return _largest(named, top)
    local = per_device_config(cfg, n_devices)
    attention = PLANNER_ATTENTION.get(choices.attention, "flash")
    terms = predict_step_memory(local, teacher_model, method=row["method"], stage=row["stage"],
                                attention=attention, compiler=compiler,
                                layout=row.get("layout", "colocated"))["terms"]
    for part in ("block_working", "scan_stack"):  # parts of "activations", not buffers
        terms.pop(part, None)
    k = cohort or 1
    scaled = {n: v * (k if n in ("params", "optimizer", "grads", "activations", "logits")
                      else 1) for n, v in terms.items()}
    return _largest(scaled, top)


def _largest(named: dict[str, float], top: int) -> str:
    big = sorted(named.items(), key=lambda kv: -kv[1])[:top]
    return ", ".join(f"{n} {_g(v)} GiB" for n, v in big)
