"""XLA's FLOP count of a compiled step, completed where its cost analysis cannot count.

XLA's CPU backend runs `jax.lax.linalg.triangular_solve` (the chunked DeltaNet's solve,
forward and backward) as a LAPACK custom call (`lapack_strsm_ffi`), for which
HloCostAnalysis reports -1 FLOPs and adds that -1 to the step's total. `completed_flops`
takes the reported total, removes each -1 and adds the solve's closed form
(`hldstudy.flops.layers_qwen.triangular_solve_flops`, read from the call's shapes in the
compiled HLO), so the count compares with the hardware estimate. Pure text parsing of
`compiled.as_text()`: nothing here compiles or imports the trainer.
"""

from __future__ import annotations

import math
import re

from hldstudy.flops.layers_qwen import triangular_solve_flops

__all__ = ["KEEP_LOOPS", "completed_flops", "triangular_solves"]

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
