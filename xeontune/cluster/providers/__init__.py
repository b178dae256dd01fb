"""Cluster providers: the interface, declared once, and the registry that routes a name to a provider.

A provider is one module that defines ``PROVIDER``, an instance of a ``Provider`` subclass, and
is made known by one ``register(name, module)`` call (the built-in ones at the end of this file).
``Provider`` declares every operation with its signature: the four a provider must implement
(``up``, ``wait``, ``query``, ``terminate``) and the capabilities the rest of the project asks
about (remote or not, SSH or not, wait timeout, bootstrap, slots, how mpirun is started and
wrapped, the network interface, cost), whose default bodies describe a cloud-like provider:
nodes are other machines, reached over SSH, that need the project installed at ``up``. A provider
overrides only what differs.

Modules are imported on first use, so the cloud SDKs stay optional.
"""

from __future__ import annotations

import argparse
import shlex
from dataclasses import dataclass, field

from xeontune.cluster.state import ClusterRecord
from xeontune.errors import UserError
from xeontune.registry import Registry


@dataclass
class ClusterSpec:
    name: str
    num_nodes: int
    region: str | None = None  # the clouds' (aws, azure): where, what size, who may SSH in
    instance_type: str | None = None
    ssh_cidr: str | None = None
    skip_bootstrap: bool = False
    data_dir: str | None = None  # training data synced to every node at bootstrap
    autostop_minutes: int = 0  # stop the cluster after this long idle (cluster/autostop.py); 0: never
    # The provider's own flags (``Provider.options``), by ``ProviderOption.key``: only it reads them.
    options: dict[str, str | bool] = field(default_factory=dict)

    def option(self, key: str) -> str | None:
        value = self.options.get(key)
        return None if value is None or value is False else str(value)


@dataclass(frozen=True)
class ProviderOption:
    """A flag that only one provider reads (Slurm's --partition, AWS's --spot): `cluster up` and `run`
    offer it, ``ClusterSpec.options`` carries its value to that provider's ``up``, and no other
    layer knows it. Given with another provider, it is a one-line error."""

    flag: str  # "--partition"
    help: str
    switch: bool = False  # a flag without a value

    @property
    def key(self) -> str:
        return self.flag.lstrip("-").replace("-", "_")


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
    searched: list[str] = field(default_factory=list)  # where it looked, e.g. "AWS region us-east-1"

    @property
    def ok(self) -> bool:
        return not self.failed

    def merge(self, other: TeardownReport) -> TeardownReport:
        self.deleted += other.deleted
        self.failed += other.failed
        self.searched += other.searched
        return self


class Provider:
    """One provider's operations and capabilities. ``name`` is what records store in ``provider``."""

    name: str = ""
    # The nodes are other machines with their own disks: mpirun runs on the head over SSH, with the
    # nodes' venv (``record.venv``) and work dir, and local paths must be copied there. False: the
    # ranks read this machine's paths and run from this venv: they run here (localhost, namespaces,
    # sharing its cores) or, for Slurm, on nodes that share this filesystem (sized by the
    # record's ``cores_per_node``).
    remote: bool = True
    # Nodes are reached over SSH (pinned host keys); False: Hydra forks ranks here, no SSH at all.
    uses_ssh: bool = True
    # `cluster up` installs the project on every node over SSH (skipped with --skip-bootstrap).
    needs_bootstrap: bool = True
    wait_timeout_s: float = 600.0  # how long `cluster up` waits for the nodes to answer
    default_iface: str = "eth0"  # the interface for Hydra and gloo when the record names none
    # The nodes are slices of one machine (network namespaces): their ranks share its cores, so
    # no rank pins itself to "its node's" cores, and --ppn auto divides the machine among nodes.
    hosts_share_cores: bool = False
    # What the head's idle watcher does (cluster/autostop.py): "teardown" (remove the cluster as
    # `xeontune teardown` does) or "poweroff" (every node shuts down; the cloud deletes what powers
    # off). "": no autostop here, and `autostop_note` says why.
    autostop_action: str = ""
    autostop_note: str = "this provider has no way for the head to stop the cluster"
    # One job at a time: `launch` and `run` refuse a job while one trains there (its head; localhost:
    # this machine). False where a scheduler shares the nodes out among jobs (Slurm's queue, Ray's
    # resources).
    one_job_at_a_time: bool = True
    # `run` checks --data-dir here with a rank's rules (train/data_check.check_training_data), before the cluster
    # exists: a mistake in the folder then costs no machine, bootstrap or queue wait. False where the
    # cluster is this machine and its ranks start within seconds: they find the same mistake.
    reads_data_first: bool = True
    # The flags only this provider reads (``ProviderOption``), delivered in ``ClusterSpec.options``.
    options: tuple[ProviderOption, ...] = ()
    # The engine that starts the ranks on these nodes (xeontune/job/engines/): "mpirun" (Hydra, over
    # SSH or forked here), "srun" (Slurm's), "ray" (Ray Train's workers).
    engine: str = "mpirun"

    # --- the operations every provider implements --------------------------------------------

    def up(self, spec: ClusterSpec) -> ClusterRecord:
        """Create the nodes (saving the record after every resource it creates), then return the
        record. Raise UserError for the user's mistakes (missing root, unknown region, quota)."""
        raise NotImplementedError

    def wait(self, record: ClusterRecord, timeout_s: float) -> None:
        """Block until every node is running and answers SSH; raise UserError naming a node that
        did not come up in time."""
        raise NotImplementedError

    def query(self, record: ClusterRecord) -> list[NodeStatus]:
        """What the provider sees now, for `xeontune cluster status`."""
        raise NotImplementedError

    def terminate(self, name: str, record: ClusterRecord | None, region: str | None = None) -> TeardownReport:
        """Delete everything of the cluster. With a record: only what it holds (its resource ids,
        and what carries its ``cluster_id`` tag), never another cluster of the same name. Without
        one (lost or unreadable): by the name tag, in ``region`` (from `teardown --region`).
        Idempotent: a second call deletes nothing and succeeds."""
        raise NotImplementedError

    # --- capabilities, with the defaults of a cloud-like provider --------------------------------

    def sweep(self, name: str) -> TeardownReport:
        """Delete what cluster ``name`` left behind when neither its record nor its provider is
        known (`teardown` without --provider). Only a provider whose names are unique on this
        machine can look by name alone; the others find nothing."""
        return TeardownReport()

    def cost_per_hour(self, record: ClusterRecord) -> float | None:
        """Estimated USD per hour of the whole cluster; None when free or unknown."""
        return None

    def iface(self, record: ClusterRecord) -> str:
        return record.iface or self.default_iface

    def slots(self, record: ClusterRecord, ppn: int) -> int:
        """How many ranks the cluster holds with ``ppn`` ranks per node."""
        return len(record.nodes) * ppn

    def slots_text(self, record: ClusterRecord, ppn: int) -> str:
        """How ``slots`` came about, for the error that says -n is too large."""
        return f"{len(record.nodes)} hosts x --ppn {ppn} = {self.slots(record, ppn)}"

    def launcher_args(self, record: ClusterRecord, ppn: int) -> list[str]:
        """Hydra's options that say how ranks are started: over SSH, through the cluster's wrapper."""
        from xeontune.cluster import files

        return ["-f", files.remote_path(record, "hosts"), "-ppn", str(ppn),
                "-launcher", "ssh", "-launcher-exec", files.remote_path(record, "ssh")]

    def wrap_launch(self, record: ClusterRecord, argv: list[str]) -> list[str]:
        """The command that runs ``argv`` (mpirun) where it must run: on the head, over SSH."""
        from xeontune.cluster import files

        return ["ssh", "-F", str(files.files_dir(record) / "ssh_config"), "-tt", record.head.name, "--",
                shlex.join(argv)]

    def check_launch(self, record: ClusterRecord) -> None:
        """Raise UserError when this machine cannot launch on the cluster (e.g. root is missing)."""


_REGISTRY: Registry[Provider] = Registry("provider", "PROVIDER", Provider)
register, unregister, names, get = _REGISTRY.register, _REGISTRY.unregister, _REGISTRY.names, _REGISTRY.get


def all_providers() -> list[Provider]:
    return [get(name) for name in names()]


_DEST = "provider_option_"  # argparse dests of the providers' own flags


def add_options(parser: argparse.ArgumentParser) -> None:
    """Every registered provider's own flags, each once, its help naming the providers that read it."""
    owners: dict[str, tuple[ProviderOption, list[str]]] = {}
    for provider in all_providers():
        for option in provider.options:
            owners.setdefault(option.flag, (option, []))[1].append(provider.name)
    for flag, (option, names_) in owners.items():
        kind = {"action": "store_true", "default": None} if option.switch else {"metavar": option.key.upper()}
        parser.add_argument(flag, dest=_DEST + option.key, help=f"{', '.join(names_)}: {option.help}", **kind)


def option_args(options: dict[str, str | bool]) -> dict[str, str | bool]:
    """``options`` (checked already) as the argparse attributes ``options_from`` reads back."""
    return {_DEST + key: value for key, value in options.items()}


def options_from(args: argparse.Namespace, name: str) -> dict[str, str | bool]:
    """The provider flags given in ``args``, which must all be provider ``name``'s own."""
    own = {option.key for option in get(name).options}
    given = {key[len(_DEST):]: value for key, value in vars(args).items()
             if key.startswith(_DEST) and value is not None and value is not False}
    for key in given:
        if key not in own:
            readers = [p.name for p in all_providers() if any(o.key == key for o in p.options)]
            raise UserError(f"--{key.replace('_', '-')} is an option of --provider {' / '.join(readers)}, "
                            f"not of {name}")
    return given


register("local", "xeontune.cluster.providers.local")
register("localhost", "xeontune.cluster.providers.localhost")
register("aws", "xeontune.cluster.providers.aws")
register("azure", "xeontune.cluster.providers.azure")
register("slurm", "xeontune.cluster.providers.slurm")
register("ray", "xeontune.cluster.providers.ray")
