"""AWS EC2 provider: a security group, an imported key pair and N tagged Ubuntu instances.

Everything this module creates carries the tags ``xeontune-cluster=<name>`` and
``xeontune-cluster-id=<record.cluster_id>`` from the call that creates it (``TagSpecifications``),
so a teardown finds it by tag even when its id never reached the state file (an interrupted
``up``). Names are not unique in an account (two users, two state dirs, the default name), the id
is: with a record, teardown and rollback go by the id tag and the recorded ids only; the name tag
is the fallback for a lost record. ``up`` refuses a name that is already in use in the region.
Each id is also written to the state file as soon as its create call returns.

Credentials come from boto3's standard chain and are never written anywhere. ``AWS_ENDPOINT_URL``
(honoured by boto3 itself) points every call at another endpoint, which is how the tests drive
this module against moto's server on loopback.

Host keys: after an instance runs, cloud-init prints its SSH host keys between ``-----BEGIN SSH
HOST KEY KEYS-----`` markers on the serial console; ``GetConsoleOutput`` reads them through the
authenticated EC2 API, and that key (not whatever answers on port 22) is pinned.
"""

from __future__ import annotations

import re
import time
from typing import Any

from xeontune.cluster import cloud, pricing, state
from xeontune.cluster.providers import ClusterSpec, NodeStatus, ProviderOption, TeardownReport
from xeontune.cluster.state import ClusterRecord, Node
from xeontune.errors import UserError

TAG_CLUSTER = "xeontune-cluster"
TAG_ROLE = "xeontune-role"
TAG_NODE = "xeontune-node"
TAG_ID = "xeontune-cluster-id"
DEFAULT_INSTANCE_TYPE = "m7i.4xlarge"  # 4th-gen Xeon (Sapphire Rapids): AMX, bf16
DISK_GB = 60  # Ubuntu + torch CPU venv + an SD1.5 model and its checkpoints
SSH_USER = "ubuntu"
CANONICAL_OWNER = "099720109477"
UBUNTU_NAME = "ubuntu/images/*ubuntu-*-amd64-server-*"
_UBUNTU_RE = re.compile(r"ubuntu-[a-z]+-(\d\d)\.04-amd64-server-(\d+(?:\.\d+)?)$")
LIVE_STATES = ["pending", "running", "shutting-down", "stopping", "stopped"]

# Seconds between polls; tests shorten them (moto answers at once).
POLL_S = 5.0
TERMINATE_TIMEOUT_S = 900.0
UNSEEN_GRACE_S = 60.0  # how long an instance id EC2 does not show yet may still appear
SG_DELETE_TIMEOUT_S = 300.0

_CREDENTIAL_CODES = {"AuthFailure", "UnauthorizedOperation", "InvalidClientTokenId", "SignatureDoesNotMatch",
                     "ExpiredToken", "RequestExpired", "OptInRequired"}
_QUOTA_CODES = {"InstanceLimitExceeded", "VcpuLimitExceeded", "InsufficientInstanceCapacity",
                "MaxSpotInstanceCountExceeded", "SecurityGroupLimitExceeded", "RulesPerSecurityGroupLimitExceeded",
                "ResourceLimitExceeded", "KeyPairLimitExceeded", "AddressLimitExceeded", "SpotMaxPriceTooLow"}


def resource_name(cluster: str) -> str:
    return f"xeontune-{cluster}"


# --- the SDK ------------------------------------------------------------------------------------


def _boto3() -> Any:
    try:
        import boto3
    except ImportError:
        raise UserError("the aws provider needs boto3: pip install 'xeontune[aws]'") from None
    return boto3


_loader: Any = None  # botocore's parsed service models, shared (they are static; credentials are not)


def _session(region: str | None = None) -> Any:
    """A fresh boto3 session (credentials and configuration resolved anew) on the shared loader."""
    global _loader
    boto3 = _boto3()
    import botocore.session
    from botocore.exceptions import ProfileNotFound

    core = botocore.session.get_session()
    try:
        if _loader is None:
            _loader = core.get_component("data_loader")
        else:
            core.register_component("data_loader", _loader)
        core.get_scoped_config()  # an unknown AWS_PROFILE fails here, not inside a later call
        return boto3.session.Session(botocore_session=core, region_name=region)
    except ProfileNotFound as exc:
        raise UserError(f"{exc}: check AWS_PROFILE (`aws configure list-profiles`)") from None


def _client(region: str) -> Any:
    """An EC2 client for ``region`` (tests wrap this to inject faults into its event hooks)."""
    from botocore.config import Config

    return _session(region).client("ec2", config=Config(retries={"max_attempts": 5, "mode": "standard"}))


def _known_regions() -> set[str]:
    session = _session()
    regions: set[str] = set()
    for partition in session.get_available_partitions():
        regions.update(session.get_available_regions("ec2", partition_name=partition))
    return regions


def resolve_region(region: str | None) -> str:
    """``--region``, else the region of boto3's configuration; checked against botocore's endpoint data."""
    region = region or _session().region_name
    if not region:
        raise UserError("no AWS region: pass --region (e.g. us-east-1) or set AWS_REGION")
    if region not in _known_regions():
        raise UserError(f"unknown AWS region {region!r} (e.g. us-east-1, eu-west-1); a brand-new region needs a newer botocore")
    return region


def _user_error(exc: BaseException, doing: str) -> UserError:
    """One line for a botocore failure: what we were doing, the API's code and message."""
    from botocore.exceptions import BotoCoreError, ClientError, NoCredentialsError, PartialCredentialsError

    if isinstance(exc, (NoCredentialsError, PartialCredentialsError)):
        return UserError(
            "no AWS credentials found: run `aws configure` (or `aws sso login`), or set AWS_PROFILE "
            "or AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY"
        )
    if isinstance(exc, ClientError):
        err = exc.response.get("Error", {})
        code, message = err.get("Code", "Unknown"), " ".join(str(err.get("Message", "")).split())
        if code in _CREDENTIAL_CODES:
            return UserError(f"AWS refused the credentials or permissions while {doing}: {code}: {message}")
        if code in _QUOTA_CODES:
            return UserError(f"AWS quota or capacity error while {doing}: {code}: {message}")
        return UserError(f"AWS error while {doing}: {code}: {message}")
    if isinstance(exc, BotoCoreError):
        return UserError(f"AWS call failed while {doing}: {' '.join(str(exc).split())}")
    raise exc


def _aws_errors() -> tuple[type[BaseException], ...]:
    from botocore.exceptions import BotoCoreError, ClientError

    return (BotoCoreError, ClientError)


def _tags(record: ClusterRecord, extra: dict[str, str] | None = None) -> list[dict[str, str]]:
    tags = {TAG_CLUSTER: record.name, TAG_ID: record.cluster_id, "Name": resource_name(record.name), **(extra or {})}
    return [{"Key": k, "Value": v} for k, v in tags.items()]


def _tag_spec(resource_type: str, record: ClusterRecord, extra: dict[str, str] | None = None) -> list[dict[str, Any]]:
    return [{"ResourceType": resource_type, "Tags": _tags(record, extra)}]


# --- up -----------------------------------------------------------------------------------------


def latest_ubuntu_lts(ec2: Any) -> tuple[str, str]:
    """(AMI id, root device name) of the newest Canonical Ubuntu LTS server image for amd64."""
    images = ec2.describe_images(
        Owners=[CANONICAL_OWNER],
        Filters=[{"Name": "name", "Values": [UBUNTU_NAME]}, {"Name": "state", "Values": ["available"]},
                 {"Name": "architecture", "Values": ["x86_64"]}, {"Name": "root-device-type", "Values": ["ebs"]},
                 {"Name": "virtualization-type", "Values": ["hvm"]}],
    )["Images"]
    best: tuple[tuple[int, str, str], dict] | None = None
    for img in images:
        m = _UBUNTU_RE.search(img.get("Name", ""))
        if not m or int(m.group(1)) % 2:  # LTS releases are even years, .04
            continue
        key = (int(m.group(1)), m.group(2), img.get("CreationDate") or "")
        if best is None or key > best[0]:
            best = (key, img)
    if best is None:
        raise UserError("no Ubuntu LTS image from Canonical found in this region; pass --ami")
    return best[1]["ImageId"], best[1].get("RootDeviceName") or "/dev/sda1"


def _image(ec2: Any, ami: str) -> tuple[str, str]:
    try:
        images = ec2.describe_images(ImageIds=[ami])["Images"]
    except _aws_errors() as exc:
        raise _user_error(exc, f"looking up AMI {ami}") from None
    if not images:
        raise UserError(f"AMI {ami} not found in this region")
    return images[0]["ImageId"], images[0].get("RootDeviceName") or "/dev/sda1"


def _check_instance_type(ec2: Any, instance_type: str) -> tuple[int, int]:
    """(physical cores, bytes of RAM) of ``instance_type``: what a node's ranks share; UserError if unknown."""
    from botocore.exceptions import ClientError

    try:
        found = ec2.describe_instance_types(InstanceTypes=[instance_type])["InstanceTypes"]
    except ClientError as exc:
        if exc.response.get("Error", {}).get("Code") in ("InvalidInstanceType", "InvalidParameterValue"):
            raise UserError(f"unknown or unavailable AWS instance type {instance_type!r} in this region "
                            f"(default: {DEFAULT_INSTANCE_TYPE})") from None
        raise
    if not found:
        raise UserError(f"unknown AWS instance type {instance_type!r} (default: {DEFAULT_INSTANCE_TYPE})")
    cpu = found[0].get("VCpuInfo", {})
    memory = int(found[0].get("MemoryInfo", {}).get("SizeInMiB") or 0) * 2**20
    return int(cpu.get("DefaultCores") or cpu.get("DefaultVCpus") or 0), memory


def _pick_subnet(ec2: Any, subnet: str | None, instance_type: str) -> tuple[str, str]:
    """(subnet id, vpc id): ``--subnet``, else a default subnet in a zone that offers the type."""
    if subnet:
        found = ec2.describe_subnets(SubnetIds=[subnet])["Subnets"]
        return found[0]["SubnetId"], found[0]["VpcId"]
    vpcs = ec2.describe_vpcs(Filters=[{"Name": "is-default", "Values": ["true"]}])["Vpcs"]
    if not vpcs:
        raise UserError("this region has no default VPC: pass --subnet SUBNET_ID (a subnet with a route to the internet)")
    vpc = vpcs[0]["VpcId"]
    subnets = ec2.describe_subnets(Filters=[{"Name": "vpc-id", "Values": [vpc]},
                                            {"Name": "default-for-az", "Values": ["true"]}])["Subnets"]
    offered = {
        o["Location"]
        for o in ec2.describe_instance_type_offerings(
            LocationType="availability-zone", Filters=[{"Name": "instance-type", "Values": [instance_type]}]
        )["InstanceTypeOfferings"]
    }
    usable = sorted((s for s in subnets if s["AvailabilityZone"] in offered), key=lambda s: s["AvailabilityZone"])
    if not usable:
        raise UserError(f"no default subnet in a zone that offers {instance_type}: pass --subnet or another --instance-type")
    return usable[0]["SubnetId"], vpc


def in_use(ec2: Any, name: str) -> list[str]:
    """What already holds cluster ``name``'s tag or resource names in this region (another state
    dir's cluster, or one whose record was lost): live instances, security groups, key pairs."""
    found = [f"instance {i['InstanceId']}"
             for page in ec2.get_paginator("describe_instances").paginate(
                 Filters=[*_by_tag(name), {"Name": "instance-state-name", "Values": LIVE_STATES}])
             for res in page["Reservations"] for i in res["Instances"]]
    groups = {g["GroupId"] for g in ec2.describe_security_groups(Filters=_by_tag(name))["SecurityGroups"]}
    groups |= {g["GroupId"] for g in ec2.describe_security_groups(
        Filters=[{"Name": "group-name", "Values": [resource_name(name)]}])["SecurityGroups"]}
    found += [f"security group {g}" for g in sorted(groups)]
    tagged = {kp.get("KeyPairId") for kp in ec2.describe_key_pairs(Filters=_by_tag(name))["KeyPairs"]}
    found += [f"key pair {kp['KeyName']}" for kp in ec2.describe_key_pairs()["KeyPairs"]
              if kp["KeyName"] == resource_name(name) or kp.get("KeyPairId") in tagged]
    return found


def _create(ec2: Any, record: ClusterRecord, spec: ClusterSpec) -> None:
    name, region = record.name, record.region
    sg = ec2.create_security_group(
        GroupName=resource_name(name), Description=f"xeontune cluster {name}", VpcId=record.extra["vpc"],
        TagSpecifications=_tag_spec("security-group", record),
    )["GroupId"]
    record.add_resource("security_group", sg, region)
    state.save(record)
    # Two rules: everything from members of this group, SSH from the caller's address only.
    cidr = record.extra["ssh_cidr"]
    ranges = ({"Ipv6Ranges": [{"CidrIpv6": cidr, "Description": "ssh from the xeontune caller"}]} if ":" in cidr
              else {"IpRanges": [{"CidrIp": cidr, "Description": "ssh from the xeontune caller"}]})
    ec2.authorize_security_group_ingress(GroupId=sg, IpPermissions=[
        {"IpProtocol": "-1", "UserIdGroupPairs": [{"GroupId": sg, "Description": "cluster-internal"}]},
        {"IpProtocol": "tcp", "FromPort": 22, "ToPort": 22, **ranges},
    ])

    key_name = resource_name(name)
    key_id = ec2.import_key_pair(
        KeyName=key_name, PublicKeyMaterial=cloud.public_key(record).encode(),
        TagSpecifications=_tag_spec("key-pair", record),
    ).get("KeyPairId") or key_name
    record.add_resource("key_pair", key_id, region)
    record.extra["key_name"] = key_name
    state.save(record)

    for i in range(spec.num_nodes):
        role = "head" if i == 0 else "worker"
        node_name = f"node{i}"
        params: dict[str, Any] = {
            "ImageId": record.extra["ami"], "InstanceType": record.instance_type,
            "MinCount": 1, "MaxCount": 1, "KeyName": key_name,
            # Idempotent: botocore's retry of a call whose answer was lost starts no second instance.
            "ClientToken": client_token(record, node_name),
            "NetworkInterfaces": [{"DeviceIndex": 0, "SubnetId": record.extra["subnet"], "Groups": [sg],
                                   "AssociatePublicIpAddress": True, "DeleteOnTermination": True}],
            # A node that powers itself off is gone, not parked and billing for its disk.
            "InstanceInitiatedShutdownBehavior": "terminate",
            "BlockDeviceMappings": [{"DeviceName": record.extra["root_device"], "Ebs": {
                "VolumeSize": DISK_GB, "VolumeType": "gp3", "DeleteOnTermination": True}}],
            "MetadataOptions": {"HttpTokens": "required", "HttpEndpoint": "enabled"},
            "TagSpecifications": [
                {"ResourceType": t, "Tags": _tags(record, {TAG_ROLE: role, TAG_NODE: node_name,
                                                           "Name": f"{resource_name(name)}-{node_name}"})}
                for t in ("instance", "volume", "network-interface")
            ],
        }
        if spec.options.get("spot"):
            params["InstanceMarketOptions"] = {"MarketType": "spot", "SpotOptions": {
                "SpotInstanceType": "one-time", "InstanceInterruptionBehavior": "terminate"}}
        inst = ec2.run_instances(**params)["Instances"][0]
        record.add_resource("instance", inst["InstanceId"], region)
        record.nodes.append(Node(node_name, role, inst.get("PrivateIpAddress") or "", None, inst["InstanceId"]))
        state.save(record)


def client_token(record: ClusterRecord, node_name: str) -> str:
    """RunInstances' idempotency token: one per node of this `up` (EC2 allows 64 ASCII characters)."""
    return f"xt-{record.cluster_id}-{node_name}"


def _refresh_addresses(ec2: Any, record: ClusterRecord) -> None:
    """Record the addresses known so far (public ones appear while instances are pending).

    Only the head's public address is recorded: SSH reaches workers through the head. Workers
    still get one, because the default VPC has no NAT and they download packages at bootstrap.
    """
    found = _describe(ec2, [n.resource_id for n in record.nodes if n.resource_id])
    for n in record.nodes:
        inst = found.get(n.resource_id or "", {})
        n.private_ip = inst.get("PrivateIpAddress") or n.private_ip
        if n.role == "head":
            n.public_ip = inst.get("PublicIpAddress") or n.public_ip
    state.save(record)


# --- wait / query -------------------------------------------------------------------------------


def _describe(ec2: Any, ids: list[str]) -> dict[str, dict]:
    """Instances by id. EC2 is eventually consistent: an instance RunInstances just returned may be
    unknown to DescribeInstances for a moment; such ids are simply absent from the answer."""
    from botocore.exceptions import ClientError

    out: dict[str, dict] = {}
    try:
        for page in ec2.get_paginator("describe_instances").paginate(InstanceIds=ids):
            for res in page["Reservations"]:
                for inst in res["Instances"]:
                    out[inst["InstanceId"]] = inst
    except ClientError as exc:
        if exc.response.get("Error", {}).get("Code") != "InvalidInstanceID.NotFound" or len(ids) < 2:
            if len(ids) == 1 and exc.response.get("Error", {}).get("Code") == "InvalidInstanceID.NotFound":
                return out
            raise
        for iid in ids:
            out.update(_describe(ec2, [iid]))
    return out


# --- teardown -----------------------------------------------------------------------------------


def _by_tag(name: str) -> list[dict[str, Any]]:
    return [{"Name": f"tag:{TAG_CLUSTER}", "Values": [name]}]


def _owned(name: str, record: ClusterRecord | None) -> list[dict[str, Any]]:
    """The filter for what teardown may delete: this record's id tag, else (no record, or one
    written before ids existed) the name tag."""
    if record is not None and record.cluster_id:
        return [{"Name": f"tag:{TAG_ID}", "Values": [record.cluster_id]}]
    return _by_tag(name)


def _terminate_instances(ec2: Any, owned: list[dict[str, Any]], recorded: set[tuple[str, str]],
                         report: TeardownReport) -> None:
    from botocore.exceptions import ClientError

    ids = {i for k, i in recorded if k == "instance"}
    for page in ec2.get_paginator("describe_instances").paginate(
            Filters=[*owned, {"Name": "instance-state-name", "Values": LIVE_STATES}]):
        for res in page["Reservations"]:
            ids.update(inst["InstanceId"] for inst in res["Instances"])
    if not ids:
        return

    def state_of(found: dict[str, dict], iid: str) -> str | None:
        return found.get(iid, {}).get("State", {}).get("Name")

    found = _describe(ec2, sorted(ids))
    # An id that EC2 does not show yet (just created: eventual consistency) still gets terminated;
    # one it never shows within the grace period is gone (purged long ago, or never existed).
    pending = {i for i in ids if state_of(found, i) != "terminated"}
    deadline = time.monotonic() + TERMINATE_TIMEOUT_S
    unseen_deadline = time.monotonic() + UNSEEN_GRACE_S
    while pending:
        for iid in sorted(pending):
            if state_of(found, iid) in ("shutting-down", "terminated"):
                continue
            try:
                ec2.terminate_instances(InstanceIds=[iid])
            except ClientError as exc:
                if exc.response.get("Error", {}).get("Code") != "InvalidInstanceID.NotFound":
                    raise
        found = _describe(ec2, sorted(pending))
        for iid in sorted(pending):
            st = state_of(found, iid)
            if st == "terminated":
                pending.discard(iid)
                report.deleted.append(f"instance {iid}")
            elif st is None and time.monotonic() > unseen_deadline:
                pending.discard(iid)
        if not pending or time.monotonic() > deadline:
            break
        time.sleep(POLL_S)
    for iid in sorted(pending):
        report.failed.append(f"instance {iid}: still {state_of(found, iid) or 'not visible'} after {TERMINATE_TIMEOUT_S:.0f}s")


def _delete_security_groups(ec2: Any, owned: list[dict[str, Any]], recorded: set[tuple[str, str]],
                            report: TeardownReport) -> None:
    from botocore.exceptions import ClientError

    ids = {i for k, i in recorded if k == "security_group"}
    ids.update(g["GroupId"] for g in ec2.describe_security_groups(Filters=owned)["SecurityGroups"])
    for sg in sorted(ids):
        deadline = time.monotonic() + SG_DELETE_TIMEOUT_S
        while True:
            try:
                ec2.delete_security_group(GroupId=sg)
                report.deleted.append(f"security group {sg}")
                break
            except ClientError as exc:
                code = exc.response["Error"]["Code"]
                if code == "InvalidGroup.NotFound":
                    break
                # Network interfaces of just-terminated instances hold the group for a while.
                if code == "DependencyViolation" and time.monotonic() < deadline:
                    time.sleep(POLL_S)
                    continue
                report.failed.append(f"security group {sg}: {code}: {exc.response['Error'].get('Message', '')}")
                break


def _delete_key_pairs(ec2: Any, owned: list[dict[str, Any]], recorded: set[tuple[str, str]],
                      report: TeardownReport) -> None:
    from botocore.exceptions import ClientError

    ids = {i for k, i in recorded if k == "key_pair"}
    ids.update(kp["KeyPairId"] for kp in ec2.describe_key_pairs(Filters=owned)["KeyPairs"] if kp.get("KeyPairId"))
    existing = {kp.get("KeyPairId"): kp["KeyName"] for kp in ec2.describe_key_pairs()["KeyPairs"]}
    for kid in sorted(ids):
        if kid not in existing:
            continue  # already gone: DeleteKeyPair would succeed silently and we would claim a deletion
        try:
            # By name: every EC2 implementation takes KeyName; the id only selects which name.
            ec2.delete_key_pair(KeyName=existing[kid])
            report.deleted.append(f"key pair {existing[kid]} ({kid})")
        except ClientError as exc:
            if exc.response["Error"]["Code"] != "InvalidKeyPair.NotFound":
                report.failed.append(f"key pair {kid}: {exc.response['Error']['Code']}")


class Aws(cloud.CloudProvider):
    name = "aws"
    options = (cloud.IMAGE_OPTION, ProviderOption("--spot", "spot instances", switch=True),
               ProviderOption("--subnet", "a subnet id instead of the default VPC's"))
    ssh_user = SSH_USER
    autostop_action = "poweroff"  # instances shut down from inside terminate (InstanceInitiatedShutdownBehavior)

    def plan(self, spec: ClusterSpec) -> cloud.CloudPlan:
        region = resolve_region(spec.region)
        instance_type = spec.instance_type or DEFAULT_INSTANCE_TYPE
        ssh_cidr = cloud.ssh_cidr(spec.ssh_cidr)
        ec2 = _client(region)
        # Everything here only reads: a bad type, AMI or subnet fails before anything exists.
        try:
            cores, memory = _check_instance_type(ec2, instance_type)
            ami, root_device = _image(ec2, spec.option("ami")) if spec.option("ami") else latest_ubuntu_lts(ec2)
            subnet, vpc = _pick_subnet(ec2, spec.option("subnet"), instance_type)
            taken = in_use(ec2, spec.name)
        except _aws_errors() as exc:
            raise _user_error(exc, "checking the region, instance type, image and network") from None
        if taken:
            raise UserError(f"a cluster named {spec.name!r} already exists in {region} ({', '.join(taken[:4])}"
                            f"{' ...' if len(taken) > 4 else ''}), not from this state dir: choose another --name, "
                            f"or if it is yours, `xeontune teardown --name {spec.name} --provider aws --region {region}`")
        return cloud.CloudPlan(
            region=region, instance_type=instance_type, image=ami, cores_per_node=cores, memory_per_node=memory,
            errors=_aws_errors(), user_error=_user_error,
            estimate=pricing.aws(instance_type, spec.num_nodes, DISK_GB, bool(spec.options.get("spot"))), client=ec2,
            extra={"ami": ami, "root_device": root_device, "vpc": vpc, "subnet": subnet, "spot": "1" if spec.options.get("spot") else "0",
                   "ssh_cidr": ssh_cidr, "disk_gb": str(DISK_GB)},
        )

    def create(self, record: ClusterRecord, spec: ClusterSpec, plan: cloud.CloudPlan) -> None:
        _create(plan.client, record, spec)
        _refresh_addresses(plan.client, record)

    def estimate(self, record: ClusterRecord) -> pricing.CostEstimate:
        return pricing.aws(record.instance_type or DEFAULT_INSTANCE_TYPE, len(record.nodes),
                           int(record.extra.get("disk_gb", DISK_GB)), record.extra.get("spot") == "1")

    def wait(self, record: ClusterRecord, timeout_s: float) -> None:
        """Until every instance runs (addresses recorded), then its host key is known and SSH logs in."""
        ec2 = _client(record.region or resolve_region(None))
        deadline = time.monotonic() + timeout_s
        ids = [n.resource_id for n in record.nodes if n.resource_id]
        print(f"waiting for {len(ids)} instance(s) to run, then for their host keys and SSH", flush=True)
        try:
            while True:
                found = _describe(ec2, ids)
                pending = [n for n in record.nodes if found.get(n.resource_id or "", {}).get("State", {}).get("Name") != "running"]
                gone = [n for n in pending if found.get(n.resource_id or "", {}).get("State", {}).get("Name")
                        in ("shutting-down", "terminated", "stopping", "stopped")]
                if gone:
                    n = gone[0]
                    st = found.get(n.resource_id or "", {}).get("State", {}).get("Name", "missing")
                    reason = found.get(n.resource_id or "", {}).get("StateReason", {}).get("Message", "")
                    raise UserError(f"node {n.name} ({n.resource_id}) of cluster {record.name!r} is {st}, not running {reason}".strip())
                if not pending:
                    break
                if time.monotonic() > deadline:
                    n = pending[0]
                    raise UserError(f"node {n.name} ({n.resource_id}) of cluster {record.name!r} was not running within {timeout_s:.0f}s")
                time.sleep(POLL_S)
            _refresh_addresses(ec2, record)
            if record.skip_bootstrap:
                return  # an emulator has no console and no sshd: stop once the nodes run
            for n in record.nodes:
                key = cloud.poll_host_key(
                    lambda n=n: ec2.get_console_output(InstanceId=n.resource_id, Latest=True).get("Output", ""),
                    n, record, deadline, POLL_S)
                cloud.pin(record, n, key)
        except _aws_errors() as exc:
            raise _user_error(exc, f"waiting for cluster {record.name!r}") from None
        cloud.wait_for_ssh(record, deadline)

    def query(self, record: ClusterRecord) -> list[NodeStatus]:
        ec2 = _client(record.region or resolve_region(None))
        try:
            found = _describe(ec2, [n.resource_id for n in record.nodes if n.resource_id]) if record.nodes else {}
        except _aws_errors() as exc:
            raise _user_error(exc, f"querying cluster {record.name!r}") from None
        out = []
        for n in record.nodes:
            inst = found.get(n.resource_id or "")
            out.append(NodeStatus(n.name, inst["State"]["Name"] if inst else "missing",
                                  inst.get("PrivateIpAddress") if inst else None, inst.get("PublicIpAddress") if inst else None))
        return out

    def terminate(self, name: str, record: ClusterRecord | None, region: str | None = None) -> TeardownReport:
        """Delete the cluster's instances, security group and key pair: the recorded ids and what
        carries the record's id tag, or, with no record, what carries the name tag."""
        region = (record.region if record else None) or resolve_region(region)
        owned = _owned(name, record)
        report = TeardownReport(searched=[f"AWS region {region} (tag {owned[0]['Name'][4:]}={owned[0]['Values'][0]})"])
        ec2 = _client(region)
        recorded = {(r.kind, r.id) for r in record.resources} if record else set()
        try:
            _terminate_instances(ec2, owned, recorded, report)
            _delete_security_groups(ec2, owned, recorded, report)
            _delete_key_pairs(ec2, owned, recorded, report)
        except _aws_errors() as exc:
            raise _user_error(exc, f"tearing down cluster {name!r} in {region}") from None
        return report

PROVIDER = Aws()
