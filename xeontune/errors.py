"""The CLI's errors: ``UserError`` (the user's mistake: one line, exit 2), ``TrainingError`` (the run
cannot go on: one line, exit 1), and ``exit_status``, which runs a command's body as the CLI does."""

from __future__ import annotations

import sys
from collections.abc import Callable


class UserError(Exception):
    """A mistake the user can fix (bad flag, missing file, unknown cluster).

    The CLI prints ``error: <message>`` and exits with code 2. Besides, only an OSError that names a
    file is caught (a path the user gave, or $XEONTUNE_HOME, that cannot be read or written: exit 1);
    a real bug still shows its traceback.
    """

    exit_code = 2


class DiskFullError(UserError):
    """A write failed for want of room or write access (ENOSPC, EDQUOT, EROFS): one line, exit 1."""

    exit_code = 1


class TrainingError(RuntimeError):
    """Training cannot go on (no gradient reaches the token vectors, a NaN loss)."""


def exit_status(command: Callable[[], int | None]) -> int:
    """Run a command's body as the CLI does: a UserError is one line on stderr and its exit code, a
    filesystem error on a named path one line and exit 1, Ctrl-C is 130. For modules run with
    ``python -m`` that must not import the CLI (no import cycle)."""
    try:
        return int(command() or 0)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except OSError as exc:
        if exc.filename is None:  # sockets, timeouts, a library's I/O: keep the traceback
            raise
        print(f"error: {exc}", file=sys.stderr)
        return 1
