"""What the cloud providers share: the ``up`` skeleton (``CloudProvider``), the record they start
from, the caller's SSH address and host-key pinning from an authenticated API. Rolling back a
failed ``up`` is ``cluster.manage``'s, for every provider.

Paths on every cloud node are the same absolute ones (Hydra needs that)::

    /opt/xeontune/venv                  the project's virtualenv (bootstrap)
    /opt/xeontune/work                  the cluster's files (hosts, ssh configs, pinned known_hosts)
    /opt/xeontune/keys/id_ed25519       a key generated on the head for head -> worker SSH

The caller's own private key never leaves this machine; the head's key never leaves the head.
"""

from __future__ import annotations

import ipaddress
import os
import re
import sys
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from xeontune.cluster import pricing, ssh, state
from xeontune.cluster.providers import ClusterSpec, Provider, ProviderOption
from xeontune.cluster.state import ClusterRecord, Node
from xeontune.errors import UserError

REMOTE_ROOT = "/opt/xeontune"
REMOTE_WORK = f"{REMOTE_ROOT}/work"
REMOTE_VENV = f"{REMOTE_ROOT}/venv"
REMOTE_KEY = f"{REMOTE_ROOT}/keys/id_ed25519"
# Answers with the caller's public address as plain text; XEONTUNE_CHECKIP_URL overrides it.
CHECKIP_URL = "https://checkip.amazonaws.com"

_HOST_KEYS_RE = re.compile(r"-----BEGIN SSH HOST KEY KEYS-----(.*?)-----END SSH HOST KEY KEYS-----", re.S)
_ED25519_RE = re.compile(r"(ssh-ed25519 [A-Za-z0-9+/=]{60,})")


def ssh_cidr(requested: str | None) -> str:
    """``--ssh-cidr`` normalised, else this machine's public address as a /32 (or /128)."""
    if requested:
        try:
            net = ipaddress.ip_network(requested, strict=False)
        except ValueError:
            raise UserError(f"--ssh-cidr {requested!r} is not a CIDR (e.g. 203.0.113.7/32)") from None
        if net.prefixlen == 0:
            print("warning: --ssh-cidr opens SSH to the whole internet", file=sys.stderr)
        return str(net)
    url = os.environ.get("XEONTUNE_CHECKIP_URL", CHECKIP_URL)
    try:
        with urllib.request.urlopen(url, timeout=10) as resp:  # noqa: S310 (fixed https URL or the user's override)
            text = resp.read(64).decode().strip()
        addr = ipaddress.ip_address(text)
    except (OSError, ValueError) as exc:
        raise UserError(f"could not detect your public address from {url} ({exc}); pass --ssh-cidr ADDR/32") from None
    return f"{addr}/{addr.max_prefixlen}"


def check_data_dir(data_dir: str | None) -> None:
    """Fail before anything is created, not after the nodes are up and billing."""
    if data_dir and not os.path.isdir(data_dir):
        raise UserError(f"--data-dir {data_dir} is not a directory")


def new_record(name: str, provider: str, region: str, ssh_user: str) -> ClusterRecord:
    """A fresh record with a new ed25519 login key (0600) in the cluster's state dir."""
    cdir = state.cluster_dir(name)
    cdir.mkdir(parents=True, exist_ok=True)
    os.chmod(cdir, 0o700)
    key = cdir / "id_ed25519"
    ssh.generate_keypair(key, comment=f"xeontune-{name}")
    known_hosts = cdir / "known_hosts"
    known_hosts.touch(mode=0o644, exist_ok=True)
    return ClusterRecord(
        name=name, provider=provider, cluster_id=state.new_cluster_id(), ssh_user=ssh_user, key_path=str(key), known_hosts_path=str(known_hosts),
        work_dir=REMOTE_WORK, region=region, venv=REMOTE_VENV, remote_key_path=REMOTE_KEY,
        remote_known_hosts_path=f"{REMOTE_WORK}/known_hosts",
    )


def public_key(record: ClusterRecord) -> str:
    return ssh.public_key_line(record.key_path)


def parse_console_host_key(console: str) -> str | None:
    """The ed25519 host key that cloud-init prints on the serial console, if it is there yet."""
    for block in _HOST_KEYS_RE.findall(console or ""):
        m = _ED25519_RE.search(block)
        if m:
            return m.group(1)
    return None


def parse_host_key(text: str) -> str | None:
    """The first ed25519 public key line anywhere in ``text`` (e.g. a run-command's stdout)."""
    m = _ED25519_RE.search(text or "")
    return m.group(1) if m else None


def poll_host_key(fetch: Callable[[], str], node: Node, record: ClusterRecord, deadline: float,
                  poll_s: float, parse: Callable[[str], str | None] = parse_console_host_key) -> str:
    """Call ``fetch`` until ``parse`` finds a host key in what it returns, or fail naming the node."""
    while True:
        key = parse(fetch())
        if key:
            return key
        if time.monotonic() > deadline:
            raise UserError(f"node {node.name} ({node.resource_id}) of cluster {record.name!r} did not report its "
                            "SSH host key in time; it may still be booting: run teardown and try again")
        time.sleep(poll_s)


def pin(record: ClusterRecord, node: Node, host_key: str) -> None:
    ssh.pin_host_key(record, node, host_key)
    state.save(record)


def wait_for_ssh(record: ClusterRecord, deadline: float) -> None:
    """Head first (workers without a public address are reached through it), then the rest."""
    for node in sorted(record.nodes, key=lambda n: n.role != "head"):
        ssh.wait_for_ssh(record, node, timeout_s=max(5.0, deadline - time.monotonic()), interval_s=5.0)


@dataclass
class CloudPlan:
    """What a cloud provider's read-only checks found; nothing exists yet."""

    region: str
    instance_type: str
    image: str  # as the "creating ..." line names it
    cores_per_node: int | None  # physical cores, when the API says
    estimate: pricing.CostEstimate
    errors: tuple[type[BaseException], ...]  # the SDK's exceptions that ``create`` may raise ...
    user_error: Callable[[BaseException, str], UserError]  # ... and how each becomes one line
    extra: dict[str, str] = field(default_factory=dict)  # the provider's own keys for the record
    client: Any = None  # the provider's SDK client(s), reused by ``create``
    memory_per_node: int | None = None  # bytes of RAM, when the API says


# An image instead of the current Ubuntu LTS: both clouds read it, each in its own form.
IMAGE_OPTION = ProviderOption("--ami", "an image instead of the current Ubuntu LTS (aws: an AMI id; azure: an image "
                              "URN PUBLISHER:OFFER:SKU:VERSION)")


class CloudProvider(Provider):
    """``up`` for a cloud: check everything read-only (including that no cluster of this name exists
    in the account), then save a fresh record, then create (the provider saves the record after
    each resource). An SDK error becomes one line; `manage.up` rolls back what was created."""

    ssh_user: str = "ubuntu"

    def plan(self, spec: ClusterSpec) -> CloudPlan:
        """Validate ``spec`` against the cloud without creating anything; UserError if it cannot work."""
        raise NotImplementedError

    def create(self, record: ClusterRecord, spec: ClusterSpec, plan: CloudPlan) -> None:
        """Create every resource of the cluster, recording each as soon as it exists."""
        raise NotImplementedError

    def estimate(self, record: ClusterRecord) -> pricing.CostEstimate:
        raise NotImplementedError

    def cost_per_hour(self, record: ClusterRecord) -> float | None:
        return self.estimate(record).usd_per_hour

    def up(self, spec: ClusterSpec) -> ClusterRecord:
        state.validate_name(spec.name)
        if spec.num_nodes < 1:
            raise UserError("a cluster needs at least one node (-n 1 or more)")
        check_data_dir(spec.data_dir)
        plan = self.plan(spec)
        record = new_record(spec.name, self.name, plan.region, self.ssh_user)
        record.instance_type, record.cores_per_node = plan.instance_type, plan.cores_per_node or None
        record.memory_per_node = plan.memory_per_node or None
        record.skip_bootstrap = spec.skip_bootstrap
        record.extra.update(plan.extra)
        state.save(record)
        print(f"creating {spec.num_nodes} x {plan.instance_type}{' (spot)' if spec.options.get('spot') else ''} in {plan.region} "
              f"from {plan.image}; {plan.estimate.line()}", flush=True)
        try:
            self.create(record, spec, plan)
        except plan.errors as exc:
            raise plan.user_error(exc, f"creating cluster {spec.name!r}") from None
        return record
