"""Orbax checkpoints: train state + JSON metadata (data position, RNG, stage, FLOPs).

Orbax writes to a temporary directory and renames it when complete, so a
crash mid-save leaves the previous checkpoint intact; `max_to_keep` keeps
the last k.
"""

from __future__ import annotations

from pathlib import Path

import jax
import orbax.checkpoint as ocp


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


def load_run_model(run_dir: str | Path, step: int | None = None):
    """(Config, Transformer) from an hldstudy run directory's latest (or given) checkpoint.

    Reads only the student's parameters (no optimizer state), onto the
    first local device; the result is an ordinary NNX module.
    """
    from flax import nnx

    from hldstudy.config import read_config
    from hldstudy.errors import InputError
    from hldstudy.model import Transformer

    run_dir = Path(run_dir)
    cfg = read_config(run_dir / "config.json")
    if not (run_dir / "checkpoints").is_dir():
        raise InputError(f"{run_dir} has no checkpoints/ (train it first)")
    manager = ocp.CheckpointManager((run_dir / "checkpoints").absolute())
    step = manager.latest_step() if step is None else step
    if step is None:
        raise InputError(f"{run_dir}/checkpoints holds no complete checkpoint")
    abstract = nnx.eval_shape(lambda: Transformer(cfg.model, rngs=nnx.Rngs(0)))
    graphdef, abstract_params = nnx.split(abstract, nnx.Param)
    device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    target = {"params": {"student": jax.tree_util.tree_map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device), abstract_params)}}
    restored = manager.restore(step, args=ocp.args.Composite(state=ocp.args.PyTreeRestore(
        item=target, restore_args=ocp.checkpoint_utils.construct_restore_args(target),
        partial_restore=True)))
    manager.close()
    return cfg, nnx.merge(graphdef, restored.state["params"]["student"])
