"""Autostop: the head removes or powers off an idle cluster by itself (`cluster up --autostop MINUTES`).

A safety net for a forgotten cluster that must not depend on the caller's laptop staying online,
so the watcher runs on the head, as a detached process (its own session, stdio to a log file)
started once the nodes are ready. A detached process rather than a systemd timer: it is the same
on every provider, the local namespaces included (no systemd there), and it needs no unit files
on the image. A reboot of the head ends it (docs/cluster.md says so).

Idle means nothing on the head runs training (``xeontune.train``, ``xeontune train``, mpirun,
mpiexec, hydra_pmi_proxy) and no SSH connection to the head is open (an ESTABLISHED inbound TCP
connection on port 22 in the head's network namespace). When that has lasted the idle time:

- ``teardown`` (local provider): the watcher returns to the namespace it was started from and
  removes the whole cluster as `xeontune teardown` does (namespaces, veths, bridge, sshds, record).
- ``poweroff`` (aws): the head logs into every worker through ``ssh_config.internal`` and runs
  ``shutdown -h now`` there, then on itself. Instances are launched with instance-initiated
  shutdown behaviour ``terminate``, so they are deleted; the security group and key pair remain
  (free) until the next `xeontune teardown` or `xeontune cluster status` deletes them.

Providers without an action (Azure: an OS shutdown leaves a VM stopped but allocated, still
billed) get no watcher; `cluster up` says so (``Provider.autostop_note``).

``python -m xeontune.cluster.autostop`` is the watcher; ``install`` starts it.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import os
import posixpath
import shlex
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from xeontune.cluster import files, providers, ssh, state
from xeontune.cluster.state import ClusterRecord
from xeontune.errors import UserError

# Test-only: the idle time in seconds instead of `--autostop` minutes.
IDLE_S_ENV = "XEONTUNE_AUTOSTOP_IDLE_S"
MAX_POLL_S = 30.0
SSH_PORT = 22
TRAINING_PROGRAMS = frozenset({"mpirun", "mpiexec", "mpiexec.hydra", "hydra_pmi_proxy"})
CLONE_NEWNET = 0x40000000


def idle_seconds(minutes: int) -> float:
    override = os.environ.get(IDLE_S_ENV)
    return float(override) if override else minutes * 60.0


def poll_seconds(idle_s: float) -> float:
    return max(0.5, min(MAX_POLL_S, idle_s / 10))


def log_path(record: ClusterRecord) -> str:
    """Beside the work dir: the cluster dir on this machine (local), /opt/xeontune on a cloud head."""
    return posixpath.join(posixpath.dirname(record.work_dir.rstrip("/")), "autostop.log")


# --- what keeps the head busy -----------------------------------------------------------------


def is_training(argv: list[str]) -> bool:
    if not argv:
        return False
    if os.path.basename(argv[0]) in TRAINING_PROGRAMS or "xeontune.train" in argv:
        return True
    # `xeontune train ...` (console script) or `python -m xeontune.cli train ...`
    return any((os.path.basename(a) == "xeontune" or a == "xeontune.cli") and b == "train"
               for a, b in zip(argv, argv[1:], strict=False))


def training_processes() -> list[str]:
    """Training processes in this process's network namespace (on a namespace host, the head's)."""
    own_net = os.readlink("/proc/self/ns/net")
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            raw = Path(f"/proc/{entry.name}/cmdline").read_bytes()
            with contextlib.suppress(PermissionError):  # another user's process on a cloud head: same netns
                if os.readlink(f"/proc/{entry.name}/ns/net") != own_net:
                    continue
        except OSError:  # exited meanwhile, or a kernel thread
            continue
        argv = [a.decode(errors="replace") for a in raw.split(b"\0") if a]
        if is_training(argv):
            found.append(f"pid {entry.name} {os.path.basename(argv[0])}")
    return found


def ssh_connections(port: int = SSH_PORT) -> int:
    """Inbound SSH connections open in this network namespace (/proc/net/tcp shows the caller's)."""
    count = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            # local address "ADDR:PORT" in hex, state 01 = ESTABLISHED
            if len(fields) > 3 and int(fields[1].rsplit(":", 1)[1], 16) == port and fields[3] == "01":
                count += 1
    return count


def busy_reasons() -> list[str]:
    reasons = training_processes()
    sessions = ssh_connections()
    if sessions:
        reasons.append(f"{sessions} ssh connection(s)")
    return reasons


def watch(idle_s: float, poll_s: float, busy: Callable[[], list[str]] = busy_reasons,
          clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep) -> None:
    """Return once ``busy()`` has found nothing for ``idle_s`` seconds in a row."""
    last_busy = clock()
    was: list[str] | None = None
    while True:
        reasons = busy()
        now = clock()
        if reasons:
            last_busy = now
        if reasons != was:  # what keeps it busy, each time that changes (a job's processes are stable)
            _log("busy: " + ", ".join(reasons) if reasons else f"idle; stopping after {idle_s:.0f}s of this")
        was = reasons
        if not reasons and now - last_busy >= idle_s:
            _log(f"idle for {now - last_busy:.0f}s")
            return
        sleep(poll_s)


def _log(message: str) -> None:
    print(f"{time.strftime('%Y-%m-%d %H:%M:%S')} autostop: {message}", flush=True)


# --- what it does then ------------------------------------------------------------------------


def _setns(fd: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.setns(fd, CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def teardown_here(name: str, home_netns: int | None) -> int:
    """The local provider's stop: back in the caller's namespace, remove the cluster as teardown does."""
    if home_netns is not None:
        _setns(home_netns)  # the bridge and veths are seen from there, not from the head's namespace
    from xeontune.cluster import manage

    report = manage.teardown(name)
    for item in report.deleted:
        _log(f"deleted {item}")
    for item in report.failed:
        _log(f"could not delete {item}")
    # The cluster's own log went with its state dir: one line stays where users look for clusters.
    summary = (f"removed idle cluster {name!r} ({len(report.deleted)} items)" if report.ok
               else f"could not fully remove idle cluster {name!r}: {'; '.join(report.failed)}")
    with open(state.home() / "autostop.log", "a") as log:
        log.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {summary}\n")
    return 0 if report.ok else 1


SHUTDOWN = ("shutdown", "-h", "now")


def poweroff(ssh_config: str, workers: list[str], shutdown: tuple[str, ...] = SHUTDOWN) -> int:
    """The cloud stop: every worker first (the head holds their key), then the head itself.
    (Tests pass a harmless ``shutdown``: their "nodes" are namespaces of the test machine.)"""
    command = shlex.join(shutdown)
    failed = 0
    for worker in workers:
        # root runs it as is; the cloud image's login user through passwordless sudo (-n: never prompt)
        script = f'if [ "$(id -u)" -eq 0 ]; then {command}; else sudo -n {command}; fi'
        proc = subprocess.run(["ssh", "-F", ssh_config, worker, "--", script],
                              capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
        ok = proc.returncode == 0  # shutdown only schedules the power-off: ssh returns before it
        _log(f"{'powering off' if ok else 'could not power off'} {worker} (exit {proc.returncode}) "
             f"{proc.stderr.strip()[:200]}".rstrip())
        failed += not ok
    _log("powering off the head")
    sudo = [] if os.geteuid() == 0 else ["sudo", "-n"]
    return subprocess.call([*sudo, *shutdown]) or (1 if failed else 0)


# --- starting it ------------------------------------------------------------------------------


def watcher_argv(record: ClusterRecord, python: str, action: str, idle_s: float) -> list[str]:
    argv = [python, "-m", "xeontune.cluster.autostop", "--name", record.name, "--action", action,
            "--idle-s", f"{idle_s:g}", "--log", log_path(record)]
    if action == "poweroff":
        argv += ["--ssh-config", files.remote_path(record, "ssh_config.internal"),
                 "--workers", ",".join(n.name for n in record.nodes if n.role != "head")]
    return argv


def install(record: ClusterRecord, minutes: int) -> bool:
    """Start the watcher on the head; False (with a warning) where the provider has no autostop."""
    provider = providers.get(record.provider)
    action = provider.autostop_action
    if not action:
        print(f"warning: --autostop is not available on {record.provider}: {provider.autostop_note}", file=sys.stderr)
        return False
    idle_s = idle_seconds(minutes)
    if action == "teardown":
        # Spawned from here, holding this namespace to return to; it then enters the head's.
        argv = [*watcher_argv(record, sys.executable, action, idle_s), "--netns", f"/run/netns/{record.head.resource_id}",
                "--home", str(state.home())]
        env = {**os.environ}
        pythonpath = str(Path(__file__).resolve().parents[2])
        env["PYTHONPATH"] = os.pathsep.join(p for p in (pythonpath, env.get("PYTHONPATH")) if p)
        with open(log_path(record), "a") as log:
            watcher = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True,
                                       env=env, close_fds=True)
        _wait_until_in_netns(watcher, f"/run/netns/{record.head.resource_id}", log_path(record))
    else:
        if record.skip_bootstrap:
            print("warning: --autostop needs the bootstrap (the watcher runs from the nodes' venv); "
                  "not installed with --skip-bootstrap", file=sys.stderr)
            return False
        argv = [*watcher_argv(record, posixpath.join(record.venv, "bin", "python"), action, idle_s), "--detach"]
        rc, out, err = ssh.run(record, record.head, argv, timeout_s=60)
        if rc != 0:
            raise UserError(f"could not start the autostop watcher on {record.head.name}: {(err or out).strip()[:300]}")
    record.autostop_minutes = minutes
    state.save(record)
    return True


def _wait_until_in_netns(watcher: subprocess.Popen, netns: str, log: str, timeout_s: float = 60) -> None:
    """Return once the watcher has entered the head's namespace, so `up` never reports a watcher
    that is still starting (Python and its imports take seconds on a loaded host) or already dead."""
    target = os.stat(netns).st_ino
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if watcher.poll() is not None:
            raise UserError(f"the autostop watcher exited at start (code {watcher.returncode}); see {log}")
        with contextlib.suppress(FileNotFoundError, ProcessLookupError):
            if os.stat(f"/proc/{watcher.pid}/ns/net").st_ino == target:
                return
        time.sleep(0.1)
    raise UserError(f"the autostop watcher did not reach the head's namespace in {timeout_s:g} s; see {log}")


def _detach(log: str) -> None:
    """Double fork into a new session, stdio to ``log``: the SSH session that started us may end."""
    if os.fork():
        os._exit(0)
    os.setsid()
    if os.fork():
        os._exit(0)
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115 (the process's own stdout)
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m xeontune.cluster.autostop",
                                     description="stop this cluster once its head has been idle for a while")
    parser.add_argument("--name", required=True)
    parser.add_argument("--action", choices=["teardown", "poweroff"], required=True)
    parser.add_argument("--idle-s", type=float, required=True)
    parser.add_argument("--log", required=True)
    parser.add_argument("--netns", help="teardown: the head's namespace to watch from")
    parser.add_argument("--home", help="teardown: the state dir ($XEONTUNE_HOME) that holds the record")
    parser.add_argument("--ssh-config", help="poweroff: the head's ssh config for the workers")
    parser.add_argument("--workers", default="", help="poweroff: comma-separated worker names")
    parser.add_argument("--detach", action="store_true", help="return at once; the watcher runs on in the background")
    args = parser.parse_args(argv)
    if args.detach:
        _detach(args.log)
    if args.home:
        os.environ["XEONTUNE_HOME"] = args.home
    home_netns = None
    if args.netns:
        home_netns = os.open("/proc/self/ns/net", os.O_RDONLY)
        with open(args.netns) as target:
            _setns(target.fileno())
    _log(f"watching cluster {args.name!r} (pid {os.getpid()}): {args.action} after {args.idle_s:g}s idle; "
         f"argv {shlex.join(sys.argv[1:])}")
    watch(args.idle_s, poll_seconds(args.idle_s))
    if args.action == "teardown":
        return teardown_here(args.name, home_netns)
    return poweroff(args.ssh_config, [w for w in args.workers.split(",") if w])


if __name__ == "__main__":
    sys.exit(main())
