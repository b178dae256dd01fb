"""The autostop watcher, run on the head: ``python -m xeontune.cluster.autostop_watch``.

What idle means and what it does then is described in cluster/autostop.py, whose ``install``
starts this module. This module never imports the installer.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import os
import shlex
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from xeontune.cluster import state

MAX_POLL_S = 30.0
SSH_PORT = 22
TRAINING_PROGRAMS = frozenset({"mpirun", "mpiexec", "mpiexec.hydra", "hydra_pmi_proxy"})
CLONE_NEWNET = 0x40000000


def poll_seconds(idle_s: float) -> float:
    return max(0.5, min(MAX_POLL_S, idle_s / 10))


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


def busy_reasons(work_dir: str | None = None) -> list[str]:
    reasons = training_processes()
    sessions = ssh_connections()
    if sessions:
        reasons.append(f"{sessions} ssh connection(s)")
    return reasons + (unfetched_jobs(work_dir) if work_dir else [])


FETCH_WAIT_S = 24 * 3600.0  # at most this long after its end does a job whose outputs nobody fetched keep the cluster up


def job_end(job_dir: Path) -> float | None:
    """When the job in ``job_dir`` ended: its ``rc`` file's time; None while its runner (``pid``)
    lives. A job with neither (its start failed, or its runner was killed) ended at its last sign
    of life: the newest of its log, pid and unfetched mark."""
    from xeontune.job.record import UNFETCHED

    with contextlib.suppress(OSError):
        return (job_dir / "rc").stat().st_mtime
    with contextlib.suppress(OSError, ValueError):
        pid = int((job_dir / "pid").read_text().strip())
        if pid > 0 and b"xeontune.job.process" in Path(f"/proc/{pid}/cmdline").read_bytes():  # not a reused pid
            return None
    times = []
    for name in ("log", "pid", UNFETCHED):
        with contextlib.suppress(OSError):
            times.append((job_dir / name).stat().st_mtime)
    return max(times, default=0.0)


def unfetched_jobs(work_dir: str, now: float | None = None, wait_s: float = FETCH_WAIT_S) -> list[str]:
    """Jobs that `run` started and whose outputs were not fetched yet (``record.UNFETCHED`` in the
    job's dir, written at start, removed by the fetch once the job ended): a lost laptop's run keeps
    its results on the head until someone fetches them, for at most ``wait_s`` after the job's end
    (``job_end``), however long it trained."""
    from xeontune.job.record import UNFETCHED

    now = time.time() if now is None else now
    found = []
    for marker in sorted(Path(work_dir, "jobs").glob(f"*/{UNFETCHED}")):
        ended = job_end(marker.parent)
        if ended is None or now - ended < wait_s:
            found.append(f"job {marker.parent.name}'s outputs not fetched yet")
    return found


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


def poweroff(ssh_config: str, workers: list[str], shutdown: tuple[str, ...] = SHUTDOWN, attempts: int = 3,
             retry_s: float = 30.0, sleep: Callable[[float], None] = time.sleep) -> int:
    """The cloud stop: every worker first (the head holds their key), then the head itself.
    A worker that does not power off is tried again; if it still does not, the head stays up and
    says so in its log (powering off would leave that worker billing with nobody to notice), and
    a failed shutdown of the head itself is logged too. (Tests pass a harmless ``shutdown``: their
    "nodes" are namespaces of the test machine.)"""
    command = shlex.join(shutdown)
    pending = list(workers)
    for attempt in range(attempts):
        pending = [worker for worker in pending if not _poweroff_worker(ssh_config, worker, command)]
        if not pending:
            break
        if attempt + 1 < attempts:
            sleep(retry_s)
    if pending:
        _log(f"FAILED: could not power off {', '.join(pending)} after {attempts} attempt(s); the head stays up "
             "so that this shows: run `xeontune teardown`")
        return 1
    _log("powering off the head")
    sudo = [] if os.geteuid() == 0 else ["sudo", "-n"]
    rc = subprocess.call([*sudo, *shutdown])
    if rc != 0:
        _log(f"FAILED: the head's own shutdown exited {rc}; it is still running: run `xeontune teardown`")
    return rc


def _poweroff_worker(ssh_config: str, worker: str, command: str) -> bool:
    # root runs it as is; the cloud image's login user through passwordless sudo (-n: never prompt)
    script = f'if [ "$(id -u)" -eq 0 ]; then {command}; else sudo -n {command}; fi'
    try:
        proc = subprocess.run(["ssh", "-F", ssh_config, worker, "--", script],
                              capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        _log(f"could not power off {worker} (no answer in 120 s)")
        return False
    ok = proc.returncode == 0  # shutdown only schedules the power-off: ssh returns before it
    _log(f"{'powering off' if ok else 'could not power off'} {worker} (exit {proc.returncode}) "
         f"{proc.stderr.strip()[:200]}".rstrip())
    return ok


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
    parser = argparse.ArgumentParser(prog="python -m xeontune.cluster.autostop_watch",
                                     description="stop this cluster once its head has been idle for a while")
    parser.add_argument("--name", required=True)
    parser.add_argument("--action", choices=["teardown", "poweroff"], required=True)
    parser.add_argument("--idle-s", type=float, required=True)
    parser.add_argument("--log", required=True)
    parser.add_argument("--netns", help="teardown: the head's namespace to watch from")
    parser.add_argument("--home", help="teardown: the state dir ($XEONTUNE_HOME) that holds the record")
    parser.add_argument("--ssh-config", help="poweroff: the head's ssh config for the workers")
    parser.add_argument("--workers", default="", help="poweroff: comma-separated worker names")
    parser.add_argument("--work-dir", help="the cluster's work dir on the head: its jobs' unfetched outputs keep it busy")
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
    watch(args.idle_s, poll_seconds(args.idle_s), busy=lambda: busy_reasons(args.work_dir))
    if args.action == "teardown":
        return teardown_here(args.name, home_netns)
    return poweroff(args.ssh_config, [w for w in args.workers.split(",") if w])


if __name__ == "__main__":
    sys.exit(main())
