"""Which tasks exist, where their data comes from, and the lm-eval YAMLs that say so.

Design notes: `docs/evaluation.md`, under this file's name.
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path

from hldstudy.errors import InputError
from hldstudy.shipped import shipped_dir

# The top-level eval/ folder (it ships with the package, hldstudy.shipped): the override
# YAMLs, and a few hand-written items per paper task for smoke tests
# (`--offline-data` FIXTURES_DIR).
OVERRIDES_DIR = shipped_dir("eval") / "overrides"
FIXTURES_DIR = shipped_dir("eval") / "fixtures"
DATA_ENV = "HLDSTUDY_EVAL_DATA"

PAPER_TASKS = ("hellaswag", "piqa", "winogrande", "lambada_openai", "arc_easy", "wikitext")
SYNTHETIC_TASKS = {"synth_mc": "synthetic_hellaswag.jsonl", "synth_cloze": "synthetic_lambada.jsonl"}
CORPUS_TASKS = ("synthetic_ppl", "valid_ppl", "c4_ppl")
# Items generated for a synthetic task when no --limit is given.
SYNTHETIC_ITEMS = 1000

# Fields each offline file's records must have (what the built-in task's
# doc_to_text / doc_to_choice / process_docs read).
SCHEMAS: dict[str, tuple[str, ...]] = {
    "hellaswag": ("ctx_a", "ctx_b", "ctx", "activity_label", "endings", "label"),
    "piqa": ("goal", "sol1", "sol2", "label"),
    "winogrande": ("sentence", "option1", "option2", "answer"),
    "lambada_openai": ("text",),
    "arc_easy": ("id", "question", "choices", "answerKey"),
    "wikitext": ("page",),
}


def lm_eval_tasks_dir() -> Path:
    import lm_eval.tasks

    return Path(lm_eval.tasks.__file__).resolve().parent


def offline_tasks() -> list[str]:
    """Tasks with an override YAML (readable from local files)."""
    if not OVERRIDES_DIR.is_dir():
        raise InputError(f"{OVERRIDES_DIR} is missing (the override YAMLs ship with the package)")
    return sorted(p.stem for p in OVERRIDES_DIR.glob("*.yaml") if p.stem not in SYNTHETIC_TASKS)


def offline_file(task: str, data_dir: str | Path) -> Path:
    return Path(data_dir) / f"{task}.jsonl"


def resolve_offline_dir(offline_data: str | Path | None) -> Path | None:
    value = offline_data if offline_data is not None else os.environ.get(DATA_ENV) or None
    if value is None:
        return None
    path = Path(value).expanduser().absolute()
    if not path.is_dir():
        src = "--offline-data" if offline_data is not None else f"${DATA_ENV}"
        raise InputError(f"{src} {path} is not a directory")
    return path


def check_offline_file(task: str, data_dir: Path) -> Path:
    """The task's JSONL file, every line checked to be a JSON object carrying the
    schema's fields (before the model loads, so a bad line 5000 costs nothing)."""
    path = offline_file(task, data_dir)
    if not path.is_file():
        raise InputError(f"{path}: missing offline data for task {task!r} (expected the split "
                         f"the task evaluates as JSONL with fields "
                         f"{', '.join(SCHEMAS.get(task, ('...',)))}; see eval/README.md)")
    fields = SCHEMAS.get(task, ())
    records = 0
    try:
        with path.open(encoding="utf-8") as fh:
            for lineno, line in enumerate(fh, 1):
                if not line.strip():
                    continue  # blank lines carry no record (the json builder skips them)
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError as e:
                    raise InputError(f"{path}:{lineno}: not JSON ({e.msg}, column {e.colno}); "
                                     "fix or remove that line") from None
                if not isinstance(rec, dict):
                    raise InputError(f"{path}:{lineno}: expected a JSON object per line, got "
                                     f"{type(rec).__name__}")
                missing = [f for f in fields if f not in rec]
                if missing:
                    raise InputError(f"{path}:{lineno}: record lacks {', '.join(missing)} "
                                     f"(schema of {task}: {', '.join(fields)}; "
                                     "see eval/README.md)")
                records += 1
    except UnicodeDecodeError as e:
        raise InputError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    except OSError as e:
        raise InputError(f"{path}: cannot be read ({e.strerror})") from None
    if not records:
        raise InputError(f"{path}: no records (one JSON object per line, fields "
                         f"{', '.join(fields) or '...'})")
    return path


def render_yaml(task: str, out_dir: Path, *, data_dir: Path | None = None,
                synth_dir: Path | None = None) -> Path:
    """Writes out_dir/<task>.yaml from OVERRIDES_DIR/<task>.yaml."""
    src = OVERRIDES_DIR / f"{task}.yaml"
    if not src.is_file():
        raise InputError(f"{src}: no override YAML for task {task!r}")
    text = src.read_text().replace("@LM_EVAL_TASKS@", lm_eval_tasks_dir().as_posix())
    text = text.replace("@CACHE_DIR@", (out_dir / "hf_cache").absolute().as_posix())
    if data_dir is not None:
        text = text.replace("@DATA_DIR@", Path(data_dir).absolute().as_posix())
    if synth_dir is not None:
        text = text.replace("@SYNTH_DIR@", Path(synth_dir).absolute().as_posix())
    if "@" in "".join(line for line in text.splitlines() if not line.lstrip().startswith("#")):
        raise InputError(f"{src}: unresolved placeholder for task {task!r}")
    out_dir.mkdir(parents=True, exist_ok=True)
    dst = out_dir / f"{task}.yaml"
    dst.write_text(text)
    return dst


def write_synthetic_data(synth_dir: Path, n: int, seed: int) -> dict[str, str]:
    """synthetic_hellaswag.jsonl and synthetic_lambada.jsonl with n items each."""
    from hldstudy.data.synthetic import save_eval_tasks

    return save_eval_tasks(synth_dir, n_multiple_choice=n, n_cloze=n, seed=seed)


@functools.lru_cache(maxsize=1)
def builtin_task_names() -> frozenset[str]:
    """Every name lm-eval's default TaskManager knows (slow: scans ~15k YAMLs)."""
    from lm_eval.tasks import TaskManager

    return frozenset(TaskManager().all_tasks)


def classify(tasks: list[str], offline_dir: Path | None) -> tuple[list[str], list[str]]:
    """(lm-eval task names, corpus task names); InputError for unknown names and
    missing offline files. Built-in names are checked against lm-eval's index only
    when they are not ours (without offline data)."""
    lm, corpus, unknown = [], [], []
    local = set(offline_tasks())
    for t in tasks:
        if t in CORPUS_TASKS:
            corpus.append(t)
        elif t in SYNTHETIC_TASKS:
            lm.append(t)
        elif offline_dir is not None:
            if t not in local:
                unknown.append(t)
            else:
                lm.append(t)
        else:
            lm.append(t)
    if offline_dir is None:
        to_check = [t for t in lm if t not in SYNTHETIC_TASKS and t not in local]
        if to_check:
            known = builtin_task_names()
            unknown += [t for t in to_check if t not in known]
    if unknown:
        choices = sorted(local) + sorted(SYNTHETIC_TASKS) + list(CORPUS_TASKS)
        where = (f": no eval/overrides/<task>.yaml to read it offline (offline tasks: "
                 f"{', '.join(choices)})"
                 if offline_dir is not None else
                 f" (ours: {', '.join(choices)}; or any lm-eval task name)")
        raise InputError(f"--tasks: unknown task {', '.join(map(repr, unknown))}{where}")
    if offline_dir is not None:
        for t in lm:
            if t not in SYNTHETIC_TASKS:
                check_offline_file(t, offline_dir)
    return lm, corpus


def prepare_task_dir(lm_tasks: list[str], out_dir: Path, *, offline_dir: Path | None,
                     limit: int | None, synthetic_seed: int = 0) -> bool:
    """Renders the YAMLs (and synthetic data) the lm-eval tasks need into out_dir.

    Returns whether lm-eval's built-in tasks must be indexed too (a task read
    from the hub).
    """
    needs_builtin = False
    synth = [t for t in lm_tasks if t in SYNTHETIC_TASKS]
    if synth:
        synth_dir = out_dir / "synthetic"
        write_synthetic_data(synth_dir, int(limit) if limit else SYNTHETIC_ITEMS, synthetic_seed)
        for t in synth:
            render_yaml(t, out_dir, synth_dir=synth_dir)
    for t in lm_tasks:
        if t in SYNTHETIC_TASKS:
            continue
        if offline_dir is not None:
            render_yaml(t, out_dir, data_dir=offline_dir)
        else:
            needs_builtin = True
    return needs_builtin
