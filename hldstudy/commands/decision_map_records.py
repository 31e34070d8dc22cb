"""The decision map's compile records: the aot commands of a cell's three programs, one
compile each in a process of its own (`python -m hldstudy.aot`), kept under a key of what
decides the program (the command, the experiment file's sha256, the lowered program's
sha256 and the tools: `hldstudy.aot.fingerprint`), and attached to the cells they are
current for; a stale one is set apart with why."""

from __future__ import annotations

import functools
import hashlib
import json
import sys
from pathlib import Path

from hldstudy.aot.fingerprint import source_sha256, stale_reason, toolchain
from hldstudy.aot.process import run_aot
from hldstudy.aot.targets import parse_target
from hldstudy.config import config_to_dict, load_experiment
from hldstudy.errors import InputError
from hldstudy.flops.hlo_count import COUNT_VERSION
from hldstudy.plan.decision_map import divisors, slice_spec
from hldstudy.plan.step_memory import fits_device


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
        # the replica over every device of its slice, as the map counts them (a file's
        # own teacher.replica_devices may name fewer: one GPU, where a TPU host has four)
        "replica": base + ["--target", slice_spec(chip, dis["replica_devices"]),
                           "--layout", "disaggregated", "--parts", "teacher",
                           "--set", f"teacher.replica_devices={dis['replica_devices']}",
                           "--set", f"teacher.replica_batch={dis['replica_batch']}"],
    }


def command_key(args: list[str]) -> str:
    return " ".join(["python -m hldstudy.aot", *args])


def command_args(key: str) -> list[str]:
    """The aot arguments of a record's command (`command_key`'s inverse: its arguments have no
    spaces)."""
    return key.split()[len(command_key([]).split()):]


def config_digest(args: list[str]) -> str:
    """sha256 of the config a command's experiment file resolves to (its attention path,
    mesh, dtypes: what it decides, not its comments), so an edited setting asks again."""
    return _resolved_digest(args[args.index("--config") + 1])


@functools.cache  # a sitting reads each file many times (every cell's every record)
def _resolved_digest(config: str) -> str:
    path = Path(config)
    if not path.is_file():
        raise InputError(f"cannot read {path}: the decision map compiles the experiment "
                         "files of its pairs; run it from the repository root")
    text = json.dumps(config_to_dict(load_experiment(path)), sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def run_compile(args: list[str]) -> dict:
    """One aot compile in a process of its own (`run_aot`): its row's memory and FLOPs, or
    its error, under its command (`command_key`) and its experiment file's digest."""
    digest = config_digest(args)
    run = run_aot(args)
    rec = {"command": command_key(args), "config_sha256": digest, "exit": run["exit"],
           "seconds": run["seconds"]}
    try:
        (row,) = run["report"]["rows"]
    except (KeyError, TypeError, ValueError):
        rec["error"] = run.get("error", "no single row in the report")
        return rec
    rec["program_sha256"] = row.get("program_sha256")
    rec["toolchain"] = run["report"].get("toolchain")
    rec["source_sha256"] = run["report"].get("source_sha256")
    rec.update({k: row[k] for k in ("fits", "device_memory_bytes", "refused", "microbatches",
                                    "xla_over_model", "planner_over_compiled",
                                    "collective_bytes", "cross_host_bytes", "roofline_s",
                                    "xla_flops", "hlo_unknown_trip_loops",
                                    "hlo_count_version") if k in row})
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


def programs_now(cells: list[dict], records: dict[str, dict],
                 save=lambda: None) -> dict[str, str | None]:
    """The sha256 of the program each record the cells read (`attach`) compiled, as this
    checkout builds it now: the record's own where this source compiled it
    (`source_sha256`: the same code lowers the same program), else lowered again
    (`lowered_program`, with progress: minutes for a 35B GPU program); a record found
    the same program is stamped with this source and `save`d, so it is not lowered again.
    Records `to_compile` compiles again (another count's figures) are not lowered."""
    kept = [r for c in cells for recs in c.get("compiled", {}).values() for r in recs]
    recount = {r["command"] for c in cells for r in uncounted(c)}
    now = source_sha256()
    programs, lower = {}, []
    for rec in kept:
        if rec["command"] in recount:  # compiled again anyway: its compile is its check
            continue
        if rec.get("source_sha256") == now and rec.get("program_sha256"):
            programs[rec["command"]] = rec["program_sha256"]
        elif rec["command"] not in lower:
            lower.append(rec["command"])
    for i, key in enumerate(lower, 1):
        print(f"[lowering {i} of {len(lower)}: the code changed since] {key}",
              file=sys.stderr, flush=True)
        programs[key] = lowered_program(command_args(key))
        if programs[key] == records[key].get("program_sha256"):
            records[key]["source_sha256"] = now
            save()
    return programs


def load_records(path: Path) -> dict[str, dict]:
    if not path.exists():
        return {}
    try:
        return {r["command"]: r for r in json.loads(path.read_text())["compiled"]}
    except (ValueError, KeyError, TypeError) as e:
        raise InputError(f"--records {path} is not a decision map's records ({e}): give "
                         "another path, or move it away to compile afresh") from None


def backend_of(args: list[str]) -> str:
    return parse_target(args[args.index("--target") + 1]).backend


def next_args(cell: dict, program: str, args: list[str]) -> list[str] | None:
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
    the planner's order (`next_args`), so a program is out of memory only when the last
    count is too; the (cell, program, args) still missing. A record is current when it
    compiled the experiment file as it is, with this host's tools, and (where `programs`
    has its command: the sha256 lowered now) the same lowered program; a stale one goes
    under cell["stale"][program] as (record, why)."""
    missing = []
    programs = programs or {}

    def current(args, cell, program):  # this command's record, if still current
        rec = records.get(command_key(args))
        if rec is None:
            return None
        why = ("its experiment file changed" if rec.get("config_sha256") != config_digest(args)
               else stale_reason(rec, toolchain(backend_of(args)),
                                 programs.get(command_key(args))))
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
                args = next_args(cell, program, args)
            if chain:
                cell["compiled"][program] = chain
    return missing


def counted(rec: dict) -> bool:
    """Whether a record's HLO figures (roofline, collectives) are this checkout's count's
    (`hlo_count.COUNT_VERSION`): the HLO is not kept, so another count's are not read."""
    return rec.get("hlo_count_version") == COUNT_VERSION


def fitting(cell: dict, program: str) -> dict | None:
    """The compiled record the cell's verdict reads for a program: the first that fits."""
    return next((r for r in cell.get("compiled", {}).get(program, [])
                 if record_fits(r, cell)), None)


def read_records(cell: dict) -> list[dict]:
    """The records whose HLO figures the page reads (after `attach`): the fitting
    colocated and student steps, and the fitting replica where the student fits (the
    disaggregated roofline needs both). An out-of-memory compile's figures are not read."""
    col, student = fitting(cell, "colocated"), fitting(cell, "disaggregated")
    replica = fitting(cell, "replica") if student else None
    return [r for r in (col, student, replica) if r is not None]


def to_compile(cells: list[dict], records: dict[str, dict],
               programs: dict[str, str | None] | None = None
               ) -> list[tuple[dict, str, list[str]]]:
    """The (cell, program, args) a sitting compiles: those without a current record
    (`attach`), then the records the page reads whose HLO figures another count made
    (the HLO is not kept, so counting again is compiling again)."""
    todo = attach(cells, records, programs)
    for cell in cells:
        recount = uncounted(cell)
        for program, recs in cell["compiled"].items():
            todo += [(cell, program, command_args(r["command"])) for r in recs
                     if r in recount]
    return todo


def uncounted(cell: dict) -> list[dict]:
    """The records the page reads (`read_records`) whose HLO figures another count made:
    what `to_compile` compiles again (after `attach`)."""
    return [r for r in read_records(cell) if not counted(r)]


__all__ = ["attach", "command_args", "command_key", "compile_commands", "config_digest",
           "counted", "fitting", "load_records", "lowered_program", "next_args", "programs_now",
           "read_records", "record_fits", "run_compile", "to_compile", "uncounted"]
