"""The cluster record and the state dir (``~/.xeontune``, or ``$XEONTUNE_HOME``).

Layout of the state dir::

    $XEONTUNE_HOME/clusters/<name>/cluster.json   the ClusterRecord (written atomically)
    $XEONTUNE_HOME/clusters/<name>/id_ed25519     the cluster's private key (0600)
    $XEONTUNE_HOME/clusters/<name>/known_hosts    host keys pinned for this cluster only
    $XEONTUNE_HOME/clusters/<name>/work/          hosts, ssh_config, ssh wrapper
    $XEONTUNE_HOME/locks/<name>.lock              held (fcntl) by `up` / `teardown` of <name>; outside
                                                  the cluster dir, which teardown deletes while holding it

Cloud providers call ``record.add_resource(...)`` and ``save(record)`` right after each create call
returns, so an interrupted ``up`` still leaves a record that ``teardown`` can work from.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import os
import re
import secrets
import stat
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from xeontune.errors import UserError
from xeontune.io import atomic_write_json

DEFAULT_CLUSTER = "default"
_NAME_RE = re.compile(r"[a-z][a-z0-9-]{0,30}")  # used with fullmatch: "$" would accept a trailing newline


@dataclass
class Node:
    name: str  # "node0" (head), "node1", ...
    role: str  # "head" | "worker"
    private_ip: str
    public_ip: str | None = None
    resource_id: str | None = None  # instance id, VM name or namespace name


@dataclass
class Resource:
    """One thing that costs money or must be cleaned up, recorded as soon as it exists."""

    kind: str  # e.g. "instance", "security_group", "key_pair", "resource_group", "netns", "bridge"
    id: str
    region: str | None = None


@dataclass
class ClusterRecord:
    name: str
    provider: str  # a registered provider's name (xeontune.cluster.providers)
    # Random, made by `up` and tagged on every cloud resource: names are not unique across users
    # of one account, this is. "" in records written before it existed (teardown then goes by name).
    cluster_id: str = ""
    nodes: list[Node] = field(default_factory=list)
    ssh_user: str = "root"
    key_path: str = ""
    known_hosts_path: str = ""
    work_dir: str = ""  # the remote work dir (same absolute path on every node)
    iface: str | None = None  # network interface Hydra and gloo must use
    region: str | None = None
    resources: list[Resource] = field(default_factory=list)
    # Where the nodes keep the project, when that is not this machine's paths (remote providers):
    venv: str = ""  # the venv on every node ("" = this Python's)
    remote_key_path: str = ""  # the head's own key for head -> worker SSH ("" = key_path)
    remote_known_hosts_path: str = ""  # the pinned host keys as the head sees them ("" = known_hosts_path)
    # What the nodes are, when the provider knows:
    instance_type: str | None = None
    cores_per_node: int | None = None  # physical cores: OMP_NUM_THREADS = cores / --ppn on remote nodes
    memory_per_node: int | None = None  # bytes of RAM: `launch --ppn auto` fits the ranks into it
    skip_bootstrap: bool = False  # `up --skip-bootstrap`: the nodes only run, nothing is installed
    autostop_minutes: int = 0  # the head's watcher stops the cluster after this long idle (0: none runs)
    address: str | None = None  # an existing cluster's own address (ray: what `ray.init` connects to)
    extra: dict[str, str] = field(default_factory=dict)  # the provider's own keys, read by it alone

    @property
    def head(self) -> Node:
        return next(n for n in self.nodes if n.role == "head")

    def node(self, name: str) -> Node:
        for n in self.nodes:
            if n.name == name:
                return n
        raise UserError(f"cluster {self.name!r} has no node {name!r} (nodes: {', '.join(n.name for n in self.nodes)})")

    def add_resource(self, kind: str, id: str, region: str | None = None) -> None:
        if not any(r.kind == kind and r.id == id for r in self.resources):
            self.resources.append(Resource(kind, id, region))

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> ClusterRecord:
        data = dict(data)
        data["nodes"] = [Node(**n) for n in data.get("nodes", [])]
        data["resources"] = [Resource(**r) for r in data.get("resources", [])]
        extra = dict(data.get("extra", {}))
        # Records written before these keys became fields kept them as strings in `extra`.
        for key, convert in _FIELDS_ONCE_IN_EXTRA.items():
            if key in extra:
                value = extra.pop(key)
                data.setdefault(key, convert(value))
        extra.pop("mixed_precision", None)  # no longer recorded: each rank decides on its own CPU
        data["extra"] = extra
        return cls(**data)


_FIELDS_ONCE_IN_EXTRA = {
    "venv": str, "remote_key_path": str, "remote_known_hosts_path": str, "instance_type": str,
    "cores_per_node": int, "skip_bootstrap": lambda v: v == "1",
}


def home() -> Path:
    return Path(os.environ.get("XEONTUNE_HOME", Path.home() / ".xeontune")).expanduser()


def new_cluster_id() -> str:
    return secrets.token_hex(8)


def validate_name(name: str) -> str:
    if not _NAME_RE.fullmatch(name):
        raise UserError(
            f"invalid cluster name {name!r}: use 1-31 lowercase letters, digits or '-', starting with a letter"
        )
    return name


def cluster_dir(name: str) -> Path:
    return home() / "clusters" / validate_name(name)


def record_path(name: str) -> Path:
    return cluster_dir(name) / "cluster.json"


def save(record: ClusterRecord) -> Path:
    path = record_path(record.name)
    path.parent.mkdir(parents=True, exist_ok=True)
    os.chmod(path.parent, 0o700)
    atomic_write_json(path, record.to_json(), mode=0o600)
    return path


def exists(name: str) -> bool:
    return record_path(name).is_file()


class CorruptRecord(UserError):
    """cluster.json exists but cannot be read as a record (truncated, edited by hand)."""

    def __init__(self, name: str, path: Path, reason: str) -> None:
        super().__init__(f"the record {path} of cluster {name!r} is unreadable ({reason}); `xeontune teardown "
                         f"--name {name} --provider P [--region R]` finds its resources by tag")
        self.path, self.reason = path, reason


def load(name: str) -> ClusterRecord:
    path = record_path(name)
    if not path.is_file():
        known = ", ".join(list_names()) or "none"
        raise UserError(f"unknown cluster {name!r} (known clusters: {known}); create it with `xeontune cluster up`")
    try:
        return ClusterRecord.from_json(json.loads(path.read_text()))
    except (ValueError, TypeError, AttributeError, KeyError) as exc:
        raise CorruptRecord(name, path, f"{type(exc).__name__}: {' '.join(str(exc).split())[:120]}") from None


def list_names() -> list[str]:
    root = home() / "clusters"
    if not root.is_dir():
        return []
    return sorted(p.name for p in root.iterdir() if (p / "cluster.json").is_file())


def delete(name: str) -> None:
    """Forget a cluster: remove its record, key and files from the state dir."""
    import shutil

    shutil.rmtree(cluster_dir(name), ignore_errors=True)


# --- the per-name lock -----------------------------------------------------------------------------


def lock_path(name: str) -> Path:
    return home() / "locks" / f"{validate_name(name)}.lock"


@contextlib.contextmanager
def locked(name: str, action: str) -> Iterator[None]:
    """Hold cluster ``name``'s lock for the whole block (``up`` and ``teardown``); a second holder
    fails at once, naming the process that has it. The lock file stays: deleting it while another
    process waits on it would let two processes hold "the" lock on two different files."""
    path = lock_path(name)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "unknown process"
            raise UserError(f"cluster {name!r} is busy: {holder} holds {path}; wait for it to finish") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} (`xeontune {action}`)\n".encode(), 0)
        yield
    finally:
        os.close(fd)  # releases the lock


# --- what may be trusted -------------------------------------------------------------------------------


def check_private(paths: list[Path], why: str) -> None:
    """UserError unless every path is owned by this user and writable by nobody else: a key or a
    directory that another user can replace would let them in (``why`` says where)."""
    uid = os.geteuid()
    for path in paths:
        st = os.stat(path)
        if st.st_uid != uid:
            raise UserError(f"{path} is owned by uid {st.st_uid}, not by you (uid {uid}); {why}: "
                            f"use a state dir of your own (XEONTUNE_HOME)")
        if st.st_mode & 0o022:
            raise UserError(f"{path} is group- or world-writable (mode {stat.S_IMODE(st.st_mode):04o}); {why}: "
                            f"run `chmod go-w {path}`")
