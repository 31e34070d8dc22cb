"""What a run directory is, and how its files are read and written (no jax).

Design notes: `docs/infrastructure.md`, under this file's name.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

from hldstudy import distributed, runlock
from hldstudy.config import Config, save_config
from hldstudy.config import read_config as _read_config_file
from hldstudy.fileio import write_json_atomic  # noqa: F401  (run files are written with it)

CONFIG_FILE = "config.json"
RESULTS_FILE = "results.json"
CHECKPOINTS_DIR = "checkpoints"
ERROR_FILE = "error.txt"
TOKENIZER_FILE = "tokenizer.model"
LOCK_FILE = "run.lock"


def is_run_dir(path: str | Path) -> bool:
    """A run that has started training: config.json and checkpoints/ (what can be loaded)."""
    path = Path(path)
    return path.is_dir() and (path / CONFIG_FILE).is_file() and (path / CHECKPOINTS_DIR).is_dir()


def has_run_files(path: str | Path) -> bool:
    """A run in any state (configured, failed, finished): config.json or results.json."""
    path = Path(path)
    return path.is_dir() and ((path / CONFIG_FILE).is_file() or (path / RESULTS_FILE).is_file())


def read_config(run_dir: str | Path) -> Config:
    """The run's resolved config (InputError when it has none)."""
    return _read_config_file(Path(run_dir) / CONFIG_FILE)


def read_results(run_dir: str | Path) -> dict | None:
    """results.json, or None when the run has not finished (or the file is unreadable)."""
    path = Path(run_dir) / RESULTS_FILE
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def checkpoint_steps(run_dir: str | Path) -> list[int]:
    """Steps of the saved checkpoints, ascending ([] when none)."""
    ck = Path(run_dir) / CHECKPOINTS_DIR
    if not ck.is_dir():
        return []
    return sorted(int(p.name) for p in ck.iterdir() if p.is_dir() and p.name.isdigit())


def status(run_dir: str | Path, eval_tasks: tuple[str, ...] = ()) -> str:
    """done | trained (evaluations in `eval_tasks` missing) | partial (has a checkpoint)
    | failed (error.txt) | new."""
    run_dir = Path(run_dir)
    res = read_results(run_dir) if (run_dir / RESULTS_FILE).exists() else None
    if res is not None and res.get("status") == "done":
        ev = res.get("eval") or {}
        return "done" if all(t in ev for t in eval_tasks) else "trained"
    if checkpoint_steps(run_dir):
        return "partial"
    if (run_dir / ERROR_FILE).exists():
        return "failed"
    return "new"


def tokenizer_path(run_dir: str | Path, cfg: Config | None = None) -> Path | None:
    """The tokenizer file a run trained with, if it is still there: `data.tokenizer` when
    the config sets it, else the run's own tokenizer.model."""
    run_dir = Path(run_dir)
    cfg = cfg if cfg is not None else read_config(run_dir)
    for path in tokenizer_candidates(run_dir, cfg):
        if path.is_file():
            return path
    return None


def tokenizer_candidates(run_dir: str | Path, cfg: Config) -> list[Path]:
    """Where a run's tokenizer is looked for, in order (for error messages)."""
    out = [Path(cfg.data.tokenizer)] if cfg.data.tokenizer else []
    return out + [Path(run_dir) / TOKENIZER_FILE]


def write_config(run_dir: str | Path, cfg: Config) -> None:
    """Writes the run's config.json (atomically, with its schema version)."""
    save_config(cfg, Path(run_dir) / CONFIG_FILE)


@contextlib.contextmanager
def owned(run_dir: str | Path, prog: str = "hldstudy"):
    """The run directory owned by this process while the block runs: made if needed, then
    locked (run.lock) before anything else is written there, released on every exit.
    A directory held by another live job raises `runlock.LockHeld` (exit code 2) naming
    it; a lock left by a dead process on this host is taken over with a warning."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    with runlock.held(run_dir / LOCK_FILE, f"the run directory {run_dir}", prog):
        yield run_dir


@contextlib.contextmanager
def job_owns(run_dir: str | Path, prog: str = "hldstudy"):
    """The job (joined first, when multi-process) owns `run_dir` while the block runs:
    process 0 holds its lock (`owned`); the other processes of the job write their
    checkpoint shards there under it, and share process 0's outcome."""
    distributed.initialize()
    with distributed.primary_decides(f"lock:{Path(run_dir).absolute()}",
                                     lambda: owned(run_dir, prog)):
        yield Path(run_dir)
