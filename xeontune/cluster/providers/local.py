"""The `local` provider: N hosts on this machine, each a network namespace with its own sshd.

Layout for a cluster named NAME (``h`` = 6 hex digits of sha1(NAME), so names stay under the
kernel's 15-character limit for interfaces)::

    bridge   xt<h>br        in the root namespace, address 10.231.X.1/24 (this machine's way in)
    netns    xeontune-NAME-node<i>, holding eth0 = 10.231.X.(11+i)/24
    veth     xt<h>v<i>      the root-side end of node i's pair, enslaved to the bridge
    sshd     one per namespace, listening only on the node's address, with a host key generated
             here (so it is pinned before first contact) and the cluster's key as its only
             authorized key

X is picked from 10.231.0.0/16 so that no address or route of this machine (or another
xeontune cluster) is in the /24. Every namespace shares this machine's filesystem and hostname,
so Hydra needs ``-iface eth0`` and gloo ``GLOO_SOCKET_IFNAME=eth0`` (else they dial 127.0.0.1).

Teardown kills every process inside the cluster's namespaces (sshd, Hydra proxies, ranks), then
deletes namespaces, veths and bridge; it finds them by name when the record is lost.

``--link-rate RATE`` (and ``--link-delay``) shape each node's link with `tc`, so that a cluster on one
machine has a real cluster's bandwidth and latency: the node's own end (its sending) gets a token
bucket at RATE (netem's rate and delay with --link-delay: a packet's one-way delay), the bridge's end
(what it receives) a token bucket at RATE. Its qdiscs go with the namespace and the veth.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

from xeontune.cluster import ssh, state
from xeontune.cluster.files import config_value
from xeontune.cluster.providers import ClusterSpec, NodeStatus, Provider, ProviderOption, TeardownReport
from xeontune.cluster.state import ClusterRecord, Node
from xeontune.errors import UserError
from xeontune.io import atomic_write_text

IFACE = "eth0"
SUBNET_PREFIX = "10.231"
MAX_NODES = 64
RATE_UNITS = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12}  # tc's, in bits per second
RATE_RE = re.compile(r"(\d+(?:\.\d+)?)(" + "|".join(RATE_UNITS) + ")", re.IGNORECASE)
DELAY_UNITS = {"us": 1e-6, "ms": 1e-3, "s": 1.0}
DELAY_RE = re.compile(r"(\d+(?:\.\d+)?)(us|ms|s)")


def _short(name: str) -> str:
    return hashlib.sha1(name.encode()).hexdigest()[:6]


def bridge_name(name: str) -> str:
    return f"xt{_short(name)}br"


def veth_name(name: str, i: int) -> str:
    return f"xt{_short(name)}v{i}"


def netns_name(name: str, i: int) -> str:
    return f"xeontune-{name}-node{i}"


def _sh(argv: list[str], check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(argv, capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise RuntimeError(f"`{' '.join(argv)}` failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc


def sshd_path() -> str | None:
    for cand in (shutil.which("sshd"), "/usr/sbin/sshd"):
        if cand and os.access(cand, os.X_OK):
            return cand
    return None


def check_requirements() -> None:
    """One-line UserError naming what is missing for namespace hosts."""
    missing = []
    if os.geteuid() != 0:
        missing.append("root (network namespaces need it; without root use --provider localhost)")
    if not shutil.which("ip"):
        missing.append("the `ip` command (apt-get install iproute2)")
    if not sshd_path():
        missing.append("sshd (apt-get install openssh-server)")
    if not shutil.which("ssh"):
        missing.append("the ssh client (apt-get install openssh-client)")
    if missing:
        raise UserError("the local provider needs " + "; ".join(missing))


def _used_third_octets() -> set[int]:
    """Third octets of 10.231.X.0/24 already used by an address or route here, or another cluster."""
    used: set[int] = set()
    text = _sh(["ip", "-o", "addr"], check=False).stdout + _sh(["ip", "route"], check=False).stdout
    for token in text.split():
        if token.startswith(SUBNET_PREFIX + "."):
            parts = token.split("/")[0].split(".")
            if len(parts) == 4 and parts[2].isdigit():
                used.add(int(parts[2]))
    for other in state.list_names():
        try:
            subnet = state.load(other).extra.get("subnet", "")
        except Exception:  # an unreadable record must not block a new cluster
            continue
        if subnet.startswith(SUBNET_PREFIX + "."):
            used.add(int(subnet.split(".")[2]))
    return used


def _pick_subnet(name: str) -> str:
    used = _used_third_octets()
    start = int(_short(name), 16) % 200 + 20
    for k in range(250):
        x = (start + k) % 250 + 1
        if x not in used:
            return f"{SUBNET_PREFIX}.{x}"
    raise UserError(f"no free /24 left in {SUBNET_PREFIX}.0.0/16 for a local cluster")


def _sshd_config(record: ClusterRecord, node: Node, host_key: Path, pid_file: Path, authorized: Path) -> str:
    return "\n".join([
        f"# sshd for xeontune cluster {record.name!r}, {node.name}",
        f"ListenAddress {node.private_ip}",
        "Port 22",
        f"HostKey {config_value(str(host_key))}",
        f"PidFile {config_value(str(pid_file))}",
        f"AuthorizedKeysFile {config_value(str(authorized))}",
        f"AllowUsers {record.ssh_user}",
        "PermitRootLogin prohibit-password",
        "PubkeyAuthentication yes",
        "PasswordAuthentication no",
        "KbdInteractiveAuthentication no",
        "UsePAM no",
        # The key files live in the 0700 state dir, which may sit under a world-writable /tmp
        # (tests); sshd's StrictModes walks up to / and would refuse them there.
        "StrictModes no",
        "X11Forwarding no",
        "PrintMotd no",
        # Hydra opens one connection per host at once; the default throttles at 10.
        "MaxStartups 100",
        # A client that vanished (a half-open connection) is dropped after 2 min, not kept ~2 h
        # (autostop counts every open SSH connection as a session); as on cloud nodes.
        "ClientAliveInterval 30",
        "ClientAliveCountMax 4",
        "Subsystem sftp internal-sftp",
        "",
    ])


# Serialises, between concurrent `up`s on this machine (whatever their state dirs): the check
# that the name is free, and the subnet choice, until the bridge claims both.
LOCK_PATH = "/run/xeontune-local.lock"
_TRUST = "sshd would trust the keys in it (the cluster's sshds run as root with StrictModes off)"


def _check_state_dir(name: str, *files: Path) -> None:
    """The state dir chain (and ``files``) must be this user's and writable by nobody else: sshd
    runs as root and accepts whatever authorized_keys file and host key it finds there."""
    cdir = state.cluster_dir(name)
    state.check_private([state.home(), cdir.parent, cdir, *files], _TRUST)


def _leftovers(name: str) -> list[str]:
    short = _short(name)
    found = [ns for ns in _netns_list() if ns.startswith(f"xeontune-{name}-node")]
    found += [link for link in _links() if link.startswith(f"xt{short}")]
    return found


def _refuse_leftovers(name: str) -> None:
    left = _leftovers(name)
    if left:
        raise UserError(f"a cluster {name!r} (another state dir's, or a previous one) left {', '.join(left[:3])}"
                        f"{' ...' if len(left) > 3 else ''} on this machine; choose another --name, or remove it "
                        f"with `xeontune teardown --name {name}`")


def rate_bps(rate: str) -> float:
    """A tc rate (10gbit, 320mbit) in bits per second; a one-line error for anything else."""
    found = RATE_RE.fullmatch(rate.strip())
    if not found or float(found[1]) <= 0:
        raise UserError(f"{rate!r}: give a rate as tc writes it, e.g. 10gbit, 25gbit, 500mbit")
    return float(found[1]) * RATE_UNITS[found[2].lower()]


def link_shape(spec: ClusterSpec) -> tuple[float | None, float | None]:
    """(bits per second, one-way delay in seconds) of --link-rate and --link-delay; None where not given.
    A mistake in either is a one-line error before anything is created."""
    rate = delay = None
    if (given := spec.option("link_rate")) is not None:
        try:
            rate = rate_bps(given)
        except UserError as exc:
            raise UserError(f"--link-rate {exc}") from None
    if (given := spec.option("link_delay")) is not None:
        found = DELAY_RE.fullmatch(given.strip())
        if not found:
            raise UserError(f"--link-delay {given!r}: give a one-way delay as tc writes it, e.g. 100us, 1ms")
        delay = float(found[1]) * DELAY_UNITS[found[2]]
    return rate, delay


def _shape_link(ns: str, veth: str, rate: float | None, delay: float | None) -> None:
    """The node's link as ``link_shape`` says: its end in ``ns`` (what it sends), the bridge's (what it gets)."""
    if rate is None and delay is None:
        return
    # Token buckets hold a millisecond at the rate (at least one 64 KiB GSO segment) and queue 50 ms.
    burst = f"{max(int((rate or 0) / 8 / 1000), 65536)}b"
    if delay is None:
        _sh(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", IFACE, "root", "tbf", "rate", f"{rate:.0f}bit",
             "burst", burst, "latency", "50ms"])
    else:
        netem = ["delay", f"{delay * 1e6:.0f}us", *(["rate", f"{rate:.0f}bit"] if rate else [])]
        # the queue: what the link holds in flight at its delay, and 1000 packets beside
        limit = 1000 + int((rate or 10e9) * delay / 8 / 1500)
        done = _sh(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", IFACE, "root", "netem", *netem,
                    "limit", str(limit)], check=False)
        if done.returncode != 0:
            if "unknown" in done.stderr.lower():
                raise UserError("--link-delay needs the kernel's netem qdisc (sch_netem), which this kernel lacks: "
                                "`modprobe sch_netem`, or leave --link-delay out (--link-rate needs only tbf)")
            raise RuntimeError(f"`tc qdisc add ... netem` failed ({done.returncode}): {done.stderr.strip()}")
    if rate is not None:
        _sh(["tc", "qdisc", "add", "dev", veth, "root", "tbf", "rate", f"{rate:.0f}bit", "burst", burst,
             "latency", "50ms"])


def _create(spec: ClusterSpec) -> ClusterRecord:
    name = spec.name
    cdir = state.cluster_dir(name)
    cdir.mkdir(parents=True, exist_ok=True)
    os.chmod(cdir, 0o700)
    record = ClusterRecord(
        name=name,
        provider=Local.name,
        ssh_user="root",
        key_path=str(cdir / "id_ed25519"),
        known_hosts_path=str(cdir / "known_hosts"),
        work_dir=str(cdir / "work"),
        iface=IFACE,
        cluster_id=state.new_cluster_id(),
    )
    rate, delay = link_shape(spec)
    for key in ("link_rate", "link_delay"):
        if spec.option(key) is not None:
            record.extra[key] = spec.option(key)
    login = ssh.generate_keypair(record.key_path, comment=f"xeontune-{name}")
    authorized = cdir / "authorized_keys"
    atomic_write_text(authorized, login + "\n", mode=0o600)
    atomic_write_text(record.known_hosts_path, "", mode=0o644)

    br = bridge_name(name)
    with open(LOCK_PATH, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # until the bridge holds name and subnet, nobody else may pick them
        _refuse_leftovers(name)  # again, under the lock: another state dir's `up` of this name may have won
        subnet = _pick_subnet(name)
        record.extra.update({"subnet": subnet, "bridge_ip": f"{subnet}.1"})
        record.nodes = [
            Node(f"node{i}", "head" if i == 0 else "worker", f"{subnet}.{11 + i}", resource_id=netns_name(name, i))
            for i in range(spec.num_nodes)
        ]
        record.add_resource("bridge", br)
        state.save(record)
        _sh(["ip", "link", "add", br, "type", "bridge"])
        _sh(["ip", "link", "set", br, "alias", owner_tag(record.cluster_id)])
        _sh(["ip", "addr", "add", f"{subnet}.1/24", "dev", br])
    _sh(["ip", "link", "set", br, "up"])

    Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)  # sshd's privilege-separation dir
    run_dir = cdir / "sshd"
    run_dir.mkdir(mode=0o700, exist_ok=True)
    sshd = sshd_path()
    assert sshd is not None
    for i, node in enumerate(record.nodes):
        ns, veth, peer = netns_name(name, i), veth_name(name, i), f"xt{_short(name)}p{i}"
        record.add_resource("netns", ns)
        record.add_resource("veth", veth)
        state.save(record)
        _sh(["ip", "netns", "add", ns])
        _sh(["ip", "link", "add", veth, "type", "veth", "peer", "name", peer])
        _sh(["ip", "link", "set", peer, "netns", ns])
        _sh(["ip", "-n", ns, "link", "set", peer, "name", IFACE])
        _sh(["ip", "-n", ns, "addr", "add", f"{node.private_ip}/24", "dev", IFACE])
        _sh(["ip", "-n", ns, "link", "set", IFACE, "up"])
        _sh(["ip", "-n", ns, "link", "set", "lo", "up"])
        _sh(["ip", "-n", ns, "link", "set", "lo", "alias", owner_tag(record.cluster_id)])
        _sh(["ip", "link", "set", veth, "master", br])
        _sh(["ip", "link", "set", veth, "up"])
        _shape_link(ns, veth, rate, delay)

        host_key = run_dir / f"{node.name}_host_ed25519"
        host_line = ssh.generate_keypair(host_key, comment=node.name)
        ssh.pin_host_key(record, node, host_line)
        config = run_dir / f"{node.name}.conf"
        pid_file = run_dir / f"{node.name}.pid"
        atomic_write_text(config, _sshd_config(record, node, host_key, pid_file, authorized), mode=0o600)
        _check_state_dir(name, run_dir, authorized, host_key, config, Path(record.key_path))
        record.add_resource("sshd", str(pid_file))
        state.save(record)
        _sh(["ip", "netns", "exec", ns, sshd, "-f", str(config), "-E", str(run_dir / f"{node.name}.log")])
    state.save(record)
    return record


def owner_tag(cluster_id: str) -> str:
    """The alias of the bridge and of each namespace's lo: which cluster (id, not name) made them."""
    return f"xeontune:{cluster_id}"


def link_alias(link: str, netns: str | None = None) -> str:
    """A link's alias ("" when none), in ``netns`` or this namespace."""
    argv = ["ip", *(["-n", netns] if netns else []), "-o", "link", "show", link]
    words = _sh(argv, check=False).stdout.split()
    return words[words.index("alias") + 1] if "alias" in words[:-1] else ""


def _pid_alive(pid_file: Path) -> bool:
    try:
        pid = int(pid_file.read_text().split()[0])
        os.kill(pid, 0)
    except (OSError, ValueError, IndexError):
        return False
    return True


def _netns_list() -> list[str]:
    if not shutil.which("ip"):
        return []
    out = _sh(["ip", "netns", "list"], check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _kill_netns_processes(ns: str, grace_s: float = 3.0) -> int:
    """SIGTERM, then SIGKILL, every process whose network namespace is ``ns``; return how many."""
    def pids() -> list[int]:
        out = _sh(["ip", "netns", "pids", ns], check=False).stdout
        return [int(p) for p in out.split() if p.isdigit() and int(p) != os.getpid()]

    found = pids()
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + grace_s
        while pids() and time.monotonic() < deadline:
            time.sleep(0.1)
        if not pids():
            break
    return len(found)


def _links() -> set[str]:
    out = _sh(["ip", "-o", "link", "show"], check=False).stdout
    names = set()
    for line in out.splitlines():
        parts = line.split(":")
        if len(parts) > 1:
            names.add(parts[1].strip().split("@")[0])
    return names


class Local(Provider):
    name = "local"
    remote = False
    hosts_share_cores = True
    reads_data_first = False  # the cluster is this machine: the ranks read the folder at once
    needs_bootstrap = False
    wait_timeout_s = 60.0
    default_iface = IFACE
    autostop_action = "teardown"  # the watcher in the head's namespace removes the whole cluster
    options = (ProviderOption("--link-rate", "shape each node's link to RATE each way with tc (10gbit, 25gbit, "
                              "500mbit): a real cluster's bandwidth on one machine"),
               ProviderOption("--link-delay", "each node's one-way link delay (100us, 1ms; needs the kernel's netem)"))

    def up(self, spec: ClusterSpec) -> ClusterRecord:
        shaped = link_shape(spec) != (None, None)
        check_requirements()
        if shaped and not shutil.which("tc"):
            raise UserError("--link-rate and --link-delay need the `tc` command (apt-get install iproute2)")
        if not 1 <= spec.num_nodes <= MAX_NODES:
            raise UserError(f"-n must be between 1 and {MAX_NODES} for the local provider")
        _refuse_leftovers(spec.name)
        state.cluster_dir(spec.name).mkdir(parents=True, exist_ok=True)
        _check_state_dir(spec.name)  # before anything exists
        try:
            return _create(spec)
        except RuntimeError as exc:  # a failed `ip`/`sshd` call: say which, in one line
            raise UserError(f"creating local cluster {spec.name!r} failed: {exc}") from exc

    def wait(self, record: ClusterRecord, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        for node in record.nodes:
            ssh.wait_for_ssh(record, node, timeout_s=max(1.0, deadline - time.monotonic()))

    def query(self, record: ClusterRecord) -> list[NodeStatus]:
        present = set(_netns_list())
        run_dir = state.cluster_dir(record.name) / "sshd"
        out = []
        for node in record.nodes:
            if node.resource_id not in present:
                st = "missing"
            elif _pid_alive(run_dir / f"{node.name}.pid"):
                st = "running"
            else:
                st = "sshd stopped"
            out.append(NodeStatus(node.name, st, node.private_ip, node.public_ip))
        return out

    def terminate(self, name: str, record: ClusterRecord | None, region: str | None = None) -> TeardownReport:
        report = TeardownReport()
        if not shutil.which("ip"):
            return report  # no iproute2: nothing of ours can exist
        if os.geteuid() != 0:
            raise UserError("tearing down a local cluster needs root")
        short = _short(name)
        prefix = f"xeontune-{name}-node"
        namespaces = [ns for ns in _netns_list() if ns.startswith(prefix) and ns[len(prefix):].isdigit()]
        # With a record that has an id, only what carries it is deleted: a stale record (an older
        # cluster of this name, another state dir's) never takes down the cluster that holds the name
        # now. Without one (lost, or from before ids), by name.
        owner = owner_tag(record.cluster_id) if record is not None and record.cluster_id else None
        foreign = [ns for ns in namespaces if owner and link_alias("lo", ns) != owner]
        for ns in foreign:
            report.searched.append(f"netns {ns}: another cluster named {name!r} (not id {record.cluster_id}), left alone")
        foreign_nodes = {ns[len(prefix):] for ns in foreign}
        namespaces = [ns for ns in namespaces if ns not in foreign]
        for ns in namespaces:
            killed = _kill_netns_processes(ns)
            proc = _sh(["ip", "netns", "del", ns], check=False)
            if proc.returncode == 0:
                report.deleted.append(f"netns {ns}" + (f" ({killed} processes stopped)" if killed else ""))
            else:
                report.failed.append(f"netns {ns}: {proc.stderr.strip()}")
        # Deleting a namespace destroys its veth pair; these catch what a crashed `up` left behind.
        for link in sorted(_links()):
            if link.startswith(f"xt{short}v") or link.startswith(f"xt{short}p") or link == bridge_name(name):
                if owner and (link[len(f"xt{short}v"):] in foreign_nodes
                              or (link == bridge_name(name) and link_alias(link) != owner)):
                    continue  # the other cluster's
                proc = _sh(["ip", "link", "del", link], check=False)
                kind = "bridge" if link == bridge_name(name) else "veth"
                if proc.returncode == 0:
                    report.deleted.append(f"{kind} {link}")
                elif link in _links():
                    report.failed.append(f"{kind} {link}: {proc.stderr.strip()}")
        # An sshd whose namespace is gone already (should not happen, but a pid file says so).
        run_dir = state.cluster_dir(name) / "sshd"
        for pid_file in sorted(run_dir.glob("*.pid")) if run_dir.is_dir() and not foreign else []:
            if _pid_alive(pid_file):
                pid = int(pid_file.read_text().split()[0])
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
                if "sshd" in cmdline and str(run_dir) in cmdline:
                    os.kill(pid, signal.SIGKILL)
                    report.deleted.append(f"sshd pid {pid}")
        return report

    def sweep(self, name: str) -> TeardownReport:
        """Namespaces, links and sshds are named after the cluster: found without a record (as root)."""
        return self.terminate(name, None) if os.geteuid() == 0 else TeardownReport()

    def wrap_launch(self, record: ClusterRecord, argv: list[str]) -> list[str]:
        return ["ip", "netns", "exec", record.head.resource_id or "", *argv]  # mpirun inside the head

    def check_launch(self, record: ClusterRecord) -> None:
        if os.geteuid() != 0:
            raise UserError(f"launching on local cluster {record.name!r} needs root (mpirun runs in the head's namespace)")


PROVIDER = Local()
