"""The one shape arithmetic: parameter counts, matmul widths and attention context.

Pure functions of a model's shape, shared by the model (`count_params`), the
FLOP accounting (`hldstudy.flops`) and the memory/network planner
(`hldstudy.plan`), so a parameter or a FLOP is counted the same way
everywhere. `ModelShape` is a dense Gemma-style decoder (`from_model_config`)
or, for the planner, a mixture-of-experts one (routed and shared experts,
untied head); a dense shape's counts equal the model's own (tested against
`Transformer`'s parameters). A Qwen3.5 shape (`family="qwen3_5"`) has gated full
attention (q and its output gate, QK-norm), `linear_layers` Gated DeltaNet layers, pre-norm
blocks only, and a sigmoid-gated shared expert of its own width `d_shared_expert`.
"""

from __future__ import annotations

from dataclasses import dataclass

from hldstudy.config import ModelConfig, layer_window


def causal_context(seq_len: int, window: int | None) -> float:
    """Average number of keys a query attends to: mean over t of min(t + 1, W)."""
    t = seq_len
    if window is None or window >= t:
        return (t + 1) / 2
    w = window
    return (w * (w + 1) / 2 + (t - w) * w) / t


@dataclass(frozen=True)
class ModelShape:
    name: str
    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    d_ff: int  # dense FFN width (0 for a pure MoE layer)
    tied_head: bool = True
    n_experts: int = 0
    experts_per_token: int = 0
    shared_experts: int = 0
    d_expert: int = 0
    sliding_window: int | None = None
    global_every: int = 1
    qk_norm: bool = True
    family: str = "gemma3"
    linear_layers: int = 0  # Gated DeltaNet layers (qwen3_5); the rest are full attention
    linear_k_heads: int = 0
    linear_v_heads: int = 0
    linear_k_head_dim: int = 0
    linear_v_head_dim: int = 0
    linear_conv_kernel: int = 4
    d_shared_expert: int = 0  # width of a sigmoid-gated shared expert (qwen3_5)
    deltanet_chunk: int = 64  # tokens per chunk of the chunked delta rule (qwen3_5)
    layer_types: tuple = ()  # qwen3_5: each layer's type, in order (full/linear_attention)

    @classmethod
    def from_model_config(cls, m: ModelConfig, name: str = "model") -> ModelShape:
        if m.family == "qwen3_5":
            return cls(name=name, vocab_size=m.vocab_size, d_model=m.d_model,
                       n_layers=m.n_layers, n_heads=m.n_heads, n_kv_heads=m.n_kv_heads,
                       head_dim=m.head_dim, d_ff=0 if m.n_experts else m.d_ff,
                       tied_head=m.tie_embeddings, n_experts=m.n_experts,
                       experts_per_token=m.experts_per_token, d_expert=m.d_expert,
                       qk_norm=True, family="qwen3_5",
                       linear_layers=sum(m.layer_type(i) == "linear_attention"
                                         for i in range(m.n_layers)),
                       linear_k_heads=m.linear_k_heads, linear_v_heads=m.linear_v_heads,
                       linear_k_head_dim=m.linear_k_head_dim,
                       linear_v_head_dim=m.linear_v_head_dim,
                       linear_conv_kernel=m.linear_conv_kernel, d_shared_expert=m.d_shared_expert,
                       deltanet_chunk=m.deltanet_chunk,
                       layer_types=tuple(m.layer_type(i) for i in range(m.n_layers)))
        return cls(name=name, vocab_size=m.vocab_size, d_model=m.d_model, n_layers=m.n_layers,
                   n_heads=m.n_heads, n_kv_heads=m.n_kv_heads, head_dim=m.head_dim,
                   d_ff=m.d_ff, tied_head=True, sliding_window=m.sliding_window,
                   global_every=m.global_every, qk_norm=m.qk_norm)

    @property
    def is_moe(self) -> bool:
        return self.n_experts > 0

    def window(self, i: int) -> int | None:
        return layer_window(self.sliding_window, self.global_every, i)

    @property
    def attn_params(self) -> int:
        """q, k, v, o (and, gated attention, the output gate's projection)."""
        d, n, k, h = self.d_model, self.n_heads, self.n_kv_heads, self.head_dim
        gate = d * n * h if self.family == "qwen3_5" else 0
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
        return self.d_ff + (self.experts_per_token + self.shared_experts) * self.d_expert + \
            self.d_shared_expert

    def layer_params(self) -> int:
        d = self.d_model
        ffn = 3 * d * self.d_ff + 3 * d * self.d_expert * (self.n_experts + self.shared_experts)
        router = d * self.n_experts
        norms = 4 * d + (2 * self.head_dim if self.qk_norm else 0)
        return self.attn_params + ffn + router + norms

    def layer_matmul_params_active(self) -> int:
        return self.attn_params + 3 * self.d_model * self.ffn_width_active + \
            self.d_model * self.n_experts

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.d_model

    @property
    def head_params(self) -> int:
        """Parameters of the LM head matrix (the embedding itself when tied)."""
        return self.vocab_size * self.d_model

    def _qwen_layers_params(self, active: bool) -> int:
        """All blocks of a qwen3_5 shape (pre-norm: 2 norms per block)."""
        d, h = self.d_model, self.head_dim
        experts = self.experts_per_token if active else self.n_experts
        ffn = 3 * d * self.d_ff + 3 * d * self.d_expert * experts + self.shared_params + \
            d * self.n_experts
        full = self.attn_params + 2 * h
        linear = self.linear_matmul_params + self.linear_other_params
        n_full = self.n_layers - self.linear_layers
        return self.n_layers * (ffn + 2 * d) + n_full * full + self.linear_layers * linear

    def is_linear(self, i: int) -> bool:
        """Whether 0-based layer i is a Gated DeltaNet layer (qwen3_5)."""
        return self.layer_types[i] == "linear_attention" if self.layer_types else False

    def block_params(self, i: int) -> int:
        """All parameters of 0-based block i (every expert; norms included)."""
        if self.family != "qwen3_5":
            return self.layer_params()
        d = self.d_model
        ffn = 3 * d * self.d_ff + 3 * d * self.d_expert * self.n_experts + self.shared_params + \
            d * self.n_experts
        mixer = (self.linear_matmul_params + self.linear_other_params if self.is_linear(i)
                 else self.attn_params + 2 * self.head_dim)
        return ffn + 2 * d + mixer

    def total_params(self) -> int:
        extra_head = 0 if self.tied_head else self.head_params
        if self.family == "qwen3_5":
            return self._qwen_layers_params(False) + self.d_model + self.embedding_params + extra_head
        return self.n_layers * self.layer_params() + self.d_model + self.embedding_params + extra_head

    def active_params(self) -> int:
        extra_head = 0 if self.tied_head else self.head_params
        if self.family == "qwen3_5":
            return self._qwen_layers_params(True) + self.d_model + self.embedding_params + extra_head
        per_layer = self.layer_params() - 3 * self.d_model * self.d_expert * (
            self.n_experts - self.experts_per_token)
        return self.n_layers * per_layer + self.d_model + self.embedding_params + extra_head


def count_params(cfg: ModelConfig) -> dict[str, int]:
    """Total and non-embedding parameter counts from the config (closed form).

    The tied head is counted once (in the embedding); an untied head is non-embedding.
    """
    shape = ModelShape.from_model_config(cfg)
    embedding = shape.embedding_params
    return {"total": shape.total_params(), "non_embedding": shape.total_params() - embedding,
            "embedding": embedding}
