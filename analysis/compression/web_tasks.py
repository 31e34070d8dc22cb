"""The worked example's task scores: two lm-eval tasks built from the held-out World
English Bible documents (no real benchmark data is on this machine: no hub access).

    python analysis/compression/web_tasks.py --text DIR --out DIR [--holdout 500]
        [--cloze-items N] [--choice-items N] [--seed 0]

Reads web_corpus.py's `web.txt` (documents are blank-line separated, as the compress
pipeline reads them) and takes its last `--holdout` documents: the ones the pipeline
holds out for perplexity, so no task item was seen in calibration or recovery. Writes,
in the schemas of the lm-eval tasks that `python -m hldstudy.eval --offline-data DIR`
reads (eval/overrides: lm-eval's own task definitions and metrics over local JSONL):

* `lambada_openai.jsonl` (a LAMBADA-shaped last-word cloze): the trailing sentences of
  a document (at least `--cloze-words` words), its final punctuation dropped; lm-eval
  scores the last word (" word") given the rest: acc (greedy match) and perplexity.
* `hellaswag.jsonl` (a HellaSwag-shaped 4-way next-sentence choice): a document's first
  sentences (at least `--choice-words` words) as the context, its next sentence as the
  true ending and 3 sentences of other held-out documents as the distractors, at a
  seeded position: acc and acc_norm (length-normalized).

Deterministic: the same text and seed give the same files, byte for byte. The items
are the first documents (in text order) that qualify; a document gives at most one
item per task.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
from pathlib import Path

ENDING_WORDS = (5, 40)  # a next sentence / distractor: between 5 and 40 words
PUNCT = ".,;:!?'\"()"


def held_out_documents(text: str, holdout: int) -> list[str]:
    docs = [" ".join(p.split()) for p in text.split("\n\n") if p.strip()]
    if len(docs) <= holdout:
        raise SystemExit(f"the text has {len(docs)} documents: none left before the "
                         f"{holdout} held out")
    return docs[-holdout:]


def sentences(doc: str) -> list[str]:
    return [s for s in re.split(r"(?<=[.!?])\s+", doc) if s]


def cloze_item(doc: str, min_words: int) -> dict | None:
    """{"text"} ending in an alphabetic last word, or None where the document has none."""
    sents = sentences(doc)
    kept: list[str] = []
    while sents and sum(len(s.split()) for s in kept) < min_words:
        kept.insert(0, sents.pop())
    words = " ".join(kept).split(" ")
    last = words[-1].rstrip(PUNCT)
    if len(words) < min_words or not last.isalpha() or len(last) < 2:
        return None
    return {"text": " ".join(words[:-1] + [last])}


def _ending_ok(s: str) -> bool:
    return ENDING_WORDS[0] <= len(s.split()) <= ENDING_WORDS[1] and "[" not in s and "]" not in s


def choice_item(doc: str, min_words: int, pool: list[str], rng: random.Random) -> dict | None:
    """A HellaSwag record (ctx_a = the context, endings, label), or None."""
    sents = sentences(doc)
    ctx: list[str] = []
    while sents and sum(len(s.split()) for s in ctx) < min_words:
        ctx.append(sents.pop(0))
    if not sents or not _ending_ok(sents[0]) or any(c in " ".join(ctx) for c in "[]"):
        return None
    true = sents[0]
    distractors: list[str] = []
    while len(distractors) < 3:
        s = rng.choice(pool)
        if s != true and s not in distractors:
            distractors.append(s)
    label = rng.randrange(4)
    endings = distractors[:label] + [true] + distractors[label:]
    context = " ".join(ctx)
    # hellaswag's process_docs builds "activity_label: ctx_a ctx_b.capitalize()", stripped:
    # ctx_b stays empty so the context keeps its own capitals.
    return {"ind": None, "activity_label": "Bible", "ctx_a": context, "ctx_b": "",
            "ctx": context, "endings": endings, "source_id": "web", "split": "val",
            "split_type": "indomain", "label": str(label)}


def build(docs: list[str], *, cloze_items: int, choice_items: int, cloze_words: int,
          choice_words: int, seed: int) -> tuple[list[dict], list[dict]]:
    cloze = [it for it in (cloze_item(d, cloze_words) for d in docs) if it][:cloze_items]
    rng = random.Random(seed)
    choice: list[dict] = []
    endings_of = [[s for s in sentences(d) if _ending_ok(s)] for d in docs]
    for i, doc in enumerate(docs):
        if len(choice) == choice_items:
            break
        # distractors come from the other held-out documents only
        pool = [s for j, ends in enumerate(endings_of) if j != i for s in ends]
        item = choice_item(doc, choice_words, pool, rng)
        if item:
            item["ind"] = i
            choice.append(item)
    for name, got, asked in (("cloze", cloze, cloze_items), ("choice", choice, choice_items)):
        if len(got) < asked:
            raise SystemExit(f"only {len(got)} {name} items qualify in the held-out documents "
                             f"({asked} asked for)")
    return cloze, choice


def write_jsonl(path: Path, records: list[dict]) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
    tmp.replace(path)


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
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_jsonl(out / "lambada_openai.jsonl", cloze)
    write_jsonl(out / "hellaswag.jsonl", choice)
    print(f"{len(cloze)} cloze items, {len(choice)} 4-way choice items from the last "
          f"{len(docs)} documents -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
