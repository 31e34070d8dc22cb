"""Document sources: synthetic, local text / jsonl files, TFDS (array_record), HF datasets.

Design notes: `docs/data.md`, under this file's name.
"""

from __future__ import annotations

import glob as globlib
import gzip
import hashlib
import itertools
import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from hldstudy.config import DataConfig
from hldstudy.data import synthetic
from hldstudy.errors import ConfigError, InputError

TEXT_EXTS = (".txt", ".txt.gz")
JSONL_EXTS = (".jsonl", ".json", ".jsonl.gz", ".json.gz")
HF_FILE_FORMATS = {".parquet": "parquet", ".jsonl": "json", ".json": "json", ".csv": "csv",
                   ".jsonl.gz": "json", ".json.gz": "json"}


def _has_glob(p: str) -> bool:
    return any(c in p for c in "*?[")


def _ends(p: Path | str, exts: tuple[str, ...]) -> bool:
    return str(p).endswith(exts)


def expand_paths(path: str | None, field: str, exts: tuple[str, ...]) -> list[Path]:
    """File / glob / directory -> sorted list of files. Raises InputError naming `field`."""
    if not path:
        raise ConfigError(field, "no path given", "pass --set " + field + "=/local/path")
    if _has_glob(path):
        files = sorted(Path(p) for p in globlib.glob(path, recursive=True) if Path(p).is_file())
        if not files:
            raise InputError(f"{field}: {path!r} matches no files")
        return files
    p = Path(path)
    if not p.exists():
        raise InputError(f"{field}: {path} does not exist (nothing is downloaded at run time)")
    if p.is_file():
        return [p]
    files = sorted(f for f in p.rglob("*") if f.is_file() and _ends(f.name, exts))
    if not files:
        raise InputError(f"{field}: directory {path} has no {'/'.join(exts)} files")
    return files


def _lines(f: Path):
    """The lines of a (gzipped) UTF-8 file, read as they are needed; only "\n" ends one."""
    try:
        opener = gzip.open if f.name.endswith(".gz") else open
        with opener(f, "rt", encoding="utf-8", newline="\n") as fh:
            yield from fh
    except (OSError, UnicodeDecodeError, EOFError) as e:
        raise InputError(f"{f}: cannot read as UTF-8 text ({e})") from e


def iter_text_files(files: list[Path]):
    """The documents of text files (blocks between blank lines), one file line at a time."""
    for f in files:
        block: list[str] = []
        for line in _lines(f):
            if line.strip():
                block.append(line)
            elif block:
                yield "".join(block).strip()
                block = []
        if block:
            yield "".join(block).strip()


def read_text_files(files: list[Path]) -> list[str]:
    return list(iter_text_files(files))


def read_jsonl_lines(lines, f: Path, text_field: str) -> list[str]:
    docs = []
    for lineno, line in lines:
        line = line.strip()
        if not line:
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise InputError(f"{f}:{lineno}: not valid JSON ({e.msg})") from None
        if not isinstance(obj, dict) or text_field not in obj:
            keys = ", ".join(sorted(obj)) if isinstance(obj, dict) else type(obj).__name__
            raise ConfigError("data.text_field", f"{f}:{lineno} has no field {text_field!r}",
                              f"fields there: {keys}")
        text = obj[text_field]
        if not isinstance(text, str):
            raise InputError(f"{f}:{lineno}: field {text_field!r} is "
                             f"{type(text).__name__}, not a string")
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:  # a JSON escape of half a surrogate pair
            raise InputError(f"{f}:{lineno}: field {text_field!r} holds a lone surrogate "
                             f"({text[e.start]!r} at character {e.start}), which is not text; "
                             "fix or drop the line") from None
        if text.strip():
            docs.append(text)
    return docs


def iter_jsonl_files(files: list[Path], text_field: str):
    """The documents of jsonl files, one line at a time."""
    for f in files:
        for lineno, line in enumerate(_lines(f), start=1):
            yield from read_jsonl_lines([(lineno, line)], f, text_field)


def read_jsonl_files(files: list[Path], text_field: str) -> list[str]:
    return list(iter_jsonl_files(files, text_field))


def _peek_jsonl(f: Path, text_field: str) -> None:
    """Checks the first record of a jsonl file has `text_field`."""
    opener = gzip.open if f.name.endswith(".gz") else open
    try:
        with opener(f, "rt", encoding="utf-8") as fh:
            for lineno, line in enumerate(fh, start=1):
                if line.strip():
                    read_jsonl_lines([(lineno, line)], f, text_field)
                    return
    except (OSError, UnicodeDecodeError, EOFError) as e:
        raise InputError(f"{f}: cannot read as UTF-8 text ({e})") from e


def _files_key(files: list[Path]) -> list:
    out = []
    for f in files:
        st = f.stat()
        out.append([str(f.resolve()), st.st_size, st.st_mtime_ns])
    return out


def _hash(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


# --------------------------------------------------------------------------- #
# Finite sources
# --------------------------------------------------------------------------- #


class Corpus:
    """A finite list of documents and a key identifying its content.

    `texts` may be a zero-argument function: the documents are then read on first
    use, so a run whose packed rows are already cached never reads the corpus.
    """

    def __init__(self, texts: list[str] | Callable[[], list[str]], key: str, description: str,
                 stream: Callable[[], Iterator[str]] | None = None):
        """stream: the documents as an iterator, read from disk as they are used (a
        corpus of any size in bounded memory); without it, `texts` is iterated."""
        self._texts = texts
        self._stream = stream
        self.key = key
        self.description = description

    def iter(self) -> Iterator[str]:
        if self._stream is not None and callable(self._texts):
            return self._stream()
        return iter(self.texts)

    def is_empty(self) -> bool:
        return next(self.iter(), None) is None

    @property
    def texts(self) -> list[str]:
        if callable(self._texts):
            self._texts = self._texts()
        return self._texts

    def __len__(self) -> int:
        return len(self.texts)

    def __repr__(self) -> str:
        n = "?" if callable(self._texts) else len(self._texts)
        return f"Corpus({self.description}, {n} docs, key={self.key})"


def _which_split(cfg: DataConfig, split: str) -> str:
    if split == cfg.train_split:
        return "train"
    if split == cfg.valid_split:
        return "valid"
    raise ConfigError("data.train_split", f"unknown split {split!r}",
                      f"this source has {cfg.train_split!r} and {cfg.valid_split!r}")


def _holdout(n: int, cfg: DataConfig) -> int:
    if n < 2 or cfg.valid_holdout_docs <= 0:
        return 0
    return min(cfg.valid_holdout_docs, max(1, n // 10))


def _split_local(docs: list[str], cfg: DataConfig, which: str, valid_docs) -> list[str]:
    """train/valid documents of a local source; `valid_docs()` reads data.valid_path."""
    if cfg.max_docs > 0:
        docs = docs[: cfg.max_docs]
    if cfg.valid_path:
        return docs if which == "train" else valid_docs()
    h = _holdout(len(docs), cfg)
    return docs[: len(docs) - h] if which == "train" else docs[len(docs) - h:]


def _stream_local(docs: Callable[[], Iterator[str]], cfg: DataConfig, which: str,
                  valid_docs: Callable[[], Iterator[str]]) -> Callable[[], Iterator[str]]:
    """`_split_local` over iterators: the same documents, read from disk in two passes
    (one counts them, for the holdout) instead of held in memory."""
    def capped():
        it = docs()
        return itertools.islice(it, cfg.max_docs) if cfg.max_docs > 0 else it

    def stream():
        if cfg.valid_path:
            return capped() if which == "train" else valid_docs()
        n = sum(1 for _ in capped())
        h = _holdout(n, cfg)
        return itertools.islice(capped(), 0, n - h) if which == "train" else \
            itertools.islice(capped(), n - h, n)

    return stream


def synthetic_corpus(cfg: DataConfig, split: str, workdir: Path | None) -> Corpus:
    which = _which_split(cfg, split)
    n = cfg.synthetic_docs if which == "train" else cfg.synthetic_valid_docs
    stream = "train" if which == "train" else "validation"
    key = f"synthetic-v{synthetic.GENERATOR_VERSION}-{cfg.synthetic_seed}-{stream}-{n}"

    def load() -> list[str]:
        cache = Path(workdir) / "synthetic" / f"{key}.jsonl" if workdir is not None else None
        if cache is not None and cache.exists():
            try:
                texts = [json.loads(line)["text"] for line in cache.read_text().splitlines()]
                if len(texts) == n:
                    return texts
            except (json.JSONDecodeError, KeyError):
                pass  # rebuilt below
        texts = synthetic.generate_documents(n, cfg.synthetic_seed, split=stream)
        if cache is not None:
            cache.parent.mkdir(parents=True, exist_ok=True)
            tmp = cache.with_name(f"{cache.name}.{os.getpid()}.tmp")
            tmp.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
            tmp.replace(cache)
        return texts

    return Corpus(load, key, f"synthetic {stream} (seed {cfg.synthetic_seed})")


def text_corpus(cfg: DataConfig, split: str) -> Corpus:
    which = _which_split(cfg, split)
    files = expand_paths(cfg.path, "data.path", TEXT_EXTS)
    vfiles = expand_paths(cfg.valid_path, "data.valid_path", TEXT_EXTS) if cfg.valid_path else []

    key = _hash(["text", which, _files_key(files), _files_key(vfiles), cfg.max_docs,
                 cfg.valid_holdout_docs])
    stream = _stream_local(lambda: iter_text_files(files), cfg, which,
                           lambda: iter_text_files(vfiles))
    return Corpus(lambda: list(stream()), f"text-{which}-{key}",
                  f"text files {cfg.path} ({which})", stream)


def jsonl_corpus(cfg: DataConfig, split: str) -> Corpus:
    which = _which_split(cfg, split)
    files = expand_paths(cfg.path, "data.path", JSONL_EXTS)
    vfiles = expand_paths(cfg.valid_path, "data.valid_path", JSONL_EXTS) if cfg.valid_path else []
    _peek_jsonl(files[0], cfg.text_field)  # a wrong text_field fails now, not after minutes

    key = _hash(["jsonl", which, _files_key(files), _files_key(vfiles), cfg.text_field,
                 cfg.max_docs, cfg.valid_holdout_docs])
    stream = _stream_local(lambda: iter_jsonl_files(files, cfg.text_field), cfg, which,
                           lambda: iter_jsonl_files(vfiles, cfg.text_field))
    return Corpus(lambda: list(stream()), f"jsonl-{which}-{key}",
                  f"jsonl files {cfg.path} ({which})", stream)


def _hf_check_column(ds, field: str, where: str) -> None:
    if field not in ds.column_names:
        raise ConfigError("data.text_field", f"{where} has no column {field!r}",
                          f"columns: {', '.join(ds.column_names)}")


def _hf_column(ds, field: str, where: str) -> list[str]:
    _hf_check_column(ds, field, where)
    col = ds[field]
    return [t for t in col if isinstance(t, str) and t.strip()]


def _hf_load(path: str, field_name: str, cache_dir: Path | None):
    """A Dataset or DatasetDict from a local path (never the hub)."""
    import datasets

    p = Path(path)
    if not _has_glob(path) and not p.exists():
        raise InputError(f"{field_name}: {path} does not exist (nothing is downloaded at run time)")
    if p.is_dir() and ((p / "dataset_dict.json").exists() or (p / "dataset_info.json").exists()
                       or (p / "state.json").exists()):
        try:
            return datasets.load_from_disk(str(p))
        except (FileNotFoundError, ValueError) as e:
            raise InputError(f"{field_name}: {path} is not a saved HF dataset ({e})") from e
    files = expand_paths(path, field_name, tuple(HF_FILE_FORMATS))
    fmts = {next(v for k, v in HF_FILE_FORMATS.items() if f.name.endswith(k))
            for f in files if _ends(f.name, tuple(HF_FILE_FORMATS))}
    if len(fmts) != 1:
        raise InputError(f"{field_name}: {path}: need files of one format among "
                         f"{sorted(set(HF_FILE_FORMATS))}, found {sorted(fmts) or 'none'}")
    kwargs = {"cache_dir": str(cache_dir)} if cache_dir is not None else {}
    return datasets.load_dataset(fmts.pop(), data_files=[str(f) for f in files], split="train",
                                 **kwargs)


def hf_corpus(cfg: DataConfig, split: str, workdir: Path | None) -> Corpus:
    import datasets

    which = _which_split(cfg, split)
    cache_dir = Path(workdir) / "hf_cache" if workdir is not None else None
    ds = _hf_load(cfg.path, "data.path", cache_dir)
    if isinstance(ds, datasets.DatasetDict):
        if cfg.train_split not in ds:
            raise ConfigError("data.train_split", f"{cfg.path} has no split {cfg.train_split!r}",
                              f"splits: {', '.join(ds)}")
        for name, part in ds.items():
            _hf_check_column(part, cfg.text_field, f"{cfg.path}[{name}]")
    else:
        _hf_check_column(ds, cfg.text_field, cfg.path)

    def texts() -> list[str]:
        if not isinstance(ds, datasets.DatasetDict):
            docs = _hf_column(ds, cfg.text_field, cfg.path)
            return _split_local(docs, cfg, which, lambda: _hf_valid(cfg, cache_dir))
        has_valid = cfg.valid_split in ds and not cfg.valid_path
        if which == "valid" and has_valid:
            out = _hf_column(ds[cfg.valid_split], cfg.text_field, cfg.path)
            return out[: cfg.max_docs] if cfg.max_docs > 0 else out
        docs = _hf_column(ds[cfg.train_split], cfg.text_field, cfg.path)
        if has_valid:  # no holdout needed
            return docs[: cfg.max_docs] if cfg.max_docs > 0 else docs
        return _split_local(docs, cfg, which, lambda: _hf_valid(cfg, cache_dir))

    fp = getattr(ds, "_fingerprint", None)
    if fp is None and isinstance(ds, datasets.DatasetDict):
        fp = {k: v._fingerprint for k, v in ds.items()}
    key = _hash(["hf", which, str(Path(cfg.path).resolve()) if not _has_glob(cfg.path) else cfg.path,
                 fp, _path_stamp(cfg.path), cfg.valid_path, _path_stamp(cfg.valid_path),
                 cfg.text_field, cfg.max_docs, cfg.valid_holdout_docs, cfg.train_split,
                 cfg.valid_split])
    return Corpus(texts, f"hf-{which}-{key}", f"HF dataset {cfg.path} ({which})")


def _hf_valid(cfg: DataConfig, cache_dir: Path | None) -> list[str]:
    import datasets

    ds = _hf_load(cfg.valid_path, "data.valid_path", cache_dir)
    if isinstance(ds, datasets.DatasetDict):
        name = cfg.valid_split if cfg.valid_split in ds else next(iter(ds))
        ds = ds[name]
    return _hf_column(ds, cfg.text_field, cfg.valid_path)


def _path_stamp(path: str | None) -> list:
    if not path:
        return []
    if _has_glob(path):
        files = [Path(p) for p in sorted(globlib.glob(path, recursive=True))]
    else:
        p = Path(path)
        files = sorted(f for f in p.rglob("*")) if p.is_dir() else [p]
    return _files_key([f for f in files if f.is_file()])


def load_corpus(cfg: DataConfig, split: str, workdir: Path | None = None) -> Corpus:
    """The documents of a finite source's split. Raises InputError on an empty split."""
    if cfg.source == "synthetic":
        corpus = synthetic_corpus(cfg, split, workdir)
    elif cfg.source == "text":
        corpus = text_corpus(cfg, split)
    elif cfg.source == "jsonl":
        corpus = jsonl_corpus(cfg, split)
    elif cfg.source == "hf":
        corpus = hf_corpus(cfg, split, workdir)
    elif cfg.source == "tfds":
        raise ConfigError("data.source", "tfds is a streaming source", "use tfds_documents()")
    else:
        raise ConfigError("data.source", f"unknown source {cfg.source!r}",
                          "one of synthetic, text, jsonl, tfds, hf")
    return corpus


# --------------------------------------------------------------------------- #
# TFDS (streamed through grain)
# --------------------------------------------------------------------------- #


def tfds_documents(cfg: DataConfig, split: str, *, shuffle_seed: int | None = None):
    """A `grain.MapDataset` of document strings over a prepared TFDS dataset.

    With `shuffle_seed`, index i of epoch e is a pseudo-random permutation
    (grain's index shuffle, reseeded every epoch; indices past the length wrap
    into the next epoch). Without it, indices run in file order and the
    dataset is finite.
    """
    import grain
    import tensorflow_datasets as tfds

    if not cfg.path:
        raise ConfigError("data.path", "data.source='tfds' needs the TFDS data_dir",
                          "pass --set data.path=/path/to/tensorflow_datasets")
    if not Path(cfg.path).exists():
        raise InputError(f"data.path: TFDS data_dir {cfg.path} does not exist "
                         "(nothing is downloaded at run time)")
    try:
        src = tfds.data_source(cfg.tfds_name, split=split, data_dir=cfg.path, download=False)
    except Exception as e:  # DatasetNotFoundError, missing split, wrong file format
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise InputError(f"data.path: cannot open TFDS dataset {cfg.tfds_name!r} split {split!r} "
                         f"under {cfg.path} ({first}); prepare it there with array_record "
                         "file format") from None
    n = len(src)
    if n == 0:
        raise InputError(f"data.path: TFDS dataset {cfg.tfds_name!r} split {split!r} is empty")
    first_rec = src[0]
    if not isinstance(first_rec, dict) or cfg.text_field not in first_rec:
        keys = ", ".join(sorted(first_rec)) if isinstance(first_rec, dict) else type(first_rec).__name__
        raise ConfigError("data.text_field", f"TFDS {cfg.tfds_name!r} has no feature {cfg.text_field!r}",
                          f"features: {keys}")
    ds = grain.MapDataset.source(src)
    if cfg.max_docs > 0:
        ds = ds[: cfg.max_docs]
    if shuffle_seed is not None:
        ds = ds.shuffle(seed=int(shuffle_seed) % 2**32)
    field = cfg.text_field

    def text(rec):
        t = rec[field]
        return t.decode("utf-8") if isinstance(t, bytes) else str(t)

    return ds.map(text)


def tfds_key(cfg: DataConfig, split: str) -> str:
    stamp = _path_stamp(str(Path(cfg.path) / cfg.tfds_name.split("/")[0])) if cfg.path else []
    return "tfds-" + _hash([cfg.tfds_name, split, str(Path(cfg.path or ".").resolve()), stamp,
                            cfg.text_field, cfg.max_docs])
