"""The train mesh's axis names and those that shard the batch.

A leaf module (no hldstudy imports) so that the losses, which partition themselves
over the batch, and sharding.py, which builds the mesh, read one definition without
an import cycle (sharding -> config -> distill -> losses).
"""

MESH_AXES = ("data", "fsdp", "expert")
BATCH_AXES = MESH_AXES
