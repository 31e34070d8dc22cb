"""Two lm-eval tasks built from held-out text, in the schemas of the offline tasks that
`python -m hldstudy.eval --offline-data DIR` reads: a LAMBADA-shaped last-word cloze
(`lambada_openai.jsonl`) and a HellaSwag-shaped 4-way next-sentence choice
(`hellaswag.jsonl`). Deterministic: the same documents and seed give the same files.

Design notes: `docs/evaluation.md`, under this file's name.
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

from hldstudy.errors import InputError
from hldstudy.fileio import write_lines_atomic

ENDING_WORDS = (5, 40)  # a next sentence / distractor: between 5 and 40 words
PUNCT = ".,;:!?'\"()"


def held_out_documents(text: str, holdout: int) -> list[str]:
    docs = [" ".join(p.split()) for p in text.split("\n\n") if p.strip()]
    if len(docs) <= holdout:
        raise InputError(f"the text has {len(docs)} documents: none left before the "
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
            raise InputError(f"only {len(got)} {name} items qualify in the held-out documents "
                             f"({asked} asked for)")
    return cloze, choice


def write_tasks(out: str | Path, cloze: list[dict], choice: list[dict]) -> None:
    """The two task files into `out` (each written atomically)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for name, records in (("lambada_openai.jsonl", cloze), ("hellaswag.jsonl", choice)):
        write_lines_atomic(out / name, [json.dumps(r, ensure_ascii=False) for r in records])
