"""The decoder of every family (`hldstudy.family`): embeddings, blocks, final norm, head.

Hidden-state numbering used everywhere in hldstudy (distillation pairs,
teacher streaming): `hidden[0]` is the scaled embedding, `hidden[l]` for
1 <= l <= n_layers is the residual stream after block l (before the final
norm), and `final_hidden` is the final-normed state that feeds the LM head.
`logits = final_hidden @ head_weight()`, `head_weight()` laid out `[D, V]` (the layout the
KD losses take): `embedding.T` when tied (Gemma), the `lm_head` parameter when not (Qwen3.5).
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx, struct

from hldstudy.config import ModelConfig
from hldstudy.errors import ConfigError
from hldstudy.family import family_of
from hldstudy.model.blocks import build_block
from hldstudy.model.layers import RMSNorm
from hldstudy.model.qwen_layers import block_aux_zeros
from hldstudy.model.stack import run_stack
from hldstudy.numerics import softcap
from hldstudy.shapes import count_params  # noqa: F401  (re-exported)


@struct.dataclass
class ModelOutput:
    logits: jax.Array | None  # [B, T, V] float32, soft-capped if configured
    final_hidden: jax.Array | None  # [B, T, D], input of the LM head
    hidden: dict  # {layer: [B, T, D]} for the requested layers
    # Mean over the run blocks of the MoE router's load-balancing loss (0 without MoE;
    # None for families without it). A student's objective adds model.router_aux_weight x it.
    router_aux_loss: jax.Array | None = None
    # [B] mean over the run blocks of the share of each row's routed expert slots dropped
    # (capacity dispatch, hldstudy.model.moe; 0 when dropless; None without MoE blocks).
    expert_drop_rate: jax.Array | None = None


class Transformer(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        pdt = jnp.dtype(cfg.param_dtype)
        # std d^-1/2 with the sqrt(d) input scale gives unit-scale inputs and
        # unit-scale tied logits at init.
        self.embedding = nnx.Param(
            (cfg.d_model ** -0.5 * jax.random.normal(rngs.params(), (cfg.vocab_size, cfg.d_model)))
            .astype(pdt))
        self.blocks = nnx.List([build_block(cfg, i, rngs) for i in range(cfg.n_layers)])
        self.final_norm = RMSNorm(cfg.d_model, cfg.norm_eps, pdt)
        if not cfg.tie_embeddings:
            self.lm_head = nnx.Param(
                (cfg.d_model ** -0.5 * jax.random.normal(rngs.params(), (cfg.d_model, cfg.vocab_size)))
                .astype(pdt))

    def head_weight(self) -> jax.Array:
        """LM head as `[D, V]` (the embedding's transpose when tied)."""
        if not self.cfg.tie_embeddings:
            return self.lm_head[...]
        return self.embedding[...].T

    def embed(self, tokens_BxT: jax.Array) -> jax.Array:
        dt = jnp.dtype(self.cfg.dtype)
        x = jnp.take(self.embedding[...], tokens_BxT, axis=0).astype(dt)
        if not family_of(self.cfg).embeds_scaled:
            return x
        # Gemma multiplies by sqrt(d) rounded to the compute dtype.
        return x * jnp.asarray(self.cfg.d_model ** 0.5, dt)

    def __call__(
        self,
        tokens_BxT: jax.Array,
        positions_BxT: jax.Array | None = None,
        segment_ids_BxT: jax.Array | None = None,
        *,
        hidden_layers: Sequence[int] = (),
        return_logits: bool = True,
        max_layer: int | None = None,
    ) -> ModelOutput:
        """Runs the decoder.

        hidden_layers: block outputs to return (0 = embeddings).
        return_logits: False skips the LM head (the fused loss builds logits itself).
        max_layer: stop after this many blocks (HLDF stage 1 runs only the
            layers it aligns); then `final_hidden` and `logits` are None.
        """
        cfg = self.cfg
        n_run = cfg.n_layers if max_layer is None else max_layer
        for layer in list(hidden_layers) + ([max_layer] if max_layer is not None else []):
            if not 0 <= layer <= cfg.n_layers:
                raise ConfigError("hidden layer", f"layer {layer} is out of range 0..{cfg.n_layers}")
        b, t = tokens_BxT.shape
        if t > cfg.max_seq_len:
            raise ConfigError("sequence length", f"{t} exceeds model.max_seq_len={cfg.max_seq_len}")
        if positions_BxT is None:
            positions_BxT = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        # segment_ids_BxT stays None for unpacked rows: attention kernels then skip
        # the same-document test (dense builds its mask per layer; chunked and
        # cudnn never build a T x T mask at all).

        embedded_BxTxD = self.embed(tokens_BxT)
        x_BxTxD, aux, hidden = run_stack(
            self.blocks, embedded_BxTxD, positions_BxT, segment_ids_BxT, n_run=n_run,
            stops=hidden_layers,
            aux=block_aux_zeros(b) if family_of(cfg).blocks_return_aux else None,
            scan=cfg.scan_layers, remat=cfg.remat, policy_name=cfg.remat_policy)
        aux = aux or {}
        drop = aux.get("expert_drop_rate") if cfg.n_experts else None
        if 0 in hidden_layers:
            hidden[0] = embedded_BxTxD
        if max_layer is not None:
            return ModelOutput(logits=None, final_hidden=None, hidden=hidden,
                               router_aux_loss=aux.get("router_aux_loss"), expert_drop_rate=drop)

        final_BxTxD = self.final_norm(x_BxTxD)
        logits = None
        if return_logits:
            logits = jnp.einsum("btd,dv->btv", final_BxTxD, self.head_weight().astype(final_BxTxD.dtype),
                                preferred_element_type=jnp.float32)
            logits = softcap(logits, cfg.final_softcap)
        return ModelOutput(logits=logits, final_hidden=final_BxTxD, hidden=hidden,
                           router_aux_loss=aux.get("router_aux_loss"), expert_drop_rate=drop)


def count_module_params(model: nnx.Module) -> int:
    return sum(x.size for x in jax.tree_util.tree_leaves(nnx.state(model, nnx.Param)))
