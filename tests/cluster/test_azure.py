"""The azure provider against a fake ARM endpoint on loopback (tests/cluster/fake_arm.py).

The real management clients talk HTTPS to it through azure-core's own transport and ARM polling;
only the base URL, a trusted test certificate (REQUESTS_CA_BUNDLE) and a static token differ
from a real run.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from azure.core.credentials import AccessToken
from azure.core.pipeline.policies import SansIOHTTPPolicy

from tests.cluster.fake_arm import TOKEN, FakeArmServer
from xeontune import cli
from xeontune.cluster import cloud, state
from xeontune.cluster.providers import azure

SUB = "00000000-0000-4000-8000-000000000001"
CIDR = "203.0.113.7/32"


class StaticToken:
    def __init__(self, token: str = TOKEN) -> None:
        self.token = token

    def get_token(self, *scopes: str, **kwargs) -> AccessToken:
        return AccessToken(self.token, 4_102_444_800)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FakeArmServer]:
    with FakeArmServer(tmp_path_factory.mktemp("arm")) as srv:
        yield srv


@pytest.fixture
def arm(server: FakeArmServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> FakeArmServer:
    server.reset()
    server.arm.quota_vcpus = 64
    monkeypatch.setenv("XEONTUNE_AZURE_ARM_ENDPOINT", server.url)
    monkeypatch.setenv("REQUESTS_CA_BUNDLE", str(server.ca))
    monkeypatch.setenv("AZURE_SUBSCRIPTION_ID", SUB)
    monkeypatch.setenv("XEONTUNE_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("XEONTUNE_CHECKIP_URL", "http://127.0.0.1:9/unused")  # never the internet
    monkeypatch.setattr(azure, "POLL_S", 0)
    monkeypatch.setattr(azure, "_credential", StaticToken)
    return server


def up_argv(name: str, n: int = 3, *extra: str) -> list[str]:
    return ["cluster", "up", "--provider", "azure", "-n", str(n), "--name", name, "--region", "eastus",
            "--ssh-cidr", CIDR, "--skip-bootstrap", *extra]


def teardown(name: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    rc = cli.main(["teardown", "--name", name, "--provider", "azure"])
    out, err = capsys.readouterr()
    return rc, out, err


def nothing_left(arm: FakeArmServer) -> bool:
    return not arm.arm.resource_groups and not arm.arm.resources


def of_type(arm: FakeArmServer, rtype: str) -> list[dict]:
    return [r for r in arm.arm.resources.values() if r["type"].lower() == rtype.lower()]


def test_up_creates_the_group_network_and_vms_then_teardown_deletes_the_group(arm, capsys):
    assert cli.main(up_argv("z1", 3)) == 0
    out = capsys.readouterr().out
    # 3 x (D16s_v6 $0.808 + a 64 GB Premium SSD) + one public IP, at creation and at the end
    assert out.count("estimated cost: $2.47/hour") == 2

    groups = list(arm.arm.resource_groups.values())
    assert [g["name"] for g in groups] == ["xeontune-z1"]
    assert groups[0]["tags"] == {"xeontune-cluster": "z1", "xeontune-cluster-id": state.load("z1").cluster_id}
    vms = of_type(arm, "Microsoft.Compute/virtualMachines")
    assert len(vms) == 3
    assert sorted(v["tags"]["xeontune-role"] for v in vms) == ["head", "worker", "worker"]
    assert all(v["tags"]["xeontune-cluster"] == "z1" for v in vms)
    key_line = (state.cluster_dir("z1") / "id_ed25519.pub").read_text().split()
    for v in vms:
        p = v["properties"]
        assert p["hardwareProfile"]["vmSize"] == "Standard_D16s_v6"
        assert p["storageProfile"]["imageReference"]["offer"] == "ubuntu-26_04-lts"  # newest LTS, not -daily/pro
        linux = p["osProfile"]["linuxConfiguration"]
        assert linux["disablePasswordAuthentication"] is True
        assert linux["ssh"]["publicKeys"][0]["keyData"].split()[:2] == key_line[:2]
    assert (state.cluster_dir("z1") / "id_ed25519").stat().st_mode & 0o777 == 0o600

    [nsg] = of_type(arm, "Microsoft.Network/networkSecurityGroups")
    rules = {r["name"]: r["properties"] for r in nsg["properties"]["securityRules"]}
    assert len(rules) == 2
    assert rules["ssh-from-caller"]["sourceAddressPrefix"] == CIDR
    assert rules["ssh-from-caller"]["destinationPortRange"] == "22"
    assert rules["cluster-internal"]["sourceAddressPrefix"] == "VirtualNetwork"
    [vnet] = of_type(arm, "Microsoft.Network/virtualNetworks")
    subnet = vnet["properties"]["subnets"][0]["properties"]
    assert subnet["networkSecurityGroup"]["id"] == nsg["id"] and subnet["defaultOutboundAccess"] is True
    assert len(of_type(arm, "Microsoft.Network/publicIPAddresses")) == 1
    nics = of_type(arm, "Microsoft.Network/networkInterfaces")
    assert len(nics) == 3
    assert sum("publicIPAddress" in n["properties"]["ipConfigurations"][0]["properties"] for n in nics) == 1

    record = state.load("z1")
    hosts = (state.cluster_dir("z1") / "work" / "hosts").read_text().split()
    assert hosts[0] == record.head.private_ip and len(set(hosts)) == 3
    assert sorted(hosts) == sorted(n["properties"]["ipConfigurations"][0]["properties"]["privateIPAddress"] for n in nics)
    assert record.head.public_ip and all(n.public_ip is None for n in record.nodes if n.role == "worker")
    assert {r.kind for r in record.resources} >= {"resource_group", "virtual_machine", "network_interface"}
    assert record.cores_per_node == 8 and "mixed_precision" not in record.extra
    assert record.memory_per_node == 64 * 2**30  # the size's MemoryGB capability
    # Long-running operations really were polled through the SDK.
    assert any("/operations/" in p for m, p in arm.arm.requests if m == "GET")

    assert cli.main(["cluster", "status", "--name", "z1"]) == 0
    out = capsys.readouterr().out
    assert out.count("running") == 3 and "estimated cost: $2.47/hour" in out

    rc, out, err = teardown("z1", capsys)
    assert rc == 0, err
    assert "deleted resource group xeontune-z1" in out
    assert nothing_left(arm)
    assert any("/operationresults/" in p for m, p in arm.arm.requests)  # the delete was waited for
    assert not state.exists("z1")
    rc, out, err = teardown("z1", capsys)
    assert rc == 0 and "deleted" not in out


def test_teardown_by_tag_when_the_state_file_is_lost(arm, capsys):
    assert cli.main(up_argv("lost", 2)) == 0
    assert cli.main(up_argv("keep", 1)) == 0
    capsys.readouterr()
    shutil.rmtree(state.cluster_dir("lost"))
    rc, out, err = teardown("lost", capsys)
    assert rc == 0, err
    assert "deleted resource group xeontune-lost" in out
    assert list(arm.arm.resource_groups) == ["xeontune-keep"]
    assert teardown("keep", capsys)[0] == 0
    assert nothing_left(arm)


class _InterruptAfter(SansIOHTTPPolicy):
    """Ctrl-C (a real SIGINT to this process) as the response to the k-th request arrives: a read,
    a write, or a poll of a long-running operation (which azure-core runs in its own thread, so a
    raise there would never reach the main thread; a signal does, as a real Ctrl-C would). ARM has
    done the work; the provider has not seen the answer."""

    def __init__(self, k: int) -> None:
        self.k, self.seen = k, []

    def on_response(self, request, response) -> None:
        req = request.http_request
        where = "/".join(req.url.split("?")[0].split("/")[-2:])
        self.seen.append(f"{req.method} {re.sub(r'[0-9a-f]{32}', '<op>', where)}")
        if len(self.seen) == self.k:
            os.kill(os.getpid(), signal.SIGINT)
            if threading.current_thread() is threading.main_thread():
                time.sleep(1)  # the handler raises KeyboardInterrupt here, at the latest


@pytest.mark.slow
def test_interrupting_up_at_each_cloud_call_then_teardown_leaves_nothing(arm, capsys, monkeypatch):
    plain = azure._client_kwargs

    def with_policy(policy: _InterruptAfter) -> None:
        monkeypatch.setattr(azure, "_client_kwargs", lambda: {**plain(), "per_call_policies": [policy]})

    counter = _InterruptAfter(0)
    with_policy(counter)
    assert cli.main(up_argv("f", 2)) == 0
    calls = list(counter.seen)
    assert [c.split()[0] for c in calls].count("PUT") == 8, calls  # group, nsg, vnet, ip, a NIC and a VM per node
    with_policy(_InterruptAfter(0))
    assert teardown("f", capsys)[0] == 0 and nothing_left(arm)
    for k in range(1, len(calls) + 1):
        policy = _InterruptAfter(k)
        with_policy(policy)
        assert cli.main(up_argv("f", 2)) == 130, k
        assert policy.seen[:k] == calls[:k]  # (an LRO thread may poll once more after the signal)
        err = capsys.readouterr().err
        if state.exists("f"):
            assert "xeontune teardown --name f" in err
        with_policy(_InterruptAfter(0))
        rc, out, err = teardown("f", capsys)
        assert rc == 0, (calls[k - 1], err)
        assert nothing_left(arm), (calls[k - 1], arm.arm.resource_groups, list(arm.arm.resources))
        assert not state.exists("f")


def _one_line_error(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


def test_unknown_region_and_size_fail_before_creating_anything(arm, capsys):
    assert cli.main(up_argv("bad", 2, "--region", "marsnorth")) == 2
    assert "unknown Azure region 'marsnorth'" in _one_line_error(capsys.readouterr().err)
    assert cli.main(up_argv("bad", 2, "--instance-type", "Standard_Huge_v9")) == 2
    assert "unknown Azure VM size 'Standard_Huge_v9'" in _one_line_error(capsys.readouterr().err)
    assert nothing_left(arm) and not any(m == "PUT" for m, _ in arm.arm.requests)
    assert not state.exists("bad")


def test_quota_error_is_one_line_and_leaves_nothing_running(arm, capsys):
    arm.arm.quota_vcpus = 40  # room for two D16s_v6, not three
    assert cli.main(up_argv("quota", 3)) == 2
    line = _one_line_error(capsys.readouterr().err)
    assert "quota" in line and "OperationNotAllowed" in line and "nothing was left running" in line
    assert len([p for m, p in arm.arm.requests if m == "PUT" and "virtualMachines" in p]) == 3
    assert nothing_left(arm)
    assert not state.exists("quota")


def test_missing_and_refused_credentials_are_one_line(arm, capsys, monkeypatch):
    from azure.identity import EnvironmentCredential

    for var in ("AZURE_CLIENT_ID", "AZURE_TENANT_ID", "AZURE_CLIENT_SECRET", "AZURE_CLIENT_CERTIFICATE_PATH",
                "AZURE_USERNAME", "AZURE_PASSWORD"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(azure, "_credential", EnvironmentCredential)  # a real credential with nothing to use
    assert cli.main(up_argv("nocred", 1)) == 2
    assert "Azure credentials missing or refused" in _one_line_error(capsys.readouterr().err)

    monkeypatch.setattr(azure, "_credential", lambda: StaticToken("expired-token"))
    assert cli.main(up_argv("nocred", 1)) == 2
    assert "InvalidAuthenticationToken" in _one_line_error(capsys.readouterr().err)

    monkeypatch.delenv("AZURE_SUBSCRIPTION_ID")
    monkeypatch.setenv("AZURE_CONFIG_DIR", str(Path(state.home()) / "no-azure-cli"))
    assert cli.main(up_argv("nocred", 1)) == 2
    assert "no Azure subscription" in _one_line_error(capsys.readouterr().err)
    assert nothing_left(arm) and not state.exists("nocred")


def test_wait_pins_host_keys_read_through_arm_then_waits_for_ssh(arm, capsys, monkeypatch):
    """Without --skip-bootstrap: each VM runs, its ed25519 key comes back from a run-command
    through the authenticated ARM API, and that key is pinned before any SSH connection."""
    assert cli.main(up_argv("w", 2)) == 0
    record = state.load("w")
    record.skip_bootstrap = False
    keys = {n.name: "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAI" + chr(65 + i) * 43 for i, n in enumerate(record.nodes)}
    arm.arm.host_keys.update(keys)
    waited: list[str] = []
    monkeypatch.setattr(cloud, "wait_for_ssh", lambda rec, deadline: waited.extend(n.name for n in rec.nodes))
    azure.PROVIDER.wait(record, timeout_s=30)
    assert waited == ["node0", "node1"]
    assert sum(m == "POST" and p.endswith("/runCommand") for m, p in arm.arm.requests) == 2
    known = Path(record.known_hosts_path).read_text().splitlines()
    assert len(known) == 2
    for node in record.nodes:
        line = next(ln for ln in known if node.name in ln.split()[0].split(","))
        assert node.private_ip in line.split()[0].split(",")
        assert line.split()[1:] == keys[node.name].split()
    assert teardown("w", capsys)[0] == 0 and nothing_left(arm)


def test_without_the_azure_extra_the_error_says_what_to_install(arm, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "azure.mgmt.compute", None)
    assert cli.main(up_argv("noextra", 1)) == 2
    assert "pip install 'xeontune[azure]'" in _one_line_error(capsys.readouterr().err)
    assert not state.exists("noextra") and nothing_left(arm)


# --- two users, one subscription: group names are shared, cluster ids are not ---------------------


def test_a_second_up_of_the_same_name_from_another_state_dir_is_refused(arm, capsys, monkeypatch, tmp_path):
    assert cli.main(up_argv("default", 2)) == 0
    before = {k: dict(v) for k, v in arm.arm.resources.items()}
    group = dict(arm.arm.resource_groups["xeontune-default"])
    capsys.readouterr()
    monkeypatch.setenv("XEONTUNE_HOME", str(tmp_path / "other-user"))
    assert cli.main(up_argv("default", 1)) == 2
    line = _one_line_error(capsys.readouterr().err)
    assert f"resource group xeontune-default already exists in subscription {SUB}" in line
    assert not state.exists("default")
    # Not adopted, not rolled back: the first user's group and VMs are as they were.
    assert arm.arm.resource_groups["xeontune-default"] == group and arm.arm.resources == before
    assert len(of_type(arm, "Microsoft.Compute/virtualMachines")) == 2
    monkeypatch.setenv("XEONTUNE_HOME", str(tmp_path / "home"))
    assert teardown("default", capsys)[0] == 0 and nothing_left(arm)


def test_teardown_with_a_record_deletes_only_a_group_that_carries_its_id(arm, capsys):
    assert cli.main(up_argv("shared", 1)) == 0
    capsys.readouterr()
    # The recorded group is now another cluster's (deleted, then re-created by another user's `up`).
    arm.arm.resource_groups["xeontune-shared"]["tags"]["xeontune-cluster-id"] = "0123456789abcdef"
    rc, out, err = teardown("shared", capsys)
    assert rc == 0, err
    assert "deleted" not in out and "xeontune-shared" in arm.arm.resource_groups
    rc, out, err = teardown("shared", capsys)  # no record now: by the name tag, saying so
    assert rc == 0 and "deleted resource group xeontune-shared" in out and "no record of cluster 'shared'" in err
    assert nothing_left(arm)


def test_a_delete_that_does_not_finish_is_reported_by_its_deadline(arm, capsys, monkeypatch):
    """Finding 10: the Azure delete had no deadline; a resource group stuck deleting hung teardown
    (and `run`'s end) forever. Now it is reported as not deleted at the deadline."""
    import time

    assert cli.main(up_argv("z9", 1)) == 0
    arm.arm.delete_polls = 10**9  # ARM keeps answering "in progress"
    monkeypatch.setattr(azure, "DELETE_DEADLINE_S", 1.0)
    start = time.monotonic()
    rc, out, err = teardown("z9", capsys)
    assert time.monotonic() - start < 30
    assert rc != 0 and "still being deleted after 1 s" in out + err, out + err
    assert state.exists("z9")  # kept: a later teardown finds it
    arm.arm.delete_polls = 0
    for op in arm.arm.operations.values():  # the first delete's poller, still polling, may finish too
        op.polls_left = 0
    rc, out, err = teardown("z9", capsys)
    assert rc == 0 and not state.exists("z9"), out + err
