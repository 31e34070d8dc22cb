"""Orbax checkpoints: train state + JSON metadata (data position, RNG, stage, FLOPs).

Orbax writes to a temporary directory and renames it when complete, so a
crash mid-save leaves the previous checkpoint intact; `max_to_keep` keeps
the last k. Below both the trainer (which saves and resumes) and the model
loader (which reads a run's student parameters); it knows no model.
"""

from __future__ import annotations

from pathlib import Path

import jax
import orbax.checkpoint as ocp

from hldstudy.errors import InputError


class Checkpointer:
    def __init__(self, directory: str | Path, keep: int):
        self.directory = Path(directory).absolute()
        self.manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True),
        )

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def save(self, step: int, state, meta: dict, *, wait: bool = True) -> None:
        if step in self.manager.all_steps():
            return
        self.manager.save(step, args=ocp.args.Composite(
            state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)))
        if wait:
            self.manager.wait_until_finished()

    def restore(self, step: int, abstract_state):
        """Restores into the shardings/dtypes of `abstract_state` (ShapeDtypeStructs)."""
        restored = self.manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract_state), meta=ocp.args.JsonRestore()))
        return restored.state, restored.meta

    def restore_meta(self, step: int) -> dict:
        return self.manager.restore(step, args=ocp.args.Composite(
            meta=ocp.args.JsonRestore())).meta

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()


def abstract_like(tree, shardings):
    return jax.tree_util.tree_map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)


def restore_partial(directory: str | Path, target, step: int | None = None):
    """The part of a saved train state that `target` (a pytree of ShapeDtypeStructs, e.g.
    `{"params": {"student": ...}}`) names, from the latest (or given) step; nothing else
    (no optimizer state) is read."""
    directory = Path(directory).absolute()
    if not directory.is_dir():
        raise InputError(f"{directory.parent} has no {directory.name}/ (train it first)")
    manager = ocp.CheckpointManager(directory)
    try:
        step = manager.latest_step() if step is None else step
        if step is None:
            raise InputError(f"{directory} holds no complete checkpoint")
        restored = manager.restore(step, args=ocp.args.Composite(state=ocp.args.PyTreeRestore(
            item=target, restore_args=ocp.checkpoint_utils.construct_restore_args(target),
            partial_restore=True)))
    finally:
        manager.close()
    return restored.state
