"""Comparing distillation methods with honest statistics.

- ``runs.load_runs(RUNS_DIR)``: one row per run, with consistency checks.
- ``stats``: paired bootstrap CI, exact sign test, Wilcoxon, Holm, seed variance,
  best-config selection.
- ``tables``: point-by-point, best-vs-best, across-grid, seed-variance and FLOPs tables.
- ``plots``: PNG figures (matplotlib Agg).
- ``report.build_report(RUNS_DIR, OUT)`` / ``python -m hldstudy.analysis``.
"""

from hldstudy.analysis.runs import config_hash, load_runs

__all__ = ["load_runs", "config_hash", "build_report"]


def build_report(*args, **kwargs):
    """See ``hldstudy.analysis.report.build_report`` (imported lazily: it pulls in matplotlib)."""
    from hldstudy.analysis.report import build_report as _build

    return _build(*args, **kwargs)
