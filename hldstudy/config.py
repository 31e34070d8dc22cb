"""Frozen, validated configuration for every hldstudy run.

An experiment is a Python file (the built-in ones: `experiments/`)
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
import re
import sys
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hldstudy import teacher_source
from hldstudy.distill import methods
from hldstudy.distill.pairs import parse_layer_pairs
from hldstudy.errors import ConfigError, InputError
from hldstudy.family import FAMILIES, GEMMA3, family_of
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
#   relevant_if    (field, value): only matters when that field has that value;
#   domain         the values it may take (`Domain`): every numeric field and every
#                  choice declares one, and `validate()` checks them all;
#   member         may differ between the students of one cohort (one teacher
#                  forward serves them all): "traced" enters the compiled step as a
#                  per-member value (learning rate, KD temperature and NLL weight,
#                  alignment weight; a train.* one also needs its optimizer wiring, as
#                  lr has), "init" only seeds the initialisation (train.seed);
#   axis           a sweep grid axis: an int orders the axes in run ids (and is the
#                  `Sweep` keyword of the field's name, the analysis column of that
#                  name: analysis="column" is implied); "replicate" is the seed axis
#                  (`Sweep(seeds=...)`, last in run ids, never a grid dimension of the
#                  comparison);
#   short          an axis' name in run ids ("T" -> kd_T2_s0);
#   aliases        further names the analysis accepts for it in folder names.
#
# A new grid axis is therefore one `knob(..., axis=5, short=..., member="traced")`
# line: the sweep's keywords and run ids, the cohort's traced hyperparameters and
# the analysis' columns and folder-name reader all read it (`grid_axes`,
# `replicate_axis`, `traced_members`, `axis_names`).
#
# `operational=True` is the common case of a field that does not change what a
# run computes (cadence, display, transport, device layout): resumable, no drift,
# ignored by the analysis. A field without tags changes results: not resumable,
# drift-checked, compared. Whether a distill.* field applies to a method is the
# method's declaration (`hldstudy.distill.methods`), not a tag.

_RULE_DEFAULTS = {"resume": False, "drift": True, "analysis": "compare",
                  "data_identity": False, "relevant_if": None, "domain": None,
                  "member": False, "axis": None, "short": None, "aliases": ()}
MEMBER_KINDS = (False, "traced", "init")
REPLICATE = "replicate"

_BOUND = re.compile(r"^(>=|>|<=|<)\s*(\S+)$")
_INTERVAL = re.compile(r"^([\[(])\s*([^,\s]+)\s*,\s*([^,\s]+)\s*([\])])$")


@dataclass(frozen=True)
class Domain:
    """The values a field may take, declared next to its default (`knob(..., domain=)`).

    `spec` is a bound ("> 0", ">= 1", "<= 10"), an interval with open or closed ends
    ("[0, 1)", "(0, 1)", "[0, 1]") or a tuple of choices. `also`: values accepted
    outside the range (train.mesh_data's -1); `note`: what a special value means or how
    to pick one, shown as the fix; `multiple_of`: a number in range must also be a
    multiple of it (SparseGPT's block of 2:4 groups). A float is also finite: inf and
    NaN are refused whatever the spec (`check_fields`). None passes where the type
    allows it.
    """

    spec: str | tuple
    also: tuple = ()
    note: str = ""
    multiple_of: int = 0
    lo: float = field(default=-math.inf, init=False, compare=False)
    hi: float = field(default=math.inf, init=False, compare=False)
    lo_open: bool = field(default=True, init=False, compare=False)
    hi_open: bool = field(default=True, init=False, compare=False)

    def __post_init__(self) -> None:
        if isinstance(self.spec, tuple):
            return
        bound, interval = _BOUND.match(self.spec.strip()), _INTERVAL.match(self.spec.strip())
        if bound:
            op, x = bound.group(1), float(bound.group(2))
            lo = op.startswith(">")
            object.__setattr__(self, "lo" if lo else "hi", x)
            object.__setattr__(self, "lo_open" if lo else "hi_open", not op.endswith("="))
        elif interval:
            object.__setattr__(self, "lo", float(interval.group(2)))
            object.__setattr__(self, "hi", float(interval.group(3)))
            object.__setattr__(self, "lo_open", interval.group(1) == "(")
            object.__setattr__(self, "hi_open", interval.group(4) == ")")
        else:
            raise TypeError(f"domain {self.spec!r}: expected '> x', '>= x', '[a, b)', ... "
                            "or a tuple of choices")

    @property
    def choices(self) -> tuple:
        return self.spec if isinstance(self.spec, tuple) else ()

    def describe(self) -> str:
        if self.choices:
            text = f"one of {', '.join(map(str, self.choices))}"
        else:
            text = self.spec.strip()
            text = f"in {text}" if text[0] in "[(" else text
            text += f" and a multiple of {self.multiple_of}" if self.multiple_of else ""
        return text + "".join(f" or {a!r}" for a in self.also)

    def contains(self, value: Any) -> bool:
        if value in self.also:
            return True
        if self.choices:
            return value in self.choices
        if isinstance(value, float) and not math.isfinite(value):
            return False
        above = value > self.lo if self.lo_open else value >= self.lo
        below = value < self.hi if self.hi_open else value <= self.hi
        return above and below and not (self.multiple_of and value % self.multiple_of)

    def check(self, fieldname: str, value: Any, default: Any = None) -> None:
        """Raises ConfigError naming the field, the domain and the fix."""
        if value is None or self.contains(value):
            return
        if self.choices:
            raise ConfigError(fieldname, f"{value!r} is not one of "
                              f"{', '.join(map(str, self.choices))}", self.note)
        fix = self.note or (f"the default is {default!r}" if default is not None else "")
        raise ConfigError(fieldname, f"must be {self.describe()}, got {value!r}", fix)


def knob(default: Any = dataclasses.MISSING, *, factory: Any = dataclasses.MISSING,
         operational: bool = False, **rules: Any) -> Any:
    """A dataclass field with its rules (see above) in its metadata. `domain` may be a
    `Domain`, its spec string ("> 0", "[0, 1)") or a tuple of choices."""
    unknown = set(rules) - set(_RULE_DEFAULTS)
    if unknown:
        raise TypeError(f"unknown field rules {sorted(unknown)}")
    if rules.get("member", False) not in MEMBER_KINDS:
        raise TypeError(f"member={rules['member']!r}: expected one of {MEMBER_KINDS}")
    axis = rules.get("axis")
    if axis not in (None, REPLICATE) and type(axis) is not int:
        raise TypeError(f"axis={axis!r}: expected an int (its place in run ids) or "
                        f"{REPLICATE!r}")
    if (axis is None) == bool(rules.get("short")) or (axis is None and rules.get("aliases")):
        raise TypeError("an axis has a short name (its name in run ids), and only an axis")
    if rules.get("domain") is not None and not isinstance(rules["domain"], Domain):
        rules["domain"] = Domain(rules["domain"])
    if operational:
        rules = {"resume": True, "drift": False, "analysis": "ignore", **rules}
    if axis is not None:  # an axis is a column of the analysis (its field name)
        rules = {"analysis": "column", **rules}
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


def grid_axes(cls: type | None = None) -> tuple[str, ...]:
    """The grid axes (rule `axis`: an int), in run-id order."""
    rules = field_rules(cls)
    return tuple(sorted((k for k, r in rules.items()
                         if r["axis"] is not None and r["axis"] != REPLICATE),
                        key=lambda k: rules[k]["axis"]))


def replicate_axis(cls: type | None = None) -> str:
    """The seed axis (`axis="replicate"`): the one field whose runs are replicates."""
    names = [k for k, r in field_rules(cls).items() if r["axis"] == REPLICATE]
    if len(names) != 1:
        raise TypeError(f"exactly one field has axis={REPLICATE!r}, found {names}")
    return names[0]


def traced_members(cls: type | None = None) -> dict[str, tuple[str, str]]:
    """{field name: (section, field)} of the `member="traced"` fields: the per-member
    values a cohort feeds into its compiled step."""
    return {k.rsplit(".", 1)[-1]: tuple(k.split(".")) for k, r in field_rules(cls).items()
            if r["member"] == "traced"}


def axis_names(cls: type | None = None) -> dict[str, dict[str, str]]:
    """{axis field: {"column": its name (the Sweep keyword, the analysis column),
    "short": its run-id name, "names": every name a folder name may use}} for the
    grid axes and the replicate axis. Raises TypeError when two axes share a name."""
    rules = field_rules(cls)
    out, seen = {}, {}
    for key in (*grid_axes(cls), replicate_axis(cls)):
        r, column = rules[key], key.rsplit(".", 1)[-1]
        names = tuple(dict.fromkeys((column, r["short"], *r["aliases"])))
        for n in names:
            if seen.setdefault(n, key) != key:
                raise TypeError(f"{key} and {seen[n]} both use the axis name {n!r}")
        out[key] = {"column": column, "short": r["short"], "names": names}
    return out


# --------------------------------------------------------------------------- #
# Sections
# --------------------------------------------------------------------------- #

DTYPES = ("float32", "bfloat16", "float16")
SOURCES = ("synthetic", "text", "jsonl", "tfds", "hf", "shards")
DIVERGENCES = ("forward_kl", "reverse_kl", "jsd")
SCHEDULES = ("cosine", "linear", "constant")
STAGE_BOUNDARIES = ("restart", "continue")
NMSE_FORMS = ("batch", "token")
ATTENTIONS = ("dense", "chunked", "cudnn", "splash", "auto")
REMAT_POLICIES = ("nothing_saveable", "dots_saveable", "offload_dots")  # hldstudy.model.stack
MOE_DISPATCHES = ("auto", "ragged", "capacity")  # hldstudy.model.moe
LOSS_IMPLS = ("fused", "materialized")
FUSED_BACKENDS = ("auto", "xla", "pallas", "pallas_triton", "pallas_mosaic")
WANDB_MODES = ("offline", "online", "disabled")
FAMILY_NAMES = tuple(FAMILIES)
# Shared domains: a count of at least one, a count that may be zero, a positive float.
COUNT = Domain(">= 1")
NONNEG = Domain(">= 0")
POSITIVE = Domain("> 0")
UNIT = Domain("[0, 1]")
_MESH = Domain(">= 1", also=(-1,), note="-1 on one axis takes the remaining devices")


def moe_dispatch_for(dispatch: str, backend: str, hopper: bool = True,
                     forward_only: bool = True) -> str:
    """`model.moe_dispatch` / `teacher.moe_dispatch` as it runs on `backend` ("cpu", "gpu",
    "tpu"; `hopper`: an sm_90 GPU, H100 / H200; `forward_only`: a teacher's forward). Auto
    is ragged (dropless) where a grouped matmul runs it: TPU (XLA's own), CPU (the
    reference) and, for a forward, Hopper (JAX's Mosaic GPU kernels,
    `hldstudy.model.grouped_matmul`); capacity elsewhere on NVIDIA GPUs: XLA GPU runs
    `ragged_dot` as a dense pass over every expert (benchmarks/results/aot_moe.md), and the
    kernels' weight gradient compiles only in a process that has the GPU, so a trained
    MoE's step through them has no compiled evidence from a CPU host (ragged, set
    explicitly, trains through them on a GPU host). The planner's GPU row is the Hopper one
    (its calibration compiles are H100 / H200) and it sizes replicas, hence the defaults."""
    if dispatch != "auto":
        return dispatch
    if backend == "gpu":
        return "ragged" if hopper and forward_only else "capacity"
    return "ragged"


def experts_run_dense(dispatch: str, backend: str, hopper: bool = True,
                      forward_only: bool = True) -> bool:
    """Whether an MoE's routed experts run as a dense pass of every row over every expert:
    ragged dispatch (`jax.lax.ragged_dot`) on XLA's CPU compiler and on a GPU without the
    Hopper kernels."""
    return moe_dispatch_for(dispatch, backend, hopper, forward_only) == "ragged" and (
        backend == "cpu" or (backend == "gpu" and not hopper))


def layer_window(sliding_window: int | None, global_every: int, i: int) -> int | None:
    """The attention window of 0-based layer i (None: global). Every `global_every`-th
    layer (1-based) is global, the others local with `sliding_window` (Gemma 3: 6)."""
    if sliding_window is None or global_every <= 1 or (i + 1) % global_every == 0:
        return None
    return sliding_window


@dataclass(frozen=True)
class ModelConfig:
    """A Gemma-style decoder. Field names follow DESIGN.md."""

    vocab_size: int = knob(32768, domain=COUNT)
    d_model: int = knob(640, domain=COUNT)
    n_layers: int = knob(18, domain=COUNT)
    n_heads: int = knob(4, domain=COUNT)
    n_kv_heads: int = knob(1, domain=COUNT)
    head_dim: int = knob(256, domain=COUNT)
    d_ff: int = knob(2048, domain=COUNT)
    max_seq_len: int = knob(2048, domain=COUNT)
    rope_base_global: float = knob(1_000_000.0, domain=POSITIVE)
    rope_base_local: float = knob(10_000.0, domain=POSITIVE)
    # Local (sliding-window) layers: window size in tokens; None = all layers global.
    sliding_window: int | None = knob(None, domain=COUNT)
    # Every `global_every`-th layer (1-based) is global, the others local
    # (Gemma 3: 6 -> five local then one global). 1 = all global.
    global_every: int = knob(1, domain=COUNT)
    qk_norm: bool = True
    attn_softcap: float | None = knob(None, domain=POSITIVE)
    final_softcap: float | None = knob(None, domain=POSITIVE)
    # Queries are scaled by query_pre_attn_scalar**-0.5 (None -> head_dim).
    query_pre_attn_scalar: float | None = knob(None, domain=POSITIVE)
    norm_eps: float = knob(1e-6, domain=POSITIVE)
    # Compute dtype of activations; parameters stay float32.
    dtype: str = knob("float32", domain=DTYPES)
    param_dtype: str = knob("float32", domain=DTYPES)
    # Attention kernel (hldstudy/model/attention.py): dense (masked T x T, the
    # reference) | chunked (flash-style blocks, any backend) | cudnn (NVIDIA GPU,
    # bf16/fp16, no soft-cap) | auto (cudnn where it fits on GPU, else chunked
    # for long sequences). All compute the same attention.
    attention: str = knob("dense", domain=ATTENTIONS)
    # Recompute each block in the backward pass (saves activation memory).
    remat: bool = knob(False, analysis="ignore")
    # What the backward keeps instead of recomputing under remat (hldstudy.model.stack):
    # nothing_saveable | dots_saveable | offload_dots (matmul outputs in host memory).
    remat_policy: str = knob("nothing_saveable", analysis="ignore", domain=REMAT_POLICIES)
    # Trace each repeating group of layers once and run the stack under a scan (compile
    # time and the backward's live buffers bounded by one group; hldstudy.model.stack).
    scan_layers: bool = knob(False, analysis="ignore")
    # --- Family and block stack (hldstudy/family.py owns what these mean) ---
    # gemma3: pre+post norms, GeGLU, sqrt(d)-scaled embedding. qwen3_5: pre-norm blocks,
    # SwiGLU (or MoE), unscaled embedding, gated full attention and Gated DeltaNet layers.
    family: str = knob(GEMMA3.name, domain=FAMILY_NAMES)
    # Comma-separated layer types repeated cyclically over n_layers ("" = the family's
    # default): attention (gemma3); full_attention, linear_attention (qwen3_5).
    layer_types: str = ""
    tie_embeddings: bool = True
    # Share of each attention head's dims that is rotated (Qwen3.5: 0.25).
    rotary_fraction: float = knob(1.0, domain="(0, 1]")
    # Gated DeltaNet (linear_attention layers): heads, head dims, conv kernel, and the
    # chunk length of the parallel (training) form -- any chunk gives the same result.
    linear_k_heads: int = knob(0, domain=NONNEG)
    linear_v_heads: int = knob(0, domain=NONNEG)
    linear_k_head_dim: int = knob(0, domain=NONNEG)
    linear_v_head_dim: int = knob(0, domain=NONNEG)
    linear_conv_kernel: int = knob(4, domain=COUNT)
    deltanet_chunk: int = knob(64, domain=COUNT)
    # Mixture of experts in every block (0 experts = dense MLP of width d_ff): routed experts
    # of width d_expert, top experts_per_token (weights renormalised over the chosen), one
    # sigmoid-gated shared expert of width d_shared_expert (0 = none).
    n_experts: int = knob(0, domain=NONNEG)
    experts_per_token: int = knob(0, domain=NONNEG)
    d_expert: int = knob(0, domain=NONNEG)
    d_shared_expert: int = knob(0, domain=NONNEG)
    # Weight of the router's load-balancing loss in a student's objective (0 = off).
    router_aux_weight: float = knob(0.0, domain=NONNEG)
    # How routed rows reach their experts (hldstudy.model.moe): ragged (dropless grouped
    # matmul: libtpu's on TPU, JAX's Mosaic GPU kernels on Hopper, a dense pass over every
    # expert on CPU and other GPUs), capacity (per sequence, a buffer of
    # moe_capacity_factor x the even share of its rows per expert, batched matmuls; rows
    # past it dropped and logged: expert_drop_rate), auto (config.moe_dispatch_for).
    moe_dispatch: str = knob("auto", analysis="ignore", domain=MOE_DISPATCHES)
    moe_capacity_factor: float = knob(2.0, analysis="ignore", domain=POSITIVE)
    # Only ever run forward (a teacher: hldstudy.teacher.colocated.forward_config), so an
    # auto choice may take a path whose backward could not be compiled here.
    forward_only: bool = knob(False, analysis="ignore")

    def is_global_layer(self, i: int) -> bool:
        """0-based layer index i: True where attention sees the whole causal context."""
        return layer_window(self.sliding_window, self.global_every, i) is None

    def window(self, i: int) -> int | None:
        return layer_window(self.sliding_window, self.global_every, i)

    def rope_base(self, i: int) -> float:
        return self.rope_base_global if self.is_global_layer(i) else self.rope_base_local

    def layer_type(self, i: int) -> str:
        """0-based layer i's type: `layer_types` repeated cyclically ("" = every layer
        "attention" for gemma3, three linear_attention then one full_attention for qwen3_5)."""
        types = [t.strip() for t in self.layer_types.split(",") if t.strip()] or \
            list(family_of(self).default_layer_types)
        return types[i % len(types)]


@dataclass(frozen=True)
class DataConfig:
    # synthetic | text | jsonl | tfds | hf | shards (prepared by `hldstudy data prepare`)
    source: str = knob("synthetic", data_identity=True, domain=SOURCES)
    # File, glob or directory for text/jsonl/hf; TFDS data_dir for tfds; the prepared
    # directory for shards.
    path: str | None = knob(None, resume=True)
    tfds_name: str = knob("c4/en", data_identity=True)
    text_field: str = knob("text", data_identity=True)
    train_split: str = knob("train", data_identity=True)
    valid_split: str = "validation"
    # SentencePiece model file; None -> train one on the training corpus into the run dir.
    tokenizer: str | None = knob(None, resume=True)
    tokenizer_vocab_size: int = knob(512, domain=COUNT)
    seq_len: int = knob(128, data_identity=True, domain=COUNT)
    batch_size: int = knob(8, data_identity=True, domain=COUNT)
    seed: int = knob(0, data_identity=True, analysis="column", domain=NONNEG)
    # Synthetic corpus size (documents) for the train / validation splits.
    synthetic_docs: int = knob(20000, data_identity=True, domain=COUNT)
    synthetic_valid_docs: int = knob(500, domain=COUNT)
    # Pack documents with segment ids (True) or cut a token stream at seq_len (False).
    packing: bool = knob(True, data_identity=True)
    # Seed of the synthetic corpus itself (data.seed only shuffles), so runs with
    # different shuffles (e.g. teacher and student) share one corpus.
    synthetic_seed: int = knob(0, data_identity=True, domain=NONNEG)
    # text/jsonl/hf: separate validation file/glob/dir; None -> hold out the last
    # `valid_holdout_docs` documents (at most 10%) of the training corpus.
    valid_path: str | None = None
    valid_holdout_docs: int = knob(500, domain=Domain(">= 0", note="0 = no holdout"))
    # Use at most this many documents of a source (0 = all).
    max_docs: int = knob(0, data_identity=True,
                         domain=Domain(">= 0", note="0 = all documents"))
    # Prepend BOS to every document (Gemma-style tokenizers expect it).
    add_bos: bool = knob(False, data_identity=True)
    # Streaming (tfds): processes that fetch and encode documents ahead of the packer
    # (0 = in the training process).
    workers: int = knob(0, operational=True, domain=NONNEG)
    # Prepared shards: read a record whose checksum fails as an empty document (each one
    # logged) instead of stopping the run.
    skip_corrupt: bool = knob(False, operational=True)


@dataclass(frozen=True)
class TrainConfig:
    steps: int = knob(100, resume=True, domain=COUNT)
    lr: float = knob(3e-3, domain=POSITIVE, member="traced", axis=1, short="lr")
    warmup_steps: int = knob(10, domain=NONNEG)
    # cosine | linear | constant
    schedule: str = knob("cosine", domain=SCHEDULES)
    min_lr_ratio: float = knob(0.1, domain=UNIT)
    weight_decay: float = knob(0.1, domain=NONNEG)
    b1: float = knob(0.9, domain=Domain("[0, 1)", note="Adam's first-moment decay, e.g. 0.9"))
    b2: float = knob(0.95, domain=Domain("[0, 1)", note="Adam's second-moment decay, e.g. 0.95-0.999"))
    grad_clip: float = knob(1.0, domain=Domain(">= 0", note="0 = no clipping"))
    # Between the stages of a two-stage method (HLDF): restart (each stage its own
    # optimizer and schedule, warm-up included: FitNets' two trainings) or continue (one
    # schedule over the run's steps; Adam's moments carried for every parameter both
    # stages train, zero for those stage 1 froze; the regressor dropped).
    stage_boundary: str = knob("restart", domain=STAGE_BOUNDARIES, axis=5, short="sb")
    seed: int = knob(0, domain=NONNEG, member="init", axis=REPLICATE, short="s")
    log_every: int = knob(10, operational=True, domain=COUNT)
    eval_every: int = knob(0, operational=True,
                           domain=Domain(">= 0", note="0 = evaluate at the end only"))
    eval_batches: int = knob(8, resume=True, analysis="ignore",
                             domain=Domain(">= 0", note="0 = the whole validation split"))
    checkpoint_every: int = knob(50, operational=True,
                                 domain=Domain(">= 0", note="0 = at the end only"))
    # At least 2: the latest checkpoint and one to fall back on when it is damaged.
    keep_checkpoints: int = knob(2, operational=True, domain=Domain(
        ">= 2", note="the latest checkpoint and one to fall back on if it is damaged"))
    # Mesh: data-parallel x FSDP x expert. -1 on data or fsdp takes the remaining devices.
    # The expert axis splits MoE expert weights along their experts (hldstudy.sharding)
    # and, like the others, the batch; it must divide model.n_experts.
    mesh_data: int = knob(-1, operational=True, domain=_MESH)
    mesh_fsdp: int = knob(1, operational=True, domain=_MESH)
    mesh_expert: int = knob(1, operational=True, domain=COUNT)
    progress: bool = knob(True, operational=True)
    # Gradient accumulation: the batch as this many micro-batches per step, their
    # gradients summed (the same gradient as the whole batch's: losses weighted by valid
    # tokens, the NMSE's teacher norms over the whole batch). 0 = auto: one micro-batch
    # when the step fits the device, else the fewest that fit (the compiler decides).
    microbatches: int = knob(0, operational=True, domain=NONNEG)


@dataclass(frozen=True)
class DistillConfig:
    # baseline | kd | hldf | hldc | patient
    method: str = knob(methods.BASELINE, analysis="column")
    alpha: float = knob(0.5, domain=UNIT, member="traced", axis=3, short="a",
                        aliases=("nllw", "nll"))  # NLL weight
    temperature: float = knob(1.0, domain=POSITIVE, member="traced", axis=2, short="T",
                              aliases=("temp", "tau"))
    # forward_kl | reverse_kl | jsd
    divergence: str = knob("forward_kl", domain=DIVERGENCES)
    jsd_beta: float = knob(0.5, relevant_if=("distill.divergence", "jsd"), domain=UNIT)
    # Weight of the hidden-alignment NMSE (hldc, patient).
    hidden_weight: float = knob(1.0, domain=NONNEG, member="traced", axis=4, short="hw")
    # "s:t,s:t" pairs of (student layer, teacher layer), 1-based block outputs.
    # Empty -> middle layer of each (hld*), evenly mapped layers (patient).
    layer_pairs: str = ""
    patient_pairs: int = knob(3, domain=COUNT)
    # Learned dense regressor d_s -> d_t per pair; False aligns raw states (needs d_s == d_t).
    regressor: bool = True
    # Share of the FLOP budget spent in HLDF stage 1, in (0, 1).
    hldf_stage1_share: float = knob(0.2, domain="(0, 1)", axis=7, short="sh")
    # The alignment loss: batch (sum of squared errors over the batch / sum of the
    # teacher's squares) or token (each valid position's own ratio, averaged: no
    # high-norm position outweighs the others).
    nmse: str = knob("batch", domain=NMSE_FORMS, axis=6, short="nmse")
    # fused | materialized
    loss_impl: str = knob("fused", analysis="ignore", domain=LOSS_IMPLS)
    # auto | xla | pallas (only for loss_impl=fused)
    fused_backend: str = knob("auto", analysis="ignore", domain=FUSED_BACKENDS)


@dataclass(frozen=True)
class TeacherConfig:
    # hldstudy run dir, GGUF file, HF safetensors dir, or remote://host:port[,...]
    checkpoint: str | None = knob(None, resume=True)
    # The teacher's model preset (hldstudy.model.presets): its shape where the checkpoint
    # cannot say yet (compiling with hldstudy.aot, counting FLOPs before the weights
    # exist); a checkpoint's own config wins.
    preset: str | None = knob(None, resume=True)
    dtype: str = knob("float32", domain=DTYPES)
    # How an MoE teacher's forward reaches its experts (model.moe_dispatch's choices;
    # capacity drops rows past factor x the even share per expert, and says so each step).
    moe_dispatch: str = knob("auto", domain=MOE_DISPATCHES)
    moe_capacity_factor: float = knob(2.0, domain=POSITIVE)
    # The attention path of the teacher's forward (model.attention's choices; auto = the
    # target's fused kernel); None = the checkpoint's own config.
    attention: str | None = knob(None, domain=ATTENTIONS)
    # Prefetch ring depth for a remote teacher.
    ring_size: int = knob(4, operational=True,
                          domain=Domain(">= 0", note="0 = request each step when it is needed"))
    timeout_s: float = knob(30.0, operational=True, domain=POSITIVE)
    # Sequences per forward on a teacher replica (`hldstudy.teacher.serve`): the global
    # batch runs as data.batch_size / replica_batch micro-batches inside one compiled
    # forward, so the replica's peak is one micro-batch's; 0 = the largest divisor of
    # data.batch_size whose forward fits the replica's device (hldstudy.teacher.microbatch).
    replica_batch: int = knob(0, operational=True,
                              domain=Domain(">= 0", note="0 = auto: the largest that fits"))
    # Devices of its host a replica's forward runs over: its weights split over them
    # (FSDP) and every micro-batch too (hldstudy.teacher.microbatch.replica_devices).
    replica_devices: int = knob(1, operational=True,
                                domain=Domain(">= 0", note="0 = every device of the host"))
    # Shared secret every call to a replica carries (the replicas' --token-file).
    token_file: str | None = knob(None, operational=True)
    # TLS: the root certificate (PEM) the replicas' --tls-cert chains to; None = plaintext.
    tls_ca: str | None = knob(None, operational=True)


@dataclass(frozen=True)
class BudgetConfig:
    # Total FLOP budget; 0 -> train.steps decides.
    flops: float = knob(0.0, resume=True, analysis="column",
                        domain=Domain(">= 0", note="0 = train.steps decides"))
    # Count the teacher's forward in the budget (the study counts student-side only).
    count_teacher: bool = knob(False, analysis="column")
    # Count the losses' own FLOPs in the budget: logit KD over the vocabulary (beyond the
    # NLL every method pays), the NMSE, and a served teacher's logits rebuilt
    # student-side. Off: the design card's 6ND + de-embedding / regressor terms.
    count_loss: bool = knob(False, analysis="column")


@dataclass(frozen=True)
class WandbConfig:
    enabled: bool = knob(False, operational=True)
    project: str = knob("hldstudy", operational=True)
    entity: str | None = knob(None, operational=True)
    group: str | None = knob(None, operational=True)
    # offline | online | disabled; WANDB_MODE in the environment wins.
    mode: str = knob("offline", operational=True, domain=WANDB_MODES)


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

def _leaves(obj: Any, prefix: str = ""):
    """(dotted name, dataclass field, value) of every leaf of a config (or a section)."""
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            yield from _leaves(value, f"{prefix}{f.name}.")
        else:
            yield f"{prefix}{f.name}", f, value


def check_fields(obj: Any, prefix: str = "") -> None:
    """Every field's declared `Domain` (ranges, choices), and every float finite.

    `obj` is a Config or one section (`prefix` names it, e.g. "model.").
    Raises ConfigError naming the first field outside its domain, and the fix.
    """
    for name, f, value in _leaves(obj, prefix):
        domain = f.metadata.get("rules", {}).get("domain")
        if isinstance(value, float) and not math.isfinite(value):
            where = f" ({domain.describe()})" if domain is not None else ""
            raise ConfigError(name, f"must be a finite number{where}, got {value!r}",
                              f"the default is {f.default!r}" if f.default is not None else "")
        if domain is not None:
            domain.check(name, value, None if f.default is dataclasses.MISSING else f.default)


def check_name(name: str) -> None:
    """`name` names the folder runs/<name>: one plain path component."""
    if (not name or name in (".", "..") or "/" in name or "\\" in name or "\0" in name
            or name != name.strip()):
        raise ConfigError("name", f"{name!r} is not a plain folder name (runs go to "
                          "runs/<name>)", "use letters, digits, '-', '_' and '.'; "
                          "--workdir chooses another place")


def validate_model(m: ModelConfig, prefix: str = "model") -> None:
    check_fields(m, f"{prefix}.")
    if m.n_heads % m.n_kv_heads:
        raise ConfigError(f"{prefix}.n_kv_heads",
                          f"n_heads={m.n_heads} is not a multiple of n_kv_heads={m.n_kv_heads}",
                          "grouped attention shares each KV head among n_heads/n_kv_heads queries")
    if m.d_model % m.n_heads:
        raise ConfigError(f"{prefix}.d_model",
                          f"d_model={m.d_model} is not divisible by n_heads={m.n_heads}",
                          "pick d_model as a multiple of n_heads")
    validate_model_family(m, prefix)


def validate_model_family(m: ModelConfig, prefix: str = "model") -> None:
    """The family fields: layer types the family builds, DeltaNet and MoE shapes."""
    fam = family_of(m)
    types = {m.layer_type(i) for i in range(m.n_layers)}
    unknown = sorted(types - set(fam.layer_types))
    if unknown:
        raise ConfigError(f"{prefix}.layer_types", f"{unknown[0]!r} is not a {m.family} layer type",
                          f"choose from {', '.join(fam.layer_types)}")
    others = dict.fromkeys(f for other in FAMILIES.values() for f in other.optional_fields)
    for name in (f for f in others if f not in fam.optional_fields):
        if getattr(m, name):
            owners = [f.name for f in FAMILIES.values() if name in f.optional_fields]
            raise ConfigError(f"{prefix}.{name}", f"{m.family} blocks have no {name}",
                              f"set model.family={owners[0]}")
    rotary = int(m.head_dim * m.rotary_fraction)
    if rotary < 2 or rotary % 2:
        raise ConfigError(f"{prefix}.rotary_fraction", f"head_dim * rotary_fraction = {rotary} "
                          "is not an even number >= 2", "rotate an even number of dims")
    if "linear_attention" in types:
        for name in ("linear_k_heads", "linear_v_heads", "linear_k_head_dim", "linear_v_head_dim"):
            if getattr(m, name) < 1:
                raise ConfigError(f"{prefix}.{name}", "must be >= 1 for linear_attention layers")
        if m.linear_v_heads % m.linear_k_heads:
            raise ConfigError(f"{prefix}.linear_v_heads", f"{m.linear_v_heads} is not a multiple "
                              f"of linear_k_heads={m.linear_k_heads}")
    if m.n_experts:
        if not 1 <= m.experts_per_token <= m.n_experts:
            raise ConfigError(f"{prefix}.experts_per_token", f"must be in 1..n_experts="
                              f"{m.n_experts}, got {m.experts_per_token}")
        if m.d_expert < 1:
            raise ConfigError(f"{prefix}.d_expert", "must be >= 1 with n_experts > 0")


def check_expert_axis(n_experts: int, expert_axis: int, what: str) -> None:
    """The mesh's expert axis must divide a MoE's experts (each device holds whole experts);
    `what` names the experts' owner (a field, or a weight's shape) in the error."""
    if n_experts % expert_axis:
        raise ConfigError("train.mesh_expert",
                          f"{expert_axis} does not divide {what} ({n_experts} experts)",
                          f"use a divisor of {n_experts}, or 1 (no expert sharding)")


def validate(cfg: Config, *, check_paths: bool = True, need_teacher: bool = True) -> Config:
    """Raises ConfigError naming the first bad field; returns cfg unchanged.

    Every field's declared domain first (`check_fields`), then the checks that
    involve several fields or the file system. `need_teacher=False`: the caller
    knows the teacher's shape another way (the FLOP CLI's --teacher-preset).
    """
    check_fields(cfg)
    check_name(cfg.name)
    validate_model(cfg.model)
    d, t, k = cfg.data, cfg.train, cfg.distill
    if check_paths and d.source != "synthetic" and not d.path:  # compiling reads no data
        raise ConfigError("data.path", f"data.source={d.source!r} needs a path",
                          "pass --set data.path=/local/path")
    if check_paths and d.path and d.source in ("text", "jsonl", "hf", "tfds", "shards"):
        import glob

        if not glob.glob(d.path):
            raise ConfigError("data.path", f"{d.path!r} does not exist",
                              "point it at local data; nothing is downloaded at run time")
    if check_paths and d.tokenizer and not Path(d.tokenizer).exists():
        raise ConfigError("data.tokenizer", f"{d.tokenizer!r} does not exist",
                          "give a SentencePiece .model file, or leave it unset to train one")
    if d.seq_len > cfg.model.max_seq_len:
        raise ConfigError("data.seq_len",
                          f"{d.seq_len} exceeds model.max_seq_len={cfg.model.max_seq_len}")
    if d.tokenizer is None and d.tokenizer_vocab_size > cfg.model.vocab_size:
        raise ConfigError("data.tokenizer_vocab_size",
                          f"{d.tokenizer_vocab_size} exceeds model.vocab_size={cfg.model.vocab_size}")
    if t.mesh_data < 0 and t.mesh_fsdp < 0:
        raise ConfigError("train.mesh_data", "mesh axes must be positive, or -1 on one axis")
    if cfg.model.n_experts:
        check_expert_axis(cfg.model.n_experts, t.mesh_expert, "model.n_experts")
    spec = methods.get(k.method)
    if k.layer_pairs:
        parse_layer_pairs(k.layer_pairs)
    if need_teacher and spec.needs_teacher and not cfg.teacher.checkpoint:
        raise ConfigError("teacher.checkpoint", f"method {k.method!r} needs a teacher",
                          "pass --set teacher.checkpoint=RUN_DIR (an hldstudy run) or a Gemma path")
    mb = cfg.train.microbatches
    if mb and d.batch_size % mb:
        raise ConfigError("train.microbatches", f"{mb} does not divide data.batch_size="
                          f"{d.batch_size}", "give a divisor of the batch, or 0 (auto)")
    rb = cfg.teacher.replica_batch
    if rb and d.batch_size % rb:
        raise ConfigError("teacher.replica_batch", f"{rb} does not divide data.batch_size="
                          f"{d.batch_size}", "give a divisor of the batch, or 0 (auto)")
    teacher_source.parse(cfg.teacher.checkpoint)  # a remote address: hosts and ports
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


def config_from_dict(data: dict, cls: type = Config, prefix: str = "") -> Any:
    """A config (or any dataclass section of typed fields) from its dict; a config.json's
    `schema_version` is read and dropped. `prefix` ("compress.") prefixes the field names
    in errors. Unknown keys and wrong types raise ConfigError naming the field."""
    if not isinstance(data, dict):
        raise ConfigError(prefix.rstrip(".") or "config", "expected a section (mapping)")
    if cls is Config and "schema_version" in data:
        data = dict(data)
        version = data.pop("schema_version")
        if not isinstance(version, int) or version > SCHEMA_VERSION:
            raise ConfigError("schema_version", f"{version!r} is newer than this hldstudy's "
                              f"{SCHEMA_VERSION}", "upgrade hldstudy to read this run")
    return _build(cls, data, prefix)


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


def parse_literal(text: str) -> Any:
    """The value of `--set key=TEXT`: none/null, true/false, JSON, else the text itself."""
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
    """Applies 'a.b=value' strings. Unknown keys and wrong types raise ConfigError.

    A mapping for a whole section (`train={"steps": 3, "lr": 0.01}`) is merged into
    it: the same as one `train.<key>=...` per entry; the section's other fields keep
    their values (it never resets them to their defaults). Anything else for a
    section is refused.
    """
    data = config_to_dict(cfg)
    for item in overrides:
        if "=" not in item:
            raise ConfigError(item, "an override needs the form key.path=value")
        key, raw = item.split("=", 1)
        key = key.strip()
        node = data
        parts = key.split(".")
        for i, p in enumerate(parts[:-1]):
            if isinstance(node, dict) and p in node and not isinstance(node[p], dict):
                raise ConfigError(".".join(parts[: i + 1]), f"is a field ({node[p]!r}), "
                                  "not a section with fields of its own",
                                  f"set it as {'.'.join(parts[: i + 1])}=VALUE")
            if not isinstance(node, dict) or p not in node or not isinstance(node[p], dict):
                raise ConfigError(".".join(parts[: i + 1]), "unknown section",
                                  f"sections: {', '.join(k for k, v in data.items() if isinstance(v, dict))}")
            node = node[p]
        if parts[-1] not in node:
            raise ConfigError(key, "unknown key",
                              f"valid keys here: {', '.join(sorted(node))}")
        value = parse_literal(raw)
        if isinstance(node[parts[-1]], dict):  # a whole section: merge, key by key
            section = node[parts[-1]]
            if not isinstance(value, dict):
                raise ConfigError(key, f"is a section; {raw!r} is not a mapping of its fields",
                                  f"set one field, e.g. {key}.{next(iter(section))}=..., or "
                                  "give a JSON object of fields")
            for sub, subvalue in value.items():
                if sub not in section:
                    raise ConfigError(f"{key}.{sub}", "unknown key",
                                      f"valid keys here: {', '.join(sorted(section))}")
                if isinstance(section[sub], dict):
                    raise ConfigError(f"{key}.{sub}", "nested sections are not merged",
                                      f"set {key}.{sub}.<field>=... instead")
                section[sub] = subvalue
            continue
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
    if path.is_dir():
        raise InputError(f"{what} {path} is a directory (give the Python file that defines "
                         f"{function}(), or the name of a built-in one)")
    spec = importlib.util.spec_from_file_location(f"hldstudy_{function}_{path.stem}", path)
    if spec is None or spec.loader is None:
        raise InputError(f"{what} {path} is not a Python file (give a .py file that defines "
                         f"{function}())")
    module = importlib.util.module_from_spec(spec)
    # Registered while it runs, as an import would: a dataclass defined there looks its
    # module up by name.
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as e:  # a broken file is a user error
        sys.modules.pop(spec.name, None)
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
