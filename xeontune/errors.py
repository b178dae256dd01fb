"""The one exception type the CLI turns into a one-line message and exit code 2."""


class UserError(Exception):
    """A mistake the user can fix (bad flag, missing file, unknown cluster).

    The CLI prints ``error: <message>`` and exits with code 2; nothing else is caught broadly,
    so a real bug still shows its traceback.
    """

    exit_code = 2


class TrainingError(RuntimeError):
    """Training cannot go on (no gradient reaches the token vectors, a NaN loss)."""
