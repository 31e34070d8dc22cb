"""FLOPs of a compiled program counted from its optimized HLO text, where XLA's cost
analysis cannot count: a compiler that gives none (XLA GPU) and loops (a scanned stack,
micro-batches, a replica's micro-batch map), whose bodies the cost analysis counts once.
Counted: dots, convolutions, cuBLAS GEMM calls and kernels' declared costs, in every
computation they sit in, a while loop's body times its known trip count; elementwise
operations are not. Pure text parsing of `compiled.as_text()`; nothing here compiles.
Design notes: `docs/flops.md`, under this file's name.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

__all__ = ["HloCount", "hlo_flops"]

_HEADER = re.compile(r"^(?:ENTRY\s+)?%?(?P<name>[\w.\-]+)\s+\(.*\)\s+->\s+.*\{\s*$")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?(?P<name>[\w.\-]+)\s+=\s+(?P<type>.+?)\s+"
                    r"(?P<op>[a-z][\w\-]*)\((?P<rest>.*)$")
_ARRAY = re.compile(r"\b(?P<dtype>[a-z]+\d*(?:e\d+m\d+\w*)?)\[(?P<dims>[\d,]*)\]")
_CALLED = re.compile(r"\b(?:calls|to_apply|body|condition|true_computation|false_computation)"
                     r"=%?([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_TRIPS = re.compile(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"?(\d+)')
_DIMS = re.compile(r"(lhs_contracting_dims|rhs_contracting_dims|lhs_batch_dims)=\{([\d,]*)\}")
_GEMM = re.compile(r'"lhs_contracting_dimensions"\s*:\s*\[([^\]]*)\]')
_DECLARED = re.compile(r'\\?"flops\\?"\s*:\s*\\?"?(\d+(?:\.\d+)?(?:[eE][+-]?\d+)?)')
_LABELS = re.compile(r"dim_labels=[^_\s]+_([^-\s]+)->")
_TARGET = re.compile(r'custom_call_target="([^"]+)"')
GEMM_TARGETS = ("__cublas$gemm", "__cublas$lt$matmul", "__cublas$lt$matmul$f8")
# Custom calls that do no multiply-adds (not listed as uncounted).
NO_FLOPS = ("TopK", "Sharding", "SPMDFullToShardShape", "SPMDShardToFullShape")


@dataclass
class HloCount:
    """The count, and what it could not count (say so beside the figure)."""

    flops: float = 0.0
    loops: int = 0                    # while loops met (each counted times its trips)
    unknown_trip_loops: int = 0       # loops without a known trip count (counted once)
    uncounted_kernels: list[str] = field(default_factory=list)  # custom calls with no cost


def _dims(text: str) -> list[int]:
    return [int(d) for d in text.split(",") if d]


def _first_array(type_text: str) -> list[int] | None:
    m = _ARRAY.search(type_text)
    return None if m is None else _dims(m["dims"])


def _split_operands(rest: str) -> tuple[str, str]:
    """(operand text, attributes after the closing parenthesis)."""
    depth = 1
    for i, ch in enumerate(rest):
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
            if depth == 0:
                return rest[:i], rest[i + 1:]
    return rest, ""


def _operand_shapes(operands: str, shapes: dict[str, list[int]]) -> list[list[int] | None]:
    """Each operand's dims: printed with its type (`f32[8,16]{1,0} %x`) or by name."""
    out = []
    depth, start = 0, 0
    parts = []
    for i, ch in enumerate(operands):
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(operands[start:i])
            start = i + 1
    parts.append(operands[start:])
    for part in (p.strip() for p in parts if p.strip()):
        typed = _first_array(part.rsplit(" ", 1)[0]) if " " in part else None
        name = part.rsplit(" ", 1)[-1].lstrip("%")
        out.append(typed if typed is not None else shapes.get(name))
    return out


def _parse(hlo_text: str):
    """{computation: [(op, type, operands, attrs, own shapes map)]}, the entry's name."""
    comps: dict[str, list] = {}
    entry, current, shapes = None, None, {}
    for line in hlo_text.splitlines():
        if current is None:
            h = _HEADER.match(line)
            if h:
                current, shapes = h["name"], {}
                comps[current] = []
                if line.lstrip().startswith("ENTRY"):
                    entry = current
            continue
        if line.strip() == "}":
            current = None
            continue
        m = _INSTR.match(line)
        if not m:
            continue
        operands, attrs = _split_operands(m["rest"])
        dims = _first_array(m["type"])
        if dims is not None:
            shapes[m["name"]] = dims
        comps[current].append((m["op"], m["type"], operands, attrs, shapes))
    return comps, entry


def _dot_flops(type_text, operands, attrs, shapes) -> float:
    out = _first_array(type_text)
    lhs = _operand_shapes(operands, shapes)[0]
    if out is None or lhs is None:
        return 0.0
    dims = dict((k, _dims(v)) for k, v in _DIMS.findall(attrs))
    contracted = math.prod(lhs[d] for d in dims.get("lhs_contracting_dims", []))
    return 2.0 * math.prod(out) * contracted


def _conv_flops(type_text, operands, attrs, shapes) -> float:
    """2 x output elements x the kernel's elements per output feature (its spatial extent
    times its input features per group): the kernel's `o` dim from `dim_labels`."""
    out = _first_array(type_text)
    shp = _operand_shapes(operands, shapes)
    labels = _LABELS.search(attrs)
    if out is None or len(shp) < 2 or shp[1] is None or labels is None:
        return 0.0
    kernel = shp[1]
    o = labels.group(1).index("o")
    return 2.0 * math.prod(out) * math.prod(kernel) / max(kernel[o], 1)


def _custom_flops(type_text, operands, attrs, shapes) -> float | None:
    target = _TARGET.search(attrs)
    name = target.group(1) if target else ""
    if name in GEMM_TARGETS:
        out = _first_array(type_text)  # the tuple's first array: the product
        lhs = _operand_shapes(operands, shapes)[0]
        g = _GEMM.search(attrs)
        if out is None or lhs is None or g is None:
            return None
        contracted = math.prod(lhs[int(d.strip().strip('"'))]
                               for d in g.group(1).split(",") if d.strip())
        return 2.0 * math.prod(out) * contracted
    declared = _DECLARED.search(attrs)
    if declared:
        return float(declared.group(1))
    return None


def hlo_flops(hlo_text: str) -> HloCount:
    """The program's FLOPs by the rules above (module docstring)."""
    comps, entry = _parse(hlo_text)
    count = HloCount()
    memo: dict[str, float] = {}

    def total(name: str, stack: tuple = ()) -> float:
        if name in memo:
            return memo[name]
        if name not in comps or name in stack:
            return 0.0
        flops = 0.0
        for op, type_text, operands, attrs, shapes in comps[name]:
            if op == "dot":
                flops += _dot_flops(type_text, operands, attrs, shapes)
            elif op == "convolution":
                flops += _conv_flops(type_text, operands, attrs, shapes)
            elif op == "custom-call":
                f = _custom_flops(type_text, operands, attrs, shapes)
                target = _TARGET.search(attrs)
                if f is None and (target.group(1) if target else "?") not in NO_FLOPS:
                    count.uncounted_kernels.append(target.group(1) if target else "?")
                elif f is not None:
                    flops += f
            if op == "while":
                called = dict(re.findall(r"\b(body|condition)=%?([\w.\-]+)", attrs))
                trips = _TRIPS.search(attrs)
                count.loops += 1
                if trips is None:
                    count.unknown_trip_loops += 1
                n = int(trips.group(1)) if trips else 1
                flops += n * sum(total(c, stack + (name,)) for c in called.values())
                continue
            branches = _BRANCHES.search(attrs)
            if branches:
                flops += max((total(b.strip().lstrip("%"), stack + (name,))
                              for b in branches.group(1).split(",") if b.strip()), default=0.0)
                continue
            for called in _CALLED.findall(attrs):
                flops += total(called, stack + (name,))
        memo[name] = flops
        return flops

    if entry is None:
        return count
    count.flops = total(entry)
    return count
