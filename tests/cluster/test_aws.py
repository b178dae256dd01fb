"""The aws provider against moto's EC2 server on 127.0.0.1, over real HTTP through boto3.

boto3 honours AWS_ENDPOINT_URL, so the provider code runs unchanged; every assertion reads the
emulated account back through a separate boto3 client. The tests that bring a cluster up (emulated,
2 to 40 s each) are marked slow: `make test-fast` starts no cluster.
"""

from __future__ import annotations

import base64
import http.client
import http.server
import json
import shutil
import sys
import threading
from pathlib import Path

import pytest

from tests.cluster.awslib import CIDR, REGION, Proxy, ec2, ec2_error, leftovers, live_instances, up_argv
from xeontune import cli
from xeontune.cluster import cloud, state
from xeontune.cluster.providers import aws
from xeontune.errors import UserError

MUTATING = {"CreateSecurityGroup", "AuthorizeSecurityGroupIngress", "ImportKeyPair", "RunInstances"}


def teardown(name: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    rc = cli.main(["teardown", "--name", name, "--provider", "aws", "--region", REGION])
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.mark.slow
def test_up_creates_tagged_nodes_two_rules_key_and_files_then_teardown_removes_all(env, capsys):
    assert cli.main(up_argv("t1", 3)) == 0
    out = capsys.readouterr().out
    # 3 x (m7i.4xlarge $0.8064 + 60 GB gp3 + a public IPv4 address), printed when creation starts and at the end
    assert out.count("estimated cost: $2.45/hour") == 2

    insts = sorted(live_instances("t1"), key=lambda i: i["LaunchTime"])
    assert len(insts) == 3
    tags = [{t["Key"]: t["Value"] for t in i["Tags"]} for i in insts]
    assert sorted(t["xeontune-role"] for t in tags) == ["head", "worker", "worker"]
    assert {t["xeontune-cluster"] for t in tags} == {"t1"}
    assert {i["InstanceType"] for i in insts} == {"m7i.4xlarge"}
    for i in insts:
        attr = ec2().describe_instance_attribute(InstanceId=i["InstanceId"], Attribute="instanceInitiatedShutdownBehavior")
        assert attr["InstanceInitiatedShutdownBehavior"]["Value"] == "terminate"
        assert i["KeyName"] == "xeontune-t1"
        assert i["MetadataOptions"]["HttpTokens"] == "required"  # IMDSv2 only
    # The image is the newest Canonical Ubuntu LTS that moto knows (16.04 beats 14.04).
    image = ec2().describe_images(ImageIds=[insts[0]["ImageId"]])["Images"][0]
    assert image["OwnerId"] == aws.CANONICAL_OWNER and "16.04" in image["Name"]

    groups = ec2().describe_security_groups(Filters=[{"Name": "group-name", "Values": ["xeontune-t1"]}])["SecurityGroups"]
    assert len(groups) == 1
    sg = groups[0]
    rules = sg["IpPermissions"]
    assert len(rules) == 2
    internal = next(r for r in rules if r["IpProtocol"] == "-1")
    assert [p["GroupId"] for p in internal["UserIdGroupPairs"]] == [sg["GroupId"]] and not internal["IpRanges"]
    ssh_rule = next(r for r in rules if r["IpProtocol"] == "tcp")
    assert (ssh_rule["FromPort"], ssh_rule["ToPort"]) == (22, 22)
    assert [r["CidrIp"] for r in ssh_rule["IpRanges"]] == [CIDR] and not ssh_rule["UserIdGroupPairs"]
    # (moto lists the groups on the network interface only, where the provider puts them)
    assert all([g["GroupId"] for g in i["NetworkInterfaces"][0]["Groups"]] == [sg["GroupId"]] for i in insts)

    keys = ec2().describe_key_pairs(KeyNames=["xeontune-t1"])["KeyPairs"]
    assert len(keys) == 1 and keys[0]["KeyType"] == "ed25519"
    key_path = state.cluster_dir("t1") / "id_ed25519"
    assert key_path.stat().st_mode & 0o777 == 0o600
    assert keys[0]["KeyName"] == "xeontune-t1"

    record = state.load("t1")
    head = next(i for i, t in zip(insts, tags, strict=True) if t["xeontune-role"] == "head")
    hosts = (state.cluster_dir("t1") / "work" / "hosts").read_text().split()
    assert hosts[0] == head["PrivateIpAddress"]
    assert sorted(hosts) == sorted(i["PrivateIpAddress"] for i in insts)
    assert record.head.public_ip == head["PublicIpAddress"]
    assert [n.public_ip for n in record.nodes if n.role == "worker"] == [None, None]  # reached through the head
    ssh_config = (state.cluster_dir("t1") / "work" / "ssh_config").read_text()
    assert ssh_config.count("ProxyJump node0") == 2 and f"HostName {head['PublicIpAddress']}" in ssh_config
    kinds = sorted(r.kind for r in record.resources)
    assert kinds == ["instance"] * 3 + ["key_pair", "security_group"]
    assert "mixed_precision" not in record.extra  # each rank decides on its own CPU
    assert record.cores_per_node == 8 and record.instance_type == "m7i.4xlarge"  # 16 vCPUs on 8 cores
    assert record.memory_per_node == 64 * 2**30  # MemoryInfo: `launch --ppn auto` fits ranks into it
    assert record.venv == "/opt/xeontune/venv" and record.work_dir == "/opt/xeontune/work"
    assert json.dumps(record.to_json()).count("testing") == 0  # no credential in the state file

    assert cli.main(["cluster", "status", "--name", "t1"]) == 0
    out = capsys.readouterr().out
    assert out.count("running") == 3 and "estimated cost: $2.45/hour" in out

    # What the instances bring along and bill for: a root volume (tagged by the provider; moto keeps the
    # tag) and a network interface each (moto drops that tag: they are followed by id instead).
    volumes = {m["Ebs"]["VolumeId"] for i in insts for m in i["BlockDeviceMappings"]}
    interfaces = {n["NetworkInterfaceId"] for i in insts for n in i["NetworkInterfaces"]}
    assert len(volumes) == len(interfaces) == 3
    assert {v["VolumeId"] for v in ec2().describe_volumes(Filters=[
        {"Name": "tag:xeontune-cluster", "Values": ["t1"]}])["Volumes"]} == volumes

    rc, out, err = teardown("t1", capsys)
    assert rc == 0, err
    assert out.count("deleted instance") == 3 and "deleted security group" in out and "deleted key pair" in out
    assert leftovers("t1") == {"instances": [], "security_groups": [], "key_pairs": []}
    # none is left behind, "available" and billing (DeleteOnTermination, which moto honours)
    assert [v["VolumeId"] for v in ec2().describe_volumes()["Volumes"] if v["VolumeId"] in volumes] == []
    assert [n["NetworkInterfaceId"] for n in ec2().describe_network_interfaces()["NetworkInterfaces"]
            if n["NetworkInterfaceId"] in interfaces] == []
    assert not state.exists("t1")
    # Idempotent: a second run finds nothing and succeeds.
    rc, out, err = teardown("t1", capsys)
    assert rc == 0 and "deleted" not in out


@pytest.mark.slow
def test_spot_subnet_and_ami_options(env, capsys):
    c = ec2()
    vpc = c.create_vpc(CidrBlock="10.77.0.0/16")["Vpc"]["VpcId"]
    subnet = c.create_subnet(VpcId=vpc, CidrBlock="10.77.1.0/24", AvailabilityZone=f"{REGION}b")["Subnet"]["SubnetId"]
    ami = next(i["ImageId"] for i in c.describe_images(Owners=["amazon"])["Images"] if i.get("RootDeviceName"))
    assert cli.main(up_argv("opts", 2, "--spot", "--subnet", subnet, "--ami", ami, "--instance-type", "c7i.4xlarge")) == 0
    insts = live_instances("opts")
    assert len(insts) == 2
    assert {i["SubnetId"] for i in insts} == {subnet} and {i["ImageId"] for i in insts} == {ami}
    assert {i.get("InstanceLifecycle") for i in insts} == {"spot"}
    assert {i["InstanceType"] for i in insts} == {"c7i.4xlarge"}
    [sg] = c.describe_security_groups(Filters=[{"Name": "tag:xeontune-cluster", "Values": ["opts"]}])["SecurityGroups"]
    assert sg["VpcId"] == vpc
    assert all(ip.startswith("10.77.1.") for ip in (state.cluster_dir("opts") / "work" / "hosts").read_text().split())
    capsys.readouterr()
    assert teardown("opts", capsys)[0] == 0
    assert leftovers("opts") == {"instances": [], "security_groups": [], "key_pairs": []}


@pytest.mark.slow
def test_teardown_from_tags_alone_when_state_file_is_lost(env, capsys):
    assert cli.main(up_argv("lost", 2)) == 0
    other = cli.main(up_argv("other", 1))  # a second cluster that must survive
    assert other == 0
    capsys.readouterr()
    shutil.rmtree(state.cluster_dir("lost"))
    rc, out, err = teardown("lost", capsys)
    assert rc == 0, err
    assert out.count("deleted instance") == 2
    assert leftovers("lost") == {"instances": [], "security_groups": [], "key_pairs": ["xeontune-other"]}
    assert len(live_instances("other")) == 1
    assert teardown("other", capsys)[0] == 0
    assert leftovers("other") == {"instances": [], "security_groups": [], "key_pairs": []}


_client_plain = aws._client


def _interrupt_after(monkeypatch: pytest.MonkeyPatch, k: int) -> list[str]:
    """Raise KeyboardInterrupt as the k-th EC2 call of ``up`` returns: the cloud has done it, the
    provider has not seen the answer (for a create, the worst moment for a crash)."""
    seen: list[str] = []

    def hook(model, **_):
        seen.append(model.name)
        if len(seen) == k:
            raise KeyboardInterrupt

    def client(region):
        c = _client_plain(region)
        c.meta.events.register("after-call.ec2", hook)
        return c

    monkeypatch.setattr(aws, "_client", client)
    return seen


@pytest.mark.slow
def test_interrupting_up_at_each_cloud_call_then_teardown_leaves_nothing(env, capsys, monkeypatch):
    calls = _interrupt_after(monkeypatch, 0)
    assert cli.main(up_argv("f", 2)) == 0
    writes = [c for c in calls if c in MUTATING]
    assert writes == ["CreateSecurityGroup", "AuthorizeSecurityGroupIngress", "ImportKeyPair", "RunInstances", "RunInstances"]
    monkeypatch.setattr(aws, "_client", _client_plain)
    assert teardown("f", capsys)[0] == 0
    for k in range(1, len(calls) + 1):
        seen = _interrupt_after(monkeypatch, k)
        assert cli.main(up_argv("f", 2)) == 130
        assert seen[:k] == calls[:k]  # then the rollback's own calls
        _, err = capsys.readouterr()
        if state.exists("f"):
            assert "xeontune teardown --name f" in err
        monkeypatch.setattr(aws, "_client", _client_plain)
        rc, out, err = teardown("f", capsys)
        assert rc == 0, (calls[k - 1], err)
        assert leftovers("f") == {"instances": [], "security_groups": [], "key_pairs": []}, calls[k - 1]
        assert not state.exists("f")




def _one_line_error(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


def test_unknown_region_and_instance_type_fail_before_creating_anything(env, capsys):
    assert cli.main(up_argv("bad", 2, "--region", "mars-north-1")) == 2
    assert "unknown AWS region 'mars-north-1'" in _one_line_error(capsys.readouterr().err)
    assert cli.main(up_argv("bad", 2, "--instance-type", "m7i.huge")) == 2
    assert "instance type 'm7i.huge'" in _one_line_error(capsys.readouterr().err)
    assert leftovers("bad") == {"instances": [], "security_groups": [], "key_pairs": []}
    assert not state.exists("bad")


def test_run_finds_a_mistake_in_the_data_folder_before_creating_anything(env, capsys, sample_images, tmp_path):
    """`run` reads --data-dir as a rank will before a node exists: a caption beside no image is one line
    here, where the cluster used to come up, bootstrap and bill for minutes to say it."""
    data = tmp_path / "data"
    shutil.copytree(sample_images, data)
    (data / "dog.txt").write_text("a photo of <t>")
    (data / "broken.png").write_bytes(b"not a picture")  # a rank skips it with a warning: so does run
    assert cli.main(["run", "--provider", "aws", "-n", "2", "--name", "baddata", "--region", REGION, "--ssh-cidr",
                     CIDR, "--", "--model", "org/model", "--placeholder-token", "<t>", "--initializer-token", "toy",
                     "--data-dir", str(data), "--output-dir", str(tmp_path / "out")]) == 2
    warning, error = capsys.readouterr().err.strip().splitlines()
    assert warning.startswith(f"warning: skipping {data / 'broken.png'}: not a readable image"), warning
    assert error.startswith("error: ") and "dog.txt has no image beside it" in error, error
    assert leftovers("baddata") == {"instances": [], "security_groups": [], "key_pairs": []}
    assert not state.exists("baddata") and not (tmp_path / "out").exists()


def test_missing_credentials_is_one_line(env, capsys, monkeypatch):
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    assert cli.main(up_argv("nocred", 1)) == 2
    assert "no AWS credentials" in _one_line_error(capsys.readouterr().err)
    assert not state.exists("nocred")
    monkeypatch.setenv("AWS_PROFILE", "no-such-profile")  # botocore raises ProfileNotFound before any call
    assert cli.main(up_argv("nocred", 1)) == 2
    assert "no-such-profile" in _one_line_error(capsys.readouterr().err)
    assert not state.exists("nocred")


def _quota_at(n: int):
    def answer(action: str, count: int, params) -> tuple[int, bytes] | None:
        if action == "RunInstances" and count == n:
            return 400, (b'<?xml version="1.0" encoding="UTF-8"?><Response><Errors><Error><Code>VcpuLimitExceeded</Code>'
                         b"<Message>You have requested more vCPU capacity than your current vCPU limit of 32 allows for "
                         b"the instance bucket that the specified instance type belongs to.</Message></Error></Errors>"
                         b"<RequestID>quota-test</RequestID></Response>")
        return None
    return answer


@pytest.mark.slow
def test_quota_error_is_one_line_and_leaves_nothing_running(env, capsys, monkeypatch):
    proxy = Proxy(env, _quota_at(2))
    with proxy as url:
        monkeypatch.setenv("AWS_ENDPOINT_URL", url)
        assert cli.main(up_argv("quota", 3)) == 2
        line = _one_line_error(capsys.readouterr().err)
        assert "VcpuLimitExceeded" in line and "nothing was left running" in line
        assert proxy.counts["RunInstances"] == 2
    monkeypatch.setenv("AWS_ENDPOINT_URL", env)
    assert leftovers("quota") == {"instances": [], "security_groups": [], "key_pairs": []}
    assert not state.exists("quota")


def test_wait_pins_the_host_key_from_the_console_then_waits_for_ssh(env, capsys, monkeypatch):
    """Without --skip-bootstrap: running, then each node's ed25519 key read from GetConsoleOutput
    (the first read is still booting, no keys yet) is pinned before any SSH connection."""
    assert cli.main(up_argv("w", 2)) == 0
    record = state.load("w")
    record.skip_bootstrap = False
    keys = {n.resource_id: "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAI" + chr(65 + i) * 43 for i, n in enumerate(record.nodes)}

    asked: list[str] = []

    def answer(action: str, count: int, params) -> tuple[int, bytes] | None:
        if action != "GetConsoleOutput":
            return None
        iid = params["InstanceId"][0]
        text = "[    3.1] cloud-init: still booting\n"
        asked.append(iid)
        if asked.count(iid) > 1:  # booting at the first look, keys printed by the second
            text += f"-----BEGIN SSH HOST KEY KEYS-----\n{keys[iid]} root@ip\n-----END SSH HOST KEY KEYS-----\n"
        out = base64.b64encode(text.encode()).decode()
        return 200, (f'<GetConsoleOutputResponse xmlns="http://ec2.amazonaws.com/doc/2016-11-15/"><requestId>r</requestId>'
                     f"<instanceId>{iid}</instanceId><timestamp>2026-11-22T12:00:00.000Z</timestamp>"
                     f"<output>{out}</output></GetConsoleOutputResponse>").encode()

    waited: list[str] = []
    monkeypatch.setattr(cloud, "wait_for_ssh", lambda rec, deadline: waited.extend(n.name for n in rec.nodes))
    proxy = Proxy(env, answer)
    with proxy as url:
        monkeypatch.setenv("AWS_ENDPOINT_URL", url)
        aws.PROVIDER.wait(record, timeout_s=30)
    assert sorted(asked) == sorted(list(keys) * 2)  # each instance: booting, then its keys
    assert waited == ["node0", "node1"]
    known = Path(record.known_hosts_path).read_text().splitlines()
    assert len(known) == 2
    for node in state.load("w").nodes:
        line = next(ln for ln in known if node.name in ln.split()[0].split(","))
        assert node.private_ip in line.split()[0].split(",")
        assert line.split()[1:] == keys[node.resource_id].split()
    monkeypatch.setenv("AWS_ENDPOINT_URL", env)
    assert teardown("w", capsys)[0] == 0


def test_wait_names_the_node_that_did_not_come_up(env, capsys, monkeypatch):
    assert cli.main(up_argv("slow", 2)) == 0
    record = state.load("slow")
    record.skip_bootstrap = False
    # A console that never shows host keys: the error names the node, after the timeout.
    proxy = Proxy(env, lambda action, count, params: (200, (
        b'<GetConsoleOutputResponse xmlns="http://ec2.amazonaws.com/doc/2016-11-15/"><requestId>r</requestId>'
        b"<instanceId>" + params["InstanceId"][0].encode() + b"</instanceId><timestamp>2026-11-22T12:00:00.000Z</timestamp>"
        b"<output></output></GetConsoleOutputResponse>")) if action == "GetConsoleOutput" else None)
    with proxy as url:
        monkeypatch.setenv("AWS_ENDPOINT_URL", url)
        with pytest.raises(UserError, match=r"node node0 \(i-[0-9a-f]+\) of cluster 'slow' did not report its SSH host key"):
            aws.PROVIDER.wait(record, timeout_s=0.3)
    monkeypatch.setenv("AWS_ENDPOINT_URL", env)
    # An instance that died while starting is named at once, with its state.
    ec2().terminate_instances(InstanceIds=[record.nodes[1].resource_id])
    with pytest.raises(UserError, match=r"node node1 \(i-[0-9a-f]+\) of cluster 'slow' is (shutting-down|terminated)"):
        aws.PROVIDER.wait(record, timeout_s=30)
    assert teardown("slow", capsys)[0] == 0


@pytest.mark.slow
def test_teardown_retries_a_busy_group_and_names_what_it_could_not_delete(env, capsys, monkeypatch):
    assert cli.main(up_argv("dep", 2)) == 0
    capsys.readouterr()

    def answer(action: str, count: int, params) -> tuple[int, bytes] | None:
        if action == "DeleteSecurityGroup" and count <= 2:  # ENIs of the terminated instances still attached
            return ec2_error("DependencyViolation", "resource sg-x has a dependent object")
        if action == "DeleteKeyPair":
            return ec2_error("UnauthorizedOperation", "You are not authorized to perform this operation.")
        return None

    proxy = Proxy(env, answer)
    with proxy as url:
        monkeypatch.setenv("AWS_ENDPOINT_URL", url)
        rc, out, err = teardown("dep", capsys)
    assert rc == 1
    assert proxy.counts["DeleteSecurityGroup"] == 3 and "deleted security group" in out
    assert "could not delete key pair" in err and "UnauthorizedOperation" in err
    assert state.exists("dep")  # kept, so the next teardown still knows what is left
    monkeypatch.setenv("AWS_ENDPOINT_URL", env)
    rc, out, err = teardown("dep", capsys)
    assert rc == 0 and "deleted key pair xeontune-dep" in out and out.count("deleted") == 1
    assert leftovers("dep") == {"instances": [], "security_groups": [], "key_pairs": []}


@pytest.mark.slow
def test_teardown_terminates_instances_ec2_does_not_show_yet(env, capsys, monkeypatch):
    """EC2 is eventually consistent: right after RunInstances, DescribeInstances may not know the
    id yet (a quota error on the next node triggers exactly such a teardown). Those ids from the
    state file are still terminated, not skipped."""
    assert cli.main(up_argv("ec", 2)) == 0
    capsys.readouterr()
    hidden = {"left": 3}

    def answer(action: str, count: int, params) -> tuple[int, bytes] | None:
        by_id = any(k.startswith("InstanceId.") for k in params)
        if action == "DescribeInstances" and hidden["left"] > 0:
            hidden["left"] -= 1
            if by_id:
                return ec2_error("InvalidInstanceID.NotFound", "The instance IDs do not exist")
            return 200, (b'<DescribeInstancesResponse xmlns="http://ec2.amazonaws.com/doc/2016-11-15/">'
                         b"<requestId>r</requestId><reservationSet/></DescribeInstancesResponse>")
        return None

    proxy = Proxy(env, answer)
    with proxy as url:
        monkeypatch.setenv("AWS_ENDPOINT_URL", url)
        rc, out, err = teardown("ec", capsys)
    assert rc == 0, err
    assert out.count("deleted instance") == 2
    monkeypatch.setenv("AWS_ENDPOINT_URL", env)
    assert leftovers("ec") == {"instances": [], "security_groups": [], "key_pairs": []}


def test_caller_address_is_detected_as_a_slash_32(env, monkeypatch):
    class Handler(http.server.BaseHTTPRequestHandler):
        def log_message(self, *args) -> None:
            pass

        def do_GET(self) -> None:
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b"198.51.100.23\n")

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        monkeypatch.setenv("XEONTUNE_CHECKIP_URL", f"http://127.0.0.1:{srv.server_address[1]}/")
        assert cloud.ssh_cidr(None) == "198.51.100.23/32"
    finally:
        srv.shutdown()
        srv.server_close()
    assert cloud.ssh_cidr("10.1.2.3/24") == "10.1.2.0/24"


def test_console_host_key_parsing():
    key = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIJ8fZ3rYk2oYQ7Qk0d1oQm1f9Q0s8oR0oTn1xXy2aB3c"
    console = (f"[  12.3] cloud-init: boot\nssh-ed25519 AAAAnotinablockAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA\n"
               f"-----BEGIN SSH HOST KEY KEYS-----\necdsa-sha2-nistp256 AAAAE2Vj root@ip\n{key} root@ip-10-0-0-5\n"
               "-----END SSH HOST KEY KEYS-----\n")
    assert cloud.parse_console_host_key(console) == key
    assert cloud.parse_console_host_key("booting...") is None


def test_without_the_aws_extra_the_error_says_what_to_install(env, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "boto3", None)  # what a base install without boto3 looks like
    assert cli.main(up_argv("noextra", 1)) == 2
    assert "pip install 'xeontune[aws]'" in _one_line_error(capsys.readouterr().err)
    assert not state.exists("noextra")


# --- two users, one account: names are shared, cluster ids are not -------------------------------


@pytest.mark.slow
def test_a_second_up_of_the_same_name_from_another_state_dir_is_refused_and_harms_nothing(env, capsys, monkeypatch,
                                                                                           tmp_path):
    assert cli.main(up_argv("default", 2)) == 0
    first = sorted(i["InstanceId"] for i in live_instances("default"))
    capsys.readouterr()
    monkeypatch.setenv("XEONTUNE_HOME", str(tmp_path / "other-user"))  # a colleague, same account, same default name
    assert cli.main(up_argv("default", 2)) == 2
    assert sorted(i["InstanceId"] for i in live_instances("default")) == first  # the first user's nodes live on
    line = _one_line_error(capsys.readouterr().err)
    assert "a cluster named 'default' already exists in us-east-1" in line and first[0] in line
    assert "security group sg-" in line and "key pair xeontune-default" in line
    assert not state.exists("default")
    monkeypatch.setenv("XEONTUNE_HOME", str(tmp_path / "home"))
    record = state.load("default")
    assert len(record.cluster_id) == 16
    tags = {t["Key"]: t["Value"] for t in live_instances("default")[0]["Tags"]}
    assert tags["xeontune-cluster-id"] == record.cluster_id
    assert teardown("default", capsys)[0] == 0
    assert leftovers("default") == {"instances": [], "security_groups": [], "key_pairs": []}


def _foreign_instance(name: str, cluster_id: str) -> str:
    """An instance of another user's cluster that has the same name (tagged as xeontune tags)."""
    ami = ec2().describe_images(Owners=["amazon"])["Images"][0]["ImageId"]
    return ec2().run_instances(ImageId=ami, MinCount=1, MaxCount=1, TagSpecifications=[{
        "ResourceType": "instance", "Tags": [{"Key": "xeontune-cluster", "Value": name},
                                             {"Key": "xeontune-cluster-id", "Value": cluster_id}]}])["Instances"][0]["InstanceId"]


@pytest.mark.slow
def test_teardown_with_a_record_deletes_only_what_carries_its_id(env, capsys, monkeypatch, tmp_path):
    assert cli.main(up_argv("shared", 2)) == 0
    foreign = _foreign_instance("shared", "0123456789abcdef")
    capsys.readouterr()
    rc, out, err = teardown("shared", capsys)
    assert rc == 0, err
    assert out.count("deleted instance") == 2 and foreign not in out
    assert [i["InstanceId"] for i in live_instances("shared")] == [foreign]
    # With no record at all, teardown goes by the name tag, and says so.
    rc, out, err = teardown("shared", capsys)
    assert rc == 0 and f"deleted instance {foreign}" in out
    assert "no record of cluster 'shared'" in err and "another state dir" in err
    assert live_instances("shared") == []


@pytest.mark.slow
def test_a_failure_after_the_instances_exist_rolls_back_unless_keep_on_failure(env, capsys, monkeypatch):
    def no_ssh(self, record, timeout_s):
        raise UserError(f"node node1 of cluster {record.name!r} did not answer SSH within 600s")

    monkeypatch.setattr(aws.Aws, "wait", no_ssh)
    argv = [a for a in up_argv("fail", 2) if a != "--skip-bootstrap"]
    assert cli.main(argv) == 2
    out, err = capsys.readouterr()
    line = _one_line_error(err)
    assert "did not answer SSH" in line and "rolled back: nothing was left running" in line
    assert "deleting what it created" in out
    assert leftovers("fail") == {"instances": [], "security_groups": [], "key_pairs": []}
    assert not state.exists("fail")

    assert cli.main([*argv, "--keep-on-failure"]) == 2
    line = _one_line_error(capsys.readouterr().err)
    assert "is kept and billing (--keep-on-failure)" in line and "`xeontune teardown --name fail`" in line
    assert len(live_instances("fail")) == 2 and state.exists("fail")
    assert cli.main(["teardown", "--name", "fail"]) == 0
    assert leftovers("fail") == {"instances": [], "security_groups": [], "key_pairs": []}


def test_teardown_without_a_record_names_the_region_it_searched(env, capsys):
    assert cli.main(up_argv("away", 1)) == 0
    capsys.readouterr()
    shutil.rmtree(state.cluster_dir("away"))
    rc = cli.main(["teardown", "--name", "away", "--provider", "aws", "--region", "us-west-2"])
    out = capsys.readouterr().out
    assert rc == 0 and "nothing to tear down" in out and "AWS region us-west-2" in out
    assert len(live_instances("away")) == 1  # it is in us-east-1, untouched
    rc, out, err = teardown("away", capsys)
    assert rc == 0 and "deleted instance" in out
    assert leftovers("away") == {"instances": [], "security_groups": [], "key_pairs": []}


def test_a_corrupt_record_falls_back_to_the_name_tag_with_a_warning(env, capsys):
    assert cli.main(up_argv("broken", 2)) == 0
    capsys.readouterr()
    path = state.record_path("broken")
    path.write_text(path.read_text()[:40])  # truncated: no provider, no region left in it
    assert cli.main(["cluster", "status", "--name", "broken"]) == 2
    assert "is unreadable" in _one_line_error(capsys.readouterr().err)
    assert cli.main(["teardown", "--name", "broken"]) == 2  # which cloud? it cannot guess
    assert "pass --provider" in _one_line_error(capsys.readouterr().err)
    rc, out, err = teardown("broken", capsys)
    assert rc == 0, err
    assert "warning: the record of cluster 'broken' is unreadable" in err and out.count("deleted instance") == 2
    assert leftovers("broken") == {"instances": [], "security_groups": [], "key_pairs": []}
    assert not state.exists("broken")


@pytest.mark.slow
def test_run_instances_carries_an_idempotency_token_from_the_cluster_id(env, capsys, monkeypatch):
    tokens: list[str] = []

    def answer(action: str, count: int, params) -> tuple[int, bytes] | None:
        if action == "RunInstances":
            tokens.append(params["ClientToken"][0])
            if count == 1:  # the answer is lost: botocore retries the same call
                return 503, b"<Response><Errors><Error><Code>Unavailable</Code><Message>x</Message></Error></Errors></Response>"
        return None

    proxy = Proxy(env, answer)
    with proxy as url:
        monkeypatch.setenv("AWS_ENDPOINT_URL", url)
        assert cli.main(up_argv("tok", 2)) == 0
    record = state.load("tok")
    assert tokens == [aws.client_token(record, "node0")] * 2 + [aws.client_token(record, "node1")]
    assert record.cluster_id in tokens[0] and len(set(tokens)) == 2 and all(len(t) <= 64 for t in tokens)
    monkeypatch.setenv("AWS_ENDPOINT_URL", env)
    capsys.readouterr()
    assert teardown("tok", capsys)[0] == 0
