"""Many checkpoints in one process: `evaluate_checkpoints(paths, tasks)`.

Design notes: `docs/evaluation.md`, under this file's name.
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import Any

from hldstudy import rundir
from hldstudy.errors import InputError, warn
from hldstudy.fileio import write_json_atomic, write_text_atomic


@dataclasses.dataclass(frozen=True)
class CheckpointTable:
    """One row per checkpoint: label, checkpoint, seconds, compiled_scorers, results."""

    rows: list[dict[str, Any]]

    def markdown(self) -> str:
        cols: list[tuple[str, str]] = []
        for row in self.rows:
            for task, metrics in row["results"].items():
                for name in metrics:
                    if not name.endswith("_stderr") and (task, name) not in cols:
                        cols.append((task, name))
        head = ["checkpoint", "seconds", "scorers compiled"] + [f"{t} {m}" for t, m in cols]
        lines = ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]
        for row in self.rows:
            vals = [row["results"].get(t, {}).get(m) for t, m in cols]
            label = row["label"] + (" (failed: see table.json)" if "error" in row else "")
            cells = [label, f"{row['seconds']:.2f}", str(row["compiled_scorers"])]
            cells += ["" if v is None else f"{v:.4f}" for v in vals]
            lines.append("| " + " | ".join(cells) + " |")
        return "\n".join(lines) + "\n"


def _is_hf_dir(path: Path) -> bool:
    try:
        return "model_type" in json.loads((path / "config.json").read_text())
    except (OSError, ValueError, TypeError):
        return False


def expand_checkpoints(paths: list[str | Path]) -> list[Path]:
    """The checkpoints behind `paths` (folders of runs expanded), checked, no duplicates."""
    from hldstudy.model.loading import model_config_of

    if not paths:
        raise InputError("--checkpoints: no checkpoint given")
    out: list[Path] = []
    for given in paths:
        p = Path(given)
        if not p.exists():
            raise InputError(f"--checkpoints: {p} does not exist")
        if p.is_dir() and not rundir.is_run_dir(p) and not _is_hf_dir(p):
            if rundir.has_run_files(p):
                raise InputError(f"--checkpoints: {p} is a run without a checkpoint "
                                 f"(no {rundir.CHECKPOINTS_DIR}/)")
            found = sorted(c for c in p.iterdir() if c.is_dir() and rundir.is_run_dir(c))
            if not found:
                raise InputError(f"--checkpoints: {p} is neither a checkpoint (run directory, "
                                 "GGUF file, Hugging Face directory) nor a folder of runs with "
                                 "checkpoints")
        else:
            found = [p]
        for c in found:
            model_config_of(c)  # a file that is no checkpoint fails here, before any loading
            if c.resolve() not in {o.resolve() for o in out}:
                out.append(c)
    return out


def checkpoint_labels(checkpoints: list[Path]) -> list[str]:
    """Names for the table and output folders: the file or folder name, made unique."""
    labels: list[str] = []
    for c in checkpoints:
        base = c.stem if c.is_file() else c.name
        label, k = base, 2
        while label in labels:
            label, k = f"{base}-{k}", k + 1
        labels.append(label)
    return labels


def evaluate_checkpoints(paths: list[str | Path], tasks: list[str] | str, *,
                         out_dir: str | Path | None = None, **evaluate_kwargs) -> CheckpointTable:
    """Evaluates every checkpoint behind `paths` on `tasks` in this process (keyword
    arguments as `runner.evaluate`); returns the table, written to `out_dir` if given. A
    checkpoint that cannot be evaluated is reported and skipped (its row has `error`)."""
    from hldstudy.eval.adapter import compiled_scorers
    from hldstudy.eval.runner import evaluate, parse_tasks

    names = parse_tasks(tasks)
    checkpoints = expand_checkpoints(list(paths))
    rows = []
    for ckpt, label in zip(checkpoints, checkpoint_labels(checkpoints), strict=True):
        if out_dir is not None:
            out = Path(out_dir) / label / "results.json"
        elif rundir.is_run_dir(ckpt):
            out = ckpt / "eval" / "results.json"
        else:
            out = None
        before, t0 = compiled_scorers(), time.perf_counter()
        row = {"label": label, "checkpoint": str(ckpt)}
        try:
            results = evaluate(ckpt, names, out=out, **evaluate_kwargs)
        except Exception as e:  # noqa: BLE001 - one damaged entry must not stop the others
            why = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
            warn(f"{label} ({ckpt}) could not be evaluated: {why}; going on with the others",
                 "hldstudy.eval")
            row.update(error=why, results={}, results_file=None)
        else:
            row.update(results=results, results_file=None if out is None else str(out))
        rows.append({**row, "seconds": round(time.perf_counter() - t0, 3),
                     "compiled_scorers": compiled_scorers() - before})
    table = CheckpointTable(rows)
    if out_dir is not None:
        write_json_atomic(Path(out_dir) / "table.json", {"tasks": names, "rows": rows})
        write_text_atomic(Path(out_dir) / "table.md", f"# Evaluation of {len(rows)} "
                          f"checkpoints\n\n{table.markdown()}")
    return table
