"""The sweep files: one `get_sweep() -> hldstudy.sweep.Sweep` per grid, with its launch
command in its top comment.

    python -m hldstudy.sweep sweeps/cpu.py --dry-run
    python -m hldstudy.sweep cpu --dry-run      # the same, by name

A file whose name starts with `_` holds shared pieces, not a grid (`_c4.py`: the study's
C4 setting, also read by experiments/c4_*.py); import it as `hldstudy.sweeps._c4`, which
works in a checkout installed with `pip install -e .` and in an installed package, which
carries this folder as `hldstudy.sweeps` (`hldstudy.shipped`). Nothing in the library
imports this folder: its files import the library.
"""
