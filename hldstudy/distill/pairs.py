"""Which (student layer, teacher layer) pairs a hidden-alignment method aligns.

Design notes: `docs/methods.md`, under this file's name.
"""

from __future__ import annotations

from hldstudy.distill import methods
from hldstudy.errors import ConfigError


def parse_layer_pairs(spec: str) -> tuple[tuple[int, int], ...]:
    """'6:12,9:17' -> ((6, 12), (9, 17)). Raises ConfigError on bad syntax."""
    pairs = []
    for part in spec.split(","):
        part = part.strip()
        try:
            s, t = part.split(":")
            pairs.append((int(s), int(t)))
        except ValueError:
            raise ConfigError("distill.layer_pairs", f"bad pair {part!r}",
                              "write student:teacher pairs like '6:12,9:17'") from None
    return tuple(pairs)


def middle_pair(n_student: int, n_teacher: int, cfg) -> tuple[tuple[int, int], ...]:
    return ((max(1, n_student // 2), max(1, n_teacher // 2)),)


def patient_pairs(n_student: int, n_teacher: int, cfg) -> tuple[tuple[int, int], ...]:
    p = cfg.distill.patient_pairs
    if p < 1:
        raise ConfigError("distill.patient_pairs", f"must be >= 1, got {p}")
    if p >= n_student or p >= n_teacher:
        raise ConfigError("distill.patient_pairs",
                          f"{p} pairs do not fit in a {n_student}-layer student / "
                          f"{n_teacher}-layer teacher",
                          "use fewer pairs than layers, or set distill.layer_pairs")
    return tuple(((i * n_student) // (p + 1), (i * n_teacher) // (p + 1))
                 for i in range(1, p + 1))


PAIR_RULES = {"middle": middle_pair, "patient": patient_pairs}

def check_layer_pairs(pairs, n_student: int, n_teacher: int) -> tuple[tuple[int, int], ...]:
    """Raises ConfigError when a layer is outside 1..n_layers of its model."""
    for s, t in pairs:
        if not 1 <= s <= n_student:
            raise ConfigError("distill.layer_pairs",
                              f"student layer {s} is out of range 1..{n_student}",
                              "layers are 1-based block outputs")
        if not 1 <= t <= n_teacher:
            raise ConfigError("distill.layer_pairs",
                              f"teacher layer {t} is out of range 1..{n_teacher}",
                              "layers are 1-based block outputs")
    return tuple((int(s), int(t)) for s, t in pairs)


def resolve_layer_pairs(cfg, teacher_model_cfg, method: str | None = None) -> tuple[tuple[int, int], ...]:
    """The (student, teacher) pairs `method` (default `cfg.distill.method`) aligns.

    cfg: the run's Config; teacher_model_cfg: the teacher's ModelConfig. (Not
    imported here: the config validates against the method registry, so
    distill/ stays below config.)

    Explicit `distill.layer_pairs` win for methods that align; methods without
    a pair rule return `()`.
    """
    spec = methods.get(method or cfg.distill.method)
    if spec.pairs is None:
        return ()
    if teacher_model_cfg is None:
        raise ConfigError("teacher", f"method {spec.name!r} needs the teacher's model config "
                          "to resolve its layer pairs")
    n_s, n_t = cfg.model.n_layers, teacher_model_cfg.n_layers
    if cfg.distill.layer_pairs:
        pairs = parse_layer_pairs(cfg.distill.layer_pairs)
    else:
        pairs = PAIR_RULES[spec.pairs](n_s, n_t, cfg)
    return check_layer_pairs(pairs, n_s, n_t)
