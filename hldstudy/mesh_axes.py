"""The train mesh's axis names and those that shard the batch.

A leaf module (no hldstudy imports) so that the losses and the MoE, which partition
themselves over the batch, and sharding.py, which builds the mesh, read one definition
without an import cycle (sharding -> config -> distill -> losses).
"""

import math

import jax

MESH_AXES = ("data", "fsdp", "expert")
BATCH_AXES = MESH_AXES


def traced_batch_axes():
    """(mesh, axes): the abstract mesh being traced under and those of its BATCH_AXES that
    split the batch there (size > 1, not already manual); (None, ()) when nothing does."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return None, ()
    axes = tuple(a for a in BATCH_AXES
                 if a in mesh.axis_names and mesh.shape[a] > 1 and a not in mesh.manual_axes)
    return (mesh, axes) if axes else (None, ())


def axes_size(mesh, axes) -> int:
    """Devices the batch is split over along `axes` of `mesh` (1 for none)."""
    return math.prod(mesh.shape[a] for a in axes) if axes else 1


def shard_mapped(fn, mesh, in_specs, out_specs, *args):
    """`jax.shard_map(fn)` over `mesh` applied to `args`, each first resharded to its spec
    where the mesh has explicit axes (explicit sharding types must already match the
    specs). check_vma off: the callers write their collectives out (and a scan's carry may
    turn per-shard in its body)."""
    if mesh.explicit_axes:
        args = tuple(jax.reshard(x, s) for x, s in zip(args, in_specs, strict=True))
    return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                         check_vma=False)(*args)
