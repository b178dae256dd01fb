"""The check every "bad input" test makes: the CLI exits 2 with exactly one `error:` line, no traceback."""

from __future__ import annotations

from xeontune.cli import main


def one_line_error(capsys, argv: list[str]) -> str:
    """Run ``xeontune argv``; return its one error line."""
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in err, err[-3000:]
    return errors[0]
