"""`hldstudy data prepare`: a config's corpus tokenized once, in worker processes, into
array_record token shards with a manifest (`hldstudy.data.shards`); killed and run again,
it continues where it stopped and ends with the same shards.

Design notes: `docs/data.md`, under this file's name.
"""

from __future__ import annotations

import errno
import hashlib
import json
import multiprocessing
import os
import shutil
import signal
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path

from hldstudy.config import DataConfig
from hldstudy.data import sources
from hldstudy.data.encoding import encode_documents
from hldstudy.data.pipeline import run_tokenizer
from hldstudy.data.shards import FORMAT, FORMAT_VERSION, MANIFEST, encode_record
from hldstudy.data.tokenizer import Tokenizer
from hldstudy.errors import ConfigError, InputError, RuntimeFault
from hldstudy.fileio import write_json_atomic
from hldstudy.signals import die_with_parent

PLAN = "prepare.json"  # what a directory is being prepared from (checked on a rerun)
DOCS_PER_SHARD = 8192


def split_documents(cfg: DataConfig, split: str):
    """(documents: an indexable of str, source description, source key) of one split;
    None for a validation split the source does not have."""
    if cfg.source == "tfds":
        try:
            docs = sources.tfds_documents(cfg, split)
        except InputError:
            if split == cfg.train_split:
                raise
            return None
        return docs, f"TFDS {cfg.tfds_name} {split}", sources.tfds_key(cfg, split)
    corpus = sources.load_corpus(cfg, split)
    if len(corpus) == 0 and split != cfg.train_split:
        return None
    return corpus.texts, corpus.description, corpus.key


# The tokenizer of a worker process (set once by `_init_worker`).
_WORKER: dict = {}


def _init_worker(tokenizer_path: str) -> None:
    die_with_parent()
    # Ctrl-C reaches the whole process group: the parent alone answers it, in one line.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _WORKER["tokenizer"] = Tokenizer.load(tokenizer_path)


def write_shard(path: Path, texts: list[str], add_bos: bool, tokenizer=None) -> dict:
    """Tokenizes `texts` into the array_record shard `path` (atomically: a temporary file,
    flushed, renamed) beside its stats file; returns the stats."""
    from array_record.python.array_record_module import ArrayRecordWriter

    tokenizer = tokenizer or _WORKER["tokenizer"]
    docs = encode_documents(tokenizer, texts, add_bos=add_bos)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    writer = ArrayRecordWriter(str(tmp), "group_size:1")
    try:
        for d in docs:
            writer.write(encode_record(d))
    finally:
        writer.close()
    with open(tmp, "rb") as fh:
        os.fsync(fh.fileno())
    stats = {"file": path.name, "documents": len(docs), "tokens": int(sum(len(d) for d in docs)),
             "bytes": tmp.stat().st_size, "sha256": _sha256(tmp)}
    # The stats first: a shard that exists has them.
    write_json_atomic(path.with_name(path.name + ".json"), stats)
    os.replace(tmp, path)
    return stats


def _fingerprint(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]


def _tokenizer_into(cfg: DataConfig, out: Path, corpus, earlier: dict | None
                    ) -> tuple[Tokenizer, str]:
    """The run's tokenizer, copied (or trained) into `out`; (tokenizer, its file name).
    `earlier`: the plan `out` was prepared under, whose tokenizer the directory's shards
    hold: a tokenizer of another fingerprint (given, found there, or to be trained) is
    refused before anything is copied or trained."""
    if cfg.tokenizer:
        src = Path(cfg.tokenizer)
        dest = out / ("tokenizer.json" if src.suffix == ".json" else "tokenizer.model")
        if earlier is not None and Tokenizer.load(src).fingerprint() != earlier["tokenizer"]:
            raise InputError(f"data.tokenizer: {src} is not the tokenizer {out} was prepared "
                             f"with (fingerprint {earlier['tokenizer']}); give another --out "
                             "to prepare with it, or unset data.tokenizer to continue this one")
        if not dest.exists():
            tmp = dest.with_name(f".{dest.name}.tmp")
            shutil.copyfile(src, tmp)
            os.replace(tmp, dest)
            cfg_json = src.with_name("tokenizer_config.json")
            if src.suffix == ".json" and cfg_json.exists():
                shutil.copyfile(cfg_json, out / "tokenizer_config.json")
        tokenizer = Tokenizer.load(dest)
    else:
        if earlier is not None and not (out / "tokenizer.model").exists():
            raise InputError(f"--out: {out} was prepared with a tokenizer (fingerprint "
                             f"{earlier['tokenizer']}) that is no longer there; a new one "
                             "would not match its shards: restore tokenizer.model, give "
                             "another --out, or delete the whole directory")
        meta = out / "tokenizer.json"
        trained = json.loads(meta.read_text()).get("vocab_size") if meta.exists() else None
        if earlier is not None and trained not in (None, cfg.tokenizer_vocab_size):
            raise InputError(f"data.tokenizer_vocab_size: {out}'s shards were prepared with a "
                             f"tokenizer of {trained} pieces, not {cfg.tokenizer_vocab_size}; "
                             f"set it back to {trained}, or give another --out")
        tokenizer = run_tokenizer(cfg, out, corpus)
        dest = out / "tokenizer.model"
    if earlier is not None and tokenizer.fingerprint() != earlier["tokenizer"]:
        raise InputError(f"--out: {out}'s tokenizer (fingerprint {tokenizer.fingerprint()}) is "
                         f"not the one its shards were prepared with ({earlier['tokenizer']}); "
                         "restore it, give another --out, or delete the whole directory")
    return tokenizer, dest.name


def prepare(cfg: DataConfig, out: str | Path, *, workers: int = 1,
            docs_per_shard: int = DOCS_PER_SHARD, progress: bool = True) -> dict:
    """Prepares `cfg`'s corpus into `out`; returns the manifest. Shards already written by
    an earlier, interrupted run of the same prepare are kept."""
    if cfg.source == "shards":
        raise ConfigError("data.source", "the data is already prepared shards",
                          "point the config at the corpus they come from")
    if workers < 1:
        raise ConfigError("--workers", f"must be >= 1, got {workers}")
    splits = {"train": split_documents(cfg, cfg.train_split),
              "valid": split_documents(cfg, cfg.valid_split)}
    train_docs = splits["train"][0]
    if len(train_docs) == 0:
        raise InputError(f"data.path: {splits['train'][1]} has no documents; nothing prepared")
    splits = {k: v for k, v in splits.items() if v is not None and len(v[0])}
    out = Path(out)
    plan = {"format": FORMAT, "version": FORMAT_VERSION, "add_bos": cfg.add_bos,
            "docs_per_shard": docs_per_shard, "sources": {k: v[2] for k, v in splits.items()}}
    earlier = _check_plan(out / PLAN, plan)  # before anything is made, copied or trained
    out.mkdir(parents=True, exist_ok=True)
    corpus = None
    if not cfg.tokenizer and cfg.source != "tfds":
        corpus = sources.Corpus(list(train_docs), splits["train"][2], splits["train"][1])
    tokenizer, tok_file = _tokenizer_into(cfg, out, corpus, earlier)
    if earlier is None:
        write_json_atomic(out / PLAN, {**plan, "tokenizer": tokenizer.fingerprint()})
    for tmp in out.glob(".*.tmp"):  # a shard a killed run was writing: written again
        tmp.unlink(missing_ok=True)
    jobs = []
    for name, (docs, _, _) in splits.items():
        n = len(docs)
        for k, start in enumerate(range(0, n, docs_per_shard)):
            path = out / f"{name}-{k:05d}.array_record"
            if not _intact(path):
                jobs.append((path, docs, start, min(start + docs_per_shard, n)))
    kept = "the shards written so far are kept: run the same command again to continue"
    try:
        _write_shards(jobs, tokenizer, cfg.add_bos, workers, progress)
    except BrokenProcessPool:
        raise RuntimeFault(f"a tokenizing worker died (killed, or out of memory) while "
                           f"preparing {out}; {kept} (fewer --workers if memory is short)"
                           ) from None
    except (OSError, RuntimeError) as e:  # array_record reports a failed write as either
        if getattr(e, "errno", None) == errno.ENOSPC or "No space left" in str(e):
            raise RuntimeFault(f"--out: the disk of {out} is full; {kept} once there is "
                               "space") from None
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        raise RuntimeFault(f"writing a shard into {out} failed ({first}); {kept}") from None
    manifest = {"format": FORMAT, "version": FORMAT_VERSION, "add_bos": cfg.add_bos,
                "tokenizer": {"file": tok_file, "fingerprint": tokenizer.fingerprint(),
                              "vocab_size": tokenizer.vocab_size},
                "source": _fingerprint(plan["sources"]),
                "sources": {k: {"description": v[1], "key": v[2]} for k, v in splits.items()},
                "splits": {}}
    for name, (docs, _, _) in splits.items():
        shards = [json.loads((out / f"{name}-{k:05d}.array_record.json").read_text())
                  for k in range(-(-len(docs) // docs_per_shard))]
        manifest["splits"][name] = {"shards": shards,
                                    "documents": sum(s["documents"] for s in shards),
                                    "tokens": sum(s["tokens"] for s in shards)}
    write_json_atomic(out / MANIFEST, manifest)
    return manifest


def _check_plan(path: Path, plan: dict) -> dict | None:
    """The plan an earlier prepare of this directory wrote (None: a new directory);
    refuses, naming what differs, when it is not `plan` (the tokenizer aside: checked
    by `_tokenizer_into`)."""
    if not path.exists():
        return None
    try:
        earlier = json.loads(path.read_text())
        assert isinstance(earlier, dict) and "tokenizer" in earlier
    except (ValueError, AssertionError):
        raise InputError(f"--out: {path} is not readable; give another --out or delete "
                         f"{path.parent}") from None
    knobs = {"sources": "corpus (data.source, data.path, the splits)",
             "docs_per_shard": "shard size (--docs-per-shard)", "add_bos": "data.add_bos"}
    for key, value in plan.items():
        if earlier.get(key) != value:
            raise InputError(f"--out: {path.parent} was prepared with another "
                             f"{knobs.get(key, key)}; give another --out, or delete it to "
                             "prepare it again")
    return earlier


def _intact(path: Path) -> bool:
    """A shard written whole: its stats file beside it, and its size (and checksum) what
    the stats recorded when it was written."""
    stats_path = path.with_name(path.name + ".json")
    if not path.exists() or not stats_path.exists():
        return False
    try:
        stats = json.loads(stats_path.read_text())
    except ValueError:
        return False
    if "bytes" not in stats:  # written before checksums were kept: count its records
        from array_record.python.array_record_module import ArrayRecordReader

        try:
            reader = ArrayRecordReader(str(path))
            ok = reader.num_records() == stats.get("documents")
            reader.close()
            return ok
        except Exception:  # noqa: BLE001 - unreadable: written again
            return False
    return path.stat().st_size == stats["bytes"] and _sha256(path) == stats["sha256"]


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _write_shards(jobs, tokenizer: Tokenizer, add_bos: bool, workers: int,
                  progress: bool) -> None:
    """Each missing shard tokenized and written, `workers` at a time (at most two shards'
    texts in flight per worker), under a progress bar counting documents."""
    from tqdm.auto import tqdm

    total = sum(stop - start for _, _, start, stop in jobs)
    bar = tqdm(total=total, unit="doc", desc="prepare", disable=not progress or not jobs)
    try:
        if workers == 1 or len(jobs) <= 1 or tokenizer.model_path is None:
            for path, docs, start, stop in jobs:
                write_shard(path, [docs[i] for i in range(start, stop)], add_bos, tokenizer)
                bar.update(stop - start)
            return
        ctx = multiprocessing.get_context("spawn")  # no copy of this process's threads
        with ProcessPoolExecutor(workers, mp_context=ctx, initializer=_init_worker,
                                 initargs=(str(tokenizer.model_path),)) as pool:
            try:
                pending: dict = {}
                for path, docs, start, stop in jobs:
                    while len(pending) >= 2 * workers:
                        _collect(pending, bar)
                    texts = [docs[i] for i in range(start, stop)]
                    pending[pool.submit(write_shard, path, texts, add_bos)] = stop - start
                while pending:
                    _collect(pending, bar)
            except BaseException:  # Ctrl-C, a failed shard: no queued shard starts
                pool.shutdown(wait=False, cancel_futures=True)
                raise
    finally:
        bar.close()


def _collect(pending: dict, bar) -> None:
    done, _ = wait(pending, return_when=FIRST_COMPLETED)
    for f in done:
        f.result()  # a worker's error stops the prepare; written shards stay
        bar.update(pending.pop(f))
