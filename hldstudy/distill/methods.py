"""The methods, declared once: what each trains, stage by stage.

Design notes: `docs/methods.md`, under this file's name.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hldstudy.errors import ConfigError

TERMS = ("nll", "kd", "align")
DEPTHS = ("all", "aligned")

# distill.* fields of the logit-KD objective, and of hidden alignment.
KD_FIELDS = ("distill.alpha", "distill.temperature", "distill.divergence", "distill.jsd_beta",
             "distill.loss_impl", "distill.fused_backend")
ALIGN_FIELDS = ("distill.layer_pairs", "distill.regressor", "distill.nmse")
# Fields outside distill.* that change only what a method of several stages trains.
MULTI_STAGE_FIELDS = ("train.stage_boundary",)


@dataclass(frozen=True)
class StageSpec:
    """One stage of a method.

    share: the stage's share of the FLOP budget (and of train.steps without a
        budget): a number, the dotted name of the config field that holds it,
        or None for what the other stages leave (the last stage).
    """

    name: str
    terms: tuple[str, ...]
    share: float | str | None = None
    depth: str = "all"

    @property
    def kd(self) -> bool:
        return "kd" in self.terms

    @property
    def aligns(self) -> bool:
        return "align" in self.terms

    @property
    def student_head(self) -> bool:
        """Whether the student's LM head runs (NLL or KD need its logits)."""
        return "nll" in self.terms or "kd" in self.terms

    @property
    def teacher_head(self) -> bool:
        return self.kd

    @property
    def uses_teacher(self) -> bool:
        return self.kd or self.aligns


@dataclass(frozen=True)
class Stage:
    """A stage of one configured run: its spec with the share resolved."""

    name: str
    share: float
    spec: StageSpec = field(compare=False, repr=False, default=None)

    @property
    def terms(self) -> tuple[str, ...]:
        return self.spec.terms


@dataclass(frozen=True)
class MethodSpec:
    """A method: its stages, its layer-pair rule, the distill.* fields it uses.

    pairs: the rule that picks (student layer, teacher layer) pairs when
        `distill.layer_pairs` is empty (`hldstudy.distill.pairs.PAIR_RULES`);
        None for methods without hidden alignment.
    fields: the `distill.*` fields that change what this method trains (the
        sweep multiplies only these axes; the analysis compares only these).
    strategy: the strategy class computing the loss, as "module:Class" (resolved
        lazily: this module stays jax-free) or a class; "" -> the generic one.
    """

    name: str
    stages: tuple[StageSpec, ...]
    fields: tuple[str, ...] = ()
    pairs: str | None = None
    strategy: str | type = ""
    description: str = ""

    def __post_init__(self):
        if not self.stages:
            raise ValueError(f"method {self.name!r} declares no stage")
        for st in self.stages:
            bad = [t for t in st.terms if t not in TERMS]
            if bad or not st.terms:
                raise ValueError(f"method {self.name!r} stage {st.name!r}: terms {st.terms} "
                                 f"must be a non-empty subset of {TERMS}")
            if st.kd and "nll" in st.terms:
                raise ValueError(f"method {self.name!r} stage {st.name!r}: the kd term already "
                                 "holds the NLL (weighted by distill.alpha)")
            if st.depth not in DEPTHS:
                raise ValueError(f"method {self.name!r} stage {st.name!r}: depth {st.depth!r} "
                                 f"is not one of {DEPTHS}")
            if (st.aligns or st.depth == "aligned") and self.pairs is None:
                raise ValueError(f"method {self.name!r} aligns hidden states but names no "
                                 "layer-pair rule")
        if self.stages[-1].share is not None:
            raise ValueError(f"method {self.name!r}: the last stage takes what the others leave "
                             "(share=None)")

    @property
    def needs_teacher(self) -> bool:
        return any(st.uses_teacher for st in self.stages)

    @property
    def aligns(self) -> bool:
        return any(st.aligns for st in self.stages)

    def resolve_stages(self, cfg) -> tuple[Stage, ...]:
        """The stages with their budget shares read from `cfg` (a Config)."""
        out, used = [], 0.0
        for st in self.stages:
            if st.share is None:
                share = 1.0 - used
            elif isinstance(st.share, str):
                section, name = st.share.split(".")
                share = float(getattr(getattr(cfg, section), name))
            else:
                share = float(st.share)
            used += share
            out.append(Stage(st.name, share, st))
        return tuple(out)

    def stage(self, cfg, name: str | None) -> Stage:
        """The stage called `name`; None is allowed for single-stage methods."""
        stages = self.resolve_stages(cfg)
        names = [s.name for s in stages]
        if name is None:
            if len(stages) > 1:
                raise ConfigError("stage", f"method {self.name!r} has stages "
                                  f"{', '.join(names)}; name one")
            return stages[0]
        for s in stages:
            if s.name == name:
                return s
        raise ConfigError("stage", f"{name!r} is not a stage of {self.name!r}",
                          f"stages: {', '.join(names)}")


# --------------------------------------------------------------------------- #
# Registry
# --------------------------------------------------------------------------- #

_REGISTRY: dict[str, MethodSpec] = {}

# The method every other is compared to, point by point and best-vs-best.
REFERENCE = "kd"
# The self-supervised reference: what a student learns without a teacher.
BASELINE = "baseline"


def register(spec: MethodSpec, *, replace: bool = False) -> MethodSpec:
    """Adds a method; every part of the suite sees it from then on."""
    if spec.name in _REGISTRY and not replace:
        raise ValueError(f"method {spec.name!r} is already registered")
    _REGISTRY[spec.name] = spec
    return spec


def unregister(name: str) -> None:
    _REGISTRY.pop(name, None)


def names() -> tuple[str, ...]:
    """Every registered method, in registration order."""
    return tuple(_REGISTRY)


def teacher_methods() -> tuple[str, ...]:
    return tuple(n for n, m in _REGISTRY.items() if m.needs_teacher)


def get(name: str, field_name: str = "distill.method") -> MethodSpec:
    """The spec of `name`; a ConfigError naming `field_name` when there is none."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ConfigError(field_name, f"{name!r} is not one of {', '.join(_REGISTRY)}") from None


def applies(key: str, method: str) -> bool:
    """Whether config field `key` changes what `method` trains.

    distill.* fields: the ones the method declares (distill.method always);
    teacher.*: methods that use a teacher; everything else: every method.
    """
    spec = get(method)
    if key == "distill.method":
        return True
    if key.startswith("distill."):
        return key in spec.fields
    if key in MULTI_STAGE_FIELDS:
        return len(spec.stages) > 1
    if key.startswith("teacher."):
        return spec.needs_teacher
    return True


def arm_fields(method: str) -> tuple[str, ...]:
    """The method's own knobs: fields it uses that not every teacher method shares.

    Runs of one method that differ in these are different "arms" in the analysis
    (e.g. HLDF with another stage-1 share); the shared KD fields are grid axes.
    """
    spec = get(method)
    others = [set(m.fields) for m in _REGISTRY.values() if m.needs_teacher]
    common = set.intersection(*others) if others else set()
    own = tuple(f for f in spec.fields if f not in common)
    return own + (MULTI_STAGE_FIELDS if len(spec.stages) > 1 else ())


# --------------------------------------------------------------------------- #
# The study's methods
# --------------------------------------------------------------------------- #

_KD = StageSpec("main", ("kd",))

register(MethodSpec(
    BASELINE, (StageSpec("main", ("nll",)),),
    description="self-supervised next-token NLL, no teacher"))
register(MethodSpec(
    REFERENCE, (_KD,), fields=KD_FIELDS,
    description="logit KD: alpha NLL + (1 - alpha) tau^2 D(p_t, p_s)"))
register(MethodSpec(
    "hldf",
    (StageSpec("stage1", ("align",), share="distill.hldf_stage1_share", depth="aligned"),
     StageSpec("stage2", ("kd",))),
    fields=KD_FIELDS + ALIGN_FIELDS + ("distill.hldf_stage1_share",), pairs="middle",
    description="FitNets-style: align the middle layer (stage 1), then logit KD (stage 2)"))
register(MethodSpec(
    "hldc", (StageSpec("main", ("kd", "align")),),
    fields=KD_FIELDS + ALIGN_FIELDS + ("distill.hidden_weight",), pairs="middle",
    description="joint: logit KD + hidden_weight x alignment of the middle layer"))
register(MethodSpec(
    "patient", (StageSpec("main", ("kd", "align")),),
    fields=KD_FIELDS + ALIGN_FIELDS + ("distill.hidden_weight", "distill.patient_pairs"),
    pairs="patient",
    description="Patient KD: logit KD + alignment of patient_pairs evenly mapped layers"))

# The study's comparison (Guigon, Dixon, Sander 2026): the methods its grids train.
STUDY = (BASELINE, REFERENCE, "hldf", "hldc")
