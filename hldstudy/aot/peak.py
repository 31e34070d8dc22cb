"""Where a compiled step's memory goes: the buffers live at its peak, by the JAX
operation that made them.

XLA's buffer assignment is dumped with the optimized HLO (`xla_dump_to` with
`xla_dump_hlo_as_text`, as compile options: `DUMP_OPTIONS`). Its live-range file lists
every value live at the program's peak with its size ("Live ranges at N (peak)"); the
optimized HLO names, for each instruction, the JAX operation it came from
(`metadata={op_name="jit(step)/transpose(jvp(...))/checkpoint/mul"}`: `transpose(...)`
is the backward, `checkpoint/rematted_computation` a remat recomputation). Pure parsing
of those two files: `peak_groups(dump_dir)`.
"""

from __future__ import annotations

import dataclasses
import re
from collections import defaultdict
from pathlib import Path

# Compile options that make XLA write the files read here.
DUMP_OPTIONS = {"xla_dump_hlo_as_text": True}

_PEAK = re.compile(r"Live ranges at (\d+) \(peak\):\n(.*?)\n\s*Stack trace breakdown", re.S)
_VALUE = re.compile(r"^\s+([^\s{]+)\{[^}]*\}: (\d+) bytes", re.M)
_INSTR = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = .*?\bop_name=\"([^\"]*)\"", re.M)
_JIT = re.compile(r"^jit\([^)]*\)/")


@dataclasses.dataclass(frozen=True)
class PeakGroup:
    """The values live at the peak that one JAX operation made (arguments: "arguments")."""

    op: str        # op_name without its leading jit(...)/, or the HLO name without one
    bytes: int
    values: int


def _one(directory: Path, suffix: str) -> Path:
    found = sorted(directory.glob(f"*after_optimizations{suffix}"))
    if not found:
        raise FileNotFoundError(f"no *after_optimizations{suffix} in {directory}")
    return found[-1]


def peak_groups(dump_dir: str | Path) -> tuple[int, list[PeakGroup]]:
    """(peak bytes, groups largest first) of the one module dumped in `dump_dir`: every
    value live at the peak, grouped by the JAX operation that made it; the step's
    arguments (HLO parameters) are one group, "arguments"."""
    d = Path(dump_dir)
    m = _PEAK.search(_one(d, "-live-range.txt").read_text())
    if m is None:
        raise ValueError(f"no peak section in the live-range file of {d}")
    ops = {name: _JIT.sub("", op) for name, op in
           _INSTR.findall(_one(d, ".txt").read_text())}
    size: dict[str, int] = defaultdict(int)
    count: dict[str, int] = defaultdict(int)
    for name, nbytes in _VALUE.findall(m.group(2)):
        key = "arguments" if name.startswith("param") else ops.get(name, name)
        size[key] += int(nbytes)
        count[key] += 1
    groups = sorted((PeakGroup(k, size[k], count[k]) for k in size),
                    key=lambda g: (-g.bytes, g.op))
    return sum(size.values()), groups
