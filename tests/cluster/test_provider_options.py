"""A provider's own flags reach only it: `cluster up` and `run` offer every provider's, each once,
the help names who reads it, and one given to another provider is a one-line error before anything
is created (before: Azure alone refused --spot and --subnet; Slurm's --partition went unread to AWS)."""

from __future__ import annotations

import argparse

import pytest

from xeontune.cli import build_parser, main
from xeontune.cluster import providers, state


def test_each_flag_is_offered_once_and_names_the_providers_that_read_it(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["cluster", "up", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert help_text.count("--partition PARTITION") == 2  # usage line and its entry
    assert "aws, azure: an image instead of the current Ubuntu LTS" in help_text
    assert "--spot aws: spot instances" in help_text


@pytest.mark.parametrize("command", [["cluster", "up"], ["run"]])
@pytest.mark.parametrize(("provider", "flags", "says"), [
    ("localhost", ["--spot"], "--spot is an option of --provider aws, not of localhost"),
    ("azure", ["--subnet", "subnet-1"], "--subnet is an option of --provider aws, not of azure"),
    ("aws", ["--partition", "debug"], "--partition is an option of --provider slurm, not of aws"),
    ("slurm", ["--link-rate", "10gbit"], "--link-rate is an option of --provider local, not of slurm"),
])
def test_a_flag_of_another_provider_is_one_line(xeontune_home, capsys, command, provider, flags, says):
    argv = [*command, "--provider", provider, "-n", "1", "--name", "opts", *flags]
    assert main([*argv, "--", "--model", "x"] if command == ["run"] else argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: {says}"]
    assert not state.exists("opts")  # nothing created


def test_the_chosen_providers_own_flags_reach_its_spec():
    args = build_parser().parse_args(["cluster", "up", "--provider", "slurm", "--partition", "debug",
                                      "--time", "1:00:00", "-n", "2"])
    assert providers.options_from(args, "slurm") == {"partition": "debug", "time": "1:00:00"}
    again = argparse.Namespace(**providers.option_args({"spot": True, "ami": "ami-1"}))
    assert providers.options_from(again, "aws") == {"spot": True, "ami": "ami-1"}
