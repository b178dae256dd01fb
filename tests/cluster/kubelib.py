"""Helpers for the tests of the kubernetes engine: `xeontune launch`'s flags as the CLI parses them, and a
job's flags (imported by the test modules, and by test_kubernetes.py's driver, a fresh process)."""

from __future__ import annotations

import argparse

from xeontune.job.engines import kubernetes as k8s

BASE = ["--image", "registry.example.com/xeontune:0.1", "--volume-claim", "xeontune-data", "--cpus", "4",
        "--memory", "16Gi", "--job-name", "tj"]
TRAIN = ["--model", "org/sd", "--data-dir", "concept", "--placeholder-token", "<t>", "--initializer-token", "toy"]


def launch_parser() -> argparse.ArgumentParser:
    """`xeontune launch`'s own flags (xeontune/cli.py) plus the module's: what the CLI hands launch_command."""
    p = argparse.ArgumentParser(prog="xeontune launch")
    p.add_argument("-n", "--num-processes", type=int)
    p.add_argument("--ppn", default="1")
    p.add_argument("--name", default="default")
    p.add_argument("--dist-backend", choices=["auto", "gloo", "ccl"], default="auto")
    p.add_argument("--dry-run", action="store_true")
    p.add_argument("--detach", action="store_true")
    p.add_argument("--env", action="append")
    k8s.add_arguments(p)
    p.add_argument("train_args", nargs=argparse.REMAINDER)
    return p


def args_of(*argv: str) -> argparse.Namespace:
    return launch_parser().parse_args(list(argv))
