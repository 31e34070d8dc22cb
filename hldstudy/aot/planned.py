"""The planner's figures of the programs `python -m hldstudy.aot` compiles, without their
compiler or devices: what the decision map sizes its cells with, from the same functions
as the figure aot prints beside a compile (`report.planner_of`)."""

from __future__ import annotations

from hldstudy.aot.compile import replica_forward, resolve_for_target, stage_names
from hldstudy.aot.report import fsdp_size, predicted_train_memory
from hldstudy.aot.targets import Target
from hldstudy.config import Config, ModelConfig
from hldstudy.teacher.microbatch import replica_forward_memory


def planned_train(cfg: Config, teacher_model: ModelConfig | None, method: str, target: Target,
                  layout: str = "colocated", cohort: int | None = None) -> dict[str, float]:
    """The planner's figures of the first stage's train step as `python -m hldstudy.aot`
    would compile it on `target` at train.microbatches (set), without its compiler or
    devices: what the decision map sizes its cells with, the same figure aot prints beside
    a compile."""
    cfg, teacher_model, choices = resolve_for_target(cfg, teacher_model, target)
    n = target.n_devices
    fsdp = fsdp_size(cfg, n)
    stage = stage_names(cfg, method, teacher_model)[0]
    return predicted_train_memory(cfg, teacher_model, method, stage, n, fsdp, choices, cohort,
                                  target.backend, layout)


def planned_replica(cfg: Config, teacher_model: ModelConfig, method: str,
                    target: Target) -> dict[str, float]:
    """The planner's figures of a replica's forward on `target` (teacher.replica_devices of
    its devices, micro-batches of teacher.replica_batch sequences, set), as
    `compile_teacher_forward` asks them beside its compile."""
    cfg, teacher_model, _ = resolve_for_target(cfg, teacher_model, target)
    tcfg, needs = replica_forward(cfg, teacher_model, method)
    n = cfg.teacher.replica_devices or target.n_devices
    return replica_forward_memory(tcfg, cfg.data.batch_size, cfg.teacher.replica_batch,
                                  cfg.data.seq_len, layers=needs.layers, head=needs.final,
                                  dtype=cfg.teacher.dtype, backend=target.backend, shards=n)


__all__ = ["planned_replica", "planned_train"]
