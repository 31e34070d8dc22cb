"""What decides a compiled program's figures, as a key a kept record is checked against:
the lowered program (its text: shapes, shardings, kernels, everything the code that built
it decided) and the versions of the tools that lowered and compiled it. A record whose
key differs from the program as this checkout and this host's tools build it is stale:
recompiled, or shown as stale, never read as current. The package's source hash says
when a record needs no lowering to be checked: the same code, command, experiment file
and tools lower the same program."""

from __future__ import annotations

import functools
import hashlib
from importlib import metadata
from pathlib import Path

# The distributions whose versions decide what a compile for a backend reports: JAX's
# lowering, XLA (jaxlib) and the target's compiler (libtpu; the CUDA plugin and its PJRT).
TOOLCHAINS = {"tpu": ("jax", "jaxlib", "libtpu"),
              "gpu": ("jax", "jaxlib", "jax-cuda12-plugin", "jax-cuda12-pjrt")}


def toolchain(backend: str) -> dict[str, str | None]:
    """{distribution: version, None where not installed} of `backend`'s tools here."""
    out = {}
    for name in TOOLCHAINS[backend]:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def program_sha256(lowered) -> str:
    """sha256 of a `jax.stages.Lowered` program's text (StableHLO with its shardings)."""
    return hashlib.sha256(lowered.as_text().encode()).hexdigest()


@functools.cache
def source_sha256() -> str:
    """sha256 of the hldstudy package's source (each .py file under it, by path): the code
    that lowers a program. A record compiled by the same source needs no lowering to be
    checked (minutes for a 35B GPU program: Mosaic kernels); another source's is lowered
    again and compared by its program's hash."""
    root = Path(__file__).resolve().parents[1]
    h = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        h.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


def stale_reason(record: dict, tools: dict[str, str | None],
                 program: str | None = None) -> str | None:
    """Why `record` is not the compile of the program as it is now (None: it is): compiled
    with other versions than `tools` has (this host's, `toolchain`; a tool absent here
    cannot say otherwise), or from another lowered
    program than `program` (its `program_sha256` now, where it was lowered to check)."""
    if "program_sha256" not in record or "toolchain" not in record:
        return "kept without its program's hash and tool versions"
    kept = record["toolchain"]
    # A tool this host lacks (no libtpu / CUDA plugin: it cannot compile for the target)
    # cannot contradict the record; a different installed version does.
    moved = [f"{k} {kept.get(k) or 'absent'} -> {v}"
             for k, v in tools.items() if v is not None and kept.get(k) != v]
    if moved:
        return "compiled with other tools (" + ", ".join(moved) + ")"
    if program is not None and program != record["program_sha256"]:
        return "the lowered program changed since it was compiled"
    return None


__all__ = ["TOOLCHAINS", "program_sha256", "source_sha256", "stale_reason", "toolchain"]
