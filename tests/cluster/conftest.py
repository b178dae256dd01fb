"""Fixtures for the cluster tests: a module-scoped local (network-namespace) cluster and a real Slurm,
the names of the clusters a test makes for itself, the tiny model and data, and moto's EC2 server.

Root tests run wherever the tests run as root (CI does) and skip only when not root or when
iproute2 / sshd are missing (scripts/install-test-deps.sh installs them). Every cluster is torn
down in a ``finally``, also when a test fails.
"""

from __future__ import annotations

import os
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.cluster import slurmlib
from tests.cluster.clusterlib import leftovers, require_local_cluster, torn_down, unique_cluster_name


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


@pytest.fixture
def tiny(tiny_model, sample_images):
    """The session's tiny pipeline and sample images (tests/conftest.py)."""
    return {"model": tiny_model, "data": sample_images}


@pytest.fixture
def root_home(xeontune_home):
    """A private state dir, for the tests that make their own clusters: they skip for a developer
    without root as the shared cluster does (as root or in CI, a missing dependency fails them)."""
    require_local_cluster()
    return xeontune_home


@pytest.fixture
def cluster_name(request, root_home) -> Iterator[str]:
    """A name unique to this test run (other runs use namespaces at the same time): the module's
    ``CLUSTER_NAME_PREFIX`` ("r" where it sets none), this process's id and a count; whatever a test
    leaves under it is torn down afterwards."""
    name = unique_cluster_name(getattr(request.module, "CLUSTER_NAME_PREFIX", "r"))
    yield name
    torn_down(name)


@pytest.fixture
def own_name(request, root_home) -> Iterator[str]:
    """A cluster name unique to this run and test (the module's ``OWN_NAME_PREFIX``, this process's id and
    part of the test's name), torn down afterwards if it is still there."""
    name = f"{request.module.OWN_NAME_PREFIX}{os.getpid() % 100000}-{request.node.name[5:13].replace('_', '-')}"
    name = name.rstrip("-")
    yield name
    torn_down(name)


@pytest.fixture(scope="module")
def moto_url() -> Iterator[str]:
    """moto's EC2 server on 127.0.0.1, for the whole module (tests/cluster/awslib.py reads it back)."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


@pytest.fixture
def env(moto_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A fresh emulated account, a private state dir, fake credentials, no real AWS reachable."""
    from xeontune.cluster.providers import aws

    urllib.request.urlopen(urllib.request.Request(f"{moto_url}/moto-api/reset", method="POST")).read()
    monkeypatch.setenv("AWS_ENDPOINT_URL", moto_url)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    monkeypatch.delenv("AWS_SESSION_TOKEN", raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-aws-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-aws-credentials"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("XEONTUNE_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("XEONTUNE_CHECKIP_URL", "http://127.0.0.1:9/unused")  # never the internet
    monkeypatch.setattr(aws, "POLL_S", 0.01)
    monkeypatch.setattr(aws, "UNSEEN_GRACE_S", 1.0)
    return moto_url
