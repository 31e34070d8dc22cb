"""The `compress` config section: what `python -m hldstudy.compress` does.

Design notes: `docs/compression.md`, under this file's name.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hldstudy.compress.data import check_source
from hldstudy.config import (
    NONNEG,
    POSITIVE,
    Domain,
    check_fields,
    config_from_dict,
    import_entry_point,
    knob,
    parse_literal,
)
from hldstudy.distill import methods
from hldstudy.errors import ConfigError, InputError
from hldstudy.fileio import write_json_atomic  # noqa: F401  (the package writes with it)

# The names hldstudy.compress.fp8 defines (FORMATS, GRANULARITIES): declared here, where
# the field is, since fp8 imports jax and validation must not.
FP8_FORMATS = ("e4m3", "e5m2")
FP8_GRANULARITIES = ("channel", "tensor")


def recover_methods() -> tuple[str, ...]:
    """Methods a recovery can use: one stage that trains the whole student with the
    logit-KD term (kd, hldc, patient), read from the method registry."""
    return tuple(n for n in methods.teacher_methods()
                 if len(methods.get(n).stages) == 1 and methods.get(n).stages[0].kd
                 and methods.get(n).stages[0].depth == "all")


@dataclass(frozen=True)
class CompressConfig:
    """Each field's values are declared with it (`knob(domain=)`, checked by
    `hldstudy.config.check_fields`, errors naming compress.FIELD)."""

    # What to compress: an hldstudy run directory, a GGUF file or a Hugging Face directory
    # (imports carry no data of their own: give calibration_data).
    checkpoint: str | None = None
    # Output directory: report.json, report.md, config.json, model.safetensors, model/.
    out: str | None = None
    # METHOD-N:M with METHOD in magnitude | wanda | sparsegpt; "" = no pruning.
    prune: str = "sparsegpt-2:4"
    # Block linears to prune and quantize (comma-separated names of
    # hldstudy.compress.layout.LINEARS; a name the model's family lacks is skipped).
    targets: str = ("q,q_gate,k,v,o,in_qkv,in_z,out,gate,up,down,shared_gate,shared_up,"
                    "shared_down")
    calibration_batches: int = knob(16, domain=NONNEG)
    calibration_batch_size: int = knob(
        0, domain=Domain(">= 0", note="0 = the checkpoint's data.batch_size"))
    calibration_seq_len: int = knob(0, domain=Domain(">= 0", note="0 = the checkpoint's "
                                                     "data.seq_len"))
    # Amount of calibration text in tokens (0 = calibration_batches decides).
    calibration_tokens: int = knob(0, domain=Domain(">= 0", note="0 = calibration_batches "
                                                    "decides"))
    # Local source for calibration, recovery and held-out perplexity (None = the run's data).
    calibration_data: str | None = None
    # TFDS dataset name (e.g. "my_text:1.0.0"): calibration_data is then its local data_dir.
    calibration_tfds: str = ""
    calibration_split: str = "train"
    calibration_valid_split: str = "validation"
    calibration_text_field: str = "text"
    # Text / JSONL sources: documents held out for perplexity (at most 10% of them).
    calibration_holdout_docs: int = knob(500, domain=Domain("> 0", note="documents held out "
                                                            "for perplexity"))
    # SparseGPT: rows per lazy-update block (whole 2:4 groups), dampening as a fraction
    # of mean(diag H).
    blocksize: int = knob(128, domain=Domain("> 0", multiple_of=4))
    percdamp: float = knob(0.01, domain=POSITIVE)
    # Recovery distillation with masks held: steps, or a FLOP budget (wins when > 0).
    recover_steps: int = knob(0, domain=Domain(">= 0", note="0 = no recovery"))
    recover_flops: float = knob(0.0, domain=Domain(">= 0", note="0 = recover_steps decides"))
    # Teacher of the recovery: None = the dense checkpoint before pruning.
    teacher: str | None = None
    method: str = knob(methods.REFERENCE, domain=recover_methods())
    divergence: str = knob("forward_kl", domain=("forward_kl", "reverse_kl"))
    # NLL weight of the recovery objective (0 = pure distillation to the teacher).
    alpha: float = knob(0.0, domain=Domain("[0, 1]", note="the NLL weight; 0 = pure "
                                           "distillation to the teacher"))
    temperature: float = knob(1.0, domain=POSITIVE)
    lr: float = knob(1e-3, domain=POSITIVE)
    warmup_steps: int = knob(5, domain=NONNEG)
    # Patient KD layer map ("s:t,..."); "" = evenly mapped pairs.
    layer_pairs: str = ""
    quantize: str | None = knob(None, domain=Domain(("fp8",), note="use --quantize fp8, or "
                                                    "leave it unset"))
    fp8_format: str = knob("e4m3", domain=FP8_FORMATS)
    fp8_granularity: str = knob("channel", domain=FP8_GRANULARITIES)
    # Quantize before recovery and train with the FP8 grid in the loop (straight-through).
    quantize_in_loop: bool = False
    # Downstream tasks per stage (comma-separated, hldstudy.eval names); "" = none.
    eval: str = ""
    # Also write DIR/compressed-tensors/: the model as a Hugging Face directory in the
    # compressed-tensors format (FP8 weights + scales; needs the `export` extra).
    export: str = knob("", domain=Domain(("", "compressed-tensors"),
                                         note="compressed-tensors, or empty for none"))
    eval_limit: int = knob(0, domain=Domain(">= 0", note="0 = every item"))
    # Also save every intermediate stage's model (stages/<stage>/ run directories), so that
    # `python -m hldstudy.eval --checkpoints` can score them all in one process.
    save_stages: bool = False
    eval_batches: int = knob(0, domain=Domain(">= 0", note="0 = the whole validation split"))
    seed: int = knob(0, domain=NONNEG)
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
    """Raises ConfigError naming the first bad field; returns cfg unchanged: the two
    paths every run needs, each field's declared domain, then the rules that read text
    or the file system or involve two fields."""
    from hldstudy.compress.prune import parse_prune

    if not cfg.checkpoint:
        raise ConfigError("compress.checkpoint", "no checkpoint given", "pass --checkpoint RUN_DIR")
    if not cfg.out:
        raise ConfigError("compress.out", "no output directory given", "pass --out DIR")
    check_fields(cfg, "compress.")
    if cfg.prune:
        parse_prune(cfg.prune)
    prune_names(cfg)
    if cfg.quantize_in_loop and cfg.quantize is None:
        raise ConfigError("compress.quantize_in_loop", "needs compress.quantize=fp8")
    if cfg.quantize_in_loop and not (cfg.recover_steps or cfg.recover_flops):
        raise ConfigError("compress.quantize_in_loop", "needs a recovery (recover_steps > 0)")
    if cfg.calibration_tfds and cfg.calibration_data is None:
        raise ConfigError("compress.calibration_tfds", "needs compress.calibration_data, the "
                          "dataset's local TFDS data_dir")
    check_source(cfg)
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
