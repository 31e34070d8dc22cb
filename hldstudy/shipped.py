"""Where the folders that ship beside the library are: experiments/, sweeps/, eval/.

In a source checkout (and an editable install) they sit at the top level, next to
hldstudy/. A wheel, or a plain `pip install .`, carries them inside the package
(pyproject.toml's package-dir maps each folder to the name in IN_PACKAGE), so the
built-in experiment and sweep files and the evaluation task files are found the same
way from any directory, installed or not.
"""

from __future__ import annotations

from pathlib import Path

PACKAGE = Path(__file__).resolve().parent

# top-level folder -> its name inside the installed package (pyproject.toml package-dir;
# tests/test_layout.py checks that the two agree).
IN_PACKAGE = {"experiments": "experiments", "sweeps": "sweeps", "eval": "eval_files"}


def shipped_dir(folder: str) -> Path:
    """The directory of the shipped folder `folder` ("experiments", "sweeps", "eval"):
    the installed copy inside the package when there is one, else the checkout's."""
    installed = PACKAGE / IN_PACKAGE[folder]
    return installed if installed.is_dir() else PACKAGE.parent / folder
