"""Pieces every hldstudy command line shares: --config/--set/--debug, the built-in
experiment and sweep files, quiet logs, and the checks of where a command will
write (made before any compute, so a bad output path never costs the work)."""

from __future__ import annotations

import argparse
import logging
import math
import os
import sys
import warnings
from pathlib import Path

from hldstudy import platforms
from hldstudy.config import Config, apply_overrides, load_experiment, validate
from hldstudy.distill import methods
from hldstudy.errors import InputError, warn
from hldstudy.shipped import shipped_dir

# A sequence longer than this gets a warning before anything is computed (the
# presets' longest context is 128k tokens).
LONG_SEQ_WARNING = 131072

# The built-in experiment and sweep files: the top-level experiments/ and sweeps/ of a
# checkout, or their copies inside an installed package (hldstudy.shipped).
EXPERIMENTS = shipped_dir("experiments")
SWEEPS = shipped_dir("sweeps")


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
    """Keeps absl/orbax/TF chatter and accelerator-plugin noise (`platforms.settle`) out
    of the terminal; our own messages stay."""
    platforms.settle()
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    warnings.filterwarnings("ignore", category=UserWarning, module="orbax")
    for name in ("absl", "orbax", "jax._src.xla_bridge", "tensorflow"):
        logging.getLogger(name).setLevel(logging.ERROR)
    # orbax's background futures that fail on a damaged checkpoint are collected as
    # "Future exception was never retrieved" (~30 lines each); the restore names the
    # damage itself, in one line.
    logging.getLogger("asyncio").setLevel(logging.CRITICAL)
    try:
        from absl import logging as absl_logging

        absl_logging.set_verbosity(absl_logging.ERROR)
    except ImportError:
        pass


def add_config_args(parser: argparse.ArgumentParser, *, required: bool = True) -> None:
    parser.add_argument("--config", required=required,
                        help="experiment file exposing get_config(), or the name of a built-in one "
                             "(experiments/<name>.py, e.g. tiny)")
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        metavar="KEY=VALUE", help="override a config field, e.g. train.steps=50")
    parser.add_argument("--debug", action="store_true", help="show tracebacks")


def resolve_config(args: argparse.Namespace, extra: list[str] = (),
                   check_paths: bool = True) -> Config:
    cfg = load_experiment(find_builtin(args.config, EXPERIMENTS))
    cfg = apply_overrides(cfg, list(extra) + list(args.overrides))
    cfg = validate(cfg, check_paths=check_paths)
    for line in not_applying(cfg, args.overrides):
        warn(line, "hldstudy.train")
    return cfg


def not_applying(cfg: Config, overrides: list[str]) -> list[str]:
    """One line for each `--set key=value` that changes nothing for the run's method
    (`methods.applies`: a teacher's field for the baseline, a stage boundary for a
    one-stage method, another method's distill.* knob)."""
    method = cfg.distill.method
    out = []
    for item in overrides:
        key = item.split("=", 1)[0].strip()
        if "=" in item and not methods.applies(key, method):
            spec = methods.get(method)
            why = ("it has one stage" if key in methods.MULTI_STAGE_FIELDS else
                   "it uses no teacher" if key.startswith("teacher.") and not spec.needs_teacher
                   else "it does not use this knob")
            out.append(f"--set {item}: does not apply to distill.method={method} ({why}); "
                       "ignored")
    return out


def _nearest_existing(path: Path) -> Path:
    for parent in (path, *path.parents):
        if os.path.lexists(parent):
            return parent
    return Path(".")


def check_output_dir(path: str | Path, what: str) -> Path:
    """`path` is, or can be made as, a directory this process writes into; InputError
    naming `what` (the flag or field) and the fix otherwise. Makes nothing."""
    path = Path(path).absolute()
    if path.exists() and not path.is_dir():
        raise InputError(f"{what} {path} is a file, not a directory "
                         "(give a directory, or move the file away)")
    base = _nearest_existing(path)
    if not base.is_dir():
        raise InputError(f"{what} {path}: {base} is a file, so the directory cannot be made "
                         "(give a path under a directory)")
    if not os.access(base, os.W_OK | os.X_OK):
        verb = "is not writable" if base == path else f"cannot be made ({base} is not writable)"
        raise InputError(f"{what} {path} {verb} (give a directory you can write to)")
    return path


def check_output_file(path: str | Path, what: str) -> Path:
    """`path` names a file a command may write: not a directory, its folder writable."""
    path = Path(path).absolute()
    if path.is_dir():
        raise InputError(f"{what} {path} is a directory (give a file name, e.g. "
                         f"{path / 'results.json'})")
    if os.path.lexists(path) and not os.access(path, os.W_OK):
        raise InputError(f"{what} {path} is not writable (give a file you can write)")
    check_output_dir(path.parent, what)
    return path


def make_output_dir(path: str | Path, what: str) -> list[Path]:
    """`check_output_dir`, then makes it (before the work whose results go there).
    Returns the directories it made, deepest first (`remove_if_empty` undoes it when
    the work fails before writing anything)."""
    path = check_output_dir(path, what)
    made = [p for p in (path, *path.parents) if not os.path.lexists(p)]
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise InputError(f"{what} {path} cannot be made: {e.strerror}") from None
    return made


def remove_if_empty(dirs: list[Path]) -> None:
    """Removes the directories `make_output_dir` made, where they are still empty."""
    for d in dirs:
        try:
            d.rmdir()
        except OSError:
            return


def warn_long_sequence(prog: str, what: str, seq_len: int) -> None:
    """One warning line on stderr when `seq_len` is past LONG_SEQ_WARNING."""
    if seq_len > LONG_SEQ_WARNING:
        print(f"{prog}: warning: {what} {seq_len} is longer than {LONG_SEQ_WARNING} tokens: "
              "past every preset's context; activations and attention grow with it "
              "(dense attention quadratically)", file=sys.stderr)


def finite_number(what: str, value: float, *, low: float = 0.0, low_open: bool = True,
                  fix: str = "") -> float:
    """`value` finite and above `low` (or at least `low`); InputError naming `what`."""
    ok = math.isfinite(value) and (value > low if low_open else value >= low)
    if not ok:
        bound = f"{'>' if low_open else '>='} {low:g}"
        raise InputError(f"{what} must be a finite number {bound}, got {value}"
                         + (f" ({fix})" if fix else ""))
    return value
