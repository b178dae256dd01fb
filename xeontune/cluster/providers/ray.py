"""The `ray` provider: a Ray cluster that exists already, whose workers run the ranks (engine ``ray``).

`up` creates nothing: it records the cluster's address (``--address``, else Ray's own ``RAY_ADDRESS``)
and reads every alive node's CPUs and memory from Ray, as the Slurm provider reads sinfo, so that
``--ppn auto`` and ``-n`` follow the same ranks-per-node rule as elsewhere. A job is one Ray Train run,
started by a driver on this machine (xeontune/job/engines/ray.py); `teardown` stops that driver if it
still runs (its Ray actors die with it) and deletes nothing of the Ray cluster, which is the user's.

Like Slurm's nodes, Ray's must see this machine's paths (the venv, the data, --output-dir, the state
dir): the engine checks it from every node before a job starts. Ray itself is an optional extra,
imported inside the functions that need it.
"""

from __future__ import annotations

import logging
import os
import socket
from dataclasses import dataclass

from xeontune.cluster import state
from xeontune.cluster.providers import ClusterSpec, NodeStatus, Provider, ProviderOption, TeardownReport
from xeontune.cluster.state import ClusterRecord, Node
from xeontune.errors import UserError

INSTALL_HINT = "--provider ray needs Ray: install it with pip install 'xeontune[ray]'"
ADDRESS_ENV = "RAY_ADDRESS"  # Ray's own: what `ray.init()` reads when given no address
REACH_TIMEOUT_S = 10.0


def import_ray():  # -> the ray module
    """``ray``, or the one-line UserError that says how to install it."""
    try:
        import ray
    except ImportError:
        raise UserError(INSTALL_HINT) from None
    return ray


@dataclass
class RayNode:
    node_id: str
    ip: str
    cpus: int
    memory: int  # bytes


def check_reachable(address: str, timeout_s: float = REACH_TIMEOUT_S) -> None:
    """A GCS address (HOST:PORT) that takes no TCP connection: one line at once, where ``ray.init``
    would retry for minutes. Ray Client addresses (ray://) and "auto" are left to ``ray.init``."""
    host, sep, port = address.rpartition(":")
    if "://" in address or not sep or not port.isdigit():
        return
    try:
        socket.create_connection((host.strip("[]") or "127.0.0.1", int(port)), timeout=timeout_s).close()
    except OSError as exc:
        raise UserError(f"cannot reach the Ray cluster at {address}: nothing answers there ({exc.strerror or exc}); "
                        "is `ray start --head` running, and is this its GCS port (6379 by default)?") from None


def connect(address: str) -> None:
    """``ray.init`` quietly, as a driver of this process; UserError naming the address when it fails."""
    ray = import_ray()
    if ray.is_initialized():
        return
    check_reachable(address)
    try:
        ray.init(address=address, log_to_driver=False, logging_level=logging.WARNING)
    except Exception as exc:  # ConnectionError, ValueError ("no cluster at ..."), grpc's own
        words = " ".join(str(exc).split())[:300] or type(exc).__name__
        raise UserError(f"cannot reach the Ray cluster at {address}: {words}") from None


def alive_nodes(address: str) -> list[RayNode]:
    """The cluster's alive nodes with their CPUs and memory, as Ray counts them."""
    ray = import_ray()
    connect(address)
    try:
        nodes = [RayNode(n["NodeID"], n.get("NodeManagerAddress", "?"), int(n["Resources"].get("CPU", 0)),
                         int(n["Resources"].get("memory", 0)))
                 for n in ray.nodes() if n.get("Alive")]
    finally:
        ray.shutdown()
    return nodes


def address_of(record: ClusterRecord) -> str:
    if not record.address:
        raise UserError(f"cluster {record.name!r} records no Ray address: tear it down and bring it up again "
                        "with --address")
    return record.address


def node_cpus(record: ClusterRecord) -> list[int]:
    """Each node's CPUs as `up` read them (nodes without CPUs host no rank)."""
    return [int(c) for c in record.extra.get("cpus", "").split(",") if c.isdigit() and int(c) > 0]


def layout(record: ClusterRecord, ranks: int, ppn: int) -> int:
    """CPUs per worker for ``ranks`` at up to ``ppn`` per node (fewer ranks than ``ppn`` share a node's
    CPUs among themselves); UserError when the cluster cannot place them."""
    cpus = node_cpus(record) or [1]
    if ranks < 1 or ppn < 1:
        raise UserError("-n and --ppn must be at least 1")
    if ppn > min(cpus):
        raise UserError(f"--ppn {ppn} is more ranks per node than the smallest Ray node has CPUs ({min(cpus)})")
    nodes = -(-ranks // ppn)
    per_node = -(-ranks // nodes)
    each = max(min(cpus) // per_node, 1)
    fits = sum(c // each for c in cpus)
    if ranks > fits:
        raise UserError(f"-n {ranks} at --ppn {ppn} needs {ranks} Ray workers of {each} CPU(s); the Ray cluster "
                        f"at {record.address} holds {fits} ({len(cpus)} node(s) with {', '.join(map(str, cpus))} "
                        "CPUs): give a larger --ppn or a smaller -n")
    return each


class Ray(Provider):
    name = "ray"
    engine = "ray"
    remote = False  # the workers read this machine's paths (a shared filesystem) and run from this venv
    uses_ssh = False
    needs_bootstrap = False
    one_job_at_a_time = False  # Ray gives each worker its CPUs: a job waits for them, or is refused (too few)
    wait_timeout_s = 1.0
    default_iface = ""
    autostop_note = "a Ray cluster is the user's: xeontune starts nothing on it that idles"
    options = (ProviderOption("--address", "the Ray cluster's address, e.g. 127.0.0.1:6379 (or ray://head:10001 for "
                              "Ray Client) (default: $RAY_ADDRESS)"),)

    def up(self, spec: ClusterSpec) -> ClusterRecord:
        address = spec.option("address") or os.environ.get(ADDRESS_ENV)
        if not address:
            raise UserError("--provider ray needs --address: the Ray cluster's address (e.g. 127.0.0.1:6379, or "
                            "ray://head:10001), or RAY_ADDRESS set")
        import_ray()
        if spec.num_nodes < 1:
            raise UserError("-n (ranks) must be at least 1")
        nodes = [n for n in alive_nodes(address) if n.cpus > 0]
        if not nodes:
            raise UserError(f"the Ray cluster at {address} has no alive node with CPUs")
        capacity = sum(n.cpus for n in nodes)
        if spec.num_nodes > capacity:
            raise UserError(f"-n {spec.num_nodes} is more ranks than the Ray cluster at {address} can hold "
                            f"({len(nodes)} node(s), {capacity} CPUs in all; a rank needs at least one)")
        record = ClusterRecord(
            name=spec.name, provider=self.name, address=address,
            nodes=[Node("ray", "head", address.split("://")[-1].rsplit(":", 1)[0], resource_id=f"ray cluster {address}")],
            ssh_user=os.environ.get("USER") or "root",
            work_dir=str(state.cluster_dir(spec.name) / "work"),  # on the shared filesystem, as the state dir
            cores_per_node=min(n.cpus for n in nodes), memory_per_node=min(n.memory for n in nodes) or None,
            extra={"ranks": str(spec.num_nodes), "cpus": ",".join(str(n.cpus) for n in nodes)})
        state.save(record)
        return record

    def wait(self, record: ClusterRecord, timeout_s: float) -> None:
        return None

    def query(self, record: ClusterRecord) -> list[NodeStatus]:
        """One line for the whole Ray cluster (its nodes are Ray's to add and remove)."""
        try:
            nodes = alive_nodes(address_of(record))
        except UserError as exc:
            return [NodeStatus(record.head.name, f"unreachable ({exc})")]
        cpus = ", ".join(str(n.cpus) for n in nodes)
        return [NodeStatus(record.head.name, f"running: {len(nodes)} alive Ray node(s), CPUs {cpus or 'none'}")]

    def terminate(self, name: str, record: ClusterRecord | None, region: str | None = None) -> TeardownReport:
        """Nothing to delete: the Ray cluster is the user's. A job of this record still running (its
        driver, on this machine) was stopped by teardown before this (``manage``: SIGINT, as Ctrl-C: it
        aborts the Ray Train run, whose workers and their ranks go with it). Idempotent."""
        return TeardownReport(searched=["nothing of Ray's: the cluster is yours"])

    def slots(self, record: ClusterRecord, ppn: int) -> int:
        return int(record.extra.get("ranks", "1"))

    def slots_text(self, record: ClusterRecord, ppn: int) -> str:
        return f"-n {self.slots(record, ppn)} of `cluster up` / `run`"

    def launcher_args(self, record: ClusterRecord, ppn: int) -> list[str]:
        raise UserError("a Ray job is started by Ray Train's TorchTrainer, not by mpirun")

    def wrap_launch(self, record: ClusterRecord, argv: list[str]) -> list[str]:
        return argv  # the driver runs here and reaches the cluster by its address


PROVIDER = Ray()
