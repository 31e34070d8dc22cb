"""Pieces every hldstudy command line shares: --config/--set/--debug, the built-in
experiment and sweep files, quiet logs."""

from __future__ import annotations

import argparse
import logging
import os
import warnings
from pathlib import Path

from hldstudy.config import Config, apply_overrides, load_experiment, validate

# The built-in experiment and sweep files (package data, see hldstudy/configs/__init__.py).
CONFIGS = Path(__file__).resolve().parent / "configs"
EXPERIMENTS = CONFIGS / "experiments"
SWEEPS = CONFIGS / "sweeps"


def find_builtin(arg: str | Path, kind: Path) -> Path:
    """`arg` when it is an existing path; otherwise, for a bare name ("tiny", "cpu.py"),
    the built-in file of that name in `kind` (EXPERIMENTS or SWEEPS) if there is one.
    Anything else comes back unchanged (the loader then says it does not exist)."""
    path = Path(arg)
    if path.exists() or len(path.parts) != 1:
        return path
    builtin = kind / path.with_suffix(".py").name
    return builtin if builtin.is_file() else path


def quiet_libraries() -> None:
    """Keeps absl/orbax/TF chatter out of the terminal; our own messages stay."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    warnings.filterwarnings("ignore", category=UserWarning, module="orbax")
    for name in ("absl", "orbax", "jax._src.xla_bridge", "tensorflow"):
        logging.getLogger(name).setLevel(logging.ERROR)
    try:
        from absl import logging as absl_logging

        absl_logging.set_verbosity(absl_logging.ERROR)
    except ImportError:
        pass


def add_config_args(parser: argparse.ArgumentParser, *, required: bool = True) -> None:
    parser.add_argument("--config", required=required,
                        help="experiment file exposing get_config(), or the name of a built-in one "
                             "(hldstudy/configs/experiments/<name>.py, e.g. tiny)")
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        metavar="KEY=VALUE", help="override a config field, e.g. train.steps=50")
    parser.add_argument("--debug", action="store_true", help="show tracebacks")


def resolve_config(args: argparse.Namespace, extra: list[str] = (),
                   check_paths: bool = True) -> Config:
    cfg = load_experiment(find_builtin(args.config, EXPERIMENTS))
    cfg = apply_overrides(cfg, list(extra) + list(args.overrides))
    return validate(cfg, check_paths=check_paths)
