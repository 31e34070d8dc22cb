"""The `compress` config section: what `python -m hldstudy.compress` does.

Resolution order: the defaults below < `--config FILE` (a JSON file with a
`compress` section, e.g. a previous DIR/config.json, or a Python file whose
`get_compress_config()` returns a CompressConfig) < the command-line
shorthands (`--prune`, `--recover-steps`, ...) < `--set compress.FIELD=VALUE`.
The resolved section is written to DIR/config.json.

Calibration set (SparseGPT / Wanda): `calibration_batches` batches of
`calibration_batch_size` sequences of `calibration_seq_len` tokens (0 = the
checkpoint's data.batch_size / data.seq_len), the first batches of the
checkpoint's training stream, or of `calibration_data` (a local .txt / .jsonl
file) when set. Default: 16 batches (16 x 8 x 128 = 16,384 tokens for the CPU
configs; SparseGPT's paper used 128 x 2048).
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hldstudy.config import config_from_dict, import_entry_point, parse_literal
from hldstudy.distill import methods
from hldstudy.errors import ConfigError, InputError
from hldstudy.fileio import write_json_atomic  # noqa: F401  (the package writes with it)

DIVERGENCES = ("forward_kl", "reverse_kl")


def recover_methods() -> tuple[str, ...]:
    """Methods a recovery can use: one stage that trains the whole student with the
    logit-KD term (kd, hldc, patient), read from the method registry."""
    return tuple(n for n in methods.teacher_methods()
                 if len(methods.get(n).stages) == 1 and methods.get(n).stages[0].kd
                 and methods.get(n).stages[0].depth == "all")


@dataclass(frozen=True)
class CompressConfig:
    # hldstudy run directory to compress (GGUF / HF imports carry no data config).
    checkpoint: str | None = None
    # Output directory: report.json, report.md, config.json, model.safetensors, model/.
    out: str | None = None
    # METHOD-N:M with METHOD in magnitude | wanda | sparsegpt; "" = no pruning.
    prune: str = "sparsegpt-2:4"
    # Block linears to prune (comma-separated subset of q,k,v,o,gate,up,down).
    targets: str = "q,k,v,o,gate,up,down"
    calibration_batches: int = 16
    calibration_batch_size: int = 0
    calibration_seq_len: int = 0
    calibration_data: str | None = None
    # SparseGPT: rows per lazy-update block, dampening as a fraction of mean(diag H).
    blocksize: int = 128
    percdamp: float = 0.01
    # Recovery distillation with masks held: steps, or a FLOP budget (wins when > 0).
    recover_steps: int = 0
    recover_flops: float = 0.0
    # Teacher of the recovery: None = the dense checkpoint before pruning.
    teacher: str | None = None
    method: str = methods.REFERENCE
    divergence: str = "forward_kl"
    # NLL weight of the recovery objective (0 = pure distillation to the teacher).
    alpha: float = 0.0
    temperature: float = 1.0
    lr: float = 1e-3
    warmup_steps: int = 5
    # Patient KD layer map ("s:t,..."); "" = evenly mapped pairs.
    layer_pairs: str = ""
    # None | "fp8"
    quantize: str | None = None
    fp8_format: str = "e4m3"
    fp8_granularity: str = "channel"
    # Quantize before recovery and train with the FP8 grid in the loop (straight-through).
    quantize_in_loop: bool = False
    # Downstream tasks per stage (comma-separated, hldstudy.eval names); "" = none.
    eval: str = ""
    eval_limit: int = 0
    # Validation batches for valid_ppl (0 = the whole validation split).
    eval_batches: int = 0
    seed: int = 0
    progress: bool = True


def prune_names(cfg: CompressConfig) -> tuple[str, ...]:
    from hldstudy.compress.layout import LINEARS

    names = tuple(n.strip() for n in cfg.targets.split(",") if n.strip())
    for n in names:
        if n not in LINEARS:
            raise ConfigError("compress.targets", f"unknown linear {n!r}",
                              f"a comma-separated subset of {','.join(LINEARS)}")
    if not names:
        raise ConfigError("compress.targets", "no linear named")
    return names


def validate(cfg: CompressConfig) -> CompressConfig:
    """Raises ConfigError naming the first bad field; returns cfg unchanged."""
    from hldstudy.compress.fp8 import FORMATS, GRANULARITIES
    from hldstudy.compress.prune import parse_prune

    if not cfg.checkpoint:
        raise ConfigError("compress.checkpoint", "no checkpoint given", "pass --checkpoint RUN_DIR")
    if not cfg.out:
        raise ConfigError("compress.out", "no output directory given", "pass --out DIR")
    if cfg.prune:
        parse_prune(cfg.prune)
    prune_names(cfg)
    for name in ("calibration_batches", "calibration_batch_size", "calibration_seq_len",
                 "recover_steps", "warmup_steps", "eval_limit", "eval_batches"):
        if getattr(cfg, name) < 0:
            raise ConfigError(f"compress.{name}", f"must be >= 0, got {getattr(cfg, name)}")
    if cfg.blocksize <= 0 or cfg.blocksize % 4:
        raise ConfigError("compress.blocksize", f"must be a positive multiple of 4, got "
                          f"{cfg.blocksize}")
    if not (cfg.percdamp > 0 and math.isfinite(cfg.percdamp)):
        raise ConfigError("compress.percdamp", f"must be > 0, got {cfg.percdamp}")
    if cfg.recover_flops < 0 or not math.isfinite(cfg.recover_flops):
        raise ConfigError("compress.recover_flops", f"must be >= 0, got {cfg.recover_flops}")
    if cfg.method not in recover_methods():
        raise ConfigError("compress.method", f"{cfg.method!r} is not one of "
                          f"{', '.join(recover_methods())}")
    if cfg.divergence not in DIVERGENCES:
        raise ConfigError("compress.divergence", f"{cfg.divergence!r} is not one of "
                          f"{', '.join(DIVERGENCES)}")
    if not 0.0 <= cfg.alpha <= 1.0:
        raise ConfigError("compress.alpha", f"the NLL weight must be in [0, 1], got {cfg.alpha}")
    if not cfg.temperature > 0:
        raise ConfigError("compress.temperature", f"must be > 0, got {cfg.temperature}")
    if not cfg.lr > 0:
        raise ConfigError("compress.lr", f"must be > 0, got {cfg.lr}")
    if cfg.quantize not in (None, "fp8"):
        raise ConfigError("compress.quantize", f"{cfg.quantize!r} is not fp8",
                          "use --quantize fp8, or leave it unset")
    if cfg.fp8_format not in FORMATS:
        raise ConfigError("compress.fp8_format", f"{cfg.fp8_format!r} is not one of "
                          f"{', '.join(FORMATS)}")
    if cfg.fp8_granularity not in GRANULARITIES:
        raise ConfigError("compress.fp8_granularity", f"{cfg.fp8_granularity!r} is not one of "
                          f"{', '.join(GRANULARITIES)}")
    if cfg.quantize_in_loop and cfg.quantize is None:
        raise ConfigError("compress.quantize_in_loop", "needs compress.quantize=fp8")
    if cfg.quantize_in_loop and not (cfg.recover_steps or cfg.recover_flops):
        raise ConfigError("compress.quantize_in_loop", "needs a recovery (recover_steps > 0)")
    if cfg.calibration_data is not None and not Path(cfg.calibration_data).is_file():
        raise ConfigError("compress.calibration_data",
                          f"{cfg.calibration_data} does not exist (no calibration data)",
                          "give a local .txt or .jsonl file, or leave it unset to calibrate "
                          "on the checkpoint's training data")
    return cfg


# --------------------------------------------------------------------------- #
# Loading, overrides, writing
# --------------------------------------------------------------------------- #


def from_dict(data: dict) -> CompressConfig:
    """A CompressConfig from a mapping; unknown keys and wrong types name the field."""
    return config_from_dict(data, CompressConfig, "compress.")


def load_file(path: str | Path) -> CompressConfig:
    path = Path(path)
    if not path.is_file():
        raise InputError(f"--config: {path} does not exist")
    if path.suffix == ".json":
        try:
            raw = json.loads(path.read_text())
        except ValueError as e:
            raise InputError(f"--config: {path} is not JSON: {e}") from None
        return from_dict(raw.get("compress", raw) if isinstance(raw, dict) else raw)
    module = import_entry_point(path, "get_compress_config", "--config:")
    cfg = module.get_compress_config()
    if not isinstance(cfg, CompressConfig):
        raise InputError(f"--config: {path}: get_compress_config() must return a CompressConfig")
    return cfg


def apply_overrides(cfg: CompressConfig, overrides: list[str]) -> CompressConfig:
    """'compress.field=value' (or 'field=value') strings, typed like the other sections."""
    sub = [o.split("=", 1) for o in overrides]
    data = dataclasses.asdict(cfg)
    names = {f.name for f in dataclasses.fields(CompressConfig)}
    for item, parts in zip(overrides, sub, strict=True):
        if len(parts) != 2:
            raise ConfigError(item, "an override needs the form compress.field=value")
        key = parts[0].strip()
        field = key.removeprefix("compress.")
        if field not in names:
            raise ConfigError(key, "unknown key", f"valid keys: compress.{', compress.'.join(sorted(names))}")
        data[field] = _parse(parts[1], field)
    return from_dict(data)


def _parse(text: str, field: str) -> Any:
    """As `--set` parses values, except that a string field keeps its text verbatim
    (unless it is none/null/true/false)."""
    str_fields = {f.name for f in dataclasses.fields(CompressConfig)
                  if "str" in str(f.type) and "int" not in str(f.type)}
    if field in str_fields and text.strip().lower() not in ("none", "null", "true", "false"):
        return text
    return parse_literal(text)


def to_dict(cfg: CompressConfig) -> dict:
    return {"compress": dataclasses.asdict(cfg)}
