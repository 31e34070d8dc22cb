"""Pieces every hldstudy command line shares: --config/--set/--debug, quiet logs."""

from __future__ import annotations

import argparse
import logging
import os
import warnings

from hldstudy.config import Config, apply_overrides, load_experiment, validate


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
                        help="experiment file (experiments/<name>.py) exposing get_config()")
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        metavar="KEY=VALUE", help="override a config field, e.g. train.steps=50")
    parser.add_argument("--debug", action="store_true", help="show tracebacks")


def resolve_config(args: argparse.Namespace, extra: list[str] = (),
                   check_paths: bool = True) -> Config:
    cfg = load_experiment(args.config)
    cfg = apply_overrides(cfg, list(extra) + list(args.overrides))
    return validate(cfg, check_paths=check_paths)
