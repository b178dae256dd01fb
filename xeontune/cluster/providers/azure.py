"""Azure provider: one resource group per cluster holding everything the cluster needs.

``xeontune-<cluster>`` (tagged ``xeontune-cluster=<cluster>`` in the call that creates it) holds
a network security group (SSH from the caller's address only, all traffic inside the vnet), a
vnet with one subnet, one static public IP for the head, a NIC per node and Ubuntu LTS VMs that
accept only the cluster's locally generated ed25519 key. Everything also carries
``xeontune-cluster-id=<record.cluster_id>``. Teardown deletes the resource group and waits for
the deletion to finish, which takes every resource in it along. With a record it deletes only a
group that carries the record's id tag (a group of the same name made by another user's ``up`` is
not this cluster); without a state file it finds the group by the name tag. ``up`` refuses when
``xeontune-<cluster>`` exists already: ``create_or_update`` would silently adopt it.

Credentials: azure-identity's DefaultAzureCredential (``az login``, environment, managed
identity); the subscription comes from AZURE_SUBSCRIPTION_ID or the Azure CLI's default. Nothing
of either is written anywhere. XEONTUNE_AZURE_ARM_ENDPOINT points the SDK at another Resource
Manager endpoint (a sovereign cloud, or the tests' fake on loopback).

Host keys: once a VM runs, its ed25519 host key is read through the authenticated ARM API (a
run-command that prints ``/etc/ssh/ssh_host_ed25519_key.pub``) and pinned; SSH never trusts a
key first seen on the network.
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
from pathlib import Path
from typing import Any

from xeontune.cluster import cloud, pricing, state
from xeontune.cluster.providers import ClusterSpec, NodeStatus, TeardownReport
from xeontune.cluster.state import ClusterRecord, Node
from xeontune.errors import UserError

TAG_CLUSTER = "xeontune-cluster"
TAG_ROLE = "xeontune-role"
TAG_ID = "xeontune-cluster-id"
DEFAULT_LOCATION = "eastus"
# Dsv6: 5th-gen Xeon (Emerald Rapids) with AMX; 16 vCPU / 64 GiB like AWS's m7i.4xlarge.
DEFAULT_SIZE = "Standard_D16s_v6"
SSH_USER = "azureuser"
DISK_GB = 64
DELETE_DEADLINE_S = 900.0  # a resource group's delete that takes longer is reported, not waited on forever
ARM_ENDPOINT = "https://management.azure.com"
VNET_PREFIX = "10.42.0.0/16"
SUBNET_PREFIX = "10.42.0.0/24"
_LTS_OFFER_RE = re.compile(r"^ubuntu-(\d\d)_04-lts$")
POLL_S = 5.0  # seconds between LRO polls; the tests shorten it
_QUOTA_CODES = {"QuotaExceeded", "SkuNotAvailable", "AllocationFailed", "ZonalAllocationFailed",
                "OverconstrainedAllocationRequest", "PublicIPCountLimitReached"}


def group_name(cluster: str) -> str:
    return f"xeontune-{cluster}"


# --- the SDK ------------------------------------------------------------------------------------


def _require_sdk() -> None:
    try:
        import azure.identity  # noqa: F401
        import azure.mgmt.compute  # noqa: F401
        import azure.mgmt.network  # noqa: F401
        import azure.mgmt.resource.resources  # noqa: F401
    except ImportError:
        raise UserError("the azure provider needs the Azure SDK: pip install 'xeontune[azure]'") from None


def _credential() -> Any:
    from azure.identity import DefaultAzureCredential

    return DefaultAzureCredential(exclude_interactive_browser_credential=True)


def _endpoint() -> str:
    return os.environ.get("XEONTUNE_AZURE_ARM_ENDPOINT", ARM_ENDPOINT).rstrip("/")


def _client_kwargs() -> dict[str, Any]:
    """Keyword arguments for every management client (tests add a per-call policy here)."""
    endpoint = _endpoint()
    return {"base_url": endpoint, "credential_scopes": [f"{endpoint}/.default"], "polling_interval": POLL_S}


def subscription_id() -> str:
    sub = os.environ.get("AZURE_SUBSCRIPTION_ID")
    if sub:
        return sub
    profile = Path(os.environ.get("AZURE_CONFIG_DIR", Path.home() / ".azure")) / "azureProfile.json"
    try:
        subs = json.loads(profile.read_text(encoding="utf-8-sig")).get("subscriptions", [])
        return next(s["id"] for s in subs if s.get("isDefault"))
    except (OSError, ValueError, StopIteration, KeyError):
        raise UserError("no Azure subscription: run `az login` (and `az account set -s ...`) or set "
                        "AZURE_SUBSCRIPTION_ID") from None


class _Clients:
    def __init__(self) -> None:
        _require_sdk()
        from azure.mgmt.compute import ComputeManagementClient
        from azure.mgmt.network import NetworkManagementClient
        from azure.mgmt.resource.resources import ResourceManagementClient

        # azure-identity logs each credential it tried as a warning; the one-line error says it all.
        quiet = logging.getLogger("azure.identity")
        if quiet.level == logging.NOTSET:
            quiet.setLevel(logging.ERROR)
        cred, sub, kw = _credential(), subscription_id(), _client_kwargs()
        self.resource = ResourceManagementClient(cred, sub, **kw)
        self.network = NetworkManagementClient(cred, sub, **kw)
        self.compute = ComputeManagementClient(cred, sub, **kw)
        self.subscription = sub


def _azure_errors() -> tuple[type[BaseException], ...]:
    from azure.core.exceptions import AzureError

    return (AzureError,)


def _user_error(exc: BaseException, doing: str) -> UserError:
    from azure.core.exceptions import ClientAuthenticationError, HttpResponseError

    if isinstance(exc, ClientAuthenticationError):
        first = " ".join(str(exc).split())[:300]
        return UserError(f"Azure credentials missing or refused while {doing}: run `az login` or set AZURE_CLIENT_ID/"
                         f"AZURE_TENANT_ID/AZURE_CLIENT_SECRET ({first})")
    if isinstance(exc, HttpResponseError):
        err = getattr(exc, "error", None)
        code = getattr(err, "code", None) or str(exc.status_code)
        message = " ".join(str(getattr(err, "message", None) or exc.message or exc).split())
        if code in _QUOTA_CODES or "quota" in message.lower():
            return UserError(f"Azure quota or capacity error while {doing}: {code}: {message}")
        return UserError(f"Azure error while {doing}: {code}: {message}")
    return UserError(f"Azure call failed while {doing}: {' '.join(str(exc).split())}")


def _plain(obj: Any) -> Any:
    """An SDK model as the REST JSON it came from (plain dicts and lists)."""
    if hasattr(obj, "as_dict"):
        return json.loads(json.dumps(obj, default=lambda o: dict(o)))
    return obj


# --- up -----------------------------------------------------------------------------------------


def _check_location_and_size(c: _Clients, location: str, size: str) -> tuple[int, int]:
    """(physical cores, bytes of RAM) of ``size`` in ``location``; UserError for an unknown location or size."""
    skus = [_plain(s) for s in c.compute.resource_skus.list(filter=f"location eq '{location}'")]
    vms = [s for s in skus if s.get("resourceType") == "virtualMachines"]
    if not vms:
        raise UserError(f"unknown Azure region {location!r} or no VM sizes offered there (e.g. eastus, westeurope)")
    match = next((s for s in vms if s.get("name", "").lower() == size.lower()), None)
    if match is None:
        raise UserError(f"unknown Azure VM size {size!r} in {location} (default: {DEFAULT_SIZE})")
    if any(r.get("reasonCode") == "NotAvailableForSubscription" for r in match.get("restrictions") or []):
        raise UserError(f"Azure VM size {size!r} is not available to this subscription in {location}")
    caps = {c_["name"]: c_["value"] for c_ in match.get("capabilities") or []}
    cores = int(caps.get("vCPUs", "0")) // max(1, int(caps.get("vCPUsPerCore", "1")))
    return cores, int(float(caps.get("MemoryGB", "0")) * 2**30)  # Azure's "GB" are GiB (D16s_v6: 64)


def latest_ubuntu_lts(c: _Clients, location: str) -> dict[str, str]:
    """Canonical's newest ``ubuntu-XX_04-lts`` offer, sku ``server``, latest version."""
    offers = [_plain(o)["name"] for o in c.compute.virtual_machine_images.list_offers(location, "Canonical")]
    lts = sorted((int(m.group(1)), o) for o in offers if (m := _LTS_OFFER_RE.match(o)) and int(m.group(1)) % 2 == 0)
    if not lts:
        raise UserError(f"no Ubuntu LTS image from Canonical found in {location}; pass --ami PUBLISHER:OFFER:SKU:VERSION")
    return {"publisher": "Canonical", "offer": lts[-1][1], "sku": "server", "version": "latest"}


def _image_ref(urn: str) -> dict[str, str]:
    parts = urn.split(":")
    if len(parts) != 4 or not all(parts):
        raise UserError(f"--ami for azure is an image URN PUBLISHER:OFFER:SKU:VERSION, not {urn!r}")
    return dict(zip(("publisher", "offer", "sku", "version"), parts, strict=True))


def _create(c: _Clients, record: ClusterRecord, spec: ClusterSpec) -> None:
    name, location = record.name, record.region
    image = _image_ref(record.extra["image"])
    rg = group_name(name)
    tags = {TAG_CLUSTER: name, TAG_ID: record.cluster_id}

    def saved(kind: str, result: Any) -> dict:
        body = _plain(result)
        record.add_resource(kind, body["id"], location)
        state.save(record)
        return body

    # The group first and tagged in the same call: everything else lives inside it.
    saved("resource_group", c.resource.resource_groups.create_or_update(rg, {"location": location, "tags": tags}))
    nsg = saved("network_security_group", c.network.network_security_groups.begin_create_or_update(rg, "xeontune-nsg", {
        "location": location, "tags": tags, "properties": {"securityRules": [
            {"name": "ssh-from-caller", "properties": {
                "priority": 100, "direction": "Inbound", "access": "Allow", "protocol": "Tcp",
                "sourceAddressPrefix": record.extra["ssh_cidr"], "sourcePortRange": "*",
                "destinationAddressPrefix": "*", "destinationPortRange": "22"}},
            {"name": "cluster-internal", "properties": {
                "priority": 110, "direction": "Inbound", "access": "Allow", "protocol": "*",
                "sourceAddressPrefix": "VirtualNetwork", "sourcePortRange": "*",
                "destinationAddressPrefix": "VirtualNetwork", "destinationPortRange": "*"}},
        ]}}).result())
    vnet = saved("virtual_network", c.network.virtual_networks.begin_create_or_update(rg, "xeontune-vnet", {
        "location": location, "tags": tags, "properties": {
            "addressSpace": {"addressPrefixes": [VNET_PREFIX]},
            # Workers have no public address but fetch packages at bootstrap: keep Azure's default
            # outbound access (new subnets are private by default), which admits no inbound traffic.
            "subnets": [{"name": "nodes", "properties": {"addressPrefix": SUBNET_PREFIX, "defaultOutboundAccess": True,
                                                          "networkSecurityGroup": {"id": nsg["id"]}}}]}}).result())
    subnet_id = vnet["properties"]["subnets"][0]["id"]
    pip = saved("public_ip", c.network.public_ip_addresses.begin_create_or_update(rg, "node0-ip", {
        "location": location, "tags": tags, "sku": {"name": "Standard"},
        "properties": {"publicIPAllocationMethod": "Static", "publicIPAddressVersion": "IPv4"}}).result())

    size = record.instance_type or DEFAULT_SIZE
    for i in range(spec.num_nodes):
        role, node_name = ("head" if i == 0 else "worker"), f"node{i}"
        ip_cfg: dict[str, Any] = {"subnet": {"id": subnet_id}, "privateIPAllocationMethod": "Dynamic"}
        if i == 0:
            ip_cfg["publicIPAddress"] = {"id": pip["id"]}
        nic = saved("network_interface", c.network.network_interfaces.begin_create_or_update(rg, f"{node_name}-nic", {
            "location": location, "tags": {**tags, TAG_ROLE: role},
            "properties": {"ipConfigurations": [{"name": "ipconfig", "properties": ip_cfg}]}}).result())
        storage: dict[str, Any] = {
            "imageReference": image,
            "osDisk": {"createOption": "FromImage", "deleteOption": "Delete", "diskSizeGB": DISK_GB,
                       "managedDisk": {"storageAccountType": "Premium_LRS"}},
        }
        if size.lower().endswith("_v6"):
            storage["diskControllerType"] = "NVMe"  # v6 sizes expose disks over NVMe only
        vm = saved("virtual_machine", c.compute.virtual_machines.begin_create_or_update(rg, node_name, {
            "location": location, "tags": {**tags, TAG_ROLE: role},
            "properties": {
                "hardwareProfile": {"vmSize": size},
                "storageProfile": storage,
                "osProfile": {"computerName": node_name, "adminUsername": SSH_USER, "linuxConfiguration": {
                    "disablePasswordAuthentication": True,
                    "ssh": {"publicKeys": [{"path": f"/home/{SSH_USER}/.ssh/authorized_keys",
                                            "keyData": cloud.public_key(record)}]}}},
                "networkProfile": {"networkInterfaces": [{"id": nic["id"], "properties": {"primary": True,
                                                                                         "deleteOption": "Delete"}}]},
            }}).result())
        private_ip = nic["properties"]["ipConfigurations"][0]["properties"].get("privateIPAddress", "")
        public_ip = pip["properties"].get("ipAddress") if i == 0 else None
        record.nodes.append(Node(node_name, role, private_ip, public_ip, vm["id"]))
        state.save(record)


# --- wait / query -------------------------------------------------------------------------------


def _power_state(vm: dict) -> str:
    for s in vm.get("properties", {}).get("instanceView", {}).get("statuses", []):
        if s.get("code", "").startswith("PowerState/"):
            return s["code"].split("/", 1)[1]
    return vm.get("properties", {}).get("provisioningState", "unknown").lower()


# --- teardown -----------------------------------------------------------------------------------


class Azure(cloud.CloudProvider):
    name = "azure"
    options = (cloud.IMAGE_OPTION,)
    ssh_user = SSH_USER
    autostop_note = ("a VM shut down from inside stays allocated and billed; only the ARM API deallocates or "
                     "deletes it, so run `xeontune teardown` when done (docs/troubleshooting.md)")

    def plan(self, spec: ClusterSpec) -> cloud.CloudPlan:
        location = (spec.region or DEFAULT_LOCATION).lower()
        if not re.fullmatch(r"[a-z0-9]+", location):
            raise UserError(f"unknown Azure region {location!r}: use a name like eastus or westeurope (no spaces)")
        size = spec.instance_type or DEFAULT_SIZE
        ssh_cidr = cloud.ssh_cidr(spec.ssh_cidr)
        c = _Clients()
        try:  # read-only checks: a bad region, size or image fails before anything exists
            cores, memory = _check_location_and_size(c, location, size)
            image = ":".join((_image_ref(spec.option("ami")) if spec.option("ami") else latest_ubuntu_lts(c, location)).values())
            taken = c.resource.resource_groups.check_existence(group_name(spec.name))
        except _azure_errors() as exc:
            raise _user_error(exc, "checking the region, VM size and image") from None
        if taken:
            raise UserError(f"resource group {group_name(spec.name)} already exists in subscription {c.subscription}, "
                            f"not from this state dir: choose another --name, or if it is yours, "
                            f"`xeontune teardown --name {spec.name} --provider azure`")
        return cloud.CloudPlan(
            region=location, instance_type=size, image=image, cores_per_node=cores, memory_per_node=memory,
            errors=_azure_errors(), user_error=_user_error,
            estimate=pricing.azure(size, spec.num_nodes), client=c,
            extra={"image": image, "ssh_cidr": ssh_cidr, "resource_group": group_name(spec.name),
                   "subscription": c.subscription},
        )

    def create(self, record: ClusterRecord, spec: ClusterSpec, plan: cloud.CloudPlan) -> None:
        _create(plan.client, record, spec)

    def estimate(self, record: ClusterRecord) -> pricing.CostEstimate:
        return pricing.azure(record.instance_type or DEFAULT_SIZE, len(record.nodes), public_ips=1)

    def wait(self, record: ClusterRecord, timeout_s: float) -> None:
        """Until every VM runs, its host key is read through ARM and pinned, and SSH logs in."""
        c = _Clients()
        rg = group_name(record.name)
        deadline = time.monotonic() + timeout_s
        print(f"waiting for {len(record.nodes)} VM(s) to run, then for their host keys and SSH", flush=True)
        try:
            for n in record.nodes:
                while True:
                    vm = _plain(c.compute.virtual_machines.get(rg, n.name, expand="instanceView"))
                    if _power_state(vm) == "running":
                        break
                    if time.monotonic() > deadline:
                        raise UserError(f"node {n.name} of cluster {record.name!r} was not running within {timeout_s:.0f}s "
                                        f"(state: {_power_state(vm)})")
                    time.sleep(POLL_S)
            if record.skip_bootstrap:
                return
            from azure.core.exceptions import ClientAuthenticationError, HttpResponseError

            for n in record.nodes:
                def fetch(n: Node = n) -> str:
                    try:
                        result = _plain(c.compute.virtual_machines.begin_run_command(rg, n.name, {
                            "commandId": "RunShellScript", "script": ["cat /etc/ssh/ssh_host_ed25519_key.pub"]}).result())
                    except ClientAuthenticationError:
                        raise
                    except HttpResponseError:
                        return ""  # the VM agent is not ready yet (a fresh VM): ask again until the deadline
                    return " ".join(v.get("message", "") for v in result.get("value", []))

                cloud.pin(record, n, cloud.poll_host_key(fetch, n, record, deadline, POLL_S, cloud.parse_host_key))
        except _azure_errors() as exc:
            raise _user_error(exc, f"waiting for cluster {record.name!r}") from None
        cloud.wait_for_ssh(record, deadline)

    def query(self, record: ClusterRecord) -> list[NodeStatus]:
        from azure.core.exceptions import ResourceNotFoundError

        c = _Clients()
        out = []
        for n in record.nodes:
            try:
                vm = _plain(c.compute.virtual_machines.get(group_name(record.name), n.name, expand="instanceView"))
                out.append(NodeStatus(n.name, _power_state(vm), n.private_ip, n.public_ip))
            except ResourceNotFoundError:
                out.append(NodeStatus(n.name, "missing"))
            except _azure_errors() as exc:
                raise _user_error(exc, f"querying cluster {record.name!r}") from None
        return out

    def terminate(self, name: str, record: ClusterRecord | None, region: str | None = None) -> TeardownReport:
        """Delete the cluster's resource group and wait for it: the one carrying the record's id tag,
        or, with no record (or one from before ids), the recorded one and those with the name tag.
        Resource groups are found subscription-wide, so ``region`` is not needed."""
        from azure.core.exceptions import HttpResponseError, ResourceNotFoundError

        c = _Clients()
        groups: set[str] = set()
        if record is not None and record.cluster_id:
            tag, value = TAG_ID, record.cluster_id
        else:
            tag, value = TAG_CLUSTER, name
            if record is not None:
                groups.update(r.id.rsplit("/", 1)[-1] for r in record.resources if r.kind == "resource_group")
        report = TeardownReport(searched=[f"Azure subscription {c.subscription} (tag {tag}={value})"])
        try:
            tagged = c.resource.resource_groups.list(filter=f"tagName eq '{tag}' and tagValue eq '{value}'")
            groups.update(_plain(g)["name"] for g in tagged)
        except _azure_errors() as exc:
            raise _user_error(exc, f"looking for cluster {name!r}'s resource group") from None
        for rg in sorted(groups):
            try:
                poller = c.resource.resource_groups.begin_delete(rg)
                poller.result(timeout=DELETE_DEADLINE_S)  # returns at the deadline, done or not
                if not poller.done():
                    report.failed.append(f"resource group {rg}: still being deleted after {DELETE_DEADLINE_S:g} s "
                                         "(Azure goes on; run `xeontune teardown` again to see it gone)")
                    continue
                report.deleted.append(f"resource group {rg} (and everything in it)")
            except ResourceNotFoundError:
                pass  # already gone: nothing to report
            except HttpResponseError as exc:
                report.failed.append(f"resource group {rg}: {_user_error(exc, 'deleting it')}")
            except _azure_errors() as exc:
                raise _user_error(exc, f"deleting resource group {rg}") from None
        return report


PROVIDER = Azure()
