"""XLA's FLOP count of a compiled step, completed where its cost analysis cannot count.

XLA's CPU backend runs `jax.lax.linalg.triangular_solve` as a LAPACK custom call
(`lapack_strsm_ffi`), for which HloCostAnalysis reports -1 FLOPs and adds that -1 to the
step's total. `completed_flops` takes the reported total, removes each -1 and adds the
solve's closed form (`triangular_solve_flops`, read from the call's shapes in the compiled
HLO). The trainer's steps no longer contain such a solve (the chunked DeltaNet inverts its
system with matmuls, `hldstudy.model.deltanet.unit_lower_inverse`, which XLA counts), so
there this is a no-op kept as a guard: a solve in a probed step (e.g. SparseGPT's
`solve_triangular`, were it ever probed) is counted rather than read as -1. Pure text
parsing of `compiled.as_text()`: nothing here compiles or imports the trainer.
"""

from __future__ import annotations

import math
import re

__all__ = ["KEEP_LOOPS", "completed_flops", "triangular_solve_flops", "triangular_solves"]


def triangular_solve_flops(n: int, columns: int, batch: int = 1) -> float:
    """A unit-diagonal triangular solve of an n x n system for `columns` right-hand sides:
    n(n-1)/2 multiply-adds per column."""
    return float(batch) * n * (n - 1) * columns


# Compiler options for a count: XLA's while-loop simplifier inlines a loop of one trip and
# then drops what only the loop's final carry needed (the DeltaNet chunk scan's last state
# update, and in the backward what that update's zero cotangent feeds), which it cannot do
# for two or more trips. Keeping the loop makes a one-chunk count the exact body that every
# chunk of a longer sequence runs (HloCostAnalysis counts a loop body once).
KEEP_LOOPS = {"xla_disable_hlo_passes": "simplify-while-loops"}

_SOLVE = re.compile(
    r"=\s*(?P<dtype>[a-z0-9]+)\[(?P<dims>[0-9,]*)\][^=]*?custom-call\((?P<operands>[^)]*)\)"
    r".*custom_call_target=\"lapack_[sdcz]trsm_ffi\".*?"
    r"backend_config=\{(?P<config>[^}]*)\}")
_CONFIG = re.compile(r"(\w+)\s*=\s*(\d+)")


def triangular_solves(hlo_text: str) -> list[float]:
    """FLOPs of each LAPACK triangular-solve custom call in the HLO text, by its closed
    form: the output holds the right-hand sides [..., m, n]; the system is m x m for a
    left-side solve ('L'), n x n for a right-side one; a non-unit diagonal adds one
    division per entry of the output."""
    out = []
    for line in hlo_text.splitlines():
        hit = _SOLVE.search(line)
        if not hit:
            continue
        dims = [int(x) for x in hit["dims"].split(",") if x]
        config = {k: chr(int(v)) for k, v in _CONFIG.findall(hit["config"])}
        *batch_dims, m, n = dims
        batch = math.prod(batch_dims)
        flops = (triangular_solve_flops(m, n, batch) if config.get("side", "L") == "L"
                 else triangular_solve_flops(n, m, batch))
        if config.get("diag", "U") != "U":
            flops += batch * m * n
        out.append(flops)
    return out


def completed_flops(reported_flops: float, hlo_text: str) -> float:
    """XLA's reported FLOPs with every triangular solve's -1 replaced by its closed form."""
    solves = triangular_solves(hlo_text)
    return float(reported_flops) + len(solves) + sum(solves)
