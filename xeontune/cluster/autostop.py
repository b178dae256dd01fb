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

``install`` (here) starts the watcher, ``python -m xeontune.cluster.autostop_watch``, which imports
nothing of this module: the installer and the watcher are two modules, not a circle.
"""

from __future__ import annotations

import contextlib
import os
import posixpath
import subprocess
import sys
import time
from pathlib import Path

from xeontune.cluster import files, providers, ssh, state
from xeontune.cluster.state import ClusterRecord
from xeontune.errors import UserError

# Test-only: the idle time in seconds instead of `--autostop` minutes.
IDLE_S_ENV = "XEONTUNE_AUTOSTOP_IDLE_S"
WATCHER_MODULE = "xeontune.cluster.autostop_watch"


def idle_seconds(minutes: int) -> float:
    override = os.environ.get(IDLE_S_ENV)
    return float(override) if override else minutes * 60.0


def log_path(record: ClusterRecord) -> str:
    """Beside the work dir: the cluster dir on this machine (local), /opt/xeontune on a cloud head."""
    return posixpath.join(posixpath.dirname(record.work_dir.rstrip("/")), "autostop.log")


# --- starting it ------------------------------------------------------------------------------


def watcher_argv(record: ClusterRecord, python: str, action: str, idle_s: float) -> list[str]:
    argv = [python, "-m", WATCHER_MODULE, "--name", record.name, "--action", action,
            "--idle-s", f"{idle_s:g}", "--log", log_path(record), "--work-dir", record.work_dir]
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
        check_poweroff_allowed(record)
        argv = [*watcher_argv(record, posixpath.join(record.venv, "bin", "python"), action, idle_s), "--detach"]
        rc, out, err = ssh.run(record, record.head, argv, timeout_s=60)
        if rc != 0:
            raise UserError(f"could not start the autostop watcher on {record.head.name}: {(err or out).strip()[:300]}")
    record.autostop_minutes = minutes
    state.save(record)
    return True


def watcher_state(record: ClusterRecord) -> str:
    """What `cluster status` says of the head's watcher: running, or not (with its log's last line,
    which says why: a failed power-off, a failed shutdown of the head, a crash)."""
    # [x]: the pattern must not match the shell that carries it
    pattern = f"[{WATCHER_MODULE[0]}]{WATCHER_MODULE[1:]} --name {record.name} "
    script = 'pgrep -f -- "$0" >/dev/null && echo running || echo stopped; tail -n 1 "$1" 2>/dev/null || true'
    try:
        rc, out, err = ssh.run(record, record.head, ["sh", "-c", script, pattern, log_path(record)], timeout_s=30)
    except Exception as exc:  # a stopped head, a dropped network: say so, status goes on
        return f"unknown ({record.head.name} did not answer: {type(exc).__name__})"
    lines = out.strip().splitlines()
    if rc != 0 or not lines:
        return f"unknown ({(err.strip() or f'exit {rc}')[:120]})"
    if lines[0] == "running":
        return "watcher running"
    return "its watcher is NOT running" + (f"; its log ends: {lines[-1].strip()[:200]}" if len(lines) > 1 else "")


# What the watcher runs as on every node: root, or a user with passwordless sudo (`sudo -n`).
CAN_SHUT_DOWN = 'test "$(id -u)" -eq 0 || sudo -n true'


def check_poweroff_allowed(record: ClusterRecord) -> None:
    """UserError naming a node where the login user could not power the node off (no passwordless
    sudo): the watcher would fail there, silently, with the cluster billing on."""
    for node in record.nodes:
        rc, out, err = ssh.run(record, node, ["sh", "-c", CAN_SHUT_DOWN], timeout_s=60)
        if rc != 0:
            raise UserError(f"--autostop needs passwordless sudo for {record.ssh_user} on {node.name} (to power it "
                            f"off), and `sudo -n true` failed there: {(err or out).strip()[:200] or f'exit {rc}'}")


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
