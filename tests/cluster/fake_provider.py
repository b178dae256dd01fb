"""A provider that lives outside the package: what a new provider needs, and nothing more.

It defines the four operations and overrides only the capabilities that differ from the
defaults; registering it (``providers.register("fake", __name__)``) is all it takes to run
`cluster up`, `launch` and `teardown` through it. Its nodes are documentation addresses that no
test ever connects to; every call is logged in ``CALLS``.
"""

from __future__ import annotations

from xeontune.cluster import state
from xeontune.cluster.providers import ClusterSpec, NodeStatus, Provider, TeardownReport
from xeontune.cluster.state import ClusterRecord, Node

CALLS: list[tuple[str, object]] = []


class Fake(Provider):
    name = "fake"
    needs_bootstrap = False  # nothing to install on nodes that do not exist
    wait_timeout_s = 7.0
    default_iface = "fk0"

    def up(self, spec: ClusterSpec) -> ClusterRecord:
        CALLS.append(("up", spec.num_nodes))
        cdir = state.cluster_dir(spec.name)
        record = ClusterRecord(
            name=spec.name, provider=self.name, ssh_user="trainer", key_path=str(cdir / "id_ed25519"),
            known_hosts_path=str(cdir / "known_hosts"), work_dir="/srv/fake/work", venv="/srv/fake/venv",
            cores_per_node=4,
            nodes=[Node(f"node{i}", "head" if i == 0 else "worker", f"192.0.2.{10 + i}", resource_id=f"fake-{i}")
                   for i in range(spec.num_nodes)],
            extra={"rack": "r1"},
        )
        record.add_resource("fake_node", "fake-0")
        state.save(record)
        return record

    def wait(self, record: ClusterRecord, timeout_s: float) -> None:
        CALLS.append(("wait", timeout_s))

    def query(self, record: ClusterRecord) -> list[NodeStatus]:
        return [NodeStatus(n.name, "humming", n.private_ip) for n in record.nodes]

    def terminate(self, name: str, record: ClusterRecord | None, region: str | None = None) -> TeardownReport:
        CALLS.append(("terminate", record.extra["rack"] if record else None))
        return TeardownReport(deleted=[f"fake node {n.resource_id}" for n in (record.nodes if record else [])])

    def cost_per_hour(self, record: ClusterRecord) -> float | None:
        return 0.5 * len(record.nodes)


PROVIDER = Fake()
