"""A launched job's process handling: attached (tied to this process), detached (on the head), its record.

Attached (`xeontune launch`, `xeontune run`): mpirun (or the ``ssh -tt`` that runs it on the head)
starts in a session of its own, so the terminal's Ctrl-C reaches only this process, which
forwards it. SIGINT, SIGTERM and SIGHUP are forwarded the way that reaches the ranks' own
KeyboardInterrupt path (measured with MPICH Hydra 5.0):

- mpirun here (local, localhost): SIGINT and SIGTERM to mpirun, which passes them to every rank;
  SIGHUP becomes SIGTERM, because Hydra dies on SIGHUP without passing it on.
- mpirun on the head through ``ssh -tt``: a signal to the local ssh only makes it exit, the head's
  pty hangs up and Hydra and the ranks are killed without their grace. Instead a Ctrl-C byte
  (0x03) goes down ssh's stdin to the head's pty, whose line discipline turns it into SIGINT for
  mpirun, which passes it to every rank.

If the job has not ended ``grace_s`` after the first signal (or at a second one), it is stopped
hard: ssh is terminated (the head's pty hangs up and everything there dies), a local mpirun is
killed with its process group. A lost SSH connection ends the job the same way on the head.

Detached (`launch --detach`): ``python -m xeontune.jobs --job-dir D -- ARGV`` on the head forks
twice (its own session, immune to the login's hang-up, like ``setsid nohup``), writes ``D/pid``,
runs ARGV attached as above with its output in ``D/log``, then writes its exit status in ``D/rc``.
`xeontune logs` reads those files.

The record of the last job of a cluster (``job.json`` in its state dir) says where the job's
files and outputs are on the head, for `xeontune logs` and `xeontune fetch`.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import posixpath
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from xeontune.errors import UserError
from xeontune.io import atomic_write_json, atomic_write_text

FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
GRACE_S = 20.0  # for the ranks to leave their step after the first signal
CTRL_C = b"\x03"

if TYPE_CHECKING:
    from xeontune.cluster.state import ClusterRecord
    from xeontune.launch import LaunchPlan


# --- attached: this process's signals reach the ranks ------------------------------------------


def via_pty(argv: Sequence[str]) -> bool:
    """Whether ``argv`` runs mpirun on another machine through ``ssh -tt`` (a pty there)."""
    return bool(argv) and Path(argv[0]).name == "ssh" and "-tt" in argv


def exit_code(rc: int) -> int:
    return 128 - rc if rc < 0 else rc  # a signal death becomes 128+signal, like a shell's


def run_attached(argv: Sequence[str], grace_s: float = GRACE_S, stdout: int | None = None,
                 stderr: int | None = None) -> tuple[int, int | None]:
    """Run ``argv`` with this process's SIGINT/SIGTERM/SIGHUP forwarded (module docstring).

    Returns (the job's exit code, the first signal that arrived or None). Signal handlers can only
    be set in the main thread; elsewhere the job simply runs."""
    pty = via_pty(argv)
    proc = subprocess.Popen(list(argv), start_new_session=True, stdout=stdout, stderr=stderr,
                            stdin=subprocess.PIPE if pty else subprocess.DEVNULL)
    received: list[int] = []
    first_at: list[float] = []

    def graceful(sig: int) -> None:
        if pty:
            with contextlib.suppress(OSError, ValueError):
                assert proc.stdin is not None
                proc.stdin.write(CTRL_C)
                proc.stdin.flush()
        else:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGTERM if sig == signal.SIGHUP else sig)

    def hard() -> None:
        with contextlib.suppress(ProcessLookupError):
            if pty:
                proc.terminate()  # ssh exits; the head's pty hangs up and takes the job with it
            else:
                os.killpg(proc.pid, signal.SIGKILL)

    def on_signal(sig: int, _frame: object) -> None:
        received.append(sig)
        if len(received) == 1:
            first_at.append(time.monotonic())
            graceful(sig)
        else:
            hard()

    main_thread = _in_main_thread()
    previous = {sig: signal.signal(sig, on_signal) for sig in FORWARDED} if main_thread else {}
    try:
        while True:
            try:
                rc = proc.wait(timeout=0.5)
                break
            except subprocess.TimeoutExpired:
                pass
            if first_at and time.monotonic() - first_at[0] > grace_s:
                hard()
                try:
                    rc = proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    rc = proc.wait()
                break
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if proc.stdin:
            with contextlib.suppress(OSError):
                proc.stdin.close()
    return exit_code(rc), (received[0] if received else None)


def _in_main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


# --- the job record ----------------------------------------------------------------------------


@dataclass
class JobInfo:
    """The last job launched on a cluster, as this machine knows it."""

    id: str  # also the name of its files' dir on the head: <work_dir>/jobs/<id>
    cluster: str
    output_dir: str  # the job's --output-dir as the head sees it (absolute)
    local_output_dir: str  # where `fetch` puts the outputs by default (absolute, on this machine)
    job_dir: str  # <work_dir>/jobs/<id> on the head: log, pid, rc
    detached: bool = False
    started: float = 0.0
    world_size: int = 0

    @property
    def log_path(self) -> str:
        return posixpath.join(self.job_dir, "log")

    @property
    def rc_path(self) -> str:
        return posixpath.join(self.job_dir, "rc")

    @property
    def pid_path(self) -> str:
        return posixpath.join(self.job_dir, "pid")


def new_job_id() -> str:
    return time.strftime("%Y%m%d-%H%M%S") + f"-{os.getpid() % 100000:05d}"


def record_path(cluster: str) -> Path:
    from xeontune.cluster import state

    return state.cluster_dir(cluster) / "job.json"


def save_job(job: JobInfo) -> None:
    atomic_write_json(record_path(job.cluster), dataclasses.asdict(job), mode=0o600)


def load_job(cluster: str) -> JobInfo:
    path = record_path(cluster)
    if not path.is_file():
        raise UserError(f"no job was launched on cluster {cluster!r} from this machine; "
                        f"start one with `xeontune launch --name {cluster} -- <train options>`")
    data = json.loads(path.read_text())
    known = {f.name for f in dataclasses.fields(JobInfo)}
    return JobInfo(**{k: v for k, v in data.items() if k in known})


# --- detached: the runner on the head ----------------------------------------------------------


def detach_argv(python: str, job_dir: str, argv: Sequence[str]) -> list[str]:
    """The command that starts ``argv`` detached on the head (run there over SSH, or here)."""
    return [python, "-m", "xeontune.jobs", "--job-dir", job_dir, "--", *argv]


def _daemon(job_dir: Path, argv: list[str]) -> None:
    """The detached job's own process: its session, its log, forwarding, then its exit status."""
    fd = os.open(job_dir / "log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    os.close(null)
    rc = 1
    try:
        rc, sig = run_attached(argv)
        if sig is not None:
            print(f"xeontune: the job got {signal.Signals(sig).name} and stopped (exit {rc})", flush=True)
    finally:
        atomic_write_text(job_dir / "rc", f"{rc}\n")


def start_detached(job_dir: str, argv: list[str]) -> int:
    """Fork the job off (double fork, new session: it survives the SSH login that started it);
    return its pid once it is written."""
    path = Path(job_dir)
    path.mkdir(parents=True, exist_ok=True)
    for name in ("rc", "pid"):
        with contextlib.suppress(FileNotFoundError):
            (path / name).unlink()
    sys.stdout.flush()
    sys.stderr.flush()
    first = os.fork()
    if first == 0:
        os.setsid()
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
        if os.fork() != 0:
            os._exit(0)
        try:
            atomic_write_text(path / "pid", f"{os.getpid()}\n")
            _daemon(path, argv)
        finally:
            os._exit(0)
    os.waitpid(first, 0)
    deadline = time.monotonic() + 10
    while not (path / "pid").is_file() and time.monotonic() < deadline:
        time.sleep(0.05)
    return int((path / "pid").read_text()) if (path / "pid").is_file() else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m xeontune.jobs",
                                     description="start a command detached, with its log and exit status in --job-dir")
    parser.add_argument("--job-dir", required=True)
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command after --")
    pid = start_detached(args.job_dir, command)
    print(pid)
    return 0 if pid else 1


if __name__ == "__main__":
    sys.exit(main())


# --- what `xeontune launch` records and starts -------------------------------------------------


def train_output_dir(train_args: Sequence[str]) -> str:
    """The --output-dir the ranks will use: the command line's last, else --config's, else the default."""
    from xeontune.train.options import TrainOptions, build_parser, load_config_file

    args = list(train_args[1:] if train_args[:1] == ["--"] else train_args)
    given = vars(build_parser().parse_known_args(args)[0])
    if given.get("output_dir"):
        return str(given["output_dir"])
    config = given.get("config")
    if config and Path(config).is_file():
        with contextlib.suppress(UserError):
            value = load_config_file(config).get("output_dir")
            if value:
                return str(value)
    return TrainOptions().output_dir


def begin(record: ClusterRecord, plan: LaunchPlan, train_args: Sequence[str], detached: bool) -> JobInfo:
    """Record the job about to start (where its files and outputs are), before it starts."""
    out = train_output_dir(train_args)
    job_id = new_job_id()
    job = JobInfo(
        id=job_id, cluster=record.name,
        output_dir=posixpath.normpath(posixpath.join(plan.wdir or os.getcwd(), out)),
        local_output_dir=str(Path(out).expanduser().absolute()),
        job_dir=posixpath.join(record.work_dir, "jobs", job_id), detached=detached, started=time.time(),
        world_size=plan.world_size,
    )
    save_job(job)
    return job


def launch_detached(record: ClusterRecord, plan: LaunchPlan, job: JobInfo) -> int:
    """Start the job on the head, detached; print how to follow it."""
    from xeontune import launch
    from xeontune.cluster import providers, ssh

    provider = providers.get(record.provider)
    if provider.uses_ssh:
        # the runner runs on the head, in its login: it starts the unwrapped mpirun command there
        runner = detach_argv(launch.python_path(record, provider), job.job_dir, plan.inner)
        pythonpath = None if provider.remote else launch._rank_pythonpath()
        if pythonpath:
            runner = ["env", f"PYTHONPATH={pythonpath}", *runner]
        rc, out, err = ssh.run(record, record.head, runner, timeout_s=60)
    else:
        proc = subprocess.run(detach_argv(sys.executable, job.job_dir, plan.argv), capture_output=True, text=True,
                              timeout=60, cwd=plan.wdir or None)
        rc, out, err = proc.returncode, proc.stdout, proc.stderr
    pid = out.strip().splitlines()[-1] if out.strip() else ""
    if rc != 0 or not pid.isdigit() or pid == "0":
        last = (err.strip() or out.strip() or "no output").splitlines()[-1]
        raise UserError(f"could not start the detached job on {record.head.name}: {last[:300]}")
    name = record.name
    print(f"started job {job.id} ({job.world_size} rank(s)) on cluster {name!r}, detached (pid {pid} on "
          f"{record.head.name}); log: {job.log_path}")
    print(f"follow it: xeontune logs --name {name} -f    outputs: xeontune fetch --name {name}")
    return 0
