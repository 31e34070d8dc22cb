"""What the trainer sees of a teacher: the `Teacher` protocol and its per-stage `StageFeed`.

Design notes: `docs/teacher.md`, under this file's name.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from hldstudy.config import ModelConfig
from hldstudy.distill.base import Batch, Strategy, TeacherOutputs
from hldstudy.distill.methods import Stage
from hldstudy.errors import ConfigError

TeacherForward = Callable[[Any, Batch], TeacherOutputs]


@runtime_checkable
class StageFeed(Protocol):
    """One stage's supply of teacher outputs."""

    forward: TeacherForward | None

    def begin(self, start: int, end: int, workdir: Path | None = None,
              data_cursor: dict | None = None) -> None: ...

    def inputs(self, step: int, batch: Batch) -> Any: ...

    def metrics(self) -> dict[str, float]: ...

    def close(self) -> None: ...


@runtime_checkable
class Teacher(Protocol):
    """A frozen teacher, wherever it runs (in the student's step, on replicas, ...)."""

    model_cfg: ModelConfig

    def check_tokenizer(self, student_tokenizer) -> None:
        """Raises ConfigError when the student tokenizes differently from the teacher."""

    def stage_feed(self, strategy: Strategy, stage: Stage, mesh) -> StageFeed:
        """The feed of one stage (a new stage's feed replaces the previous one)."""

    def close(self) -> None:
        """Ends every feed (streams, threads); the teacher can open new ones."""


class _NoFeed:
    """The feed of a run without a teacher: no forward, no inputs."""

    forward = None

    def begin(self, start: int, end: int, workdir: Path | None = None,
              data_cursor: dict | None = None) -> None:
        pass

    def inputs(self, step: int, batch: Batch) -> None:
        return None

    def metrics(self) -> dict[str, float]:
        return {}

    def close(self) -> None:
        pass


NO_FEED: StageFeed = _NoFeed()


@dataclass(frozen=True)
class StageNeeds:
    """What one stage needs of the teacher: its final hidden state and head, block outputs."""

    final: bool
    layers: tuple[int, ...]  # 1-based block outputs, ascending


def check_layers(layers, n_layers: int, field: str, *, first: int = 1,
                 what: str = "teacher layer") -> tuple[int, ...]:
    """The one range check of teacher layers: each in first..n_layers (block outputs are
    1-based; 0, the embedding output, only where `first=0`). Returns them sorted."""
    for layer in layers:
        if not first <= layer <= n_layers:
            raise ConfigError(field, f"{what} {layer} is out of range {first}..{n_layers}",
                              "layers are 1-based block outputs" if first == 1 else "")
    return tuple(sorted(set(int(x) for x in layers)))


def stage_needs(strategy: Strategy, stage: Stage, model_cfg: ModelConfig) -> StageNeeds:
    """What `stage` of `strategy` asks of a teacher shaped `model_cfg` (range-checked)."""
    layers = check_layers(strategy.teacher_layers(stage), model_cfg.n_layers,
                          "distill.layer_pairs")
    return StageNeeds(bool(strategy.teacher_needs_head(stage)), layers)


def method_needs(strategy: Strategy, model_cfg: ModelConfig) -> StageNeeds:
    """The union of what every stage of the method asks (what a replica must serve)."""
    final, layers = False, set()
    for stage in strategy.stages():
        needs = stage_needs(strategy, stage, model_cfg)
        final |= needs.final
        layers |= set(needs.layers)
    return StageNeeds(final, tuple(sorted(layers)))
