"""The package's layering, read from the source (nothing imported): no import cycle
between files or between subpackages, library floors import only downward, and no
code outside distill/ names a method (the registry does)."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PKG = ROOT / "hldstudy"
METHOD_NAMES = {"baseline", "kd", "hldf", "hldc", "patient"}
# (importer, imported): library floors that must not import the ones above them.
FORBIDDEN = [(a, b) for a in ("losses", "model")
             for b in ("train", "distill", "teacher", "sweep", "eval", "analysis", "compress")]
FORBIDDEN += [("flops", "train"), ("budget", "train"), ("analysis", "train"), ("data", "model"),
              ("distill", "config"), ("shapes", "model")]


def _modules() -> dict[str, Path]:
    out = {}
    for f in PKG.rglob("*.py"):
        parts = f.relative_to(ROOT).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    return out


def _entry(mod: str) -> bool:  # command-line entry points may import anything
    return mod.endswith(".__main__") or mod == "hldstudy.cli"


def _imports(mod: str, f: Path, mods: dict) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(f.read_text())):  # function-level imports count too
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                here = mod.split(".") if f.name == "__init__.py" else mod.split(".")[:-1]
                here = here[:len(here) - node.level + 1]
                base = ".".join(here + ([node.module] if node.module else []))
            names = [base] + [f"{base}.{a.name}" for a in node.names]
        for name in names:
            while name and name not in mods:
                name = name.rpartition(".")[0]
            if name and name != mod and not (f.name == "__init__.py"
                                             and name.startswith(mod + ".")):
                out.add(name)
    return out


def _package(mod: str) -> str:
    parts = mod.split(".")
    return parts[1] if len(parts) > 1 else "__root__"


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(10_000)
    for v in list(graph):
        if v not in index:
            visit(v)
    return out


def test_no_cycles_and_only_downward_imports():
    mods = _modules()
    edges = {m: _imports(m, f, mods) for m, f in mods.items()}
    assert _cycles(edges) == []
    packages: dict[str, set[str]] = {}
    for m, deps in edges.items():
        if _entry(m):
            continue
        for d in deps:
            if _package(m) != _package(d):
                packages.setdefault(_package(m), set()).add(_package(d))
    assert _cycles(packages) == []
    assert [f"{a}->{b}" for a, b in FORBIDDEN if b in packages.get(a, ())] == []


def test_method_names_live_in_distill():
    found = {}
    for mod, f in _modules().items():
        if _package(mod) == "distill":
            continue
        tree = ast.parse(f.read_text())
        docs = {id(n.body[0].value) for n in ast.walk(tree)
                if isinstance(n, (ast.Module, ast.FunctionDef, ast.ClassDef,
                                  ast.AsyncFunctionDef))
                and n.body and isinstance(n.body[0], ast.Expr)
                and isinstance(n.body[0].value, ast.Constant)}
        n = sum(1 for c in ast.walk(tree) if isinstance(c, ast.Constant)
                and c.value in METHOD_NAMES and id(c) not in docs)
        if n:
            found[mod] = n
    # A demonstration may name the method it demonstrates; nothing compares names.
    assert sum(found.values()) <= 2, found


def test_shared_structure_tool_agrees():
    tool = ROOT.parent / "shared" / "tools" / "structure.py"
    if not tool.exists():
        pytest.skip("../shared/tools/structure.py is not beside this checkout "
                    "(the tests above check the same rules)")
    r = subprocess.run([sys.executable, str(tool), "hldstudy", "--strict"], cwd=ROOT,
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
