"""`hldstudy plan --decision-map`: the seed's decision map (colocated or disaggregated, per
pair and target) from the planner, beside what the target's compiler says of the cells it
compiled.

    hldstudy plan --decision-map --out docs/decision_map.md            # planner + records
    hldstudy plan --decision-map --compile --out docs/decision_map.md  # + compile the rest

The compiled cells (`COMPILED`) run `python -m hldstudy.aot` in a process each, kept in
`--records` under a key of what decides the program (`hldstudy.aot.fingerprint`): a stale
record is compiled again with `--compile`, else shown as stale. A failed compile is not
kept (exit 3). Notes: `docs/planner.md`, `plan/decision_map.py`."""

from __future__ import annotations

import argparse
import dataclasses
import functools
import hashlib
import json
import math
import re
import sys
from pathlib import Path

from hldstudy.aot.check import load_run
from hldstudy.aot.fingerprint import stale_reason, toolchain
from hldstudy.aot.planned import planned_replica, planned_train
from hldstudy.aot.process import run_aot
from hldstudy.aot.targets import check_installed, parse_target
from hldstudy.cli_common import check_output_file
from hldstudy.errors import ConfigError, InputError, RuntimeFault, user_errors
from hldstudy.fileio import write_json_atomic, write_text_atomic
from hldstudy.plan.decision_map import (
    PAIRS,
    TARGETS,
    CellSizes,
    MapPair,
    decision_map,
    divisors,
    slice_spec,
)
from hldstudy.plan.presets import plan_model
from hldstudy.plan.step_memory import compiled_peak, fits_device

PROG = "hldstudy plan --decision-map"
RECORDS = "docs/decision_map.json"
GiB = 2**30
# Why a cell reads the planner's figures alone (the page's header says what `--compile`
# costs: minutes and up to ~15 GiB per program on 2 cores, the records kept between sittings).
NOT_COMPILED = "planner only: not compiled yet"


@functools.cache
def _pair_run(config: str):
    return load_run(config, [], None, None)


def cell_sizes(pair: MapPair, spec: str) -> CellSizes:
    """A cell's memory model: aot's planner (`hldstudy.aot.planned`) on the pair's
    experiment file as `compile_commands` would compile it on `spec`, at a micro-batch
    count (train) or a replica's devices and sequences per forward."""
    cfg, method, teacher = _pair_run(pair.config)
    if cfg.data.batch_size * cfg.data.seq_len != pair.tokens_per_step or \
            cfg.data.seq_len != pair.seq_len:
        raise ConfigError("pair", f"{pair.name}: {pair.config} trains on {cfg.data.batch_size} "
                          f"x {cfg.data.seq_len} tokens per step, the map's pair on "
                          f"{pair.tokens_per_step:,} of {pair.seq_len}",
                          "make the pair's tokens_per_step and seq_len the file's")
    target = parse_target(spec)

    def train(layout: str, microbatches: int) -> float:
        run = dataclasses.replace(cfg, train=dataclasses.replace(
            cfg.train, microbatches=microbatches))
        return planned_train(run, teacher, method, target, layout)["total_bytes"]

    def replica(devices: int, per_forward: int) -> float:
        run = dataclasses.replace(cfg, teacher=dataclasses.replace(
            cfg.teacher, replica_batch=per_forward))
        return planned_replica(run, teacher, method,
                               parse_target(slice_spec(target.chip, devices)))["total_bytes"]

    return CellSizes(train, replica, target.backend)


def compile_commands(cell: dict) -> dict[str, list[str]]:
    """The aot command lines (after `python -m hldstudy.aot`) of a cell's three programs, at
    the planner's micro-batches: the colocated step, the disaggregated student step, and one
    replica's forward on its own devices."""
    base = ["--config", cell["config"], "--json"]
    dis = cell["disaggregated"]
    chip = parse_target(cell["target"]).chip
    return {
        "colocated": base + ["--target", cell["target"], "--layout", "colocated",
                             "--parts", "train", "--set",
                             f"train.microbatches={cell['colocated']['microbatches']}"],
        "disaggregated": base + ["--target", cell["target"], "--layout", "disaggregated",
                                 "--parts", "train", "--set",
                                 f"train.microbatches={dis['microbatches']}"],
        "replica": base + ["--target", slice_spec(chip, dis["replica_devices"]),
                           "--layout", "disaggregated", "--parts", "teacher", "--set",
                           f"teacher.replica_batch={dis['replica_batch']}"],
    }


def _key(args: list[str]) -> str:
    return " ".join(["python -m hldstudy.aot", *args])


def _args(key: str) -> list[str]:
    """The aot arguments of a record's command (`_key`'s inverse: its arguments have no
    spaces)."""
    return key.split()[len(_key([]).split()):]


def config_digest(args: list[str]) -> str:
    """sha256 of the experiment file a command compiles: a record is the compile of the
    file as it was (its attention path, mesh, dtypes), so an edited file asks again."""
    path = Path(args[args.index("--config") + 1])
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError as e:
        raise InputError(f"cannot read {path} ({e.strerror}): the decision map compiles "
                         "the experiment files of its pairs; run it from the repository "
                         "root") from None


def run_compile(args: list[str]) -> dict:
    """One aot compile in a process of its own (`run_aot`): its row's memory and FLOPs, or
    its error, under its command (`_key`) and its experiment file's digest."""
    digest = config_digest(args)
    run = run_aot(args)
    rec = {"command": _key(args), "config_sha256": digest, "exit": run["exit"],
           "seconds": run["seconds"]}
    try:
        (row,) = run["report"]["rows"]
    except (KeyError, TypeError, ValueError):
        rec["error"] = run.get("error", "no single row in the report")
        return rec
    rec["program_sha256"] = row.get("program_sha256")
    rec["toolchain"] = run["report"].get("toolchain")
    rec.update({k: row[k] for k in ("fits", "device_memory_bytes", "refused", "microbatches",
                                    "xla_over_model", "planner_over_compiled",
                                    "collective_bytes", "cross_host_bytes", "roofline_s",
                                    "xla_flops", "hlo_unknown_trip_loops") if k in row})
    rec["total_bytes"] = row.get("compiled", {}).get("total_bytes")
    if row.get("compiled", {}).get("peak_memory_bytes"):
        rec["peak_memory_bytes"] = row["compiled"]["peak_memory_bytes"]
    rec["largest"] = [[g["op"], g["bytes"]] for g in row.get("peak", {}).get("largest", [])[:3]]
    return rec


def lowered_program(args: list[str]) -> str | None:
    """The sha256 of the program a compile command would compile, lowered only (seconds,
    `python -m hldstudy.aot --lower-only`); None where it does not lower."""
    run = run_aot([*args, "--lower-only"])
    try:
        (row,) = run["report"]["rows"]
        return row["program_sha256"]
    except (KeyError, TypeError, ValueError):
        return None


def _load(path: Path) -> dict[str, dict]:
    if not path.exists():
        return {}
    try:
        return {r["command"]: r for r in json.loads(path.read_text())["compiled"]}
    except (ValueError, KeyError, TypeError) as e:
        raise InputError(f"--records {path} is not a decision map's records ({e}): give "
                         "another path, or move it away to compile afresh") from None


def _backend(args: list[str]) -> str:
    return parse_target(args[args.index("--target") + 1]).backend


def _next_args(cell: dict, program: str, args: list[str]) -> list[str] | None:
    """The compile to try after `args`' did not fit, in the order the planner tries counts
    (`plan.decision_map.map_cell`): a train step's next micro-batch count up, a replica's
    next smaller forward (its next micro-batch count); None after the last."""
    sequences = cell["tokens_per_step"] // cell["seq_len"]
    knob = "teacher.replica_batch=" if program == "replica" else "train.microbatches="
    now = int(next(a for a in args if a.startswith(knob)).split("=")[1])
    if program == "replica":
        micro = sequences // now
        up = [m for m in divisors(sequences // cell["disaggregated"]["replica_devices"])
              if m > micro]
        value = sequences // up[0] if up else None
    else:
        up = [k for k in divisors(sequences // cell["devices"]) if k > now]
        value = up[0] if up else None
    return None if value is None else [f"{knob}{value}" if a.startswith(knob) else a
                                       for a in args]


def record_fits(rec: dict, cell: dict) -> bool | None:
    """A compiled record's verdict under the map's one rule: its figure (`compiled_peak`,
    `fits_device`) within the same usable share of the device as the planner's cells
    (cell["limit_bytes"]); a refused compile does not fit; None for a failed one."""
    if "error" in rec:
        return None
    if rec.get("refused") or not rec.get("total_bytes"):
        return False
    return fits_device(rec, parse_target(cell["target"]).backend, cell["limit_bytes"])


def attach(cells: list[dict], records: dict[str, dict],
           programs: dict[str, str | None] | None = None) -> list[tuple[dict, str, list[str]]]:
    """Each compiled cell's records under cell["compiled"][program]: the compile at the
    planner's micro-batches and, while one does not fit (`record_fits`), the next count in
    the planner's order (`_next_args`), so a program is out of memory only when the last
    count is too; the (cell, program, args) still missing. A record is current when it
    compiled the experiment file as it is, with this host's tools, and (where `programs`
    has its command: the sha256 lowered now) the same lowered program; a stale one goes
    under cell["stale"][program] as (record, why)."""
    missing = []
    programs = programs or {}

    def current(args, cell, program):  # this command's record, if still current
        rec = records.get(_key(args))
        if rec is None:
            return None
        why = ("its experiment file changed" if rec.get("config_sha256") != config_digest(args)
               else stale_reason(rec, toolchain(_backend(args)), programs.get(_key(args))))
        if why is None:
            return rec
        cell["stale"][program] = (rec, why)
        return None

    for cell in cells:
        cell["compiled"], cell["stale"] = {}, {}
        for program, args in compile_commands(cell).items():
            chain = []
            while args is not None:
                rec = current(args, cell, program)
                if rec is None:
                    missing.append((cell, program, args))
                    break
                chain.append(rec)
                if record_fits(rec, cell) is not False:
                    break
                args = _next_args(cell, program, args)
            if chain:
                cell["compiled"][program] = chain
    return missing


def _gib(x) -> str:
    return "-" if x is None else f"{x / GiB:.1f}"


def _compiled_cell(recs: list[dict] | None, cell: dict) -> str:
    """The compiled records' figures as the fits rule reads them (`compiled_peak`; libtpu's
    total beside its peak), each with its verdict and, in a chain, its count."""
    if not recs:
        return ""
    backend = parse_target(cell["target"]).backend
    out = []
    for rec in recs:
        if "error" in rec:
            out.append("error")
            continue
        fits = "fits" if record_fits(rec, cell) else "**OOM**"
        mb = ""
        if len(recs) > 1:
            batch = re.search(r"replica_batch=(\d+)", rec["command"])
            mb = (f" at {batch.group(1)} seq" if batch else
                  f" at mb {rec['microbatches']}" if "microbatches" in rec else "")
        figure = f"**{_gib(compiled_peak(rec, backend))}**" if rec.get("total_bytes") \
            else "refused"
        if rec.get("peak_memory_bytes") and backend == "tpu":
            figure += f" peak, {_gib(rec['total_bytes'])} total"
        out.append(f"{figure} ({fits}{mb})")
    return " / compiled " + "; ".join(out)


def _stale_cell(stale: tuple[dict, str] | None) -> str:
    """A stale record's figure, shown as such (the verdict stays the planner's)."""
    if stale is None:
        return ""
    rec, why = stale
    return f" / stale compile {_gib(rec.get('total_bytes'))} total ({why})"


HEADER = (
    "Generated by `hldstudy plan --decision-map --compile --out docs/decision_map.md` "
    "(`hldstudy.commands.decision_map`; cells: `hldstudy.plan.decision_map`). One memory "
    "model: each figure is aot's planner (`hldstudy.aot.planned`, what `python -m "
    "hldstudy.aot` prints beside the same program) for the pair's experiment file on the "
    "target, GiB per device, at the fewest micro-batches (`mb`) that fit 90% of the "
    "device (the most, when none does). A planner figure is read at the pessimistic end "
    "of its band (`<= X`: the compiled figure the planner's implies on that compiler, "
    "from its validation on programs it was not fitted to, "
    "benchmarks/results/planner_validation.md). The student trains in bf16 with float32 "
    "weights and Adam, remat, FSDP over the target's devices (16 GPUs as two hosts of "
    "8), each pair's tokens per step (1M for the MoE pairs, 256 x 2048 for the HLD "
    "study's); the teacher in bf16. Disaggregated: the student on the target, the "
    "teacher on replicas of their own (`k x R`: k replicas of R devices, as many as keep "
    "the student busy). Network, Gbps per device against the data-center link "
    "(`hldstudy.chips`, sources in docs/infrastructure.md): the stream's need (in brackets "
    "what the teacher's logits would need instead), and each layout's own collectives "
    "that cross hosts on the same NIC, from its compiled HLO (`hldstudy.flops.hlo_count`: "
    "bytes each device sends, ring algorithms; one host's and a TPU slice's stay on NVLink "
    "or ICI: 0; `-` not compiled). A compiled "
    "figure (`python -m hldstudy.aot` at the same micro-batches; the commands are in "
    "docs/decision_map.json) is read by the same rule, within 90% of the device "
    "(`hldstudy.plan.fits_device`: the total on a GPU, libtpu's own peak on a TPU, the "
    "figure libtpu admits a program by), and where one count does not fit, the next count "
    "in the planner's order is compiled; a cell's verdict is the compiler's where it "
    "compiled the cell. A record that is not the compile of the program as this checkout "
    "lowers it with this host's jax / libtpu / CUDA plugin (`hldstudy.aot.fingerprint`) "
    "reads *stale compile*, with why: its figure is shown, its verdict is the planner's "
    "until `--compile` compiles it again. Speed: the step's time and tokens/s per device, "
    "every device counted (the replicas' too), from the planner's FLOPs at 0.4 MFU on the "
    "chip's bf16 peak: **estimates, not measured** (no device has timed them), the same "
    "efficiency for both layouts, so they tell only what the FLOPs and the replicas' "
    "rounding tell; the faster layout among those that fit, with its margin. A cell "
    "\"planner only: not compiled yet\" has no compile of its programs: `--compile` "
    "compiles them, one process each (minutes and up to ~15 GiB of RAM per program on 2 "
    "cores), the records written after each, so the map fills in over several sittings.")


def _planned(fits: bool, nbytes: float, band: list[float], extra: str) -> str:
    return f"{'fits' if fits else '**OOM**'} {_gib(nbytes)} <= {_gib(band[1])} ({extra})"


def _coverage(cell: dict) -> str:
    """Whether the cell's verdict is the compiler's, and where not why (one line)."""
    comp = cell.get("compiled", {})
    missing = [p for p in _PLANNED if p not in comp]
    if not missing:
        return " (compiled)"
    if len(missing) == len(_PLANNED):
        return f"; {NOT_COMPILED}"
    return f"; partly compiled ({', '.join(missing)}: {NOT_COMPILED})"


def _collectives_gbps(cell: dict, program: str, step_time: float) -> float | None:
    """Gbps per device of a compiled train step's collectives that cross hosts (its HLO's
    `cross_host_bytes` per step over the step's time); None where not compiled."""
    recs = [r for r in cell.get("compiled", {}).get(program, [])
            if record_fits(r, cell) and "cross_host_bytes" in r]
    return None if not recs else 8 * recs[0]["cross_host_bytes"] / step_time / 1e9


def _fitting(cell: dict, program: str) -> dict | None:
    """The compiled record the cell's verdict reads for a program: the first that fits."""
    return next((r for r in cell.get("compiled", {}).get(program, [])
                 if record_fits(r, cell)), None)


def roofline(cell: dict) -> dict | None:
    """Speed from the compiled programs where they have a roofline (`roofline_s`: each
    kernel at its FLOP or HBM bound, `hldstudy.flops.hlo_count`): the colocated step's
    time and tokens/s per device; disaggregated, the student's step, one replica's time
    per served step, the replicas that keep the student fed, and tokens/s per device with
    every device counted. None where neither layout's programs are compiled; "unknown
    trip" loops (counted once: a lower bound) are counted."""
    tokens, n = cell["tokens_per_step"], cell["devices"]
    out, loops = {}, 0
    col = _fitting(cell, "colocated")
    if col and col.get("roofline_s"):
        out["colocated"] = {"step_s": col["roofline_s"],
                            "tokens_per_s_per_device": tokens / col["roofline_s"] / n}
        loops += col.get("hlo_unknown_trip_loops", 0)
    student, replica = _fitting(cell, "disaggregated"), _fitting(cell, "replica")
    if student and replica and student.get("roofline_s") and replica.get("roofline_s"):
        t_s, t_r = student["roofline_s"], replica["roofline_s"]
        r_dev = cell["disaggregated"]["replica_devices"]
        replicas = max(1, math.ceil(t_r / t_s - 1e-9))
        step = max(t_s, t_r / replicas)
        out["disaggregated"] = {"step_s": step, "student_s": t_s, "replica_s": t_r,
                                "replicas": replicas, "devices_total": n + replicas * r_dev,
                                "tokens_per_s_per_device": tokens / step / (n + replicas * r_dev)}
        loops += student.get("hlo_unknown_trip_loops", 0) + \
            replica.get("hlo_unknown_trip_loops", 0)
    if not out:
        return None
    out["unknown_trip_loops"] = loops
    return out


def _speed(cell: dict) -> str:
    """The planner's estimate, and the compiled programs' roofline where there is one."""
    col, dis = cell["colocated"], cell["disaggregated"]
    text = (f"estimate: col {col['step_time_s']:.2f} s, {col['tokens_per_s_per_device']:,.0f}; "
            f"dis {dis['step_time_s']:.2f} s, {dis['tokens_per_s_per_device']:,.0f}")
    roof = roofline(cell)
    if roof is None:
        return text
    parts = []
    if "colocated" in roof:
        r = roof["colocated"]
        parts.append(f"col {r['step_s']:.2f} s, {r['tokens_per_s_per_device']:,.0f}")
    if "disaggregated" in roof:
        r = roof["disaggregated"]
        parts.append(f"dis {r['step_s']:.2f} s (replica {r['replica_s']:.2f} s a step: "
                     f"{r['replicas']} x {cell['disaggregated']['replica_devices']} keep up), "
                     f"{r['tokens_per_s_per_device']:,.0f}")
    loops = (f"; {roof['unknown_trip_loops']} loops of unknown trips counted once"
             if roof["unknown_trip_loops"] else "")
    return text + "; **roofline**: " + "; ".join(parts) + loops


def _network(cell: dict) -> str:
    """The NIC's need per device against the link: the stream's (hidden states; logits
    instead beside it), and each layout's own collectives that cross hosts, from its
    compiled HLO."""
    col, dis = cell["colocated"], cell["disaggregated"]
    parts = [f"stream {dis['need_gbps']:.2f} (logits {dis['logits_need_gbps']:,.0f})"]
    for layout, step in (("colocated", col["step_time_s"]),
                         ("disaggregated", dis["step_time_s"])):
        got = _collectives_gbps(cell, layout, step)
        short = "col" if layout == "colocated" else "dis"
        parts.append(f"{short} collectives {'-' if got is None else f'{got:.1f}'}")
    return "; ".join(parts) + f" / {dis['link_gbps']:g}"


def format_map(cells: list[dict]) -> str:
    lines = ["# The decision map: colocated or disaggregated, from the planner and the compiler",
             "", HEADER, "",
             "| pair | target | colocated | disaggregated student | replicas | "
             "replica | network need / link | step s, tokens/s/device | verdict |",
             "|---|---|---|---|---|---|---|---|---|"]
    for c in cells:
        col, dis = c["colocated"], c["disaggregated"]
        comp, stale = c.get("compiled", {}), c.get("stale", {})
        col_cell = (_planned(col["fits"], col["peak_bytes"], col["band_bytes"],
                             f"mb {col['microbatches']}")
                    + _compiled_cell(comp.get("colocated"), c)
                    + _stale_cell(stale.get("colocated")))
        dis_cell = (_planned(dis["student_fits"], dis["peak_bytes"], dis["band_bytes"],
                             f"mb {dis['microbatches']}")
                    + _compiled_cell(comp.get("disaggregated"), c)
                    + _stale_cell(stale.get("disaggregated")))
        rep_cell = (_planned(dis["replica_fits"], dis["replica_peak_bytes"],
                             dis["replica_band_bytes"],
                             f"{dis['replica_batch']} seq per forward")
                    + _compiled_cell(comp.get("replica"), c) + _stale_cell(stale.get("replica")))
        dis_verdict = "fits" if _fits(c, "disaggregated") else (
            dis["verdict"] if dis["verdict"] != "fits" else "OOM")
        verdict = (f"colocated {'fits' if _fits(c, 'colocated') else 'OOM'}, "
                   f"disaggregated {dis_verdict}{_faster(c)}{_coverage(c)}")
        speed = _speed(c)
        lines.append(
            f"| {c['pair']} | {c['target']} | {col_cell} | {dis_cell} | "
            f"{dis['replicas']} x {dis['replica_devices']} ({dis['devices_total']} devices) | "
            f"{rep_cell} | {_network(c)} | {speed} | "
            f"{verdict} |")
    lines += ["", _reading(cells)]
    return "\n".join(lines) + "\n"


def _rates(cell: dict) -> tuple[dict[str, float], str]:
    """Tokens/s per device of the layouts that fit, and whose: the compiled programs'
    roofline where it has both layouts (or the only one that fits), else the planner's
    estimate."""
    fit = [lay for lay in ("colocated", "disaggregated") if _fits(cell, lay)]
    roof = roofline(cell) or {}
    if fit and all(lay in roof for lay in fit):
        return {lay: roof[lay]["tokens_per_s_per_device"] for lay in fit}, "roofline"
    return {lay: cell[lay]["tokens_per_s_per_device"] for lay in fit}, "estimate, unproven"


def _best(cell: dict) -> str | None:
    """The layout with more tokens/s per device among those that fit (None: neither)."""
    rate, _ = _rates(cell)
    return max(rate, key=rate.get) if rate else None


def _faster(cell: dict) -> str:
    """'; faster: <layout> by N% (whose figures)' among the layouts that fit, '' when none
    fits."""
    rate, whose = _rates(cell)
    if not rate:
        return ""
    best = max(rate, key=rate.get)
    if len(rate) == 1:
        return f"; faster: {best}, the only one that fits"
    other = min(rate, key=rate.get)
    return f"; faster: {best} by {100 * (rate[best] / rate[other] - 1):.0f}% ({whose})"


def _fits(cell: dict, layout: str) -> bool:
    """The layout's verdict, the compiler's where it compiled the cell (a train step fits
    when it fits at some micro-batch count compiled)."""
    comp = cell.get("compiled", {})

    def compiled(program):
        verdicts = [v for v in (record_fits(r, cell) for r in comp.get(program, []))
                    if v is not None]
        return any(verdicts) if verdicts else None

    if layout == "colocated":
        got = compiled("colocated")
        return cell["colocated"]["fits"] if got is None else got
    student, replica = compiled("disaggregated"), compiled("replica")
    if student is None or replica is None:
        return cell["disaggregated"]["fits"]
    return student and replica and cell["disaggregated"]["verdict"] != "network-bound"


_PLANNED = {"colocated": ("colocated", "peak_bytes"),
            "disaggregated": ("disaggregated", "peak_bytes"),
            "replica": ("disaggregated", "replica_peak_bytes")}


def _reading(cells: list[dict]) -> str:
    """The table read against the seed's claim, one line per pair (the compiler's verdict
    where it compiled the cell, else the planner's, said so), and how far the planner was
    from the compiler where both sized the same program."""
    out = ["## Against the seed", ""]
    for pair in PAIRS:
        mine = [c for c in cells if c["pair"] == pair.name]

        def named(cs):
            return ", ".join(c["target"] + ("" if c.get("compiled") else " (planner)")
                             for c in cs) or "no target"

        decisive = [c for c in mine if not _fits(c, "colocated") and _fits(c, "disaggregated")]
        both_oom = [c for c in mine if not _fits(c, "colocated")
                    and not _fits(c, "disaggregated")]
        faster = {lay: [c["target"] for c in mine if _best(c) == lay]
                  for lay in ("colocated", "disaggregated")}
        out.append(f"- *{pair.branch}* ({pair.name}): colocated fits on "
                   f"{named([c for c in mine if _fits(c, 'colocated')])}; out of memory "
                   f"colocated and fitting disaggregated on {named(decisive)}; out of memory "
                   f"both ways on {named(both_oom)}. Faster: colocated on "
                   f"{', '.join(faster['colocated']) or 'no target'}; disaggregated on "
                   f"{', '.join(faster['disaggregated']) or 'no target'}.")
    both = [c for c in cells if _fits(c, "colocated") and _fits(c, "disaggregated")]
    if both:
        cost = [1 - c["disaggregated"]["tokens_per_s_per_device"]
                / c["colocated"]["tokens_per_s_per_device"] for c in both]
        out += ["", f"- Speed (the planner's estimate): where both layouts fit ({len(both)} "
                f"cells), disaggregating costs {100 * min(cost):.0f}-{100 * max(cost):.0f}% "
                "of the tokens/s per device, every device counted: at one MFU for both, "
                "the layouts do nearly the same FLOPs, and the replicas, rounded up to "
                "whole ones, sit partly idle. The seed's case for speed rests on what this "
                "estimate cannot see (the teacher's forward at a higher efficiency on its "
                "own devices, the student's step without the teacher's memory pressure); "
                "that is for compiled programs' rooflines and a lent device to show."]
    ratios = {p: [] for p in _PLANNED}
    for c in cells:
        for program, recs in c.get("compiled", {}).items():
            if recs and recs[0].get("total_bytes"):
                layout, key = _PLANNED[program]
                held_to = compiled_peak(recs[0], parse_target(c["target"]).backend)
                ratios[program].append(c[layout][key] / held_to)
    spans = "; ".join(f"{p} {min(r):.2f}-{max(r):.2f} ({len(r)})"
                      for p, r in ratios.items() if r)
    if spans:
        out += ["", f"The planner's peak over the compiler's, where both sized the same "
                f"program (cells compiled): {spans}. Below 1 the planner is optimistic: read "
                "its uncompiled \"fits\" near the limit as unproven."]
    return "\n".join(out)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=PROG, description=(
        "The seed's decision map: colocated or disaggregated per teacher -> student pair and "
        "target, from the planner, beside the compiler's figures for the cells it compiled."))
    ap.add_argument("--decision-map", action="store_true", required=True)
    ap.add_argument("--out", default=None, help="write the markdown here (default: print it)")
    ap.add_argument("--records", default=RECORDS,
                    help=f"the compiled cells' records, JSON (default {RECORDS})")
    ap.add_argument("--compile", action="store_true",
                    help="compile the marked cells' programs not yet in --records (needs the "
                         "aot extra; minutes and up to ~15 GiB of RAM each)")
    ap.add_argument("--json", action="store_true", help="the cells as one JSON list")
    ap.add_argument("--debug", action="store_true")
    return ap


def main(argv: list[str]) -> int:
    a = build_parser().parse_args(argv)
    with user_errors(a.debug, prog=PROG):
        out = check_output_file(a.out, "--out") if a.out else None
        records_path = check_output_file(a.records, "--records") if a.compile \
            else Path(a.records)
        targets = [(t, parse_target(t).chip, parse_target(t).n_devices) for t in TARGETS]
        cells = decision_map(PAIRS, targets, shape_of=plan_model, sizes_of=cell_sizes)
        records = _load(records_path)
        programs: dict[str, str | None] = {}
        missing = attach(cells, records)
        if a.compile:  # the compiler's extra, checked before minutes of work
            for spec in sorted({c["target"] for c in cells}):
                check_installed(parse_target(spec))
            # What the kept records compiled, lowered again now: a record of a program the
            # code no longer builds is compiled again, an unchanged one is kept.
            kept = [r["command"] for c in cells for recs in c.get("compiled", {}).values()
                    for r in recs]
            programs = {k: lowered_program(_args(k)) for k in kept}
            missing = attach(cells, records, programs)
        done, failed, compiled = 0, [], set()
        while a.compile:  # a compile that does not fit may ask for one more
            todo = [m for m in missing if _key(m[2]) not in failed and _key(m[2]) not in compiled]
            if not todo:
                break
            cell, program, args = todo[0]
            done += 1
            print(f"[{done}, {len(todo)} to go] compiling {cell['pair']} on "
                  f"{cell['target']}: {program} ({args[-1]})", file=sys.stderr, flush=True)
            rec = run_compile(args)
            print(f"    {rec.get('seconds')} s: " + (rec.get("error") or (
                f"{_gib(rec.get('total_bytes'))} GiB per device, "
                f"{'fits' if rec.get('fits') else 'does not fit'}")), file=sys.stderr, flush=True)
            if "error" in rec:  # not kept: a failed compile is tried again next time
                failed.append(rec["command"])
                continue
            records[rec["command"]] = rec
            compiled.add(rec["command"])
            records_path.parent.mkdir(parents=True, exist_ok=True)
            write_json_atomic(records_path, {"compiled": list(records.values())})
            missing = attach(cells, records, programs)
        if missing:
            print(f"{PROG}: {len(missing)} marked program(s) not compiled yet (--compile "
                  "compiles them)", file=sys.stderr)
        if a.json:
            print(json.dumps(cells, sort_keys=True))
        elif out is not None:  # its folder checked before the work, made now
            out.parent.mkdir(parents=True, exist_ok=True)
            write_text_atomic(out, format_map(cells))
            print(f"wrote {out}", file=sys.stderr)
        else:
            print(format_map(cells))
        if failed:
            raise RuntimeFault(f"{len(failed)} compile(s) failed and were not recorded; the "
                               f"first: {failed[0]}")
    return 0


__all__ = ["attach", "compile_commands", "format_map", "main"]
