"""The `localhost` provider: every rank on this machine, started by Hydra's fork launcher.

No root, no sshd, no network setup: one node (``node0`` at 127.0.0.1) with ``-n`` slots. It is
the way to try `xeontune launch` without root, and to check that N ranks give the same result
as one process.
"""

from __future__ import annotations

import os

from xeontune.cluster import state
from xeontune.cluster.providers import ClusterSpec, NodeStatus, Provider, TeardownReport
from xeontune.cluster.state import ClusterRecord, Node
from xeontune.errors import UserError


class Localhost(Provider):
    name = "localhost"
    remote = False
    uses_ssh = False
    needs_bootstrap = False
    reads_data_first = False  # the cluster is this machine: the ranks read the folder at once
    wait_timeout_s = 1.0
    default_iface = "lo"
    autostop_note = "a localhost cluster is only a record: nothing of it runs or costs while idle"

    def up(self, spec: ClusterSpec) -> ClusterRecord:
        if spec.num_nodes < 1:
            raise UserError("-n must be at least 1")
        cdir = state.cluster_dir(spec.name)
        record = ClusterRecord(
            name=spec.name,
            provider=self.name,
            nodes=[Node("node0", "head", "127.0.0.1", resource_id="localhost")],
            ssh_user=os.environ.get("USER") or "root",
            work_dir=str(cdir / "work"),
            iface=self.default_iface,
            extra={"slots": str(spec.num_nodes)},  # `up -n`: ranks, not hosts
        )
        state.save(record)
        return record

    def wait(self, record: ClusterRecord, timeout_s: float) -> None:
        return None

    def query(self, record: ClusterRecord) -> list[NodeStatus]:
        return [NodeStatus(n.name, "running", n.private_ip, n.public_ip) for n in record.nodes]

    def terminate(self, name: str, record: ClusterRecord | None, region: str | None = None) -> TeardownReport:
        return TeardownReport()  # nothing was created outside the state dir

    def slots(self, record: ClusterRecord, ppn: int) -> int:
        return max(int(record.extra.get("slots", 1)), ppn)

    def slots_text(self, record: ClusterRecord, ppn: int) -> str:
        return f"{self.slots(record, ppn)} slots"

    def launcher_args(self, record: ClusterRecord, ppn: int) -> list[str]:
        return ["-launcher", "fork"]

    def wrap_launch(self, record: ClusterRecord, argv: list[str]) -> list[str]:
        return argv  # mpirun runs right here


PROVIDER = Localhost()
