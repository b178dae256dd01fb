"""After autostop: the instances terminated themselves; `cluster status` and `teardown` delete what
they leave (security group, key pair), against moto's EC2 server over real HTTP.

The instances' own `shutdown -h now` (InstanceInitiatedShutdownBehavior=terminate) is played by a
TerminateInstances call from a separate client: what EC2 shows afterwards is the same.
"""

from __future__ import annotations

import pytest

from tests.cluster.awslib import ec2, leftovers, live_instances, up_argv
from xeontune import cli
from xeontune.cluster import state

pytestmark = pytest.mark.usefixtures("env")  # moto's server, a fresh account, a private state dir (conftest.py)


def terminate_from_inside(name: str) -> None:
    ids = [i["InstanceId"] for i in live_instances(name)]
    assert len(ids) == 3
    ec2().terminate_instances(InstanceIds=ids)
    assert live_instances(name) == []


@pytest.mark.slow
def test_status_notices_terminated_instances_and_deletes_the_rest(capsys):
    assert cli.main(up_argv("gone", 3)) == 0
    capsys.readouterr()
    terminate_from_inside("gone")
    left = leftovers("gone")
    assert left["security_groups"] and left["key_pairs"]  # what powering off leaves

    assert cli.main(["cluster", "status", "--name", "gone"]) == 0
    out = capsys.readouterr().out
    assert out.count("terminated") >= 3 and "every node is terminated" in out
    assert "deleted security group sg-" in out and "deleted key pair xeontune-gone" in out
    assert "cluster 'gone' forgotten" in out
    assert leftovers("gone") == {"instances": [], "security_groups": [], "key_pairs": []}
    assert not state.exists("gone")
    assert cli.main(["cluster", "status"]) == 0
    assert "no clusters" in capsys.readouterr().out


def test_status_leaves_running_clusters_alone(capsys):
    assert cli.main(up_argv("live", 2)) == 0
    capsys.readouterr()
    assert cli.main(["cluster", "status", "--name", "live"]) == 0
    out = capsys.readouterr().out
    assert "estimated cost" in out and "deleted" not in out
    assert state.exists("live") and len(live_instances("live")) == 2


@pytest.mark.slow
def test_teardown_after_autostop_deletes_the_rest(capsys):
    assert cli.main(up_argv("gone2", 3)) == 0
    terminate_from_inside("gone2")
    capsys.readouterr()
    assert cli.main(["teardown", "--name", "gone2"]) == 0
    out = capsys.readouterr().out
    assert "deleted security group" in out and "deleted key pair" in out and "deleted instance" not in out
    assert leftovers("gone2") == {"instances": [], "security_groups": [], "key_pairs": []}


def test_autostop_needs_the_bootstrap(capsys):
    assert cli.main(up_argv("nob", 1, "--autostop", "30")) == 0
    out, err = capsys.readouterr()
    assert "not installed with --skip-bootstrap" in err and "autostop:" not in out
    assert state.load("nob").autostop_minutes == 0
    assert cli.main(["teardown", "--name", "nob"]) == 0

