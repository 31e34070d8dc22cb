"""Metrics sinks: JSONL in the run directory, and W&B (offline unless WANDB_MODE says otherwise).

metrics.jsonl is append-only while a run trains (one line per record, flushed);
a crash can leave its last line torn. On resume the file is rewritten without the
records past the resumed step, atomically (temporary file, fsync, rename), and a
line that is not JSON is dropped with a warning naming the file and line instead
of blocking the resume (`read_records` reads it the same way for anyone else).
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

from hldstudy.config import Config, config_to_dict
from hldstudy.errors import warn


def _read_lines(path: Path, report: bool) -> list[tuple[str, dict]]:
    """(line, record) for every line of a JSONL file that holds a JSON object."""
    try:
        text = path.read_bytes().decode("utf-8", errors="replace")
    except FileNotFoundError:
        return []
    out, bad = [], []
    lines = text.splitlines()
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except ValueError:
            rec = None
        if isinstance(rec, dict):
            out.append((line, rec))
        else:
            bad.append(i)
    if bad and report:
        torn = bad == [len(lines)] and not text.endswith("\n")
        what = (f"its last line ({bad[0]}) is torn (a crash mid-write?)" if torn else
                f"line(s) {', '.join(map(str, bad[:5]))}{' ...' if len(bad) > 5 else ''} "
                "are not JSON records")
        warn(f"{path}: {what}; skipped")
    return out


def read_records(path: str | Path, *, report: bool = True) -> list[dict]:
    """The JSON records of a JSONL file; a line that does not parse (a torn last line
    after a crash, a damaged one elsewhere) is skipped with one warning naming the file
    and line. An empty or missing file has no records."""
    return [rec for _, rec in _read_lines(Path(path), report)]


def write_lines_atomic(path: str | Path, lines: list[str]) -> None:
    """Replaces `path` with `lines` so that readers see the old file or the new one."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        with open(tmp, "w") as fh:
            fh.writelines(line + "\n" for line in lines)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


class MetricsLogger:
    def __init__(self, workdir: Path, cfg: Config, resume_step: int = 0):
        self.path = Path(workdir) / "metrics.jsonl"
        self._truncate_after(resume_step)
        self._file = open(self.path, "a")
        self._wandb = None
        if cfg.wandb.enabled and os.environ.get("WANDB_MODE", cfg.wandb.mode) != "disabled":
            import wandb

            self._wandb = wandb.init(
                project=cfg.wandb.project, entity=cfg.wandb.entity, group=cfg.wandb.group,
                name=cfg.name, dir=str(workdir), config=config_to_dict(cfg),
                mode=os.environ.get("WANDB_MODE", cfg.wandb.mode), resume="allow",
                id=_stable_run_id(workdir))

    def _truncate_after(self, step: int) -> None:
        # A run that crashed after its last checkpoint logged steps that the
        # resumed run will log again; keep each step once. A torn last line (the
        # crash hit mid-write) is dropped, reported, never fatal.
        if not self.path.exists():
            return
        kept = [line for line, rec in _read_lines(self.path, report=True)
                if _step_of(rec) <= step]
        write_lines_atomic(self.path, kept)

    def log(self, record: dict) -> None:
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if self._wandb is not None:
            self._wandb.log({k: v for k, v in record.items() if k != "step"}, step=record["step"])

    def summary(self, values: dict) -> None:
        if self._wandb is not None:
            self._wandb.summary.update(values)

    def close(self) -> None:
        self._file.close()
        if self._wandb is not None:
            self._wandb.finish()


def _step_of(rec: dict) -> float:
    try:
        return float(rec.get("step", 0))
    except (TypeError, ValueError):
        return 0.0


def _stable_run_id(workdir: Path) -> str:
    import hashlib

    return hashlib.sha1(str(Path(workdir).absolute()).encode()).hexdigest()[:12]
