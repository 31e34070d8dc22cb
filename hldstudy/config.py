"""Frozen, validated configuration for every hldstudy run.

An experiment is a Python file (the built-in ones: `hldstudy/configs/experiments/`)
exposing `get_config()`
that returns a `Config`. The command line may override any leaf with
`--set section.field=value`; values are parsed to the field's declared type.
`validate()` runs before any compute and raises `ConfigError` naming the
field. Every run writes `config_to_dict(cfg)` as `config.json` in its
directory, and `config_from_dict` reads it back.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hldstudy.distill import methods
from hldstudy.distill.pairs import parse_layer_pairs
from hldstudy.errors import ConfigError, InputError
from hldstudy.fileio import write_json_atomic

# Written into every config.json; 1 = files written before the version existed.
SCHEMA_VERSION = 2
# Keys of a config.json that are about the file, not the run (never compared).
FILE_KEYS = frozenset({"schema_version"})

# --------------------------------------------------------------------------- #
# Field rules
# --------------------------------------------------------------------------- #
#
# Each field says, once, how the rest of the suite treats it (`knob`); every
# list that used to be kept by hand is derived from these tags (`fields_where`):
#
#   resume         may differ when a run directory is resumed (the trainer refuses
#                  any other change, naming the field);
#   drift          a difference between a run directory and its sweep grid makes
#                  the run stale (False: cadence, display, transport, mesh);
#   analysis       "compare": a varying field is an extra dimension of the
#                  comparison; "column": a column of its own; "ignore": never
#                  changes what is compared;
#   data_identity  part of what trainer and teacher replica must share for
#                  `batch_at(step)` to be the same batch;
#   relevant_if    (field, value): only matters when that field has that value.
#
# `operational=True` is the common case of a field that does not change what a
# run computes (cadence, display, transport, device layout): resumable, no drift,
# ignored by the analysis. A field without tags changes results: not resumable,
# drift-checked, compared. Whether a distill.* field applies to a method is the
# method's declaration (`hldstudy.distill.methods`), not a tag.

_RULE_DEFAULTS = {"resume": False, "drift": True, "analysis": "compare",
                  "data_identity": False, "relevant_if": None}


def knob(default: Any = dataclasses.MISSING, *, factory: Any = dataclasses.MISSING,
         operational: bool = False, **rules: Any) -> Any:
    """A dataclass field with its rules (see above) in its metadata."""
    unknown = set(rules) - set(_RULE_DEFAULTS)
    if unknown:
        raise TypeError(f"unknown field rules {sorted(unknown)}")
    if operational:
        rules = {"resume": True, "drift": False, "analysis": "ignore", **rules}
    return field(default=default, default_factory=factory, metadata={"rules": rules})


def field_rules(cls: type | None = None, prefix: str = "") -> dict[str, dict]:
    """{dotted field: its rules, defaults filled in} for every leaf of `cls` (Config)."""
    cls = cls or Config
    out = {}
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            out.update(field_rules(hints[f.name], f"{prefix}{f.name}."))
        else:
            out[f"{prefix}{f.name}"] = {**_RULE_DEFAULTS, **f.metadata.get("rules", {})}
    return out


def fields_where(rule: str, value: Any = True) -> frozenset[str]:
    """Dotted names of the fields whose `rule` equals `value`."""
    return frozenset(k for k, r in field_rules().items() if r[rule] == value)


# --------------------------------------------------------------------------- #
# Sections
# --------------------------------------------------------------------------- #


def layer_window(sliding_window: int | None, global_every: int, i: int) -> int | None:
    """The attention window of 0-based layer i (None: global). Every `global_every`-th
    layer (1-based) is global, the others local with `sliding_window` (Gemma 3: 6)."""
    if sliding_window is None or global_every <= 1 or (i + 1) % global_every == 0:
        return None
    return sliding_window


@dataclass(frozen=True)
class ModelConfig:
    """A Gemma-style decoder. Field names follow DESIGN.md."""

    vocab_size: int = 32768
    d_model: int = 640
    n_layers: int = 18
    n_heads: int = 4
    n_kv_heads: int = 1
    head_dim: int = 256
    d_ff: int = 2048
    max_seq_len: int = 2048
    rope_base_global: float = 1_000_000.0
    rope_base_local: float = 10_000.0
    # Local (sliding-window) layers: window size in tokens; None = all layers global.
    sliding_window: int | None = None
    # Every `global_every`-th layer (1-based) is global, the others local
    # (Gemma 3: 6 -> five local then one global). 1 = all global.
    global_every: int = 1
    qk_norm: bool = True
    attn_softcap: float | None = None
    final_softcap: float | None = None
    # Queries are scaled by query_pre_attn_scalar**-0.5 (None -> head_dim).
    query_pre_attn_scalar: float | None = None
    norm_eps: float = 1e-6
    # Compute dtype of activations; parameters stay float32.
    dtype: str = "float32"
    param_dtype: str = "float32"
    # Attention kernel (hldstudy/model/attention.py): dense (masked T x T, the
    # reference) | chunked (flash-style blocks, any backend) | cudnn (NVIDIA GPU,
    # bf16/fp16, no soft-cap) | auto (cudnn where it fits on GPU, else chunked
    # for long sequences). All compute the same attention.
    attention: str = "dense"
    # Recompute each block in the backward pass (saves activation memory).
    remat: bool = knob(False, analysis="ignore")

    def is_global_layer(self, i: int) -> bool:
        """0-based layer index i: True where attention sees the whole causal context."""
        return layer_window(self.sliding_window, self.global_every, i) is None

    def window(self, i: int) -> int | None:
        return layer_window(self.sliding_window, self.global_every, i)

    def rope_base(self, i: int) -> float:
        return self.rope_base_global if self.is_global_layer(i) else self.rope_base_local


@dataclass(frozen=True)
class DataConfig:
    # synthetic | text | jsonl | tfds | hf
    source: str = knob("synthetic", data_identity=True)
    # File, glob or directory for text/jsonl/hf; TFDS data_dir for tfds.
    path: str | None = knob(None, resume=True)
    tfds_name: str = knob("c4/en", data_identity=True)
    text_field: str = knob("text", data_identity=True)
    train_split: str = knob("train", data_identity=True)
    valid_split: str = "validation"
    # SentencePiece model file; None -> train one on the training corpus into the run dir.
    tokenizer: str | None = knob(None, resume=True)
    tokenizer_vocab_size: int = 512
    seq_len: int = knob(128, data_identity=True)
    batch_size: int = knob(8, data_identity=True)
    seed: int = knob(0, data_identity=True, analysis="column")
    # Synthetic corpus size (documents) for the train / validation splits.
    synthetic_docs: int = knob(20000, data_identity=True)
    synthetic_valid_docs: int = 500
    # Pack documents with segment ids (True) or cut a token stream at seq_len (False).
    packing: bool = knob(True, data_identity=True)
    # Seed of the synthetic corpus itself (data.seed only shuffles), so runs with
    # different shuffles (e.g. teacher and student) share one corpus.
    synthetic_seed: int = knob(0, data_identity=True)
    # text/jsonl/hf: separate validation file/glob/dir; None -> hold out the last
    # `valid_holdout_docs` documents (at most 10%) of the training corpus.
    valid_path: str | None = None
    valid_holdout_docs: int = 500
    # Use at most this many documents of a source (0 = all).
    max_docs: int = knob(0, data_identity=True)
    # Prepend BOS to every document (Gemma-style tokenizers expect it).
    add_bos: bool = knob(False, data_identity=True)


@dataclass(frozen=True)
class TrainConfig:
    steps: int = knob(100, resume=True)
    lr: float = knob(3e-3, analysis="column")
    warmup_steps: int = 10
    # cosine | linear | constant
    schedule: str = "cosine"
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    b1: float = 0.9
    b2: float = 0.95
    grad_clip: float = 1.0
    seed: int = knob(0, analysis="column")
    log_every: int = knob(10, operational=True)
    eval_every: int = knob(0, operational=True)
    eval_batches: int = knob(8, resume=True, analysis="ignore")
    checkpoint_every: int = knob(50, operational=True)
    keep_checkpoints: int = knob(2, operational=True)
    # Mesh: data-parallel x FSDP. -1 on one axis takes the remaining devices.
    mesh_data: int = knob(-1, operational=True)
    mesh_fsdp: int = knob(1, operational=True)
    progress: bool = knob(True, operational=True)


@dataclass(frozen=True)
class DistillConfig:
    # baseline | kd | hldf | hldc | patient
    method: str = knob(methods.BASELINE, analysis="column")
    alpha: float = knob(0.5, analysis="column")  # NLL weight
    temperature: float = knob(1.0, analysis="column")
    # forward_kl | reverse_kl | jsd
    divergence: str = "forward_kl"
    jsd_beta: float = knob(0.5, relevant_if=("distill.divergence", "jsd"))
    # Weight of the hidden-alignment NMSE (hldc, patient).
    hidden_weight: float = 1.0
    # "s:t,s:t" pairs of (student layer, teacher layer), 1-based block outputs.
    # Empty -> middle layer of each (hld*), evenly mapped layers (patient).
    layer_pairs: str = ""
    patient_pairs: int = 3
    # Learned dense regressor d_s -> d_t per pair; False aligns raw states (needs d_s == d_t).
    regressor: bool = True
    # Share of the FLOP budget spent in HLDF stage 1, in (0, 1).
    hldf_stage1_share: float = 0.2
    # fused | materialized
    loss_impl: str = knob("fused", analysis="ignore")
    # auto | xla | pallas (only for loss_impl=fused)
    fused_backend: str = knob("auto", analysis="ignore")


@dataclass(frozen=True)
class TeacherConfig:
    # hldstudy run dir, GGUF file, HF safetensors dir, or remote://host:port[,...]
    checkpoint: str | None = knob(None, resume=True)
    dtype: str = "float32"
    # Prefetch ring depth for a remote teacher.
    ring_size: int = knob(4, operational=True)
    timeout_s: float = knob(30.0, operational=True)


@dataclass(frozen=True)
class BudgetConfig:
    # Total FLOP budget; 0 -> train.steps decides.
    flops: float = knob(0.0, resume=True, analysis="column")
    # Count the teacher's forward in the budget (the study counts student-side only).
    count_teacher: bool = knob(False, analysis="column")


@dataclass(frozen=True)
class WandbConfig:
    enabled: bool = knob(False, operational=True)
    project: str = knob("hldstudy", operational=True)
    entity: str | None = knob(None, operational=True)
    group: str | None = knob(None, operational=True)
    # offline | online | disabled; WANDB_MODE in the environment wins.
    mode: str = knob("offline", operational=True)


@dataclass(frozen=True)
class Config:
    name: str = knob("run", resume=True, analysis="column")
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    distill: DistillConfig = field(default_factory=DistillConfig)
    teacher: TeacherConfig = field(default_factory=TeacherConfig)
    budget: BudgetConfig = field(default_factory=BudgetConfig)
    wandb: WandbConfig = field(default_factory=WandbConfig)


# --------------------------------------------------------------------------- #
# Validation
# --------------------------------------------------------------------------- #

DTYPES = ("float32", "bfloat16", "float16")
SOURCES = ("synthetic", "text", "jsonl", "tfds", "hf")
DIVERGENCES = ("forward_kl", "reverse_kl", "jsd")


def _choice(fieldname: str, value: Any, options: tuple) -> None:
    if value not in options:
        raise ConfigError(fieldname, f"{value!r} is not one of {', '.join(options)}")


def _positive(fieldname: str, value: float, allow_zero: bool = False) -> None:
    ok = value >= 0 if allow_zero else value > 0
    if not ok or (isinstance(value, float) and math.isnan(value)):
        bound = ">= 0" if allow_zero else "> 0"
        raise ConfigError(fieldname, f"must be {bound}, got {value}")


def validate_model(m: ModelConfig, prefix: str = "model") -> None:
    for name in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim",
                 "d_ff", "max_seq_len"):
        _positive(f"{prefix}.{name}", getattr(m, name))
    if m.n_heads % m.n_kv_heads:
        raise ConfigError(f"{prefix}.n_kv_heads",
                          f"n_heads={m.n_heads} is not a multiple of n_kv_heads={m.n_kv_heads}",
                          "grouped attention shares each KV head among n_heads/n_kv_heads queries")
    if m.d_model % m.n_heads:
        raise ConfigError(f"{prefix}.d_model",
                          f"d_model={m.d_model} is not divisible by n_heads={m.n_heads}",
                          "pick d_model as a multiple of n_heads")
    if m.sliding_window is not None:
        _positive(f"{prefix}.sliding_window", m.sliding_window)
    _positive(f"{prefix}.global_every", m.global_every)
    for name in ("attn_softcap", "final_softcap", "query_pre_attn_scalar"):
        v = getattr(m, name)
        if v is not None:
            _positive(f"{prefix}.{name}", v)
    _positive(f"{prefix}.norm_eps", m.norm_eps)
    _choice(f"{prefix}.dtype", m.dtype, DTYPES)
    _choice(f"{prefix}.param_dtype", m.param_dtype, DTYPES)
    _choice(f"{prefix}.attention", m.attention, ("dense", "chunked", "cudnn", "auto"))


def validate(cfg: Config, *, check_paths: bool = True) -> Config:
    """Raises ConfigError naming the first bad field; returns cfg unchanged."""
    validate_model(cfg.model)
    d, t, k = cfg.data, cfg.train, cfg.distill
    _choice("data.source", d.source, SOURCES)
    if d.source != "synthetic" and not d.path:
        raise ConfigError("data.path", f"data.source={d.source!r} needs a path",
                          "pass --set data.path=/local/path")
    if check_paths and d.path and d.source in ("text", "jsonl", "hf", "tfds"):
        import glob

        if not glob.glob(d.path):
            raise ConfigError("data.path", f"{d.path!r} does not exist",
                              "point it at local data; nothing is downloaded at run time")
    if check_paths and d.tokenizer and not Path(d.tokenizer).exists():
        raise ConfigError("data.tokenizer", f"{d.tokenizer!r} does not exist",
                          "give a SentencePiece .model file, or leave it unset to train one")
    _positive("data.seq_len", d.seq_len)
    _positive("data.batch_size", d.batch_size)
    if d.seq_len > cfg.model.max_seq_len:
        raise ConfigError("data.seq_len",
                          f"{d.seq_len} exceeds model.max_seq_len={cfg.model.max_seq_len}")
    if d.tokenizer is None and d.tokenizer_vocab_size > cfg.model.vocab_size:
        raise ConfigError("data.tokenizer_vocab_size",
                          f"{d.tokenizer_vocab_size} exceeds model.vocab_size={cfg.model.vocab_size}")
    _positive("train.steps", t.steps)
    _positive("train.lr", t.lr)
    _positive("train.warmup_steps", t.warmup_steps, allow_zero=True)
    _choice("train.schedule", t.schedule, ("cosine", "linear", "constant"))
    if not 0 <= t.min_lr_ratio <= 1:
        raise ConfigError("train.min_lr_ratio", f"must be in [0, 1], got {t.min_lr_ratio}")
    _positive("train.weight_decay", t.weight_decay, allow_zero=True)
    _positive("train.grad_clip", t.grad_clip, allow_zero=True)
    _positive("train.log_every", t.log_every)
    _positive("train.checkpoint_every", t.checkpoint_every, allow_zero=True)
    _positive("train.keep_checkpoints", t.keep_checkpoints)
    if t.mesh_data == 0 or t.mesh_fsdp == 0 or (t.mesh_data < 0 and t.mesh_fsdp < 0):
        raise ConfigError("train.mesh_data", "mesh axes must be positive, or -1 on one axis")
    spec = methods.get(k.method)
    if not 0.0 <= k.alpha <= 1.0:
        raise ConfigError("distill.alpha", f"the NLL weight must be in [0, 1], got {k.alpha}")
    if not k.temperature > 0:
        raise ConfigError("distill.temperature", f"must be > 0, got {k.temperature}")
    _choice("distill.divergence", k.divergence, DIVERGENCES)
    if not 0.0 <= k.jsd_beta <= 1.0:
        raise ConfigError("distill.jsd_beta", f"must be in [0, 1], got {k.jsd_beta}")
    if not 0.0 < k.hldf_stage1_share < 1.0:
        raise ConfigError("distill.hldf_stage1_share",
                          f"must be in (0, 1), got {k.hldf_stage1_share}")
    _positive("distill.hidden_weight", k.hidden_weight, allow_zero=True)
    _choice("distill.loss_impl", k.loss_impl, ("fused", "materialized"))
    _choice("distill.fused_backend", k.fused_backend, ("auto", "xla", "pallas"))
    if k.layer_pairs:
        parse_layer_pairs(k.layer_pairs)
    if spec.needs_teacher and not cfg.teacher.checkpoint:
        raise ConfigError("teacher.checkpoint", f"method {k.method!r} needs a teacher",
                          "pass --set teacher.checkpoint=RUN_DIR (an hldstudy run) or a Gemma path")
    _choice("teacher.dtype", cfg.teacher.dtype, DTYPES)
    _positive("teacher.ring_size", cfg.teacher.ring_size, allow_zero=True)
    _positive("budget.flops", cfg.budget.flops, allow_zero=True)
    _choice("wandb.mode", cfg.wandb.mode, ("offline", "online", "disabled"))
    return cfg


# --------------------------------------------------------------------------- #
# Serialization and overrides
# --------------------------------------------------------------------------- #


def config_to_dict(cfg: Any) -> dict:
    return dataclasses.asdict(cfg)


def _build(cls: type, data: dict, prefix: str) -> Any:
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = set(data) - names
    if unknown:
        key = sorted(unknown)[0]
        raise ConfigError(f"{prefix}{key}", "unknown key",
                          f"valid keys: {', '.join(sorted(names))}")
    kwargs = {}
    for name, value in data.items():
        tp = hints[name]
        if dataclasses.is_dataclass(tp):
            if not isinstance(value, dict):
                raise ConfigError(f"{prefix}{name}", "expected a section (mapping)")
            kwargs[name] = _build(tp, value, f"{prefix}{name}.")
        else:
            kwargs[name] = _coerce(value, tp, f"{prefix}{name}")
    return cls(**kwargs)


def config_from_dict(data: dict, cls: type = Config) -> Any:
    """A config from its dict; a config.json's `schema_version` is read and dropped."""
    if cls is Config and "schema_version" in data:
        data = dict(data)
        version = data.pop("schema_version")
        if not isinstance(version, int) or version > SCHEMA_VERSION:
            raise ConfigError("schema_version", f"{version!r} is newer than this hldstudy's "
                              f"{SCHEMA_VERSION}", "upgrade hldstudy to read this run")
    return _build(cls, data, "")


def _coerce(value: Any, tp: Any, fieldname: str) -> Any:
    """Checks / converts a parsed value to the annotated type (int, float, bool, str, optional)."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _coerce(value, inner[0], fieldname)
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(fieldname, f"expected true/false, got {value!r}")
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            if isinstance(value, float) and value.is_integer():
                return int(value)
            raise ConfigError(fieldname, f"expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(fieldname, f"expected a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(fieldname, f"expected a string, got {value!r}")
        return value
    return value


def _parse_literal(text: str) -> Any:
    low = text.strip().lower()
    if low in ("none", "null"):
        return None
    if low == "true":
        return True
    if low == "false":
        return False
    try:
        return json.loads(text)
    except (json.JSONDecodeError, ValueError):
        return text


def apply_overrides(cfg: Config, overrides: list[str] | tuple[str, ...]) -> Config:
    """Applies 'a.b=value' strings. Unknown keys and wrong types raise ConfigError."""
    data = config_to_dict(cfg)
    for item in overrides:
        if "=" not in item:
            raise ConfigError(item, "an override needs the form key.path=value")
        key, raw = item.split("=", 1)
        key = key.strip()
        node = data
        parts = key.split(".")
        for i, p in enumerate(parts[:-1]):
            if not isinstance(node, dict) or p not in node or not isinstance(node[p], dict):
                raise ConfigError(".".join(parts[: i + 1]), "unknown section",
                                  f"sections: {', '.join(k for k, v in data.items() if isinstance(v, dict))}")
            node = node[p]
        if parts[-1] not in node:
            raise ConfigError(key, "unknown key",
                              f"valid keys here: {', '.join(sorted(node))}")
        value = _parse_literal(raw)
        if isinstance(node[parts[-1]], str) and not isinstance(value, str) and value is not None:
            value = raw  # "--set name=123" keeps the string
        node[parts[-1]] = value
    return config_from_dict(data)


def import_entry_point(path: str | Path, function: str, what: str):
    """Imports a Python file (an experiment, a sweep) that must define `function`.

    A missing file, an import error or a missing function is an InputError
    naming the file, never a traceback.
    """
    path = Path(path)
    if not path.exists():
        raise InputError(f"{what} {path} does not exist")
    spec = importlib.util.spec_from_file_location(f"hldstudy_{function}_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as e:  # a broken file is a user error
        raise InputError(f"{what} {path} failed to import: {type(e).__name__}: {e}") from e
    if not hasattr(module, function):
        raise InputError(f"{what} {path} has no {function}() function")
    return module


def load_experiment(path: str | Path) -> Config:
    """Imports an experiment file and calls its `get_config()`."""
    cfg = import_entry_point(path, "get_config", "--config:").get_config()
    if not isinstance(cfg, Config):
        raise InputError(f"--config: {path}: get_config() must return hldstudy.config.Config")
    return cfg


def flatten(d: dict, prefix: str = "") -> dict:
    """{'a': {'b': 1}} -> {'a.b': 1}: config dicts compared field by field."""
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def save_config(cfg: Config, path: str | Path) -> None:
    data = {"schema_version": SCHEMA_VERSION, **config_to_dict(cfg)}
    write_json_atomic(path, data, sort_keys=True)


def read_config(path: str | Path) -> Config:
    path = Path(path)
    if not path.exists():
        raise InputError(f"{path} does not exist (is this an hldstudy run directory?)")
    return config_from_dict(json.loads(path.read_text()))


def replace(cfg: Any, **changes: Any) -> Any:
    return dataclasses.replace(cfg, **changes)
