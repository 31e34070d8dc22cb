"""What decides a compiled program's figures, as a key a kept record is checked against:
the lowered program (its text: shapes, shardings, kernels, everything the code that built
it decided) and the versions of the tools that lowered and compiled it. A record whose
key differs from the program as this checkout and this host's tools build it is stale:
recompiled, or shown as stale, never read as current. The hash of the source that lowers
programs says when a record needs no lowering to be checked: the same code, command,
experiment file and tools lower the same program."""

from __future__ import annotations

import ast
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


def lowering_sources(root: Path) -> list[Path]:
    """The package's files that can shape a program `python -m hldstudy.aot` lowers: the
    closure of `hldstudy.aot`'s imports, read from the source (imports inside functions
    included), and of the modules a string names ("hldstudy.distill.x:Class" strategies
    are imported by name). Files outside it (the map's page, analysis, commands) cannot
    change a lowered program, so editing them leaves every record current."""
    package = root.name
    files = {".".join(f.relative_to(root.parent).with_suffix("").parts).removesuffix(
        ".__init__"): f for f in root.rglob("*.py")}

    def known(name: str) -> str | None:
        while name and name not in files:
            name = name.rpartition(".")[0]
        return name or None

    seen, todo = set(), [m for m in files if m == f"{package}.aot" or
                         m.startswith(f"{package}.aot.")]
    while todo:
        mod = todo.pop()
        if mod in seen:
            continue
        seen.add(mod)
        parts = mod.split(".") if files[mod].name == "__init__.py" else mod.split(".")[:-1]
        for node in ast.walk(ast.parse(files[mod].read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = ".".join(parts[:len(parts) - node.level + 1]) if node.level else ""
                stem = ".".join(x for x in (base, node.module or "") if x)
                names = [stem] + [f"{stem}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and \
                    node.value.startswith(package + "."):
                names = [node.value.partition(":")[0]]
            for name in names:
                if name.split(".")[0] == package and (hit := known(name)):
                    todo.extend(m for m in (hit, *_parents(hit)) if m not in seen)
    return sorted(files[m] for m in seen)


def _parents(mod: str) -> list[str]:
    """A module's packages: importing it runs each one's __init__."""
    parts = mod.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


@functools.cache
def source_sha256(root: Path | None = None) -> str:
    """sha256 of the source that lowers a program (`lowering_sources`, each file by path).
    A record compiled by the same source needs no lowering to be checked (minutes for a
    35B GPU program: Mosaic kernels); another source's is lowered again and compared by
    its program's hash. `root`: the package's folder (this one's by default)."""
    root = root or Path(__file__).resolve().parents[1]
    h = hashlib.sha256()
    for path in lowering_sources(root):
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


__all__ = ["TOOLCHAINS", "lowering_sources", "program_sha256", "source_sha256", "stale_reason", "toolchain"]
