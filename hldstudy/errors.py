"""User-facing errors.

Anything a user can fix (a bad config value, a missing file, incompatible
teacher and student) raises `ConfigError` or `InputError` with a one-line
message that names the field or file and the fix. CLIs print that line and
exit non-zero; `--debug` shows the traceback.
"""

from __future__ import annotations

import contextlib
import sys


class HLDError(Exception):
    """Base of errors the user can act on."""


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


@contextlib.contextmanager
def user_errors(debug: bool = False, prog: str = "hldstudy"):
    """Turns `HLDError` into `prog: error: <message>` and exit code 2."""
    try:
        yield
    except HLDError as e:
        if debug:
            raise
        print(f"{prog}: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
