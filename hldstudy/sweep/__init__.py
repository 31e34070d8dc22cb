"""Sweeps: grid definitions expanded into runs, executed locally, on SLURM or by W&B agents.

- ``spec``: ``Sweep`` (what a sweep file's ``get_sweep()`` returns; built-in ones in
  ``sweeps/``),
  ``expand`` (grid -> ``Run``s, method-aware, no duplicates), run ids and statuses.
- ``worker``: one process's ``Worker`` (teacher and data loaded once, train, evaluate).
- ``executors``: ``local`` (N processes), ``slurm`` (submitit), ``wandb`` (grid sweep + agent).
- ``python -m hldstudy.sweep SWEEP --executor local|slurm|wandb [--parallel N] [--dry-run --json]``.
"""

from hldstudy.sweep.spec import Run, Sweep, expand, load_sweep, run_id_for, run_status

__all__ = ["Sweep", "Run", "expand", "load_sweep", "run_id_for", "run_status"]
