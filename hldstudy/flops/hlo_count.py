"""FLOPs of a compiled program counted from its optimized HLO text, where XLA's cost
analysis cannot count: a compiler that gives none (XLA GPU) and loops (a scanned stack,
micro-batches, a replica's micro-batch map), whose bodies the cost analysis counts once.
Counted: dots, convolutions (their taps on real input), cuBLAS GEMM calls and kernels'
declared costs, in every computation they sit in, a while loop's body times its trip count
(recorded, or read from its condition); elementwise operations are not. Pure text parsing
of `compiled.as_text()`; nothing here compiles.
Design notes: `docs/flops.md`, under this file's name.
"""

from __future__ import annotations

import hashlib
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from hldstudy.chips import KERNEL_FLOPS_SCOPE

__all__ = ["COUNT_VERSION", "HloCount", "hlo_flops"]

# What a figure counted from a program's HLO was counted by (this file's source): a kept
# figure from another count is not read as this one's (the HLO itself is not kept).
COUNT_VERSION = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:16]

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
_WINDOW = re.compile(r"window=\{([^}]*)\}")
_TARGET = re.compile(r'custom_call_target="([^"]+)"')
GEMM_TARGETS = ("__cublas$gemm", "__cublas$lt$matmul", "__cublas$lt$matmul$f8")
# Custom calls that do no multiply-adds (not listed as uncounted).
NO_FLOPS = ("TopK", "Sharding", "SPMDFullToShardShape", "SPMDShardToFullShape")


# Collectives and the bytes each device sends for one, per byte of its result, over a group
# of n devices (ring algorithms, the bandwidth-optimal ones NCCL and the TPU ICI run):
# all-gather (n-1)/n of its gathered result, reduce-scatter (n-1) x its shard (the input's
# (n-1)/n), all-reduce 2 (n-1)/n, all-to-all (n-1)/n, a permute its whole result.
COLLECTIVES = {
    "all-gather": lambda n: (n - 1) / n, "reduce-scatter": lambda n: n - 1.0,
    "all-reduce": lambda n: 2 * (n - 1) / n, "all-to-all": lambda n: (n - 1) / n,
    "collective-permute": lambda n: 1.0,
}
_MESH_GROUPS = re.compile(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}")
_GROUPS = re.compile(r"replica_groups=(\{\{[\d,{} ]*\}\}|\[[\d,]+\]<=\[[\d,]+\](?:T\([\d,]+\))?)")
_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "bf16": 2, "f16": 2, "s32": 4,
          "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8}


@dataclass
class HloCount:
    """The count, and what it could not count (say so beside the figure)."""

    flops: float = 0.0
    # Bytes each device sends in the program's collectives, by kind (loops times their
    # trips), and the part whose groups span devices of more than one host (`host_size`
    # devices per host, in device order): what crosses the data-center network.
    collective_bytes: dict[str, float] = field(default_factory=dict)
    cross_host_bytes: float = 0.0
    # An ideal roofline of the program on a chip (`peak_flops`, `hbm_bytes_per_s` given):
    # every executed instruction (a fusion whole, its intermediates on chip) takes the
    # larger of its FLOPs at the peak and its bytes in and out at the HBM bandwidth, one
    # after another, loops times their trips; collectives are not in it (the network's).
    roofline_s: float = 0.0
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
    for part in (p.strip() for p in _top_level_parts(operands)):
        typed = _first_array(part.rsplit(" ", 1)[0]) if " " in part else None
        name = part.rsplit(" ", 1)[-1].lstrip("%")
        out.append(typed if typed is not None else shapes.get(name))
    return out


def _type_bytes(type_text: str) -> float:
    """Bytes of every array in an instruction's result type (a tuple's summed)."""
    return float(sum(_BYTES.get(m["dtype"], 4) * math.prod(_dims(m["dims"]))
                     for m in _ARRAY.finditer(type_text)))


# Instructions that move no bytes through HBM themselves (their operands' bytes are counted
# where they are read): aliases, tuples, ids; loops and calls count their bodies.
_NO_TRAFFIC = {"parameter", "get-tuple-element", "tuple", "bitcast", "constant", "after-all",
               "partition-id", "replica-id", "opt-barrier", "while", "conditional", "call",
               "add-dependency"}


def _operand_bytes(operands: str, shapes: dict) -> list[float]:
    """Each operand's bytes: printed with its type, or by name."""
    known = shapes.get("#bytes", {})
    return [_type_bytes(part.rsplit(" ", 1)[0])
            if " " in part and _ARRAY.search(part.rsplit(" ", 1)[0])
            else known.get(part.rsplit(" ", 1)[-1].lstrip("%"), 0.0)
            for part in (p.strip() for p in _top_level_parts(operands))]


# Ops that read only the part of their first operand they return.
_SLICING = ("dynamic-slice", "slice", "gather")


def _io_bytes(type_text: str, operands: str, shapes: dict, op: str = "") -> float:
    """What an executed instruction reads and writes: its operands' bytes and its result's;
    a slice reads what it returns, an in-place update writes (and reads) its update."""
    if op in _SLICING:
        return 2 * _type_bytes(type_text)
    sizes = _operand_bytes(operands, shapes)
    if op == "dynamic-update-slice" and len(sizes) > 1:
        return 2 * sizes[1]
    return sum(sizes) + _type_bytes(type_text)


def _kernel_io_bytes(comps: dict, defs: dict, fused: str, type_text: str, operands: str,
                     shapes: dict) -> float:
    """A fusion's bytes in and out of HBM (its intermediates stay on chip): each operand's
    bytes, except one the kernel only slices (a scan's step of a stacked weight: the slices'
    bytes) or only updates in place at its root (a dynamic-update-slice into a loop's
    buffer: neither read nor written whole, the update written)."""
    inner, body = defs.get(fused), comps.get(fused)
    if not inner or not body:
        return _io_bytes(type_text, operands, shapes)
    sizes, own = _operand_bytes(operands, shapes), body[0][4].get("#bytes", {})
    params = {n: int(v[1]) for n, v in inner.items() if n != "ROOT" and v[0] == "parameter"}
    root = inner.get("ROOT")
    root_name = next((n for n, v in inner.items() if n != "ROOT" and v == root), None)
    outs = [root_name] if root and root[0] != "tuple" else _names(root[1]) if root else []
    written, in_place = 0.0, set()
    for out in outs:
        op, ops, _ = inner.get(out, ("", "", ""))
        args = _names(ops)
        if op == "dynamic-update-slice" and args and args[0] in params:
            in_place.add(args[0])
            written += own.get(args[1], 0.0)
        else:
            written += own.get(out, 0.0)
    uses: dict[str, list[tuple[str, str, int]]] = {n: [] for n in params}
    for name, (op, ops, _) in inner.items():
        if name != "ROOT":
            for i, arg in enumerate(_names(ops)):
                if arg in uses:
                    uses[arg].append((name, op, i))
    read = 0.0
    for name, index in params.items():
        full = sizes[index] if index < len(sizes) else 0.0
        mine = uses[name]
        if mine and all(op in _SLICING and i == 0 for _, op, i in mine):
            read += min(full, sum(own.get(n, 0.0) for n, _, _ in mine))
        elif not (name in in_place and all(op == "dynamic-update-slice" and i == 0
                                           for _, op, i in mine)):
            read += full
    return read + written


def _top_level_parts(operands: str) -> list[str]:
    """An operand list split at its top-level commas (a printed type's own commas kept)."""
    out, depth, start = [], 0, 0
    for i, ch in enumerate(operands):
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch == "," and depth == 0:
            out.append(operands[start:i])
            start = i + 1
    out.append(operands[start:])
    return [p for p in out if p.strip()]


def _parse(hlo_text: str):
    """{computation: [(op, type, operands, attrs, own shapes map)]}, the entry's name, and
    {computation: {instruction: (op, operands, attrs)}} with the root under "ROOT"."""
    comps: dict[str, list] = {}
    defs: dict[str, dict] = {}
    entry, current, shapes = None, None, {}
    for line in hlo_text.splitlines():
        if current is None:
            h = _HEADER.match(line)
            if h:
                current, shapes = h["name"], {}
                comps[current], defs[current] = [], {}
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
        shapes.setdefault("#bytes", {})[m["name"]] = _type_bytes(m["type"])
        comps[current].append((m["op"], m["type"], operands, attrs, shapes))
        defs[current][m["name"]] = (m["op"], operands, attrs)
        if line.lstrip().startswith("ROOT"):
            defs[current]["ROOT"] = (m["op"], operands, attrs)
    return comps, entry, defs


def _names(operands: str) -> list[str]:
    return [part.strip().rsplit(" ", 1)[-1].lstrip("%") for part in operands.split(",")]


def _constant(defs: dict, name: str) -> int | None:
    """The integer `name` holds where it is a scalar constant (through copies)."""
    for _ in range(8):
        op, operands, _ = defs.get(name, (None, "", ""))
        if op == "constant":
            try:
                return int(operands.strip())
            except ValueError:
                return None
        if op not in ("copy", "bitcast", "convert"):
            return None
        name = _names(operands)[0]
    return None


_FLIP = {"LT": "GT", "LE": "GE", "GT": "LT", "GE": "LE"}


_PASS_THROUGH = ("copy", "bitcast", "convert")


def _unwrapped(defs: dict, instr, op: str):
    """`instr` (op, operands, attrs), or where XLA CPU wraps one `op` in a fusion of its own
    (`wrapped_compare`, `wrapped_add`), that op with the fusion's operands in place of its
    parameters."""
    if instr is None or instr[0] != "fusion":
        return instr
    fused = re.search(r"calls=%?([\w.\-]+)", instr[2])
    inner = defs.get(fused.group(1), {}) if fused else {}
    if inner.get("ROOT", ("",))[0] != op:
        return None
    outer = _names(instr[1])
    params = {n: int(v[1]) for n, v in inner.items() if n != "ROOT" and v[0] == "parameter"}
    args = [outer[params[a]] if a in params else a for a in _names(inner["ROOT"][1])]
    return op, ", ".join(args), inner["ROOT"][2]


def _counter_step(defs: dict, body: str, index: int) -> int | None:
    """How much a loop's counter (tuple element `index`) grows per trip: the body's root
    tuple's element there, through copies, as counter + constant. libtpu's widened loops
    (`wide.*`, e.g. windowed matmuls) run two windows a trip and step by 2. None where the
    update is not of that form."""
    body_defs = defs.get(body, {})
    root = body_defs.get("ROOT")
    if root is None or root[0] != "tuple":
        return None
    elements = _names(root[1])
    if index >= len(elements):
        return None
    name = elements[index]
    while body_defs.get(name, ("",))[0] in _PASS_THROUGH:
        name = _names(body_defs[name][1])[0]
    op, operands, _ = _unwrapped(defs, body_defs.get(name), "add") or (None, "", "")
    if op != "add":
        return None
    args = _names(operands)
    for counter, other in (args, args[::-1]):
        c_op, _, c_attrs = body_defs.get(counter, (None, "", ""))
        at = re.search(r"index=(\d+)", c_attrs)
        step = _constant(body_defs, other)
        if c_op == "get-tuple-element" and at and int(at.group(1)) == index and step:
            return step
    return None


def _trip_count(defs: dict, caller: str, init: str, condition: str,
                body: str = "") -> int | None:
    """A counted loop's trips from its condition where the compiler records none (libtpu):
    the condition's root compares a tuple element (the counter) with a constant bound; the
    counter starts at that element of the loop's initial tuple (a constant; 0 where it is
    not one, as XLA's counted loops start) and grows by the body's step (`_counter_step`;
    1 where the body does not say, as XLA's counted loops do)."""
    cond_defs = defs.get(condition, {})
    fused = re.search(r"calls=%?([\w.\-]+)", (cond_defs.get("ROOT") or ("", "", ""))[2])
    if cond_defs.get("ROOT", ("",))[0] == "fusion" and fused:  # XLA GPU fuses the bound
        # into the compare's own computation: its constants are read there
        cond_defs = {**defs.get(fused.group(1), {}), **cond_defs}
    root = _unwrapped(defs, cond_defs.get("ROOT"), "compare")
    if root is None or root[0] != "compare":
        return None
    direction = re.search(r"direction=(\w+)", root[2])
    args = _names(root[1])
    if direction is None or len(args) != 2:
        return None
    d = direction.group(1)
    bound, counter = _constant(cond_defs, args[1]), args[0]
    if bound is None:
        bound, counter, d = _constant(cond_defs, args[0]), args[1], _FLIP.get(d, d)
    op, operands, attrs = cond_defs.get(counter, (None, "", ""))
    index = re.search(r"index=(\d+)", attrs)
    if bound is None or op != "get-tuple-element" or index is None or d not in ("LT", "LE"):
        return None
    start = 0
    tup = defs.get(caller, {}).get(init)
    if tup is not None and tup[0] == "tuple":
        elements = _names(tup[1])
        if int(index.group(1)) < len(elements):
            start = _constant(defs[caller], elements[int(index.group(1))]) or 0
    step = _counter_step(defs, body, int(index.group(1))) or 1
    span = bound - start + (1 if d == "LE" else 0)
    trips = -(-span // step)
    return trips if trips > 0 else None


def _dot_flops(type_text, operands, attrs, shapes) -> float:
    out = _first_array(type_text)
    lhs = _operand_shapes(operands, shapes)[0]
    if out is None or lhs is None:
        return 0.0
    dims = dict((k, _dims(v)) for k, v in _DIMS.findall(attrs))
    contracted = math.prod(lhs[d] for d in dims.get("lhs_contracting_dims", []))
    return 2.0 * math.prod(out) * contracted


def _window_fields(attrs: str) -> dict[str, list]:
    window = _WINDOW.search(attrs)
    fields = dict(f.split("=", 1) for f in window.group(1).split() if "=" in f) if window else {}
    return {k: v.split("x") for k, v in fields.items()}


def _real_taps(n: int, out: int, k: int, stride: int, lo: int, lhs_dilate: int,
               rhs_dilate: int) -> int:
    """Over one spatial dim, the (output position, window tap) pairs that land on a real
    input value, not on padding or the zeros an input dilation inserts: libtpu writes
    batched matmuls as convolutions whose windows are mostly such zeros (a window of 32
    over one padded input; windows of 8x32x64 over an input dilated by as much)."""
    if out * k > 4_000_000:  # a plain window too long to walk: its taps, all real
        return out * k
    hits = 0
    span = (n - 1) * lhs_dilate + 1
    for q in range(out):
        for t in range(k):
            x = q * stride + t * rhs_dilate - lo
            hits += 0 <= x < span and x % lhs_dilate == 0
    return hits


def _conv_flops(type_text, operands, attrs, shapes) -> float:
    """2 x the multiply-adds on real values: per output element, the kernel's input features
    per group (its `i` dim, `dim_labels`) times the window taps that land on real input
    (`_real_taps`, each spatial dim)."""
    out = _first_array(type_text)
    shp = _operand_shapes(operands, shapes)
    labels = re.search(r"dim_labels=([^_\s]+)_([^-\s]+)->(\S+?)[,\s]", attrs + " ")
    if out is None or len(shp) < 2 or shp[0] is None or shp[1] is None or labels is None:
        return 0.0
    lhs_l, rhs_l, out_l = labels.groups()
    lhs, kernel = shp
    w = _window_fields(attrs)
    spatial = sorted(c for c in lhs_l if c.isdigit())
    # Per output element of the non-spatial dims: the input features times the real taps.
    macs = math.prod(out[out_l.index(c)] for c in out_l if not c.isdigit()) \
        * kernel[rhs_l.index("i")]
    for d, c in enumerate(spatial):
        def field(name, default, d=d):
            return int(w[name][d]) if name in w and d < len(w[name]) else default

        lo = int(w["pad"][d].split("_")[0]) if "pad" in w and d < len(w["pad"]) else 0
        macs *= _real_taps(lhs[lhs_l.index(c)], out[out_l.index(c)], kernel[rhs_l.index(c)],
                           field("stride", 1), lo, field("lhs_dilate", 1),
                           field("rhs_dilate", 1))
    return 2.0 * macs


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
    # A kernel declaring its cost by name scope (chips.KERNEL_FLOPS_SCOPE): the innermost.
    scoped = re.search(r'op_name="([^"]*)"', attrs)
    if scoped:
        costs = re.findall(KERNEL_FLOPS_SCOPE + r"(\d+)", scoped.group(1))
        if costs:
            return float(costs[-1])
    return None


def _groups(attrs: str) -> list[list[int]]:
    """The device groups of a collective: listed ({{0,1},{2,3}}), as an iota ([2,4]<=[8],
    optionally transposed: [2,4]<=[4,2]T(1,0)), or over axes of a device mesh
    (mesh['a'=2,'b'=4] {'b'}: the devices in row-major order, a group along the named
    axes)."""
    mesh = _MESH_GROUPS.search(attrs)
    if mesh is not None:
        axes = re.findall(r"'([^']+)'=(\d+)", mesh.group(1))
        names, sizes = [a for a, _ in axes], [int(n) for _, n in axes]
        over = [names.index(a) for a in re.findall(r"'([^']+)'", mesh.group(2)) if a in names]
        rest = [i for i in range(len(names)) if i not in over]
        ids = np.arange(math.prod(sizes)).reshape(sizes).transpose(rest + over)
        return ids.reshape(-1, math.prod(sizes[i] for i in over)).tolist()
    m = _GROUPS.search(attrs)
    if m is None:
        return []
    text = m.group(1)
    if text.startswith("{"):
        return [_dims(g) for g in re.findall(r"\{([\d,]+)\}", text)]
    shape, rest = text[1:].split("]<=[", 1)
    dims, _, perm = rest.partition("]")
    ids = list(range(math.prod(_dims(dims))))
    if perm.startswith("T("):
        ids = np.arange(len(ids)).reshape(_dims(dims)).transpose(
            _dims(perm[2:-1])).reshape(-1).tolist()
    n_groups, size = _dims(shape)[0], math.prod(_dims(shape)[1:])
    return [ids[i * size:(i + 1) * size] for i in range(n_groups)]


def _collective(op: str, type_text: str, attrs: str, host_size: int):
    """(kind, bytes a device sends, whether its groups cross hosts) of one collective, or
    None for any other op."""
    kind = op.removesuffix("-start")
    if kind not in COLLECTIVES or op.endswith("-done"):
        return None
    arrays = list(_ARRAY.finditer(type_text))
    if not arrays:
        return None
    last = arrays[-1]  # an async start's result is (operands..., result)
    nbytes = _BYTES.get(last["dtype"], 4) * math.prod(_dims(last["dims"]))
    groups = _groups(attrs)
    n = len(groups[0]) if groups and groups[0] else 2
    cross = any(len({d // host_size for d in g}) > 1 for g in groups) if host_size else False
    if kind == "collective-permute":
        pairs = re.search(r"source_target_pairs=\{([^}]*(?:\}[^}]*)*)\}", attrs)
        ids = [int(x) for x in re.findall(r"\d+", pairs.group(1))] if pairs else []
        cross = bool(host_size) and any(
            a // host_size != b // host_size for a, b in zip(ids[::2], ids[1::2], strict=False))
        n = 2
    return kind, nbytes * COLLECTIVES[kind](max(n, 1)), cross


def hlo_flops(hlo_text: str, host_size: int = 0, peak_flops: float = 0.0,
              hbm_bytes_per_s: float = 0.0) -> HloCount:
    """The program's FLOPs by the rules above (module docstring), the bytes its collectives
    send per device (`host_size`: devices per host, 0 for one host) and, given a chip's
    peak FLOP/s and HBM bandwidth, its ideal roofline time (`HloCount.roofline_s`)."""
    comps, entry, defs = _parse(hlo_text)
    count = HloCount()
    memo: dict[str, tuple[float, dict, float, float]] = {}
    roofline = peak_flops > 0 and hbm_bytes_per_s > 0

    def total(name: str, stack: tuple = ()) -> tuple[float, dict, float, float]:
        if name in memo:
            return memo[name]
        if name not in comps or name in stack:
            return 0.0, {}, 0.0, 0.0
        flops, sent, cross, seconds = 0.0, {}, 0.0, 0.0

        def add(other, times=1, own_time=True):
            nonlocal flops, cross, seconds
            flops += times * other[0]
            for k, v in other[1].items():
                sent[k] = sent.get(k, 0.0) + times * v
            cross += times * other[2]
            seconds += times * other[3] if own_time else 0.0

        for op, type_text, operands, attrs, shapes in comps[name]:
            before = flops
            coll = _collective(op, type_text, attrs, host_size)
            if coll is not None:
                sent[coll[0]] = sent.get(coll[0], 0.0) + coll[1]
                cross += coll[1] if coll[2] else 0.0
            elif roofline and op not in _NO_TRAFFIC and not op.endswith("-done") \
                    and op != "fusion":
                seconds += _io_bytes(type_text, operands, shapes, op) / hbm_bytes_per_s
            if op == "fusion":  # one kernel: its FLOPs and its bytes in and out
                called = _CALLED.findall(attrs)
                for t in [total(c, stack + (name,)) for c in called]:
                    add(t, own_time=False)
                if roofline:
                    io = _kernel_io_bytes(comps, defs, called[0], type_text, operands,
                                          shapes) if called else 0.0
                    seconds += max((flops - before) / peak_flops, io / hbm_bytes_per_s)
                continue
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
            if roofline and flops > before:  # a dot, convolution or kernel: compute-bound
                # where its FLOPs take longer than its bytes (counted above)
                io = _io_bytes(type_text, operands, shapes) / hbm_bytes_per_s
                seconds += max(0.0, (flops - before) / peak_flops - io)
            if op == "while":
                called = dict(re.findall(r"\b(body|condition)=%?([\w.\-]+)", attrs))
                trips = _TRIPS.search(attrs)
                n = int(trips.group(1)) if trips else _trip_count(
                    defs, name, _names(operands)[0], called.get("condition", ""),
                    called.get("body", ""))
                count.loops += 1
                if n is None:
                    count.unknown_trip_loops += 1
                    n = 1
                for c in called.values():
                    add(total(c, stack + (name,)), n)
                continue
            branches = _BRANCHES.search(attrs)
            if branches:
                taken = [total(b.strip().lstrip("%"), stack + (name,))
                         for b in branches.group(1).split(",") if b.strip()]
                if taken:  # the costliest branch
                    add(max(taken, key=lambda t: t[0]))
                continue
            for called in _CALLED.findall(attrs):
                add(total(called, stack + (name,)))
        memo[name] = (flops, sent, cross, seconds)
        return memo[name]

    if entry is None:
        return count
    count.flops, count.collective_bytes, count.cross_host_bytes, count.roofline_s = total(entry)
    return count
