"""The `localhost` provider for real: three ranks on this machine with Hydra's fork launcher (no root)."""

from __future__ import annotations

import subprocess

import pytest

from tests.cluster.clusterlib import REPO
from xeontune.cluster import files, manage, providers
from xeontune.job import start as launcher

pytestmark = pytest.mark.slow


def test_three_ranks_all_reduce_on_localhost(xeontune_home):
    record, written = manage.up(providers.ClusterSpec(name="solo", num_nodes=3), "localhost")
    try:
        assert written == {} and not (files.files_dir(record) / "hosts").exists()  # no SSH, no hosts file
        plan = launcher.build_plan(record, 3, 1, "gloo", [], module="tests.cluster.allreduce_probe")
        launcher.preflight(record, plan)
        proc = subprocess.run(plan.argv, cwd=REPO, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        lines = [line for line in proc.stdout.splitlines() if "probe rank=" in line]
        assert len(lines) == 3 and all("ok=True" in line and "master=127.0.0.1" in line for line in lines)
    finally:
        assert manage.teardown("solo").ok
