"""The frozen, colocated teacher.

Loaded once (an hldstudy run directory, a Gemma GGUF file or a Hugging Face
safetensors directory), held in inference dtype on the student's mesh with
no optimizer state, and run inside the student's compiled step under
stop_gradient. It returns hidden states, never logits: the KD loss rebuilds
the teacher's logits chunk by chunk from `final_hidden` and the head.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx

from hldstudy.config import Config, ModelConfig
from hldstudy.distill.base import Stage, Strategy, TeacherOutputs
from hldstudy.errors import ConfigError


def _is_run_dir(path: Path) -> bool:
    return path.is_dir() and (path / "config.json").exists() and (path / "checkpoints").is_dir()


def teacher_tokenizer_path(checkpoint: str) -> Path | None:
    """The tokenizer file that belongs to a teacher run directory, if any."""
    path = Path(checkpoint)
    if _is_run_dir(path):
        from hldstudy.config import read_config

        tcfg = read_config(path / "config.json")
        tok = Path(tcfg.data.tokenizer) if tcfg.data.tokenizer else path / "tokenizer.model"
        return tok if tok.exists() else None
    return None


def with_teacher_tokenizer(cfg: Config) -> Config:
    """A distillation run without its own tokenizer uses its teacher's (they must match)."""
    if cfg.distill.method == "baseline" or cfg.data.tokenizer or not cfg.teacher.checkpoint:
        return cfg
    tok = teacher_tokenizer_path(cfg.teacher.checkpoint)
    if tok is None:
        return cfg
    return dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, tokenizer=str(tok)))


def teacher_forward_fn(graphdef, layers: tuple[int, ...], needs_head: bool):
    """`forward(teacher_params, batch) -> TeacherOutputs`: the teacher's part of a step.

    Runs only as deep as the deepest requested layer when the head is not needed
    (HLDF stage 1). Shared by the colocated teacher, the streaming server and
    the FLOP/memory probes, so all of them compute the same thing.
    """
    max_layer = None if needs_head else max(layers)

    def forward(params, batch) -> TeacherOutputs:
        model = nnx.merge(graphdef, params)
        out = model(batch["tokens"], batch["positions"], batch["segment_ids"],
                    hidden_layers=layers, return_logits=False, max_layer=max_layer)
        return TeacherOutputs(final_hidden=out.final_hidden if needs_head else None,
                              hidden=out.hidden,
                              head_weight=model.head_weight() if needs_head else None)

    return forward


class ColocatedTeacher:
    def __init__(self, model, tokenizer, *, dtype: str = "float32", source: str = ""):
        self.source = source
        self.model_cfg: ModelConfig = dataclasses.replace(model.cfg, dtype=dtype, remat=False)
        graphdef, params = nnx.split(model, nnx.Param)
        self.graphdef = nnx.split(nnx.eval_shape(
            lambda: type(model)(self.model_cfg, rngs=nnx.Rngs(0))), nnx.Param)[0]
        self.params = jax.tree_util.tree_map(lambda x: x.astype(jnp.dtype(dtype)), params)
        self.tokenizer = tokenizer
        self._placed = None

    def check_tokenizer(self, student_tokenizer) -> None:
        if self.tokenizer is None:
            return
        if self.tokenizer.vocab_size != student_tokenizer.vocab_size or \
                self.tokenizer.fingerprint() != student_tokenizer.fingerprint():
            raise ConfigError(
                "data.tokenizer",
                f"the student's tokenizer ({student_tokenizer.vocab_size} pieces) is not the "
                f"teacher's ({self.tokenizer.vocab_size} pieces, from {self.source})",
                "leave data.tokenizer unset to use the teacher's, or point it at the teacher's file")

    def forward_fn(self, layers: tuple[int, ...], needs_head: bool):
        return teacher_forward_fn(self.graphdef, layers, needs_head)

    def step_inputs(self, strategy: Strategy, stage: Stage, mesh):
        """(forward run inside the student's step, teacher params placed on the mesh)."""
        from hldstudy.train import mesh as mesh_lib

        if self._placed is None:
            self._placed = jax.device_put(self.params, mesh_lib.tree_shardings(mesh, self.params))
        layers = strategy.teacher_layers(stage)
        needs_head = strategy.teacher_needs_head(stage)
        for layer in layers:
            if not 1 <= layer <= self.model_cfg.n_layers:
                raise ConfigError("distill.layer_pairs",
                                  f"teacher layer {layer} is out of range 1..{self.model_cfg.n_layers}")
        return self.forward_fn(layers, needs_head), self._placed


def load_teacher(cfg: Config, student_tokenizer=None) -> ColocatedTeacher:
    """Loads `cfg.teacher.checkpoint` and checks it against the student's tokenizer."""
    spec = cfg.teacher.checkpoint
    if not spec:
        raise ConfigError("teacher.checkpoint", f"method {cfg.distill.method!r} needs a teacher",
                          "pass --set teacher.checkpoint=RUN_DIR (an hldstudy run) or a Gemma path")
    if spec.startswith("remote://"):
        from hldstudy.teacher.remote import RemoteTeacher

        teacher = RemoteTeacher.connect(cfg)
    else:
        path = Path(spec)
        if not path.exists():
            raise ConfigError("teacher.checkpoint", f"{spec} does not exist",
                              "give an hldstudy run directory, a .gguf file or an HF directory")
        if _is_run_dir(path):
            from hldstudy.data.tokenizer import Tokenizer
            from hldstudy.train.checkpoint import load_run_model

            _, model = load_run_model(path)
            tok_path = teacher_tokenizer_path(spec)
            tokenizer = Tokenizer.load(tok_path) if tok_path else None
        else:
            from hldstudy.model.importers import load_pretrained

            model, tokenizer = load_pretrained(path)
        teacher = ColocatedTeacher(model, tokenizer, dtype=cfg.teacher.dtype, source=spec)
    if student_tokenizer is not None:
        teacher.check_tokenizer(student_tokenizer)
    return teacher
