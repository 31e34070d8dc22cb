"""The built-in experiment and sweep files; they ship with the package.

    hldstudy/configs/experiments/<name>.py   get_config() -> Config (`--config`)
    hldstudy/configs/sweeps/<name>.py        get_sweep() -> Sweep (`hldstudy sweep FILE`)

They are files loaded by path, like any of yours, with the launch command of
each in its top comment. `hldstudy train --config` and `hldstudy sweep` also
take the bare name of a built-in file (`tiny`, `cpu`;
`hldstudy.cli_common.find_builtin`), so they work from an installed package.
Your own files can live anywhere (e.g. `experiments/` and `sweeps/` next to
your runs); to start from a built-in one, copy it from the folder that
`python -c "import hldstudy.configs as c; print(c.__path__[0])"` prints.

Nothing in the library imports this package: its files import the library.
"""

from hldstudy.distill.methods import STUDY as STUDY_METHODS  # noqa: F401  (the grids' methods)
