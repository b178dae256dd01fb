"""Cluster providers: one module per provider, each exporting the same four functions.

A provider module implements::

    up(spec: ClusterSpec) -> ClusterRecord
        Create the nodes (saving the record after every resource it creates), then return the
        record. Raise UserError for the user's mistakes (missing root, unknown region, quota).
    wait(record: ClusterRecord, timeout_s: float) -> None
        Block until every node is running and answers SSH; raise UserError naming a node that
        did not come up in time.
    query(record: ClusterRecord) -> list[NodeStatus]
        What the provider sees now, for `xeontune cluster status`.
    terminate(name: str, record: ClusterRecord | None) -> TeardownReport
        Delete everything of the cluster, from the record and, when it is lost, by tag/name.
        Idempotent: a second call deletes nothing and succeeds.

Modules are imported on demand so the cloud SDKs stay optional.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from types import ModuleType

from xeontune.errors import UserError

PROVIDERS = ("local", "localhost", "aws", "azure")


@dataclass
class ClusterSpec:
    name: str
    num_nodes: int
    region: str | None = None
    instance_type: str | None = None
    image: str | None = None  # AMI id / image URN override
    spot: bool = False
    ssh_cidr: str | None = None
    subnet: str | None = None
    skip_bootstrap: bool = False
    data_dir: str | None = None  # training data synced to every node at bootstrap
    extra: dict[str, str] = field(default_factory=dict)


@dataclass
class NodeStatus:
    name: str
    state: str  # "running", "stopped", "missing", ...
    private_ip: str | None = None
    public_ip: str | None = None


@dataclass
class TeardownReport:
    deleted: list[str] = field(default_factory=list)  # human-readable "kind id" of each deletion
    failed: list[str] = field(default_factory=list)  # "kind id: reason" for what is still there

    @property
    def ok(self) -> bool:
        return not self.failed


def get(provider: str) -> ModuleType:
    if provider not in PROVIDERS:
        raise UserError(f"unknown provider {provider!r} (choose from: {', '.join(PROVIDERS)})")
    return importlib.import_module(f"xeontune.cluster.providers.{provider}")
