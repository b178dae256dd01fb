"""The project's Python SSH client (paramiko), for what xeontune itself runs on the nodes: `up`'s
wait, the bootstrap, launch's preflight. What mpirun and `cluster ssh` run goes through OpenSSH
with the ``ssh_config`` files that ``files.py`` writes. Both trust the same thing only: the host
keys pinned in the cluster's own ``known_hosts``.

Every connection here checks the node's host key against the cluster's own ``known_hosts`` file
(``record.known_hosts_path``), filled at ``up`` time from a key the provider knows (the local
provider generates the sshd host keys itself; a cloud provider reads them from the instance's
console output or its own bootstrap). Unknown or changed keys are refused: there is no
auto-add policy anywhere.

Addressing: a node is reached at its public address when it has one, else at its private
address; a node without a public address in a cluster whose head has one is reached through the
head (a ``direct-tcpip`` channel, the same as ``ProxyJump``).

Typical use::

    ssh.generate_keypair(state_dir / "id_ed25519")          # 0600 private key + .pub
    ssh.pin_host_key(record, node, "ssh-ed25519 AAAA...")     # at up time
    ssh.wait_for_ssh(record, node, timeout_s=120)             # banner, then a real login
    rc, out, err = ssh.run(record, node, ["python3", "-V"])  # argv, quoted with shlex.join
    ssh.put_tree(record, node, "dist/", "/opt/xeontune/dist") # SFTP, recursive (links: tree_plan)
"""

from __future__ import annotations

import contextlib
import os
import shlex
import socket
import stat
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from xeontune.errors import UserError
from xeontune.io import atomic_write_text

T = TypeVar("T")
KEEPALIVE_S = 15
SFTP_TIMEOUT_S = 120.0  # one SFTP request (a put of a block) that gets no answer this long fails

if TYPE_CHECKING:  # paramiko is imported lazily: `xeontune --help` should not pay for it
    import paramiko

    from xeontune.cluster.state import ClusterRecord, Node

SSH_PORT = 22


# --- keys ---------------------------------------------------------------------------------------


def generate_keypair(path: str | os.PathLike[str], comment: str = "xeontune") -> str:
    """Write a new ed25519 private key at ``path`` (0600, OpenSSH format) and ``path.pub``.

    Returns the public key line (``ssh-ed25519 AAAA... comment``). Used for the cluster's login
    key and, by the local provider, for each node's sshd host key.
    """
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    key = Ed25519PrivateKey.generate()
    private = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH, serialization.NoEncryption()
    ).decode()
    public = key.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
    line = f"{public.decode()} {comment}".strip()
    atomic_write_text(path, private, mode=0o600)
    atomic_write_text(f"{os.fspath(path)}.pub", line + "\n", mode=0o644)
    return line


def public_key_line(private_key_path: str | os.PathLike[str]) -> str:
    """The ``type base64`` public line of an existing key (from its ``.pub`` file)."""
    return Path(f"{os.fspath(private_key_path)}.pub").read_text().strip()


def node_aliases(node: Node) -> list[str]:
    """Every name a node is reached by; its host key is pinned under all of them."""
    names = [node.name, node.private_ip]
    if node.public_ip:
        names.append(node.public_ip)
    return [n for i, n in enumerate(names) if n and n not in names[:i]]


def pin_host_key(record: ClusterRecord, node: Node, host_key_line: str) -> None:
    """Record ``host_key_line`` (``ssh-ed25519 AAAA...``) as the node's only accepted host key.

    Any previous entry for the node's names is replaced. The file is written atomically and is
    readable by OpenSSH too (the ssh config that Hydra uses points at it).
    """
    parts = host_key_line.split()
    if len(parts) < 2:
        raise ValueError(f"not a public key line: {host_key_line!r}")
    key_type, key_b64 = parts[0], parts[1]
    path = Path(record.known_hosts_path)
    aliases = node_aliases(node)
    kept = []
    if path.is_file():
        for line in path.read_text().splitlines():
            hosts = line.split(" ", 1)[0].split(",") if line.strip() else []
            if hosts and not set(hosts) & set(aliases):
                kept.append(line)
    kept.append(f"{','.join(aliases)} {key_type} {key_b64}")
    atomic_write_text(path, "\n".join(kept) + "\n", mode=0o644)


# --- connecting ---------------------------------------------------------------------------------


def address(node: Node) -> str:
    """The address this machine dials for ``node`` (public if it has one, else private)."""
    return node.public_ip or node.private_ip


def _jump_host(record: ClusterRecord, node: Node) -> Node | None:
    head = record.head
    if node.public_ip or node is head or node.name == head.name or not head.public_ip:
        return None
    return head


def _client(record: ClusterRecord) -> paramiko.SSHClient:
    import paramiko

    if not record.known_hosts_path or not Path(record.known_hosts_path).is_file():
        raise UserError(f"cluster {record.name!r} has no known_hosts file; recreate it with `xeontune cluster up`")
    client = paramiko.SSHClient()
    # Only this cluster's pinned keys: not ~/.ssh/known_hosts, and never auto-add.
    client.load_host_keys(record.known_hosts_path)
    client.set_missing_host_key_policy(paramiko.RejectPolicy())
    return client


def connect(record: ClusterRecord, node: Node, timeout_s: float = 15.0) -> paramiko.SSHClient:
    """An authenticated ``paramiko.SSHClient`` to ``node``; the caller closes it.

    Raises paramiko/socket errors as they come (``wait_for_ssh`` turns them into a UserError
    that names the node); a host key that is not the pinned one raises
    ``paramiko.BadHostKeyException`` / ``SSHException`` and is never accepted.
    """
    sock = None
    jump = _jump_host(record, node)
    jump_client = None
    if jump is not None:
        jump_client = connect(record, jump, timeout_s)
        transport = jump_client.get_transport()
        assert transport is not None
        sock = transport.open_channel("direct-tcpip", (node.private_ip, SSH_PORT), ("127.0.0.1", 0))
    client = _client(record)
    try:
        client.connect(
            node.private_ip if jump is not None else address(node),
            port=SSH_PORT,
            username=record.ssh_user,
            key_filename=record.key_path,
            timeout=timeout_s,
            banner_timeout=timeout_s,
            auth_timeout=timeout_s,
            allow_agent=False,
            look_for_keys=False,
            sock=sock,
        )
    except BaseException:
        client.close()
        if jump_client is not None:
            jump_client.close()
        raise
    if jump_client is not None:
        client._xeontune_jump = jump_client  # type: ignore[attr-defined]  # kept alive with the client
    transport = client.get_transport()
    if transport is not None:  # a dead link is noticed (its requests fail) rather than waited on forever
        transport.set_keepalive(KEEPALIVE_S)
    return client


def close(client: paramiko.SSHClient) -> None:
    """Close a client from ``connect`` (and its jump connection, if any)."""
    client.close()
    jump = getattr(client, "_xeontune_jump", None)
    if jump is not None:
        jump.close()


def _banner(host: str, port: int, timeout_s: float) -> str:
    with socket.create_connection((host, port), timeout=timeout_s) as s:
        s.settimeout(timeout_s)
        data = s.recv(256)
    text = data.decode(errors="replace").strip()
    if not text.startswith("SSH-"):
        raise ConnectionError(f"no SSH banner (got {text[:40]!r})")
    return text


def wait_for_ssh(record: ClusterRecord, node: Node, timeout_s: float = 120.0, interval_s: float = 1.0) -> None:
    """Block until ``node`` shows an SSH banner and accepts a real login that runs ``true``.

    Raises UserError naming the node (and the last error seen) when ``timeout_s`` passes first.
    """
    deadline = time.monotonic() + timeout_s
    last = "no attempt"
    while True:
        remaining = deadline - time.monotonic()
        try:
            if _jump_host(record, node) is None:
                _banner(address(node), SSH_PORT, max(1.0, min(10.0, remaining)))
            rc, _, err = run(record, node, ["true"], timeout_s=max(1.0, min(15.0, remaining)))
            if rc == 0:
                return
            last = f"`true` exited {rc}: {err.strip()[:200]}"
        except UserError:
            raise  # a broken record (no known_hosts) will not heal by waiting
        except Exception as exc:  # any other failure here means "not up yet"; report the last one
            last = f"{type(exc).__name__}: {exc}".strip()
        if time.monotonic() + interval_s > deadline:
            raise UserError(
                f"node {node.name} ({address(node)}) of cluster {record.name!r} did not answer SSH "
                f"within {timeout_s:.0f}s: {last}"
            )
        time.sleep(interval_s)


# --- running and copying ------------------------------------------------------------------------


def run(
    record: ClusterRecord,
    node: Node,
    argv: Sequence[str],
    timeout_s: float | None = None,
    stdin: bytes | None = None,
) -> tuple[int, str, str]:
    """Run ``argv`` on ``node`` and return ``(exit code, stdout, stderr)``.

    ``argv`` is quoted with ``shlex.join``: each element reaches the remote program as one
    argument, whatever it holds. Use ``["sh", "-c", script]`` only for a script you wrote.
    """
    client = connect(record, node, timeout_s or 15.0)
    try:
        chan_in, chan_out, chan_err = client.exec_command(shlex.join(argv), timeout=timeout_s)
        if stdin is not None:
            chan_in.write(stdin)
        chan_in.channel.shutdown_write()
        # Both streams at once: paramiko widens the SSH window only as a stream is read, so a
        # command that fills stderr's window while we wait for stdout's end would never finish.
        with ThreadPoolExecutor(max_workers=1) as pool:
            err_bytes = pool.submit(chan_err.read)
            out = chan_out.read().decode(errors="replace")
            err = err_bytes.result().decode(errors="replace")
        rc = chan_out.channel.recv_exit_status()
        return rc, out, err
    finally:
        close(client)


def on_every_node(nodes: Sequence[Node], fn: Callable[[Node], T], workers: int = 8) -> list[T]:
    """``fn(node)`` for every node at once. The first error (or Ctrl-C) is raised at once, without
    waiting for the other nodes' work (a teardown that follows ends their connections)."""
    from concurrent.futures import FIRST_EXCEPTION, wait

    pool = ThreadPoolExecutor(max_workers=max(1, min(workers, len(nodes))))
    try:
        futures = [pool.submit(fn, node) for node in nodes]
        wait(futures, return_when=FIRST_EXCEPTION)
        for future in futures:
            if future.done() and future.exception() is not None:
                raise future.exception()  # type: ignore[misc]
        return [future.result() for future in futures]
    finally:
        pool.shutdown(wait=False, cancel_futures=True)


@dataclass
class TreePlan:
    """What ``put_tree`` sends of a local folder; paths relative to it, in POSIX form."""

    dirs: list[str] = field(default_factory=list)  # folders to create
    files: list[tuple[Path, str]] = field(default_factory=list)  # (local path, read through any link; where)
    links: list[tuple[str, str]] = field(default_factory=list)  # (where, relative target): links inside the tree
    skipped: list[tuple[Path, str]] = field(default_factory=list)  # (local link, why it is not sent)


def tree_plan(local_dir: str | os.PathLike[str], follow_file_links: frozenset[str] = frozenset()) -> TreePlan:
    """``put_tree``'s rule for each entry of ``local_dir``, at every depth. Files and folders are sent. A symlink
    that resolves inside the tree is recreated as a relative link (the same target on the node); one that
    points outside it, or nowhere, is skipped, since following it could upload anything on this machine (a
    link to $HOME would send ~/.ssh to every node).

    ``follow_file_links`` (a training data folder, ``bootstrap.sync_data``: the suffixes of the files
    training reads): the rule the training reader has (``train.images.is_image_file``: ``Path.is_file``,
    which follows links): a link to a file of those suffixes, wherever it points, is sent as the file's
    bytes (a linked dataset trains on the nodes as it does here), unless it points inside the tree (then
    it is a link, as above); a link to any other file outside the tree, to a folder, or to nothing, is
    skipped: training reads no folder and no other file, and a stray link to a key is not sent."""
    src = Path(local_dir)
    top = src.resolve()
    plan = TreePlan()
    for root, dirs, names in os.walk(src):  # followlinks=False: links to dirs come in `dirs`, never walked
        rel_root = Path(root).relative_to(src)
        for name in sorted(dirs + names):
            local = Path(root) / name
            rel = (rel_root / name).as_posix()
            if not local.is_symlink():
                if name in dirs:
                    plan.dirs.append(rel)
                else:
                    plan.files.append((local, rel))
                continue
            try:
                target = local.resolve()
            except (OSError, RuntimeError):  # a loop of links
                plan.skipped.append((local, "a symlink that loops"))
                continue
            inside = target.is_relative_to(top) and target.exists()
            if follow_file_links and not target.exists():
                plan.skipped.append((local, f"a symlink to nothing ({target})"))
            elif follow_file_links and not target.is_file():
                plan.skipped.append((local, f"a symlink to a folder ({target}): training reads files (and links to "
                                            "files), no folder"))
            elif inside:
                plan.links.append((rel, os.path.relpath(target, local.parent.resolve())))
            elif follow_file_links and local.suffix.lower() in follow_file_links:
                plan.files.append((local, rel))
            elif follow_file_links:
                plan.skipped.append((local, f"a symlink to {target}, outside the folder, and no file training reads"))
            else:
                plan.skipped.append((local, f"a symlink to {target}, outside {top} (or missing)"))
    return plan


def say_skipped(plan: TreePlan) -> None:
    for link, why in plan.skipped:
        print(f"warning: not uploading {link}: {why}", file=sys.stderr)


def put_tree(record: ClusterRecord, node: Node, local_dir: str | os.PathLike[str], remote_dir: str,
             follow_file_links: frozenset[str] = frozenset()) -> int:
    """Copy ``local_dir`` recursively to ``remote_dir`` on ``node`` over SFTP; return files copied.

    Directories are created as needed and file modes are kept (so a 0600 key stays 0600).
    Existing files are overwritten. Symlinks follow ``tree_plan``'s rule (``follow_file_links``: a
    data folder's); each one skipped is named in a warning.
    """
    src = Path(local_dir)
    if not src.is_dir():
        raise UserError(f"not a directory: {src}")
    plan = tree_plan(src, follow_file_links)
    say_skipped(plan)
    client = connect(record, node)
    try:
        sftp = client.open_sftp()
        sftp.get_channel().settimeout(SFTP_TIMEOUT_S)
        try:
            sftp_makedirs(sftp, remote_dir)
            base = remote_dir.rstrip("/")
            for rel in plan.dirs:
                sftp_makedirs(sftp, f"{base}/{rel}")
            for local, rel in plan.files:
                sftp.put(os.fspath(local), f"{base}/{rel}")  # through a link: its target's bytes
                sftp.chmod(f"{base}/{rel}", stat.S_IMODE(local.stat().st_mode))
            for rel, target in plan.links:
                with contextlib.suppress(OSError):
                    sftp.remove(f"{base}/{rel}")  # a re-run: replace the old link (or file) of that name
                sftp.symlink(target, f"{base}/{rel}")
        finally:
            sftp.close()
    finally:
        close(client)
    return len(plan.files)


def put_file(record: ClusterRecord, node: Node, local_path: str | os.PathLike[str], remote_path: str) -> None:
    """Copy one file over SFTP, keeping its mode; the remote parent directory is created."""
    client = connect(record, node)
    try:
        sftp = client.open_sftp()
        sftp.get_channel().settimeout(SFTP_TIMEOUT_S)
        try:
            sftp_makedirs(sftp, remote_path.rsplit("/", 1)[0] or "/")
            sftp.put(os.fspath(local_path), remote_path)
            sftp.chmod(remote_path, stat.S_IMODE(Path(local_path).stat().st_mode))
        finally:
            sftp.close()
    finally:
        close(client)


def sftp_makedirs(sftp: paramiko.SFTPClient, path: str) -> None:
    parts = [p for p in path.split("/") if p]
    current = "/" if path.startswith("/") else ""
    for part in parts:
        current = f"{current.rstrip('/')}/{part}" if current else part
        try:
            sftp.stat(current)
        except FileNotFoundError:
            sftp.mkdir(current)
