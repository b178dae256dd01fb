"""A launched job's processes: attached (tied to this process) or detached (on the head).

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

Detached (`launch --detach`, `run`): ``python -m xeontune.job.process --job-dir D -- ARGV`` on the head forks
twice (its own session, immune to the login's hang-up, like ``setsid nohup``), writes ``D/pid``,
runs ARGV attached as above with its output in ``D/log``, then writes its exit status in ``D/rc``.
`xeontune logs` reads those files.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from xeontune.io import atomic_write_text

FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
GRACE_S = 20.0  # for the ranks to leave their step after the first signal
CTRL_C = b"\x03"


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
    proc: subprocess.Popen | None = None
    received: list[int] = []
    forwarded: list[int] = []
    first_at: list[float] = []

    def graceful(sig: int) -> None:
        if proc is None or forwarded:
            return  # not started yet (Popen passes it on once it returns), or passed on already
        forwarded.append(sig)
        if pty:
            with contextlib.suppress(OSError, ValueError):
                assert proc.stdin is not None
                proc.stdin.write(CTRL_C)
                proc.stdin.flush()
        else:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGTERM if sig == signal.SIGHUP else sig)

    def hard() -> None:
        if proc is None:
            return
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
    if main_thread:  # the detached runner blocks them until here: one that came early is handled now
        signal.pthread_sigmask(signal.SIG_UNBLOCK, FORWARDED)
    try:
        if received:  # stopped before the job began: it never starts
            return exit_code(-received[0]), received[0]
        proc = subprocess.Popen(list(argv), start_new_session=True, stdout=stdout, stderr=stderr,
                                stdin=subprocess.PIPE if pty else subprocess.DEVNULL)
        if received:  # they came while Popen ran
            graceful(received[0])
            if len(received) > 1:
                hard()
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
        if proc is not None and proc.stdin:
            with contextlib.suppress(OSError):
                proc.stdin.close()
    return exit_code(rc), (received[0] if received else None)


def _in_main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


# --- detached: the runner on the head ----------------------------------------------------------


def detach_argv(python: str, job_dir: str, argv: Sequence[str]) -> list[str]:
    """The command that starts ``argv`` detached on the head (run there over SSH, or here)."""
    return [python, "-m", "xeontune.job.process", "--job-dir", job_dir, "--", *argv]


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
        # a stop may come as soon as the pid is out, before run_attached forwards signals: held till then
        signal.pthread_sigmask(signal.SIG_BLOCK, FORWARDED)
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
    parser = argparse.ArgumentParser(prog="python -m xeontune.job.process",
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

