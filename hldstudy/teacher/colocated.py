"""The frozen, colocated teacher.

Loaded once (an hldstudy run directory, a Gemma GGUF file or a Hugging Face
safetensors directory: `hldstudy.teacher.load_teacher`), held in inference
dtype on the student's mesh with no optimizer state, and run inside the
student's compiled step under stop_gradient. It returns hidden states, never
logits: the KD loss rebuilds the teacher's logits chunk by chunk from
`final_hidden` and the head.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx

from hldstudy import sharding
from hldstudy.config import ModelConfig, TeacherConfig
from hldstudy.data.tokenizer import mismatch as tokenizer_mismatch
from hldstudy.distill.base import Batch, Strategy, TeacherOutputs
from hldstudy.distill.methods import Stage
from hldstudy.errors import ConfigError
from hldstudy.teacher.base import StageFeed, TeacherForward, stage_needs


def teacher_forward_fn(graphdef, layers: tuple[int, ...], needs_head: bool) -> TeacherForward:
    """`forward(teacher_params, batch) -> TeacherOutputs`: the teacher's part of a step.

    Runs only as deep as the deepest requested layer when the head is not needed
    (HLDF stage 1). Shared by the colocated teacher, the streaming server and
    the FLOP/memory probes, so all of them compute the same thing.
    """
    max_layer = None if needs_head else max(layers)

    def forward(params, batch: Batch) -> TeacherOutputs:
        model = nnx.merge(graphdef, params)
        out = model(batch["tokens"], batch["positions"], batch["segment_ids"],
                    hidden_layers=layers, return_logits=False, max_layer=max_layer)
        return TeacherOutputs(final_hidden=out.final_hidden if needs_head else None,
                              hidden=out.hidden,
                              head_weight=model.head_weight() if needs_head else None,
                              expert_drop_rate=out.expert_drop_rate)

    return forward


class ParamsFeed:
    """A colocated stage: the input of every step is the teacher's placed parameters."""

    def __init__(self, forward: TeacherForward, params):
        self.forward, self.params = forward, params

    def begin(self, start: int, end: int, workdir: Path | None = None,
              data_cursor: dict | None = None) -> None:
        pass

    def inputs(self, step: int, batch: Batch):
        return self.params

    def metrics(self) -> dict[str, float]:
        return {}

    def close(self) -> None:
        pass


def forward_config(model: ModelConfig, teacher: TeacherConfig) -> ModelConfig:
    """The shape a teacher's forward runs in: the run's `teacher.dtype`, attention path
    (`teacher.attention`, where set) and MoE dispatch (`teacher.moe_dispatch`,
    `teacher.moe_capacity_factor`; auto may take a path without a compiled backward:
    `forward_only`), no remat and its layers
    unrolled. No backward runs through it, so neither remat nor a scan bounds anything;
    and a scan stacks the parameters it runs inside the program (hldstudy.model.stack), a
    second copy of the teacher's weights (62.7 GiB for Qwen3.5-35B-A3B in bf16, compiled
    for an H100)."""
    return dataclasses.replace(model, dtype=teacher.dtype, remat=False, scan_layers=False,
                               attention=teacher.attention or model.attention,
                               moe_dispatch=teacher.moe_dispatch,
                               moe_capacity_factor=teacher.moe_capacity_factor,
                               forward_only=True)


class ColocatedTeacher:
    """The teacher model itself, run inside the student's step (implements `Teacher`)."""

    def __init__(self, model, tokenizer, *, teacher: TeacherConfig | None = None,
                 source: str = ""):
        self.source = source
        teacher = teacher or TeacherConfig()
        dtype = teacher.dtype
        self.model_cfg: ModelConfig = forward_config(model.cfg, teacher)
        _, params = nnx.split(model, nnx.Param)
        self.graphdef = nnx.split(nnx.eval_shape(
            lambda: type(model)(self.model_cfg, rngs=nnx.Rngs(0))), nnx.Param)[0]
        self.params = jax.tree_util.tree_map(lambda x: x.astype(jnp.dtype(dtype)), params)
        self.tokenizer = tokenizer
        self._placed = None

    def check_tokenizer(self, student_tokenizer) -> None:
        if self.tokenizer is None:
            return
        differs = tokenizer_mismatch(student_tokenizer.vocab_size, student_tokenizer.fingerprint(),
                                     self.tokenizer.vocab_size, self.tokenizer.fingerprint())
        if differs:
            raise ConfigError(
                "data.tokenizer", f"{differs} (teacher: {self.source})",
                "leave data.tokenizer unset to use the teacher's, or point it at the teacher's file")

    def forward_fn(self, layers: tuple[int, ...], needs_head: bool) -> TeacherForward:
        return teacher_forward_fn(self.graphdef, layers, needs_head)

    def head_vxd(self) -> jax.Array:
        """The LM head as `[V, D]`, the layout a replica sends (`head_weight().T`): the
        embedding when tied (Gemma), the transposed `lm_head` when not (Qwen3.5), so a
        remote student rebuilds the same teacher logits as a colocated one."""
        if self.model_cfg.tie_embeddings:
            return self.params["embedding"][...]
        return self.params["lm_head"][...].T

    def stage_feed(self, strategy: Strategy, stage: Stage, mesh) -> StageFeed:
        needs = stage_needs(strategy, stage, self.model_cfg)
        if self._placed is None:
            # put_tree: also right when the mesh spans several processes (each places its shards)
            self._placed = sharding.put_tree(self.params, sharding.tree_shardings(mesh, self.params))
        return ParamsFeed(self.forward_fn(needs.layers, needs.final), self._placed)

    def close(self) -> None:
        pass
