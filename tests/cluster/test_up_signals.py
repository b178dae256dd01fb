"""Signals to a real `xeontune cluster up --provider aws -n 3` and `xeontune run --provider aws`
(issue 29), against moto's EC2 server over real HTTP.

The command runs as a user runs it (a fresh process) and waits for the nodes' host keys, as a real
`up` does for minutes; a proxy in front of moto says when it got there, and can hold the
rollback's TerminateInstances so that a second signal lands inside the rollback. SIGHUP comes
from closing the process's controlling terminal (a pty), as a closed terminal window sends it.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.cluster.awslib import CIDR, REGION, Proxy, ec2_error, leftovers, live_instances
from tests.cluster.clusterlib import REPO
from xeontune import cli
from xeontune.cluster import state

NOTHING = {"instances": [], "security_groups": [], "key_pairs": []}
REQUIRED = ["--model", "org/model", "--placeholder-token", "<t>", "--initializer-token", "toy"]


class Cloud:
    """The proxy's view of the command: ``waiting`` once `up` polls the consoles for host keys (every
    instance exists by then); ``terminating`` once the rollback deletes them. With ``hold``, that
    TerminateInstances waits for ``release`` and is then refused (the command is gone by then)."""

    def __init__(self, hold: bool = False) -> None:
        self.hold = hold
        self.waiting = threading.Event()
        self.terminating = threading.Event()
        self.release = threading.Event()

    def __call__(self, action: str, count: int, params: dict) -> tuple[int, bytes] | None:
        if action == "GetConsoleOutput":
            self.waiting.set()
        if action == "TerminateInstances":
            self.terminating.set()
            if self.hold:
                self.release.wait(120)
                return ec2_error("RequestExpired", "held by the test")
        return None


pytestmark = pytest.mark.usefixtures("env")  # moto's server, a fresh account, a private state dir (conftest.py)


@contextlib.contextmanager
def proxied(hold: bool = False) -> Iterator[tuple[Cloud, str]]:
    """A proxy in front of moto (where ``env`` points AWS_ENDPOINT_URL) that watches the command."""
    watch = Cloud(hold)
    with Proxy(os.environ["AWS_ENDPOINT_URL"], watch) as url:
        try:
            yield watch, url
        finally:
            watch.release.set()


def up_argv(name: str) -> list[str]:
    return [sys.executable, "-m", "xeontune.cli", "cluster", "up", "--provider", "aws", "-n", "3", "--name", name,
            "--region", REGION, "--ssh-cidr", CIDR]


def start(argv: list[str], url: str, log: Path) -> subprocess.Popen:
    return subprocess.Popen(argv, cwd=REPO, stdin=subprocess.DEVNULL, stdout=log.open("w"), stderr=subprocess.STDOUT,
                            env={**os.environ, "AWS_ENDPOINT_URL": url})


def wait_for(event: threading.Event, proc: subprocess.Popen, log: Path, what: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not event.wait(0.2):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"never {what} (exit {proc.poll()}):\n{log.read_text()[-3000:]}")


def finished(proc: subprocess.Popen, timeout: float = 120) -> int:
    try:
        return proc.wait(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.slow
def test_sigterm_while_up_waits_rolls_back_everything(tmp_path):
    """SIGTERM 3 instances in (the nodes exist, `up` waits for them) left the instances, the security
    group and the key pair running, exit 143 and not a word. Now it rolls back as Ctrl-C does."""
    log = tmp_path / "up.log"
    with proxied() as (watch, url):
        proc = start(up_argv("term"), url, log)
        wait_for(watch.waiting, proc, log, "waited for the nodes")
        assert len(live_instances("term")) == 3
        proc.send_signal(signal.SIGTERM)
        rc = finished(proc)
    text = log.read_text()
    assert rc == 143, text[-3000:]
    assert text.strip().splitlines()[-1] == "`cluster up` interrupted (SIGTERM) (rolled back: nothing was left running)"
    assert "Traceback" not in text
    assert leftovers("term") == NOTHING and not state.exists("term")


@pytest.mark.slow
def test_a_closed_terminal_rolls_back_everything():
    """SIGHUP, as closing the terminal sends it (the pty's master closed: the kernel hangs up the
    process's controlling terminal, and every write to it fails from then on): rolled back, exit 129."""
    with proxied() as (watch, url):
        master, slave = os.openpty()
        # a new session whose controlling terminal is the pty (sh opens it by name as the session leader)
        proc = subprocess.Popen(["sh", "-c", 'exec "$@" <"$0" >"$0" 2>&1', os.ttyname(slave), *up_argv("hup")],
                                cwd=REPO, start_new_session=True, stdin=slave, stdout=slave, stderr=slave,
                                env={**os.environ, "AWS_ENDPOINT_URL": url})
        os.close(slave)
        seen = b""
        deadline = time.monotonic() + 120
        try:
            while not watch.waiting.is_set():
                assert proc.poll() is None and time.monotonic() < deadline, seen.decode(errors="replace")[-3000:]
                if select.select([master], [], [], 0.2)[0]:
                    seen += os.read(master, 65536)
            assert len(live_instances("hup")) == 3
        finally:
            os.close(master)  # the terminal goes away
        rc = finished(proc)
    assert rc == 129, (rc, seen.decode(errors="replace")[-3000:])
    assert leftovers("hup") == NOTHING and not state.exists("hup")


@pytest.mark.slow
def test_an_interrupted_rollback_says_what_is_left_and_how_to_delete_it(tmp_path):
    """A second signal while `up` rolls back stops the rollback (Ctrl-C's way out): the last line
    names every resource that may be left and the teardown that deletes them, and it does."""
    log = tmp_path / "up.log"
    with proxied(hold=True) as (watch, url):
        proc = start(up_argv("half"), url, log)
        wait_for(watch.waiting, proc, log, "waited for the nodes")
        proc.send_signal(signal.SIGTERM)
        wait_for(watch.terminating, proc, log, "began the rollback")
        proc.send_signal(signal.SIGTERM)
        rc = finished(proc)
    text = log.read_text()
    assert rc == 143, text[-3000:]
    last = text.strip().splitlines()[-1]
    assert last.startswith("`cluster up` interrupted (SIGTERM); the clean-up was interrupted: what may be left "
                           "and billing: "), last
    left = leftovers("half")
    assert len(left["instances"]) == 3 and left["security_groups"] and left["key_pairs"]
    for item in [*left["instances"], *left["security_groups"]]:
        assert item in last, (item, last)
    assert last.endswith("delete it with `xeontune teardown --name half`"), last
    assert state.exists("half")
    assert cli.main(["teardown", "--name", "half"]) == 0
    assert leftovers("half") == NOTHING and not state.exists("half")


@pytest.mark.slow
def test_run_whose_up_rollback_is_interrupted_ends_with_what_is_left(tmp_path, sample_images):
    """`run`'s last line said "cluster 'X' was not created by this run and is kept" when its own
    `up` was interrupted while rolling back: it must say what may be left and how to delete it."""
    log = tmp_path / "run.log"
    argv = [sys.executable, "-m", "xeontune.cli", "run", "--provider", "aws", "-n", "2", "--name", "runhalf",
            "--region", REGION, "--ssh-cidr", CIDR, "--", *REQUIRED, "--data-dir", str(sample_images), "--output-dir",
            str(tmp_path / "out")]
    with proxied(hold=True) as (watch, url):
        proc = start(argv, url, log)
        wait_for(watch.waiting, proc, log, "waited for the nodes")
        proc.send_signal(signal.SIGTERM)
        wait_for(watch.terminating, proc, log, "began the rollback")
        proc.send_signal(signal.SIGTERM)
        rc = finished(proc)
    text = log.read_text()
    assert rc == 143, text[-3000:]
    last = text.strip().splitlines()[-1]
    left = leftovers("runhalf")
    assert len(left["instances"]) == 2, left
    assert last.startswith("cluster 'runhalf' was not fully created, nor deleted again; what may be left and "
                           "billing: "), last
    assert all(item in last for item in [*left["instances"], *left["security_groups"]]), last
    assert last.endswith("delete it with: xeontune teardown --name runhalf"), last
    assert cli.main(["teardown", "--name", "runhalf"]) == 0
    assert leftovers("runhalf") == NOTHING and not state.exists("runhalf")
