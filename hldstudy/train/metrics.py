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
from pathlib import Path

from hldstudy.config import Config, config_to_dict
from hldstudy.fileio import read_jsonl, read_records, write_lines_atomic  # noqa: F401


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
        kept = [line for line, rec in read_jsonl(self.path, report=True)
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
