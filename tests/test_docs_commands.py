"""Every `xeontune ...` command the README and docs/ show in a shell block parses as the CLI parses it,
with the training options after `--` read as a rank reads them (each method's own options, those it
requires): a flag renamed, or put on the wrong side of `--`, fails here rather than for a user who
copies it."""

from __future__ import annotations

import argparse
import re
import shlex
from pathlib import Path

import pytest

from xeontune import bench, cli
from xeontune.errors import UserError
from xeontune.job.spec import strip_dashes
from xeontune.train import options

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
SUBCOMMANDS = {"model", "sample-data", "train", "doctor", "bench", "cluster", "launch", "run", "fetch",
               "logs", "teardown"}
# A shortened command, a shell variable or a config file: not all its train options are on the line.
PLACEHOLDERS = ("...", "<train options>", "$", "--config")
SHELL_OPERATORS = {"|", "||", "&&", ";", "&"}
COMMAND = re.compile(
    r"^\s*(?:\$\s+)?"  # a prompt
    r"(?:[A-Z_][A-Z0-9_]*=(?:\$\([^)]*\)|\S*)\s+)*"  # VAR=value, VAR=$(...)
    r"(?:sudo\s+(?:-E\s+)?|/usr/bin/time\s+-v\s+)?(?:\S*/)?"  # sudo, time, a path to the script
    r"(xeontune\s+(\S+).*)$")


def shown_commands(doc: Path) -> list[str]:
    """The `xeontune <subcommand> ...` lines of the doc's shell blocks, continuation lines joined; a line
    may start with `$ `, environment assignments, `sudo`, `/usr/bin/time -v` or a path. Output lines
    in a block (`xeontune bench: ...`) are not commands."""
    commands = []
    for block in re.findall(r"```(?:sh|bash|console|shell)?\n(.*?)```", doc.read_text(), re.S):
        for line in re.sub(r"\\\n\s*", " ", block).splitlines():
            match = COMMAND.match(line)
            if match and match[2] in SUBCOMMANDS:
                commands.append(match[1])
    return commands


CASES = [pytest.param(doc, command, id=f"{doc.name}:{i}") for doc in DOCS
         for i, command in enumerate(shown_commands(doc))]


def _argv(command: str) -> list[str]:
    argv = shlex.split(command, comments=True)[1:]
    cut = next((i for i, word in enumerate(argv) if word in SHELL_OPERATORS or word.startswith(">")), len(argv))
    return argv[:cut]


def _raise_errors(parser: argparse.ArgumentParser) -> None:
    """argparse's errors as UserErrors that say what was wrong, in ``parser`` and every subcommand's."""
    def error(message: str) -> None:
        raise UserError(f"{parser.prog}: {message}")

    parser.error = error  # type: ignore[method-assign]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                _raise_errors(sub)


def _parse_cli(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    _raise_errors(parser)
    return parser.parse_args(argv)


def test_the_docs_show_commands():
    assert len(CASES) >= 30, [c.values[1] for c in CASES]  # the extraction still finds them


@pytest.mark.parametrize(("doc", "command"), CASES)
def test_a_command_in_the_docs_parses(doc, command):
    argv = _argv(command)
    subcommand, rest = argv[0], argv[1:]
    train_args: list[str] = []
    if subcommand == "train":
        train_args = rest
    elif subcommand == "bench":
        _parse_cli(bench.build_parser(), rest)
    else:
        args = _parse_cli(cli.build_parser(), argv)
        train_args = strip_dashes(getattr(args, "train_args", None) or [])  # as `launch` and `run` read them
    if train_args and not any(p in " ".join(train_args) for p in PLACEHOLDERS):
        options.read_options(train_args)
