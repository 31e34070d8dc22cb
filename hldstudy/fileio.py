"""Files rewritten in place are written atomically: readers see the old file or the new
one, never a part, and a crash mid-write leaves the old one intact."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Any


def write_json_atomic(path: str | Path, data: Any, *, indent: int | None = 2,
                      sort_keys: bool = False) -> None:
    """Writes `data` as JSON so that readers see the old file or the new one, never a part:
    a temporary file in the same directory, flushed to disk, then renamed over `path`."""
    path = Path(path)
    text = json.dumps(data, indent=indent, sort_keys=sort_keys) + "\n"
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
