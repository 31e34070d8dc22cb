"""User-facing errors and the exit codes every hldstudy command shares.

Design notes: `docs/infrastructure.md`, under this file's name.
"""

from __future__ import annotations

import contextlib
import sys

EXIT_OK = 0
EXIT_BUG = 1
EXIT_INPUT = 2
EXIT_RUNTIME = 3


def exit_code_for_signal(signum: int) -> int:
    """128 + N, as a shell reports a process stopped by signal N."""
    return 128 + int(signum)


class HLDError(Exception):
    """Base of errors the user can act on."""

    exit_code = EXIT_INPUT


class ConfigError(HLDError, ValueError):
    """A configuration value is invalid. The message starts with the field path."""

    def __init__(self, field: str, problem: str, fix: str = ""):
        self.field = field
        msg = f"{field}: {problem}"
        if fix:
            msg += f" ({fix})"
        super().__init__(msg)


class InputError(HLDError, ValueError):
    """An input file or directory is missing or malformed."""


class RuntimeFault(HLDError, RuntimeError):
    """A fault met while running (exit code 3): the state went non-finite, a checkpoint
    could not be saved, the step would not fit in memory. The message names the step,
    file or field and the likely fix."""

    exit_code = EXIT_RUNTIME


def exit_code_of(exc: BaseException) -> int:
    """The exit code a CLI gives for `exc` (a sweep records the same for a run)."""
    signum = getattr(exc, "signum", None)
    if signum is not None:  # hldstudy.train.loop.Interrupted
        return exit_code_for_signal(signum)
    if isinstance(exc, HLDError):
        return exc.exit_code
    if isinstance(exc, SystemExit):
        return exc.code if isinstance(exc.code, int) else EXIT_BUG
    return EXIT_BUG


def warn(message: str, prog: str = "hldstudy") -> None:
    """One warning line on stderr (not through logging: the CLIs silence library logs)."""
    print(f"{prog}: warning: {message}", file=sys.stderr, flush=True)


def note(message: str, prog: str = "hldstudy") -> None:
    """One line of news on stderr (where a run stands), beside the warnings."""
    print(f"{prog}: {message}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def user_errors(debug: bool = False, prog: str = "hldstudy"):
    """Turns `HLDError` into `prog: error: <message>` and its exit code (2, or 3 for a
    `RuntimeFault`)."""
    try:
        yield
    except HLDError as e:
        if debug:
            raise
        print(f"{prog}: error: {e}", file=sys.stderr)
        raise SystemExit(e.exit_code) from None
