"""`hldstudy plan --decision-map`: the seed's decision map (colocated or disaggregated, per
pair and target) from the planner, beside what the target's compiler says of the cells it
compiled.

    hldstudy plan --decision-map --out docs/decision_map.md            # planner + records
    hldstudy plan --decision-map --compile --out docs/decision_map.md  # + compile the rest

Every cell's programs are compiled with `--compile` (`decision_map_records`: one process
each, kept in `--records` under a key of what decides the program), a stale record again,
else shown as stale; the page is `decision_map_page`. A failed compile is not kept (exit
3). Notes: `docs/planner.md`, `plan/decision_map.py`."""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import sys
from pathlib import Path

from hldstudy.aot.check import load_run
from hldstudy.aot.planned import planned_replica, planned_train
from hldstudy.aot.targets import check_installed, parse_target
from hldstudy.cli_common import check_output_file
from hldstudy.commands.decision_map_page import format_map
from hldstudy.commands.decision_map_records import (
    attach,
    command_key,
    load_records,
    programs_now,
    run_compile,
    to_compile,
)
from hldstudy.errors import ConfigError, RuntimeFault, user_errors
from hldstudy.fileio import write_json_atomic, write_text_atomic
from hldstudy.plan.decision_map import (
    PAIRS,
    TARGETS,
    CellSizes,
    MapPair,
    check_vocabularies,
    decision_map,
    map_cell,
    slice_spec,
)
from hldstudy.plan.presets import plan_model
from hldstudy.shapes import ModelShape

PROG = "hldstudy plan --decision-map"
RECORDS = "docs/decision_map.json"
GiB = 2**30


@functools.cache
def _pair_run(config: str):
    return load_run(config, [], None, None)


def cell_sizes(pair: MapPair, spec: str) -> CellSizes:
    """A cell's memory model: aot's planner (`hldstudy.aot.planned`) on the pair's
    experiment file as `compile_commands` would compile it on `spec`."""
    cfg, method, teacher = _pair_run(pair.config)
    if cfg.data.batch_size * cfg.data.seq_len != pair.tokens_per_step or \
            cfg.data.seq_len != pair.seq_len:
        raise ConfigError("pair", f"{pair.name}: {pair.config} trains on {cfg.data.batch_size} "
                          f"x {cfg.data.seq_len} tokens per step, the map's pair on "
                          f"{pair.tokens_per_step:,} of {pair.seq_len}",
                          "make the pair's tokens_per_step and seq_len the file's")
    return run_sizes(cfg, method, teacher, spec)


def run_sizes(cfg, method: str, teacher, spec: str) -> CellSizes:
    """A run's memory model on target `spec`: aot's planner (`hldstudy.aot.planned`) at a
    micro-batch count (train) or a replica's devices and sequences per forward."""
    target = parse_target(spec)

    def train(layout: str, microbatches: int) -> float:
        run = dataclasses.replace(cfg, train=dataclasses.replace(
            cfg.train, microbatches=microbatches))
        return planned_train(run, teacher, method, target, layout)["total_bytes"]

    def replica(devices: int, per_forward: int) -> float:
        run = dataclasses.replace(cfg, teacher=dataclasses.replace(
            cfg.teacher, replica_batch=per_forward, replica_devices=devices))
        return planned_replica(run, teacher, method,
                               parse_target(slice_spec(target.chip, devices)))["total_bytes"]

    return CellSizes(train, replica, target.backend)


def run_cell(config: str, overrides: list[str], method: str | None,
             teacher_preset: str | None, spec: str) -> dict:
    """One run's cell of the map (`hldstudy plan --config`): its experiment file on target
    `spec`, both layouts sized by aot's planner, timed and networked as the map's cells."""
    cfg, method, teacher = load_run(config, overrides, method, teacher_preset)
    if teacher is None:
        raise ConfigError("distill.method", f"{method} trains without a teacher: there is no "
                          "layout to choose", "plan a method with a teacher (kd, hldf, hldc)")
    target = parse_target(spec)
    t = ModelShape.from_model_config(teacher, "teacher")
    s = ModelShape.from_model_config(cfg.model, "student")
    check_vocabularies(t, s, "teacher")
    cell = map_cell(t, s, target.chip, target.n_devices,
                    run_sizes(cfg, method, teacher, spec),
                    tokens_per_step=cfg.data.batch_size * cfg.data.seq_len,
                    seq_len=cfg.data.seq_len)
    cell.update({"pair": f"{cfg.name} ({method})", "config": config, "target": spec,
                 "chip": target.chip.name})
    return cell


def _compile_needed(cells: list[dict], records: dict[str, dict], programs: dict,
                     records_path: Path, failed: list[str]) -> None:
    """Compiles what the cells need (`to_compile`: the programs without a current record,
    the records another HLO count counted), one process each:
    one node's cells first (the map's must: every 8-device cell compiled before the
    16-device ones), the smaller pairs first within each (a 122B program compiles for a
    quarter of an hour on 2 cores, a 123M one in a minute); each record written as it
    comes, so an interrupted sitting keeps what it compiled. A program that does not fit
    asks for the next count (`attach`); a failed compile is not kept (listed in `failed`,
    tried again next time)."""
    first = _cheapest_first(cells)
    done, compiled = 0, set()
    while True:
        todo = sorted((m for m in to_compile(cells, records, programs)
                       if command_key(m[2]) not in failed and command_key(m[2]) not in compiled),
                      key=lambda m: first(m[0]))
        if not todo:
            return
        cell, program, args = todo[0]
        done += 1
        print(f"[{done}, {len(todo)} to go] compiling {cell['pair']} on "
              f"{cell['target']}: {program} ({args[-1]})", file=sys.stderr, flush=True)
        rec = run_compile(args)
        print(f"    {rec.get('seconds')} s: " + (rec.get("error") or (
            f"{(rec.get('total_bytes') or 0) / GiB:.1f} GiB per device, "
            f"{'fits' if rec.get('fits') else 'does not fit'}")), file=sys.stderr, flush=True)
        if _keep(rec, records, records_path, failed):
            compiled.add(rec["command"])


def _cheapest_first(cells: list[dict]):
    """The order a sitting compiles cells in: one node's before two nodes' (every 8-device
    cell is the map's must), the map's smaller pairs first within each."""
    pairs = {p: i for i, p in enumerate(dict.fromkeys(c["pair"] for c in cells))}
    return lambda cell: (cell["devices"], pairs[cell["pair"]])


def _keep(rec: dict, records: dict[str, dict], records_path: Path, failed: list[str]) -> bool:
    """A compile's record kept and written at once; a failed one listed in `failed`, not
    kept (the next sitting tries it again)."""
    if "error" in rec:
        failed.append(rec["command"])
        return False
    records[rec["command"]] = rec
    _save(records_path, records)
    return True


def _save(records_path: Path, records: dict[str, dict]) -> None:
    records_path.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(records_path, {"compiled": list(records.values())})


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
        records = load_records(records_path)
        programs: dict[str, str | None] = {}
        failed: list[str] = []
        if a.compile:  # the compiler's extra, checked before minutes of work
            for spec in sorted({c["target"] for c in cells}):
                check_installed(parse_target(spec))
            # What needs no lowering to know first (programs without a record, records
            # another HLO count counted), then the kept records checked against the program
            # as this checkout lowers it (lowered again only where the code that lowers
            # changed since: `programs_now`), the stale compiled.
            _compile_needed(cells, records, programs, records_path, failed)
            programs = programs_now(cells, records, lambda: _save(records_path, records))
            _compile_needed(cells, records, programs, records_path, failed)
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


__all__ = ["cell_sizes", "main", "run_cell", "run_sizes"]
