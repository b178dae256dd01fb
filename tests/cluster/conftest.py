"""Fixtures for the real-cluster tests: a module-scoped local (network-namespace) cluster.

Root tests run wherever the tests run as root (CI does) and skip only when not root or when
iproute2 / sshd are missing (scripts/install-test-deps.sh installs them). Every cluster is torn
down in a ``finally``, also when a test fails.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from tests.cluster import slurmlib
from tests.cluster.clusterlib import leftovers, require_local_cluster


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    """A real Slurm of 3 nodes on this machine (tests/cluster/slurmlib.py), for the whole module."""
    slurmlib.require_slurm()
    cluster = slurmlib.start(tmp_path_factory.mktemp("slurm"), nodes=3)
    yield cluster
    slurmlib.stop(cluster)


@pytest.fixture(scope="module")
def local_cluster(request, tmp_path_factory) -> Iterator:
    """A 3-node local cluster for the whole module (about 1 s to create); torn down afterwards."""
    require_local_cluster()
    from xeontune.cluster import manage, providers, state

    name = f"t{os.getpid() % 100000}-{request.module.__name__.rsplit('.', 1)[-1][5:13].replace('_', '-')}".rstrip("-")
    home = tmp_path_factory.mktemp("xeontune-home")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("XEONTUNE_HOME", str(home))
        try:
            record, _ = manage.up(providers.ClusterSpec(name=name, num_nodes=3), "local")
            yield record
        finally:
            if state.exists(name) or leftovers(name):
                manage.teardown(name, "local")
