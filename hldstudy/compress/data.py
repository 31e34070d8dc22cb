"""The text a compression reads: calibration, recovery and held-out perplexity, one source.

Design notes: `docs/compression.md`, under this file's name.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

from hldstudy.config import Config, DataConfig
from hldstudy.data import sources
from hldstudy.errors import ConfigError

FIELD = "compress.calibration_data"
# Bytes of each file read to decide it is text (a NUL byte, or bytes that are not UTF-8,
# in the first chunk mean it is not).
_PEEK = 1 << 16


def source_kind(ccfg) -> str:
    """"tfds", "jsonl" or "text"."""
    if ccfg.calibration_tfds:
        return "tfds"
    path = Path(ccfg.calibration_data)
    if path.suffix == ".jsonl" or path.name.endswith(".jsonl.gz"):
        return "jsonl"
    if path.is_dir() and not any(path.rglob("*.txt")) and not any(path.rglob("*.txt.gz")) \
            and any(path.rglob("*.jsonl")):
        return "jsonl"
    return "text"


def check_source(ccfg) -> None:
    """The source exists, is not empty and is text (checked on the files themselves,
    before any model is loaded). ConfigError naming compress.calibration_data."""
    if ccfg.calibration_data is None:
        return
    path = Path(ccfg.calibration_data)
    if not path.exists():
        raise ConfigError(FIELD, f"{path} does not exist (no calibration data)",
                          "give a local text/JSONL file, a folder of them, or a TFDS data_dir "
                          "with compress.calibration_tfds")
    kind = source_kind(ccfg)
    if kind == "tfds":
        if not path.is_dir():
            raise ConfigError(FIELD, f"{path} is not a TFDS data_dir (a folder)")
        return
    exts = sources.JSONL_EXTS if kind == "jsonl" else sources.TEXT_EXTS
    if path.is_dir():
        files = sorted(f for f in path.rglob("*") if f.is_file() and str(f).endswith(exts))
        if not files:
            raise ConfigError(FIELD, f"folder {path} has no {'/'.join(exts)} files",
                              "put the calibration text in .txt (or .jsonl) files")
    else:
        files = [path]
    if all(f.stat().st_size == 0 for f in files):
        raise ConfigError(FIELD, f"{path} is empty (no calibration text)")
    for f in files:
        if f.name.endswith(".gz"):
            continue  # read (and checked) by the data pipeline
        with f.open("rb") as fh:
            head = fh.read(_PEEK)
        try:
            # a multi-byte character cut by the peek is still text
            head.decode("utf-8") if len(head) < _PEEK else head[:-4].decode("utf-8")
            ok = b"\x00" not in head
        except UnicodeDecodeError:
            ok = False
        if not ok:
            raise ConfigError(FIELD, f"{f} is not text (binary or not UTF-8)",
                              "give UTF-8 text or JSONL files")


def data_config(ccfg, base: DataConfig | None, *, tokenizer_file: str, add_bos: bool,
                ) -> DataConfig:
    """The data section recovery and held-out evaluation read: the run's own (`base`) or
    one over `compress.calibration_data` (sequences of calibration_seq_len tokens in
    batches of calibration_batch_size, or the data defaults)."""
    if ccfg.calibration_data is None:
        if base is None:
            raise ConfigError(FIELD, f"{ccfg.checkpoint} is an imported checkpoint with no "
                              "data of its own to calibrate and evaluate on",
                              "pass --calibration-data PATH (text, JSONL or a TFDS data_dir)")
        return dataclasses.replace(base, tokenizer=tokenizer_file)
    kind = source_kind(ccfg)
    common = dict(path=str(Path(ccfg.calibration_data).absolute()), tokenizer=tokenizer_file,
                  seq_len=ccfg.calibration_seq_len or DataConfig.seq_len,
                  batch_size=ccfg.calibration_batch_size or DataConfig.batch_size,
                  add_bos=add_bos, packing=True, text_field=ccfg.calibration_text_field,
                  seed=ccfg.seed, valid_path=None, max_docs=0)
    if kind == "tfds":
        return DataConfig(source="tfds", tfds_name=ccfg.calibration_tfds,
                          train_split=ccfg.calibration_split,
                          valid_split=ccfg.calibration_valid_split, **common)
    return DataConfig(source=kind, valid_holdout_docs=ccfg.calibration_holdout_docs, **common)


def calibration_config(ccfg, data: DataConfig) -> DataConfig:
    """`data` with the calibration sequence length and batch size (0 = data's own)."""
    return dataclasses.replace(data, batch_size=ccfg.calibration_batch_size or data.batch_size,
                               seq_len=ccfg.calibration_seq_len or data.seq_len)


def run_config(ccfg, run_cfg: Config | None, model_cfg, data: DataConfig) -> Config:
    """The run config the pipeline works with: the run's own, or (imported checkpoints)
    the defaults around the checkpoint's model and the source's data section."""
    if run_cfg is None:
        name = Path(str(ccfg.checkpoint)).name or "checkpoint"
        return Config(name=name, model=model_cfg, data=data)
    return dataclasses.replace(run_cfg, data=data)


def n_batches(ccfg, data: DataConfig) -> int:
    """Calibration batches: enough for `calibration_tokens`, else `calibration_batches`."""
    if ccfg.calibration_tokens:
        return math.ceil(ccfg.calibration_tokens / (data.batch_size * data.seq_len))
    return ccfg.calibration_batches


def check_tokens(ccfg, stream, batches: list[dict]) -> None:
    """The source holds at least the tokens asked for (ConfigError otherwise). A finite
    source counts its whole training split; a TFDS stream the batches drawn."""
    if ccfg.calibration_data is None or not ccfg.calibration_tokens:
        return
    stats = getattr(stream, "stats", None)
    if stats is not None:
        have = int(stats()["tokens"])
    else:
        have = int(sum(int(b["mask"].sum()) for b in batches))
    if have < ccfg.calibration_tokens:
        raise ConfigError("compress.calibration_tokens",
                          f"{ccfg.calibration_data} tokenizes to {have:,} training tokens, "
                          f"fewer than the {ccfg.calibration_tokens:,} asked for",
                          "give more text or ask for fewer tokens")


def read_error(e: Exception) -> ConfigError:
    """A data-pipeline failure on the calibration source, as one line naming the field."""
    if isinstance(e, ConfigError):
        return e
    return ConfigError(FIELD, f"no calibration data could be read ({e})",
                       "give a local text/JSONL file or folder, or a TFDS data_dir")

