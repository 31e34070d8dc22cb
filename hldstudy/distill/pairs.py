"""Which (student layer, teacher layer) pairs a hidden-alignment method aligns.

Layer numbers are 1-based block outputs (`hidden[l]` in
`hldstudy.model.transformer`: the residual stream after block l), so a pair
`(l, m)` aligns the student's block-l output with the teacher's block-m
output. The same resolution is used by the FLOP count (`hldstudy.flops`),
the strategies and the teacher streaming, so they can never disagree.

Defaults when `distill.layer_pairs` is empty:

- hldf / hldc: one pair, the middle layer of each, `(n_s // 2, n_t // 2)`.
- patient: `distill.patient_pairs = P` pairs at the same relative depths
  `i / (P + 1)`, i = 1..P: `((i * n_s) // (P + 1), (i * n_t) // (P + 1))`.
  P = 1 gives the hld default. The last block is left to the logit KD term,
  as in Patient KD (Sun et al., 2019).
- baseline / kd: no pairs.
"""

from __future__ import annotations

from hldstudy.config import Config, ModelConfig, parse_layer_pairs
from hldstudy.errors import ConfigError

HIDDEN_METHODS = ("hldf", "hldc", "patient")


def default_layer_pairs(method: str, n_student: int, n_teacher: int,
                        patient_pairs: int = 3) -> tuple[tuple[int, int], ...]:
    if method in ("hldf", "hldc"):
        return ((max(1, n_student // 2), max(1, n_teacher // 2)),)
    if method == "patient":
        p = patient_pairs
        if p < 1:
            raise ConfigError("distill.patient_pairs", f"must be >= 1, got {p}")
        if p >= n_student or p >= n_teacher:
            raise ConfigError("distill.patient_pairs",
                              f"{p} pairs do not fit in a {n_student}-layer student / "
                              f"{n_teacher}-layer teacher",
                              "use fewer pairs than layers, or set distill.layer_pairs")
        return tuple(((i * n_student) // (p + 1), (i * n_teacher) // (p + 1))
                     for i in range(1, p + 1))
    return ()


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


def resolve_layer_pairs(cfg: Config, teacher_model_cfg: ModelConfig | None,
                        method: str | None = None) -> tuple[tuple[int, int], ...]:
    """The (student, teacher) pairs `method` (default `cfg.distill.method`) aligns.

    Explicit `distill.layer_pairs` win for hldf / hldc / patient; methods
    without hidden alignment return `()`.
    """
    method = method or cfg.distill.method
    if method not in HIDDEN_METHODS:
        return ()
    if teacher_model_cfg is None:
        raise ConfigError("teacher", f"method {method!r} needs the teacher's model config "
                          "to resolve its layer pairs")
    n_s, n_t = cfg.model.n_layers, teacher_model_cfg.n_layers
    if cfg.distill.layer_pairs:
        pairs = parse_layer_pairs(cfg.distill.layer_pairs)
    else:
        pairs = default_layer_pairs(method, n_s, n_t, cfg.distill.patient_pairs)
    return check_layer_pairs(pairs, n_s, n_t)
