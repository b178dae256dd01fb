"""Make a fresh cluster ready to train, over SSH/SFTP from this machine.

For every node, in parallel: copy the project's wheel (built here, so every node runs exactly
this code) and ``scripts/bootstrap-node.sh``, run the script (venv at the same absolute path on
every node, the wheel installed into it), copy the cluster's files (hosts, ssh config, pinned
known_hosts) into ``record.work_dir`` and sync the training data (``sync_data``).

Remote clusters (the provider's ``remote``) also get a head -> worker login for Hydra: the head
generates its own ed25519 key (``record.remote_key_path``) and every node authorizes its public half. The caller's private
key never leaves this machine and the head's never leaves the head. Their sshd gets keepalives
(``--client-alive``: a client that stopped answering is dropped within 2 min, so a vanished laptop
does not keep the head's autostop waiting for hours); the local provider's own sshds set them already.
"""

from __future__ import annotations

import hashlib
import os
import posixpath
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from xeontune.cluster import files, providers, ssh, state
from xeontune.cluster.cloud import REMOTE_ROOT
from xeontune.cluster.state import ClusterRecord, Node
from xeontune.errors import UserError

REPO_ROOT = Path(__file__).resolve().parents[2]
NODE_SCRIPT = REPO_ROOT / "scripts" / "bootstrap-node.sh"
DEFAULT_ROOT = REMOTE_ROOT  # /opt/xeontune on every cloud node
SSHD_DROP_IN_DIR = "/etc/ssh/sshd_config.d"  # what a cloud image's sshd_config includes


@dataclass
class BootstrapOptions:
    root: str = DEFAULT_ROOT  # venv at <root>/venv on every node
    offline: bool = False  # no package index on the nodes: venv over system site-packages, wheel without deps
    data_dir: str | None = None
    parallel: bool = True
    timeout_s: float = 1800.0  # per node: a cold venv with torch is a few minutes
    client_alive_dir: str | None = None  # where the node's sshd keepalive settings go (None: left alone)


def build_wheel(out_dir: Path) -> Path:
    """Build the project's wheel from this checkout (no dependencies, no build isolation)."""
    if not (REPO_ROOT / "pyproject.toml").is_file():
        raise UserError(f"bootstrap builds the wheel from a source checkout; no pyproject.toml in {REPO_ROOT}")
    argv = [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "-w", str(out_dir), str(REPO_ROOT)]
    # With this environment's setuptools first (offline, fast); else pip fetches the build backend.
    proc = subprocess.run([*argv, "--no-build-isolation"], capture_output=True, text=True)
    if proc.returncode != 0:
        proc = subprocess.run(argv, capture_output=True, text=True)
    wheels = sorted(out_dir.glob("xeontune-*.whl"))
    if proc.returncode != 0 or not wheels:
        tail = " ".join(proc.stderr.strip().splitlines()[-1:]) or "no wheel written"
        raise UserError(f"could not build the xeontune wheel: {tail}")
    return wheels[-1]


def _check(node: Node, what: str, result: tuple[int, str, str]) -> str:
    rc, out, err = result
    if rc != 0:
        last = (err.strip() or out.strip()).splitlines()[-1:] or ["no output"]
        raise UserError(f"bootstrap of node {node.name} failed while {what} (exit {rc}): {last[0][:300]}")
    return out


def run(record: ClusterRecord, options: BootstrapOptions) -> None:
    """Bootstrap every node of ``record``; raise UserError naming the first node that failed."""
    if options.data_dir and not Path(options.data_dir).is_dir():
        raise UserError(f"--data-dir {options.data_dir} is not a directory")
    remote = providers.get(record.provider).remote  # nodes that do not share this disk
    with tempfile.TemporaryDirectory(prefix="xeontune-wheel-") as tmp:
        wheel = build_wheel(Path(tmp))
        print(f"bootstrapping {len(record.nodes)} node(s) with {wheel.name} into {options.root}/venv", flush=True)
        stage = f"/tmp/xeontune-bootstrap-{record.name}"
        remote_wheel = posixpath.join(stage, wheel.name)
        remote_script = posixpath.join(stage, "bootstrap-node.sh")
        head_pub = None
        if remote:
            head_pub = _head_key(record, record.head, remote_script, options.root)

        def one(node: Node) -> None:
            ssh.put_file(record, node, wheel, remote_wheel)
            ssh.put_file(record, node, NODE_SCRIPT, remote_script)
            argv = node_argv(record, options, remote_script, remote_wheel, head_pub)
            _check(node, "installing the venv", ssh.run(record, node, argv, timeout_s=options.timeout_s))
            if remote:
                # Nodes that share this disk (local namespaces) already have these files.
                ssh.put_tree(record, node, files.files_dir(record), record.work_dir)
                ssh.put_file(record, node, record.known_hosts_path, files.remote_known_hosts_path(record))
            if options.data_dir:
                sync_data(record, node, options.data_dir)
            ssh.run(record, node, ["rm", "-rf", stage], timeout_s=60)
            print(f"  {node.name} ready", flush=True)

        if remote:
            _record_iface(record)
        if options.parallel and len(record.nodes) > 1:
            ssh.on_every_node(record.nodes, one)  # a failure or Ctrl-C does not wait for the other nodes
        else:
            for node in record.nodes:
                one(node)


def node_argv(record: ClusterRecord, options: BootstrapOptions, script: str, wheel: str,
              head_pub: str | None = None) -> list[str]:
    """The node script's command line (scripts/bootstrap-node.sh) for one node."""
    argv = ["bash", script, "--root", options.root, "--wheel", wheel, "--work-dir", record.work_dir,
            "--user", record.ssh_user]
    if options.offline:
        argv.append("--offline")
    if options.client_alive_dir:
        argv += ["--client-alive", options.client_alive_dir]
    if head_pub:
        argv += ["--authorize-key", head_pub]
    return argv


def data_target(record: ClusterRecord, data_dir: str) -> str:
    """Where --data-dir lives on every node: ``<work_dir>/data/<name>-<digest of its path here>``,
    so two folders of one name (``a/data``, ``b/data``) never share a copy."""
    path = Path(data_dir).expanduser().resolve()
    digest = hashlib.sha256(os.fsencode(path)).hexdigest()[:10]
    return posixpath.join(record.work_dir, "data", f"{path.name}-{digest}")


# What training reads of a data folder (train.images.IMAGE_SUFFIXES, masks among them, and IMAGE.txt /
# metadata.jsonl captions), named here without importing the trainer: a symlink to such a file is synced
# as the file; tests/train/test_low_findings.py checks the two lists agree.
DATA_FILE_SUFFIXES = frozenset({".png", ".jpg", ".jpeg", ".webp", ".bmp", ".tif", ".tiff", ".txt", ".jsonl"})


def sync_data(record: ClusterRecord, node: Node, data_dir: str) -> str:
    """Make the node's copy of ``data_dir`` exactly its files now (nothing left from an older
    sync: copied into a fresh folder, then swapped in); return its path on the node. Symlinks go by the
    training reader's rule (``ssh.tree_plan``'s ``follow_file_links``): a link to a file is sent as the
    file, one to a folder or to nothing is skipped with a warning naming it, as the reader skips it here."""
    target = data_target(record, data_dir)
    staging = f"{target}.sync"
    _check(node, "clearing the data's staging folder", ssh.run(record, node, ["rm", "-rf", staging], timeout_s=300))
    ssh.put_tree(record, node, data_dir, staging, follow_file_links=DATA_FILE_SUFFIXES)
    _check(node, "swapping in the synced data", ssh.run(
        record, node, ["sh", "-c", 'rm -rf "$1" && mv "$0" "$1"', staging, target], timeout_s=300))
    return target


def _head_key(record: ClusterRecord, head: Node, remote_script: str, root: str) -> str:
    """Generate the head's own key on the head; return its public line."""
    ssh.put_file(record, head, NODE_SCRIPT, remote_script)
    out = _check(head, "creating the head's key", ssh.run(
        record, head, ["bash", remote_script, "--root", root, "--user", record.ssh_user,
                       "--make-cluster-key", files.remote_key_path(record)], timeout_s=120))
    line = next((ln.strip() for ln in out.splitlines() if ln.startswith("ssh-ed25519 ")), None)
    if line is None:
        raise UserError(f"bootstrap of node {head.name}: no public key came back from ssh-keygen")
    return line


def _record_iface(record: ClusterRecord) -> None:
    """The head's interface that holds its private address (ens5 on EC2 Nitro, eth0 on Azure):
    Hydra's -iface and gloo's GLOO_SOCKET_IFNAME need it, and every node runs the same image."""
    head = record.head
    out = _check(head, "finding its network interface", ssh.run(record, head, ["ip", "-o", "-4", "addr", "show"], timeout_s=60))
    for line in out.splitlines():
        fields = line.split()
        if len(fields) >= 4 and fields[3].split("/")[0] == head.private_ip:
            record.iface = fields[1]
            state.save(record)
            return
    raise UserError(f"bootstrap of node {head.name}: no interface holds its private address {head.private_ip}")


def options_for(record: ClusterRecord, data_dir: str | None) -> BootstrapOptions:
    """What `cluster up` uses: parallel on remote nodes, with sshd keepalives (their system sshd);
    one at a time where nodes share this disk (and this machine's /etc/ssh, left alone)."""
    remote = providers.get(record.provider).remote
    return BootstrapOptions(data_dir=data_dir, parallel=remote, client_alive_dir=SSHD_DROP_IN_DIR if remote else None)
