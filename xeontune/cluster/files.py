"""The files a cluster's head needs: the hosts file, SSH configs and the ssh wrapper.

``write_cluster_files(record)`` writes them into ``files_dir(record)`` (the cluster's ``work/``
in the state dir)::

    hosts                  private addresses, head first, one per line (what `mpirun -f` reads)
    ssh_config             for this machine: head by public address, workers through the head
    ssh_config.internal    for the head: every node by private address (what Hydra uses)
    ssh                    the launcher wrapper Hydra execs: ssh -F ssh_config.internal "$@"

No accelerate config is written: every rank runs under mpirun, and accelerate takes rank, world
size and master address from the environment `xeontune launch` gives it; each rank decides its
precision on its own CPU (``hardware.choose_precision``).

For providers whose nodes share this disk ``record.work_dir`` is that same directory, so the head (a namespace on
this machine) reads the files in place. A remote provider's bootstrap copies the directory to
``record.work_dir`` on the head; the paths written inside ``ssh_config.internal`` and ``ssh`` are
those of ``record.work_dir`` and of the key and known_hosts as they will be on the head (see
``remote_key_path``).
"""

from __future__ import annotations

import shlex
from pathlib import Path

from xeontune.cluster import state
from xeontune.cluster.state import ClusterRecord, Node
from xeontune.io import atomic_write_text

MASTER_PORT = 29500  # on the head, for torch.distributed's rendezvous


def files_dir(record: ClusterRecord) -> Path:
    """Where this machine keeps the cluster's generated files."""
    return state.cluster_dir(record.name) / "work"


def remote_path(record: ClusterRecord, name: str) -> str:
    """The absolute path of a generated file as the head node sees it."""
    return f"{record.work_dir.rstrip('/')}/{name}"


def remote_key_path(record: ClusterRecord) -> str:
    """The login key's path on the head (the local key itself when the head shares this disk)."""
    return record.remote_key_path or record.key_path


def remote_known_hosts_path(record: ClusterRecord) -> str:
    return record.remote_known_hosts_path or record.known_hosts_path


def hosts_text(record: ClusterRecord) -> str:
    """One private address per line, head first: the format ``mpirun -f`` reads."""
    nodes = sorted(record.nodes, key=lambda n: n.role != "head")
    return "".join(f"{n.private_ip}\n" for n in nodes)


def config_value(value: str) -> str:
    """A path for an OpenSSH config file: double-quoted when it holds a space."""
    return f'"{value}"' if any(c.isspace() for c in value) else value


def _host_block(record: ClusterRecord, node: Node, host_name: str, key: str, known_hosts: str,
                jump: str | None) -> str:
    patterns = " ".join(dict.fromkeys([node.name, node.private_ip, *( [node.public_ip] if node.public_ip else [])]))
    lines = [
        f"Host {patterns}",
        f"    HostName {host_name}",
        f"    User {record.ssh_user}",
        f"    IdentityFile {config_value(key)}",
        "    IdentitiesOnly yes",
        f"    UserKnownHostsFile {config_value(known_hosts)}",
        "    GlobalKnownHostsFile /dev/null",
        # Host keys are pinned at `up`; an unknown or changed key is refused, never added.
        "    StrictHostKeyChecking yes",
        "    HostKeyAlias " + node.name,
        "    BatchMode yes",
        "    ConnectTimeout 10",
        "    ServerAliveInterval 15",
        "    LogLevel ERROR",
    ]
    if jump:
        lines.append(f"    ProxyJump {jump}")
    return "\n".join(lines) + "\n"


def ssh_config_text(record: ClusterRecord, internal: bool) -> str:
    """An OpenSSH client config for the cluster's nodes.

    ``internal=False``: for this machine (head by public address when it has one, workers without
    one through the head). ``internal=True``: for use on the head, every node by private address.
    """
    key = remote_key_path(record) if internal else record.key_path
    known = remote_known_hosts_path(record) if internal else record.known_hosts_path
    head = record.head
    blocks = [f"# written by xeontune for cluster {record.name!r} ({'on the head' if internal else 'this machine'})\n"]
    for node in record.nodes:
        if internal:
            host, jump = node.private_ip, None
        elif node.public_ip:
            host, jump = node.public_ip, None
        else:
            host = node.private_ip
            jump = head.name if (head.public_ip and node.name != head.name) else None
        blocks.append(_host_block(record, node, host, key, known, jump))
    return "\n".join(blocks)


def ssh_wrapper_text(record: ClusterRecord) -> str:
    config = remote_path(record, "ssh_config.internal")
    return f'#!/bin/sh\n# Hydra execs this instead of plain ssh, so every hop uses the cluster\'s pinned keys.\nexec ssh -F {shlex.quote(config)} "$@"\n'


def write_cluster_files(record: ClusterRecord) -> dict[str, Path]:
    """Write every file the head needs; return ``{name: path}`` of what was written."""
    out = files_dir(record)
    out.mkdir(parents=True, exist_ok=True)
    written: dict[str, Path] = {}

    def put(name: str, text: str, mode: int = 0o644) -> None:
        atomic_write_text(out / name, text, mode=mode)
        written[name] = out / name

    put("hosts", hosts_text(record))
    put("ssh_config", ssh_config_text(record, internal=False))
    put("ssh_config.internal", ssh_config_text(record, internal=True))
    put("ssh", ssh_wrapper_text(record), mode=0o755)
    return written
