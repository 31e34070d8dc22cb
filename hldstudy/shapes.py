"""The one shape arithmetic: parameter counts, matmul widths and attention context.

Pure functions of a model's shape, shared by the model (`count_params`), the FLOP
accounting (`hldstudy.flops`) and the planner (`hldstudy.plan`), so a parameter or a
FLOP is counted the same way everywhere (tested against `Transformer`'s parameters).
"""

from __future__ import annotations

from dataclasses import dataclass

from hldstudy.config import ModelConfig, layer_window
from hldstudy.family import Family, family_of


def causal_context(seq_len: int, window: int | None) -> float:
    """Average number of keys a query attends to: mean over t of min(t + 1, W)."""
    t = seq_len
    if window is None or window >= t:
        return (t + 1) / 2
    w = window
    return (w * (w + 1) / 2 + (t - w) * w) / t


def scan_groups(kinds, start: int, stop: int) -> tuple[int, int]:
    """(period p, number of whole groups) for layers [start, stop) of a stack whose layer i
    is of kind `kinds[i]` (anything comparable: the model's block graphdefs, the planner's
    `ModelShape.layer_kind`): p the shortest period of the kinds over the range; (0, 0)
    where fewer than two groups would run (nothing to gain from a scan)."""
    n = stop - start
    for p in range(1, n // 2 + 1):
        if all(kinds[i] == kinds[i + p] for i in range(start, stop - p)):
            return p, n // p
    return 0, 0


def scan_ranges(kinds, n_run: int, stops=()) -> list[tuple[int, int, int, int]]:
    """How a stack runs layers [0, n_run) (`model.scan_layers`): cut at each of `stops`
    (the hidden states a method reads) into ranges (start, stop, period, groups), each
    scanned from its start in `groups` whole groups of `period` layers (`scan_groups`), the
    rest of it unrolled. kinds None: nothing scanned (period and groups 0)."""
    ranges, start = [], 0
    for stop in sorted({s for s in stops if 0 < s < n_run} | {n_run}):
        period, groups = scan_groups(kinds, start, stop) if kinds is not None else (0, 0)
        ranges.append((start, stop, period, groups))
        start = stop
    return ranges


def scanned_layers(kinds, n_run: int, stops=()) -> tuple[int, ...]:
    """The layers of [0, n_run) that run inside a scan (`scan_ranges`)."""
    return tuple(i for start, _, period, groups in scan_ranges(kinds, n_run, stops)
                 for i in range(start, start + period * groups))


@dataclass(frozen=True)
class ModelShape:
    """A model's shape as the counts read it: the `ModelConfig` (its fields are this
    shape's), with what its family fixes applied (`hldstudy.family`): a Qwen3.5 head
    may be untied and always has QK-norm, only Gemma 3 has sliding windows, a MoE's
    dense FFN width is 0."""

    cfg: ModelConfig
    name: str = "model"

    @classmethod
    def from_model_config(cls, m: ModelConfig, name: str = "model") -> ModelShape:
        return cls(m, name)

    def __getattr__(self, attr: str):
        if attr.startswith("_") or attr in ("cfg", "name"):  # copy / pickle probe these
            raise AttributeError(attr)
        return getattr(self.cfg, attr)

    @property
    def fam(self) -> Family:
        return family_of(self.cfg)

    @property
    def d_ff(self) -> int:  # dense FFN width (0 for a MoE block)
        return 0 if self.cfg.n_experts else self.cfg.d_ff

    @property
    def tied_head(self) -> bool:
        return self.fam.head_always_tied or self.cfg.tie_embeddings

    @property
    def qk_norm(self) -> bool:
        return self.fam.always_qk_norm or self.cfg.qk_norm

    @property
    def sliding_window(self) -> int | None:
        return self.cfg.sliding_window if self.fam.windowed else None

    @property
    def global_every(self) -> int:
        return self.cfg.global_every if self.fam.windowed else 1

    @property
    def experts_per_token(self) -> int:
        return self.cfg.experts_per_token if self.cfg.n_experts else 0

    @property
    def d_expert(self) -> int:
        return self.cfg.d_expert if self.cfg.n_experts else 0

    @property
    def layer_types(self) -> tuple[str, ...]:
        return tuple(self.cfg.layer_type(i) for i in range(self.cfg.n_layers))

    @property
    def linear_layers(self) -> int:  # Gated DeltaNet layers; the rest are full attention
        return sum(t == "linear_attention" for t in self.layer_types)

    @property
    def is_moe(self) -> bool:
        return self.n_experts > 0

    def window(self, i: int) -> int | None:
        return layer_window(self.sliding_window, self.global_every, i)

    @property
    def attn_params(self) -> int:
        """q, k, v, o (and, gated attention, the output gate's projection)."""
        d, n, k, h = self.d_model, self.n_heads, self.n_kv_heads, self.head_dim
        gate = d * n * h if self.fam.gated_attention else 0
        return 2 * d * n * h + 2 * d * k * h + gate

    @property
    def linear_conv_dim(self) -> int:
        return 2 * self.linear_k_heads * self.linear_k_head_dim + \
            self.linear_v_heads * self.linear_v_head_dim

    @property
    def linear_matmul_params(self) -> int:
        """Gated DeltaNet projections: in_qkv, in_z, in_b, in_a, out."""
        d, hv, dv = self.d_model, self.linear_v_heads, self.linear_v_head_dim
        return d * self.linear_conv_dim + 2 * d * hv * dv + 2 * d * hv

    @property
    def linear_other_params(self) -> int:
        """Gated DeltaNet's conv taps, A_log, dt_bias and gated-norm weight."""
        return self.linear_conv_dim * self.linear_conv_kernel + 2 * self.linear_v_heads + \
            self.linear_v_head_dim

    @property
    def shared_params(self) -> int:
        """The sigmoid-gated shared expert (qwen3_5): SwiGLU of d_shared_expert + its gate."""
        return 3 * self.d_model * self.d_shared_expert + (self.d_model if self.d_shared_expert else 0)

    @property
    def ffn_width_active(self) -> int:
        """FFN width a token passes through (dense d_ff + routed and shared experts)."""
        return self.d_ff + self.experts_per_token * self.d_expert + self.d_shared_expert

    def layer_matmul_params_active(self) -> int:
        """A full-attention block's matmul parameters a token passes through."""
        return self.attn_params + 3 * self.d_model * self.ffn_width_active + \
            self.d_model * self.n_experts

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.d_model

    @property
    def head_params(self) -> int:
        """Parameters of the LM head matrix (the embedding itself when tied)."""
        return self.vocab_size * self.d_model

    def layer_kind(self, i: int) -> tuple[str, int | None]:
        """What makes block i's traced program its own: its mixer and attention window."""
        return self.layer_types[i], self.window(i)

    def is_linear(self, i: int) -> bool:
        """Whether 0-based layer i is a Gated DeltaNet layer."""
        return self.layer_types[i] == "linear_attention"

    def block_params(self, i: int, active: bool = False) -> int:
        """Parameters of 0-based block i, norms included: every expert, or (`active`) the
        routed experts a token passes through."""
        d = self.d_model
        experts = self.experts_per_token if active else self.n_experts
        ffn = 3 * d * self.d_ff + 3 * d * self.d_expert * experts + self.shared_params + \
            d * self.n_experts
        mixer = (self.linear_matmul_params + self.linear_other_params if self.is_linear(i)
                 else self.attn_params + (2 * self.head_dim if self.qk_norm else 0))
        return ffn + self.fam.norms_per_block * d + mixer

    def _params(self, active: bool) -> int:
        extra_head = 0 if self.tied_head else self.head_params
        blocks = sum(self.block_params(i, active) for i in range(self.n_layers))
        return blocks + self.d_model + self.embedding_params + extra_head

    def total_params(self) -> int:
        return self._params(False)

    def active_params(self) -> int:
        return self._params(True)


def count_params(cfg: ModelConfig) -> dict[str, int]:
    """Total and non-embedding parameter counts from the config (closed form).

    The tied head is counted once (in the embedding); an untied head is non-embedding.
    """
    shape = ModelShape.from_model_config(cfg)
    embedding = shape.embedding_params
    return {"total": shape.total_params(), "non_embedding": shape.total_params() - embedding,
            "embedding": embedding}
