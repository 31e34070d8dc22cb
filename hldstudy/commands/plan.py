"""`hldstudy plan --config EXP --target T`: will a run fit and which layout is faster
(colocated vs disaggregated teacher: the run's cell of the decision map, sized by aot's
planner); from presets (`--teacher P --student P ...`): step times and whether the stream
stalls the link; `--sweep SWEEP`: what a whole grid costs per layout
(colocated, disaggregated, cohort, and grid: one replica set for every cohort, printed
beside its bound with the replica's window memory).

The tables come from the pure model in `hldstudy.plan` (`--json` for one
machine-readable object); this module only parses flags and prints.
"""

from __future__ import annotations

import argparse
import json
import math
import sys

from hldstudy.aot.check import check_grid
from hldstudy.aot.targets import parse_target
from hldstudy.cli_common import SWEEPS, find_builtin, warn_long_sequence
from hldstudy.commands.decision_map import main as decision_map_main
from hldstudy.commands.decision_map import run_cell
from hldstudy.commands.decision_map_page import format_rows
from hldstudy.errors import ConfigError, RuntimeFault, user_errors
from hldstudy.model.loading import teacher_model_config
from hldstudy.plan.layouts import PlanInputs, check_inputs, plan
from hldstudy.plan.presets import plan_model
from hldstudy.plan.terms import GB, dtype_bytes
from hldstudy.sweep.cohorts import auto_cohort, device_hours, study_flops
from hldstudy.sweep.spec import expand, load_sweep


def _gb(x: float) -> str:
    return f"{x / GB:.2f}"


def format_markdown(r: dict) -> str:
    i = r["inputs"]
    col, dis = r["colocated"], r["disaggregated"]
    lines = [
        f"**{i['teacher']} -> {i['student']}**: {i['tokens_per_step']} tokens/step, "
        f"{i['devices']} devices at {i['mfu']:.0%} MFU of {i['tflops']:g} TFLOPS, "
        f"link {i['link_gbps']:g} Gbps/device, T={i['seq_len']}, loss={i['loss']}, "
        f"remat={i['remat']}, streamed layers={r['n_streamed_layers']}, "
        f"stream {i['stream_dtype']}, grad-accum {i['grad_accum']}, "
        f"teacher devices {i['teacher_devices'] or i['devices']}",
        "",
        "| | colocated | disaggregated (trainer) | disaggregated (teacher) |",
        "|---|---:|---:|---:|",
        f"| step time (s), estimate | {col['step_time_s']:.3f} | "
        f"{dis['student_step_time_s']:.3f} | {dis['teacher_step_time_s']:.3f} |",
        f"| verdict | - | {'network-bound' if dis['network_bound'] else 'keeps up with the link'}"
        f" | {'teacher-bound' if dis['teacher_bound'] else 'keeps up'} "
        f"(needs {dis['teacher_devices_for_throughput']} devices) |",
    ]
    if i.get("fanout_window"):
        lines.append(f"| fan-out window ({i['fanout_window']} steps, host, per replica) | - | - | "
                     f"{_gb(dis['fanout_window_bytes'])} GB |")
    net = r["network_bytes_per_step"]
    lines += ["",
              f"Network per step: hidden {_gb(net['hidden'])} GB vs logits {_gb(net['logits'])} GB "
              f"({net['logits_over_hidden']:.1f}x); required link {r['required_link_gbps']:.1f} "
              f"Gbps/device (logits would need {r['required_link_gbps_if_logits']:.0f}).",
              "",
              "Memory per device: `hldstudy plan --config EXP --target T` (aot's planner, the "
              "one model of a program's peak, with its validated band)."]
    return "\n".join(lines)


def _study_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="hldstudy plan --sweep",
                                 description="FLOPs and device-hours of a whole sweep: colocated "
                                             "vs disaggregated vs cohort vs one replica set for the grid.")
    ap.add_argument("--sweep", required=True, help="sweep file or built-in sweep name")
    ap.add_argument("--cohort", default=None, metavar="K|auto",
                    help="at most K students per cohort (default: every compatible run of a "
                         "method in one cohort); auto: the largest K whose cohorts fit --hbm")
    ap.add_argument("--hbm", type=float, default=None,
                    help="GB of memory per device (with --cohort auto)")
    ap.add_argument("--usable", type=float, default=0.9,
                    help="usable fraction of --hbm (with --cohort auto)")
    ap.add_argument("--devices", type=int, default=1,
                    help="data-parallel devices per run, splitting its batch (with --cohort auto)")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="K=V")
    ap.add_argument("--tflops", type=float, default=989.0, help="peak TFLOPS per device")
    ap.add_argument("--mfu", type=float, default=0.4)
    ap.add_argument("--check-compile", default=None, metavar="TARGET",
                    help="also compile the grid's steps, in this layout, for TARGET (v5e:2x4, "
                         "h100:8, ...: python -m hldstudy.aot; needs the aot extra)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--debug", action="store_true")
    return ap


def _check_study_args(a) -> None:
    """Every flag checked before any work; `--cohort K` parsed to an int."""
    if a.check_compile:
        parse_target(a.check_compile, "--check-compile")  # refused before any work
    auto = a.cohort == "auto"
    if auto:
        if a.hbm is None or not (math.isfinite(a.hbm) and a.hbm > 0):
            raise ConfigError("--hbm", "--cohort auto needs the device memory",
                              "give --hbm GB (> 0) per device")
        if not 0 < a.usable <= 1:
            raise ConfigError("--usable", f"{a.usable} is out of range", "0 < F <= 1")
    elif a.cohort is not None:
        try:
            a.cohort = int(a.cohort)
        except ValueError:
            raise ConfigError("--cohort", f"{a.cohort!r} is not a number",
                              "--cohort K (K >= 1) or --cohort auto") from None
        if a.cohort < 1:
            raise ConfigError("--cohort", f"must be >= 1, got {a.cohort}")
    for name, value in (("--mfu", a.mfu), ("--tflops", a.tflops)):
        if not (math.isfinite(value) and value > 0) or (name == "--mfu" and value > 1):
            raise ConfigError(name, f"{value} is out of range",
                              "--mfu in (0, 1], --tflops > 0 and finite")


def _print_study(r: dict, a, chosen: dict | None) -> None:
    if chosen is not None:
        nxt = chosen["bytes_at_k_plus_1"]
        print(f"--cohort auto: K = {chosen['k']}, the largest cohort that fits "
              f"{_gb(chosen['limit_bytes'])} GB ({a.hbm:g} GB x {a.usable:g} usable, the "
              f"batch over {a.devices} device(s)): "
              f"its step needs {_gb(chosen['bytes_at_k'])} GB"
              + (f", K = {chosen['k'] + 1} would need {_gb(nxt)} GB" if nxt else
                 " (every compatible run of a method in one cohort)"))
    print(f"sweep {r['sweep']}: {r['runs']} runs, {r['cohorts']} cohorts "
          f"(at most {r['cohort_size']} students each); device-hours at "
          f"{a.mfu:.0%} MFU of {a.tflops:g} TFLOPS")
    print("| layout | teacher FLOPs | student FLOPs | total FLOPs | device-hours |")
    print("|---|---:|---:|---:|---:|")
    for name, lay in r["layouts"].items():
        print(f"| {name} | {lay['teacher_flops']:.3e} | {lay['student_flops']:.3e} | "
              f"{lay['total_flops']:.3e} | {lay['device_hours']:,.0f} |")
    s = r["cohort_savings"]
    print(f"cohorts: teacher FLOPs {s['teacher']:.1f}x lower, total {s['total']:.2f}x lower")
    g = r["grid"]
    print(f"grid (one replica set, --teacher-replicas): teacher FLOPs {g['teacher_flops']:.4e}"
          f", {g['teacher_x_lower']:.1f}x below colocated; bound {g['bound']:.4e} "
          f"({g['longest_steps']:,} steps x one whole forward, {g['bound_x_lower']:.1f}x "
          f"below colocated; grid / bound = {g['of_bound']:.4f}); replica window "
          f"{_gb(g['replica_window_bytes'])} GB for {g['window']} steps")


def _study(a) -> tuple[dict, list[dict], dict | None]:
    """(the grid's FLOPs per layout, the compiled steps of --check-compile)."""
    sweep = load_sweep(find_builtin(a.sweep, SWEEPS))
    runs = expand(sweep, a.overrides)
    teacher = teacher_model_config(runs[0].config.teacher.checkpoint, sweep.teacher_preset)
    chosen = None
    if a.cohort == "auto":
        if a.devices < 1:
            raise ConfigError("--devices", f"must be >= 1, got {a.devices}")
        chosen = auto_cohort(runs, teacher, a.hbm * GB * a.usable, a.devices)
        if chosen["k"] == 0:
            raise ConfigError("--cohort", f"not even one student fits: the largest cohort "
                              f"step needs {_gb(chosen['bytes_at_k'])} GB of the "
                              f"{_gb(chosen['limit_bytes'])} GB usable "
                              f"({a.hbm:g} GB x {a.usable:g}) with the batch over "
                              f"{a.devices} device(s)",
                              "more data-parallel devices (--devices N), or a device with "
                              "more memory")
        a.cohort = chosen["k"]
    r = study_flops(runs, teacher, a.cohort or len(runs))
    if chosen is not None:
        r["cohort_auto"] = chosen
    r.update({"sweep": sweep.name, "mfu": a.mfu, "peak_tflops": a.tflops})
    for lay in r["layouts"].values():
        lay["device_hours"] = device_hours(lay["total_flops"], a.mfu, a.tflops)
    colo, coh = r["layouts"]["colocated"], r["layouts"]["cohort"]
    r["cohort_savings"] = {
        "teacher": colo["teacher_flops"] / max(coh["teacher_flops"], 1e-30),
        "total": colo["total_flops"] / coh["total_flops"]}
    g = r["grid"]
    g["teacher_x_lower"] = colo["teacher_flops"] / max(g["teacher_flops"], 1e-30)
    g["bound_x_lower"] = colo["teacher_flops"] / max(g["bound"], 1e-30)
    g["of_bound"] = g["teacher_flops"] / max(g["bound"], 1e-30)
    compiled = (check_grid(runs, teacher, a.cohort or len(runs), a.check_compile)
                if a.check_compile else [])
    if compiled:
        r["check_compile"] = [{k: v for k, v in c.items() if k != "text"} for c in compiled]
    return r, compiled, chosen


def study_main(argv: list[str]) -> int:
    """`--sweep SWEEP`: teacher, student and total FLOPs of a whole grid under the
    colocated, disaggregated and cohort layouts, and device-hours."""
    a = _study_parser().parse_args(argv)
    with user_errors(a.debug, prog="hldstudy.plan"):
        _check_study_args(a)
        r, compiled, chosen = _study(a)
        if a.json:
            print(json.dumps(r, sort_keys=True))
            return _compile_verdict(compiled)
        _print_study(r, a, chosen)
        for c in compiled:
            print(f"\n{len(c['runs'])} run(s): {', '.join(c['runs'])}\n{c['text']}")
        return _compile_verdict(compiled)
    return 0


def _compile_verdict(compiled: list[dict]) -> int:
    """RuntimeFault (exit 3) naming the first compiled step that does not fit."""
    for c in compiled:
        if "does_not_fit" in c:
            raise RuntimeFault(c["does_not_fit"])
    return 0


def run_main(argv: list[str]) -> int:
    """`--config EXP --target T`: the run's cell of the decision map, colocated vs
    disaggregated on the target, sized by aot's planner (the figure `python -m hldstudy.aot`
    prints beside the compiled program: one memory model)."""
    ap = argparse.ArgumentParser(prog="hldstudy plan --config",
                                 description="Will this run fit on the target, colocated or "
                                             "with its teacher on replicas, and which is faster.")
    ap.add_argument("--config", required=True, help="experiment file or built-in name")
    ap.add_argument("--target", required=True, help="h100:8, h200:2x8, v5p:2x2x2, ...")
    ap.add_argument("--method", default=None, help="method (default: the config's)")
    ap.add_argument("--teacher-preset", default=None,
                    help="the teacher's model preset (default: read teacher.checkpoint)")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="K=V")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--debug", action="store_true")
    a = ap.parse_args(argv)
    with user_errors(a.debug, prog="hldstudy.plan"):
        cell = run_cell(a.config, a.overrides, a.method, a.teacher_preset, a.target)
        if a.json:
            print(json.dumps(cell, sort_keys=True))
        else:
            print("\n".join([*format_rows([cell]), "", RUN_NOTE]))
    return 0


RUN_NOTE = ("GiB per device by aot's planner, `<= X` its validated band's pessimistic end "
            "(what fits reads, 90% of the device); times are the planner's FLOPs at 0.4 MFU, "
            "estimates. `python -m hldstudy.aot --config EXP --target T --layout L` compiles "
            "the program with the target's compiler; `hldstudy plan --decision-map` has the "
            "map's pairs and what each column means.")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if any(a == "--sweep" or a.startswith("--sweep=") for a in argv):
        return study_main(argv)
    if "--decision-map" in argv:
        return decision_map_main(argv)
    if any(a == "--config" or a.startswith("--config=") for a in argv):
        return run_main(argv)
    ap = argparse.ArgumentParser(prog="hldstudy plan",
                                 description="Time / network planner from model presets: "
                                             "colocated vs disaggregated teacher (memory: "
                                             "hldstudy plan --config EXP --target T).")
    ap.add_argument("--teacher", required=True, help="model preset (hldstudy.model.presets)")
    ap.add_argument("--student", required=True)
    ap.add_argument("--tokens-per-step", type=int, required=True)
    ap.add_argument("--devices", type=int, required=True, help="trainer devices")
    ap.add_argument("--link", type=float, required=True, help="Gbps inbound per trainer device")
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--loss", choices=("fused", "materialized"), default="fused")
    ap.add_argument("--remat", action="store_true")
    ap.add_argument("--stream-dtype", default="bf16")
    ap.add_argument("--hidden-layers", type=int, default=0,
                    help="teacher intermediate layers streamed besides the final hidden")
    ap.add_argument("--teacher-devices", type=int, default=None)
    ap.add_argument("--grad-accum", type=int, default=1)
    ap.add_argument("--tflops", type=float, default=989.0, help="peak TFLOPS per device")
    ap.add_argument("--mfu", type=float, default=0.4)
    ap.add_argument("--no-fused-recompute", action="store_true")
    ap.add_argument("--fanout-window", type=int, default=0,
                    help="steps a cohort replica holds (serve --window); 0 = no fan-out")
    ap.add_argument("--fanout-union-layers", type=int, default=0,
                    help="streamed tensors of the cohort's union of layers (0: as one run)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--debug", action="store_true")
    a = ap.parse_args(argv)
    with user_errors(a.debug, prog="hldstudy.plan"):
        p = PlanInputs(teacher=plan_model(a.teacher), student=plan_model(a.student),
                       tokens_per_step=a.tokens_per_step, devices=a.devices,
                       link_gbps=a.link, seq_len=a.seq_len, loss=a.loss, remat=a.remat,
                       stream_dtype=a.stream_dtype, hidden_layers=a.hidden_layers,
                       teacher_devices=a.teacher_devices, grad_accum=a.grad_accum,
                       tflops=a.tflops, mfu=a.mfu, fused_recompute=not a.no_fused_recompute,
                       fanout_window=a.fanout_window, fanout_union_layers=a.fanout_union_layers)
        dtype_bytes(p.stream_dtype)
        check_inputs(p)
        warn_long_sequence("hldstudy.plan", "--seq-len", p.seq_len)
        r = plan(p)
        if a.json:
            print(json.dumps(r, sort_keys=True))
        else:
            print(format_markdown(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
