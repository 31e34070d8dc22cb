"""Files rewritten in place are written atomically: readers see the old file or the new
one, never a part, and a crash mid-write leaves the old one intact. Append-only JSONL
logs (metrics.jsonl, teacher_steps.log) are read tolerating a torn last line."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Any

from hldstudy.errors import warn


def write_json_atomic(path: str | Path, data: Any, *, indent: int | None = 2,
                      sort_keys: bool = False) -> None:
    """Writes `data` as JSON so that readers see the old file or the new one."""
    write_text_atomic(path, json.dumps(data, indent=indent, sort_keys=sort_keys) + "\n")


def write_text_atomic(path: str | Path, text: str) -> None:
    """Readers see the old file or the new one, never a part: a temporary file in the
    same directory, flushed to disk, then renamed over `path`."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        with open(tmp, "w") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def read_jsonl(path: Path, report: bool = True) -> list[tuple[str, dict]]:
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
    return [rec for _, rec in read_jsonl(Path(path), report)]


def write_lines_atomic(path: str | Path, lines: list[str]) -> None:
    """Replaces `path` with `lines` so that readers see the old file or the new one."""
    write_text_atomic(path, "".join(line + "\n" for line in lines))
