"""The worked example's task scores: two lm-eval tasks built from the held-out World
English Bible documents (`hldstudy.eval.web_tasks` builds them; this is its command line).

    python analysis/compression/web_tasks.py --text DIR --out DIR [--holdout 500]
        [--cloze-items N] [--choice-items N] [--seed 0]

Reads web_corpus.py's `web.txt` (documents are blank-line separated, as the compress
pipeline reads them) and takes its last `--holdout` documents: the ones the pipeline
holds out for perplexity, so no task item was seen in calibration or recovery.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from hldstudy.eval.web_tasks import build, held_out_documents, write_tasks


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--text", required=True, help="folder of web_corpus.py's web.txt")
    p.add_argument("--out", required=True)
    p.add_argument("--holdout", type=int, default=500,
                   help="the pipeline's calibration_holdout_docs")
    p.add_argument("--cloze-items", type=int, default=200)
    p.add_argument("--choice-items", type=int, default=200)
    p.add_argument("--cloze-words", type=int, default=40)
    p.add_argument("--choice-words", type=int, default=15)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    docs = held_out_documents((Path(args.text) / "web.txt").read_text(), args.holdout)
    cloze, choice = build(docs, cloze_items=args.cloze_items, choice_items=args.choice_items,
                          cloze_words=args.cloze_words, choice_words=args.choice_words,
                          seed=args.seed)
    write_tasks(args.out, cloze, choice)
    print(f"{len(cloze)} cloze items, {len(choice)} 4-way choice items from the last "
          f"{len(docs)} documents -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
