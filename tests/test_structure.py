"""The package's layering, read from the source (nothing imported): no import cycle
between files, every subpackage on a declared floor importing only floors below it,
every function-level import of an hldstudy module listed with its reason, and no code
outside distill/ naming a method (the registry does)."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PKG = ROOT / "hldstudy"
METHOD_NAMES = {"baseline", "kd", "hldf", "hldc", "patient"}

# The floors, bottom first: a package (subpackage or top-level module of hldstudy) imports
# only packages on floors below its own, never one beside it. The front door
# (`hldstudy/__main__.py`, `hldstudy/cli.py`) and the commands (`hldstudy/commands/`) are
# the top floor and may import anything; a subpackage's `__main__.py` is part of its
# package and held to its floor. A new package fails
# `test_packages_import_only_floors_below` until it is placed here.

def _parse(path: Path) -> ast.Module:
    # CPython 3.11's ast.parse can raise a spurious "AST constructor recursion depth
    # mismatch" SystemError (cpython gh-106905), seen once in a pytest-xdist worker: parse again.
    try:
        return ast.parse(path.read_text())
    except SystemError:
        return ast.parse(path.read_text())

FLOORS = (
    ("errors", "family", "mesh_axes", "numerics", "platforms", "shipped", "signals", "wandb_online"),  # import nothing of ours
    ("__root__", "checkpoint", "chips", "distributed", "fileio", "runlock", "teacher_source"),  # on errors / numerics only (the package's __init__: on platforms)
    ("losses",),  # loss math; its kernels sized from the chip table
    ("distill",),  # the method registry: declarations, no config
    ("config",),  # the schema, validated against the registry
    ("cli_common", "data", "rundir", "shapes", "sharding"),  # read a config
    ("flops", "model"),  # FLOP counting and stage budgets; the model
    ("analysis", "eval", "plan"),  # read results; use a model or its shapes
    ("teacher",),  # the teacher's forward and service; a replica sized by the planner
    ("train",),  # the trainer: teacher, model, data, stage budgets
    ("compress", "sweep"),  # drive the trainer
    ("aot",),  # compiles a run's (or a grid's) steps for a target: trainer, planner, sweep
    ("quickstart", "study"),  # the whole pipeline
    ("commands",),  # command lines that reach across floors (plan, flops)
)

# Every import of an hldstudy module inside a function, as "importer -> imported": each
# is a decision (a cycle broken, a heavy or optional dependency loaded late, or nothing
# yet), visible here. A new one fails `test_function_level_imports_are_listed` until it
# is listed with its reason or moved to the top of its module; a gone one must go too.
# Load times: measured on a 2-core CPU host, importer loaded first.
_MOVABLE = "no cycle, nothing new to load (its importer loads it already): could be module-level"
_CLI = "command line: flags are parsed and checked before the {} loads"
FUNCTION_LEVEL_IMPORTS = {
    "hldstudy.study.__main__ -> hldstudy.study.real_text":
        _CLI.format("study (JAX, the trainer, the sweep)"),
    "hldstudy.analysis -> hldstudy.analysis.report":
        "package export kept lazy: report imports the package back and loads matplotlib (~2 s)",
    "hldstudy.analysis.__main__ -> hldstudy.analysis.ablation":
        _CLI.format("ablation reading (pandas, the runs loader)"),
    "hldstudy.analysis.__main__ -> hldstudy.analysis.report":
        _CLI.format("report's matplotlib (~2 s)"),
    "hldstudy.compress.__main__ -> hldstudy.compress.config": _MOVABLE,
    "hldstudy.compress.__main__ -> hldstudy.compress.pipeline":
        _CLI.format("pipeline (jax, flax, gguf: ~4 s)"),
    "hldstudy.compress.config -> hldstudy.compress.layout":
        "keeps the compress config free of jax: validating a section loads none",
    "hldstudy.compress.config -> hldstudy.compress.prune":
        "keeps the compress config free of jax and flax: validating a section loads none",
    "hldstudy.compress.demo -> hldstudy.cli_common": _MOVABLE,
    "hldstudy.compress.demo -> hldstudy.compress.pipeline":
        "the pipeline (30 modules) only when the demo runs",
    "hldstudy.compress.demo -> hldstudy.errors": _MOVABLE,
    "hldstudy.compress.demo -> hldstudy.model.presets": _MOVABLE,
    "hldstudy.compress.demo -> hldstudy.train.loop":
        "the trainer only when a demo model is not trained yet",
    "hldstudy.compress.pipeline -> hldstudy.eval":
        "evaluation only when downstream tasks are asked for",
    "hldstudy.compress.pipeline -> hldstudy.eval.adapter":
        "lm-eval (an optional dependency) only when downstream tasks are asked for",
    "hldstudy.eval -> hldstudy.eval.adapter":
        "package export kept lazy (module __getattr__): lm-eval and the model (~9 s)",
    "hldstudy.eval -> hldstudy.eval.perplexity":
        "package export kept lazy (module __getattr__), like its siblings",
    "hldstudy.eval -> hldstudy.eval.runner":
        "package export kept lazy: runner imports the package back (file cycle)",
    "hldstudy.eval.__main__ -> hldstudy.eval.runner": _CLI.format("evaluator"),
    "hldstudy.eval.__main__ -> hldstudy.eval.multi": _CLI.format("many-checkpoint evaluator"),
    "hldstudy.eval.multi -> hldstudy.eval.adapter":
        "every checkpoint path is checked before jax, lm-eval and the model load (one line at once)",
    "hldstudy.eval.multi -> hldstudy.eval.runner":
        "every checkpoint path is checked before jax, lm-eval and the model load (one line at once)",
    "hldstudy.eval.multi -> hldstudy.model.loading":
        "every checkpoint path is checked before jax, lm-eval and the model load (one line at once)",
    "hldstudy.eval.perplexity -> hldstudy.data.pipeline":
        "the data pipeline (sentencepiece) only when a corpus is measured",
    "hldstudy.eval.runner -> hldstudy.eval.adapter":
        "lm-eval and the model (~7.5 s) only once task names and files are checked",
    "hldstudy.eval.runner -> hldstudy.eval.perplexity": "corpus tasks only (numpy, tqdm)",
    "hldstudy.eval.tasks -> hldstudy.data.synthetic":
        "synthetic data (sentencepiece) only when fixture files are written",
    "hldstudy.eval.testing -> hldstudy.checkpoint":
        "fixture builder: orbax and jax (~6 s) only when a checkpoint fixture is made",
    "hldstudy.eval.testing -> hldstudy.data.synthetic":
        "fixture builder: sentencepiece only when a fixture is made",
    "hldstudy.eval.testing -> hldstudy.data.tokenizer":
        "fixture builder: sentencepiece only when a fixture is made",
    "hldstudy.eval.testing -> hldstudy.model":
        "fixture builder: flax and the model (~6 s) only when a fixture is made",
    "hldstudy.commands.flops -> hldstudy.train.probe":
        "the XLA probe compiles the trainer's step: loaded only for --check-xla",
    "hldstudy.model.gguf_tokenizer -> hldstudy.data.tokenizer":
        "sentencepiece only when a GGUF file's tokenizer is built",
    "hldstudy.quickstart -> hldstudy.analysis":
        "front door: each stage loads what it runs (analysis: pandas, pyarrow)",
    "hldstudy.quickstart -> hldstudy.cli_common": _MOVABLE,
    "hldstudy.quickstart -> hldstudy.data": "front door: each stage loads what it runs",
    "hldstudy.quickstart -> hldstudy.errors": _MOVABLE,
    "hldstudy.quickstart -> hldstudy.rundir": "front door: each stage loads what it runs",
    "hldstudy.quickstart -> hldstudy.sweep.cohort_exec":
        "front door: each stage loads what it runs (cohort executor)",
    "hldstudy.quickstart -> hldstudy.sweep.executors":
        "front door: each stage loads what it runs (sweep executors)",
    "hldstudy.quickstart -> hldstudy.sweep.launch":
        "front door: each stage loads what it runs (sweep launch)",
    "hldstudy.quickstart -> hldstudy.sweep.spec":
        "front door: each stage loads what it runs (the grid)",
    "hldstudy.quickstart -> hldstudy.train.loop":
        "front door: each stage loads what it runs (the trainer, ~8 s)",
    "hldstudy.sweep.__main__ -> hldstudy.cli_common": _MOVABLE,
    "hldstudy.sweep.__main__ -> hldstudy.distill.methods": _MOVABLE,
    "hldstudy.sweep.__main__ -> hldstudy.model": "--cohort auto without a teacher checkpoint",
    "hldstudy.sweep.__main__ -> hldstudy.plan": "--cohort auto only (the planner's GB)",
    "hldstudy.sweep.__main__ -> hldstudy.sweep.cohort_exec": "--cohort only",
    "hldstudy.sweep.__main__ -> hldstudy.sweep.confirm": _MOVABLE,
    "hldstudy.sweep.__main__ -> hldstudy.sweep.cohorts": "--cohort auto only",
    "hldstudy.sweep.__main__ -> hldstudy.model.loading": _MOVABLE,
    "hldstudy.sweep.__main__ -> hldstudy.sweep.executors": _MOVABLE,
    "hldstudy.sweep.__main__ -> hldstudy.sweep.grid_exec": "--teacher-replicas only",
    "hldstudy.sweep.__main__ -> hldstudy.sweep.gridteach": "--teacher-replicas only",
    "hldstudy.sweep.__main__ -> hldstudy.sweep.launch": _MOVABLE,
    "hldstudy.sweep.__main__ -> hldstudy.sweep.spec": _MOVABLE,
    "hldstudy.sweep.__main__ -> hldstudy.train.program":
        "--cohort auto only: the cohort program's default mode (jax, ~1 s)",
    "hldstudy.sweep.__main__ -> hldstudy.train.loop":
        "--cohort auto only: the device's free memory (the trainer, ~1 s)",
    "hldstudy.sweep.cohort_exec -> hldstudy.sweep.executors": _MOVABLE,
    "hldstudy.sweep.confirm -> hldstudy.analysis.runs":
        "--confirm only, when the picks are chosen: the analysis (pandas) loads then",
    "hldstudy.sweep.confirm -> hldstudy.analysis.tables":
        "--confirm only, when the picks are chosen: the analysis (pandas) loads then",
    "hldstudy.sweep.cohort_exec -> hldstudy.sweep.worker": _MOVABLE,
    "hldstudy.sweep.cohort_exec -> hldstudy.train.cohort":
        "the trainer (~1 s) only in the process that trains, not in a dry run",
    "hldstudy.sweep.cohort_exec -> hldstudy.train.loop":
        "the trainer (~1 s) only in the process that trains, not in a dry run",
    "hldstudy.sweep.executors -> hldstudy.cli_common": _MOVABLE,
    "hldstudy.sweep.executors -> hldstudy.fileio": _MOVABLE,
    "hldstudy.sweep.executors -> hldstudy.sweep.worker": _MOVABLE,
    "hldstudy.sweep.executors -> hldstudy.train.loop":
        "the trainer (~1 s) only in the process that trains, not in a dry run",
    "hldstudy.sweep.launch -> hldstudy.sweep.spec": _MOVABLE,
    "hldstudy.sweep.worker -> hldstudy.analysis.runs":
        "pandas and pyarrow (~1 s) only when a finished run's identity is written",
    "hldstudy.sweep.worker -> hldstudy.data": _MOVABLE,
    "hldstudy.sweep.worker -> hldstudy.eval":
        "evaluation is optional: its ImportError is caught and recorded, not fatal",
    "hldstudy.sweep.worker -> hldstudy.teacher":
        "the teacher runtime (~1 s) only for a method that needs a teacher",
    "hldstudy.sweep.worker -> hldstudy.train.loop":
        "the trainer (~1 s) only when a run still has steps to train",
    "hldstudy.train.__main__ -> hldstudy.model.presets": _CLI.format("model"),
    "hldstudy.train.__main__ -> hldstudy.train.loop": _CLI.format("trainer (~8.6 s)"),
    "hldstudy.train.loop -> hldstudy.data": _MOVABLE,
}


def _modules() -> dict[str, Path]:
    out = {}
    for f in PKG.rglob("*.py"):
        parts = f.relative_to(ROOT).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    return out


def _entry(mod: str) -> bool:  # the front door may import anything
    return mod in ("hldstudy.__main__", "hldstudy.cli")


def _imported(mod: str, f: Path, node: ast.AST, mods: dict, own: bool) -> set[str]:
    """The hldstudy modules an import statement names (`from a.b import c`: a.b.c when it
    is a module, else a.b; never `mod` itself; a package's own submodules from its
    `__init__` only with `own`: they are what `from package import x` resolves to)."""
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        base = node.module or ""
        if node.level:
            here = mod.split(".") if f.name == "__init__.py" else mod.split(".")[:-1]
            here = here[:len(here) - node.level + 1]
            base = ".".join(here + ([node.module] if node.module else []))
        names = [f"{base}.{a.name}" for a in node.names]
    out = set()
    for name in names:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        if name and name != mod and (own or not (f.name == "__init__.py"
                                                 and name.startswith(mod + "."))):
            out.add(name)
    return out


def _imports(mod: str, f: Path, mods: dict, *, in_functions_only: bool = False) -> set[str]:
    """What `mod` imports, at module level and inside functions alike; or only inside
    functions, a package's `__init__` importing its own submodules included."""
    out = set()

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)) and (
                    in_function or not in_functions_only):
                out.update(_imported(mod, f, child, mods, own=in_functions_only))
            visit(child, in_function or isinstance(
                child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    visit(_parse(f), False)
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


def test_no_import_cycle_between_files():
    mods = _modules()
    assert _cycles({m: _imports(m, f, mods) for m, f in mods.items()}) == []


def test_packages_import_only_floors_below():
    mods = _modules()
    floor_of = {p: i for i, floor in enumerate(FLOORS) for p in floor}
    assert sum(len(floor) for floor in FLOORS) == len(floor_of), "a package on two floors"
    found = {_package(m) for m in mods if not _entry(m)}
    assert sorted(found - floor_of.keys()) == [], "packages on no floor: add them to FLOORS"
    assert sorted(floor_of.keys() - found) == [], "FLOORS names packages that are gone"
    upward = set()
    for m, f in mods.items():
        if _entry(m):
            continue
        for d in _imports(m, f, mods):
            a, b = _package(m), _package(d)
            if a != b and floor_of[b] >= floor_of[a]:
                upward.add(f"{m} -> {d} (floor {floor_of[a]} {a} imports floor "
                           f"{floor_of[b]} {b})")
    assert sorted(upward) == []


def test_function_level_imports_are_listed():
    mods = _modules()
    found = {f"{m} -> {d}" for m, f in mods.items()
             for d in _imports(m, f, mods, in_functions_only=True)}
    new = sorted(found - FUNCTION_LEVEL_IMPORTS.keys())
    gone = sorted(FUNCTION_LEVEL_IMPORTS.keys() - found)
    assert not new, (f"function-level imports not in FUNCTION_LEVEL_IMPORTS (move each to "
                     f"the top of its module, or list it with its reason): {new}")
    assert not gone, f"FUNCTION_LEVEL_IMPORTS lists imports that are gone (remove them): {gone}"
    assert all(r.strip() for r in FUNCTION_LEVEL_IMPORTS.values())


def test_method_names_live_in_distill():
    found = {}
    for mod, f in _modules().items():
        if _package(mod) == "distill":
            continue
        tree = _parse(f)
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
    r = subprocess.run([sys.executable, str(tool), "hldstudy", "--strict", "--mains"], cwd=ROOT,
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def _functions(tree: ast.Module):
    return [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]


def test_no_function_over_100_lines():
    long = [f"{f.relative_to(ROOT)}:{n.name} {n.end_lineno - n.lineno + 1}"
            for f in PKG.rglob("*.py") for n in _functions(_parse(f))
            if n.end_lineno - n.lineno + 1 > 100]
    assert long == [], "split these functions (design prose belongs in docs/)"


def test_module_docstrings_are_short():
    """At most 12 lines: the design prose of a module lives in docs/<subsystem>.md."""
    long = []
    for f in PKG.rglob("*.py"):
        body = _parse(f).body
        if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                and isinstance(body[0].value.value, str):
            n = body[0].end_lineno - body[0].lineno + 1
            if n > 12:
                long.append(f"{f.relative_to(ROOT)} {n}")
    assert long == []


def test_model_family_names_are_compared_in_the_registry_only():
    """hldstudy/family.py owns what differs between families; nothing else compares or
    spells a family's name (the config's default reads it from the registry)."""
    from hldstudy.family import FAMILIES

    found = []
    for f in PKG.rglob("*.py"):
        if f.name == "family.py" and f.parent == PKG:
            continue
        found += [f"{f.relative_to(ROOT)}:{c.lineno}" for c in ast.walk(_parse(f))
                  if isinstance(c, ast.Constant) and c.value in FAMILIES]
    assert found == []


def test_the_step_programs_are_built_in_one_place():
    """Only hldstudy/train/program.py calls make_train_step / make_cohort_step."""
    callers = set()
    for f in PKG.rglob("*.py"):
        for c in ast.walk(_parse(f)):
            if isinstance(c, ast.Call):
                name = getattr(c.func, "id", getattr(c.func, "attr", None))
                if name in ("make_train_step", "make_cohort_step"):
                    callers.add(str(f.relative_to(ROOT)))
    assert callers == {"hldstudy/train/program.py"}
