"""Ahead-of-time compilation for the study's accelerators on a machine without them.

`python -m hldstudy.aot` compiles a run's programs (the train step of each stage or the
cohort step, the teacher replica's forward, the eval step) for a named TPU or NVIDIA
target with that target's own compiler (libtpu, the JAX CUDA plugin: the `aot` extra),
and sets what the compiler reports per device beside the planner's prediction and the
FLOP model. `hldstudy plan --sweep S --check-compile TARGET` runs it for a grid.

- `targets`: target names -> compile-only devices (TPU topologies, GPU target configs);
- `compile`: the trainer's own step builders over abstract, placed inputs, compiled;
- `report`: the compiler's figures beside the planner's and the FLOP model's.

It sits above train/ (whose step builders it compiles) and plan/ (whose predictions it
reports), below sweep/ and the plan CLI, which call it.
"""
