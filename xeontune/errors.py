"""The one exception type the CLI turns into a one-line message and exit code 2."""

from __future__ import annotations

import sys
from collections.abc import Callable


class UserError(Exception):
    """A mistake the user can fix (bad flag, missing file, unknown cluster).

    The CLI prints ``error: <message>`` and exits with code 2; nothing else is caught broadly,
    so a real bug still shows its traceback.
    """

    exit_code = 2


class TrainingError(RuntimeError):
    """Training cannot go on (no gradient reaches the token vectors, a NaN loss)."""


def exit_status(command: Callable[[], int | None]) -> int:
    """Run a command's body as the CLI does: a UserError is one line on stderr and its exit code,
    Ctrl-C is 130. For modules run with ``python -m`` that must not import the CLI (no import cycle)."""
    try:
        return int(command() or 0)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
