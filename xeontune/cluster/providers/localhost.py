"""The `localhost` provider: every rank on this machine, started by Hydra's fork launcher.

No root, no sshd, no network setup: one node (``node0`` at 127.0.0.1) with ``-n`` slots. It is
the way to try `xeontune launch` without root, and to check that N ranks give the same result
as one process.
"""

from __future__ import annotations

import os

from xeontune.cluster import state
from xeontune.cluster.providers import ClusterSpec, NodeStatus, TeardownReport
from xeontune.cluster.state import ClusterRecord, Node
from xeontune.errors import UserError

IFACE = "lo"


def up(spec: ClusterSpec) -> ClusterRecord:
    if spec.num_nodes < 1:
        raise UserError("-n must be at least 1")
    cdir = state.cluster_dir(spec.name)
    record = ClusterRecord(
        name=spec.name,
        provider="localhost",
        nodes=[Node("node0", "head", "127.0.0.1", resource_id="localhost")],
        ssh_user=os.environ.get("USER") or "root",
        work_dir=str(cdir / "work"),
        iface=IFACE,
        extra={"slots": str(spec.num_nodes)},
    )
    state.save(record)
    return record


def wait(record: ClusterRecord, timeout_s: float) -> None:
    return None


def query(record: ClusterRecord) -> list[NodeStatus]:
    return [NodeStatus(n.name, "running", n.private_ip, n.public_ip) for n in record.nodes]


def terminate(name: str, record: ClusterRecord | None) -> TeardownReport:
    return TeardownReport()  # nothing was created outside the state dir
