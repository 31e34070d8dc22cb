"""The experiment files: one `get_config() -> hldstudy.config.Config` per run, big_vision
style, each with its launch command in its top comment.

    python -m hldstudy.train --config experiments/tiny.py --workdir runs/tiny
    python -m hldstudy.train --config tiny --workdir runs/tiny      # the same, by name

They are files loaded by path, like any of yours; `--config NAME` finds the built-in one
of that name (`hldstudy.cli_common.find_builtin`), also from an installed package, which
carries this folder as `hldstudy.experiments` (`hldstudy.shipped`). The C4 runs
(c4_*.py) take their values from sweeps/_c4.py, the one place the study's setting is
written. Nothing in the library imports this folder: its files import the library.
"""
