"""Helpers for the real-cluster tests (imported by conftest.py and the test modules)."""

from __future__ import annotations

import contextlib
import itertools
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def local_cluster_missing() -> str | None:
    """Why the local provider cannot run here, or None."""
    if os.geteuid() != 0:
        return "needs root (network namespaces)"
    from xeontune.cluster.providers import local

    if not shutil.which("ip"):
        return "needs iproute2"
    if not local.sshd_path():
        return "needs openssh-server (scripts/install-test-deps.sh)"
    if not shutil.which("ssh"):
        return "needs openssh-client"
    return None


def process_alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def require_installed(why: str | None) -> None:
    """Skip for a developer without root when ``why`` (what is missing) is set; as root or in CI, where
    `make test` installs everything first (scripts/install-test-deps.sh, the dev extras), it fails."""
    if why and (os.geteuid() == 0 or os.environ.get("CI")):
        pytest.fail(f"root (or CI) runs these tests after the install step, yet it {why}")
    if why:
        pytest.skip(why)


def require_local_cluster() -> None:
    """Skip only for a developer without root (network namespaces need it). As root, which is how CI
    and `make test` run them after scripts/install-test-deps.sh, anything missing is a failure: the
    install step did not do its job. CI is recognised by its CI variable too, should it not be root."""
    why = local_cluster_missing()
    if why and (os.geteuid() == 0 or os.environ.get("CI")):
        pytest.fail(f"root (or CI) runs the cluster tests after scripts/install-test-deps.sh, yet the local cluster {why}")
    if why:
        pytest.skip(why)


def cli(*args: str, env: dict[str, str] | None = None, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """Run `xeontune ...` as a user would (a fresh process, from the repo root)."""
    return subprocess.run([sys.executable, "-m", "xeontune.cli", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})


def leftovers(name: str) -> list[str]:
    """Every namespace, link or live process of cluster ``name`` that still exists."""
    from xeontune.cluster.providers import local

    found = []
    netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    found += [f"netns {line.split()[0]}" for line in netns.splitlines() if line.startswith(f"xeontune-{name}-node")]
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    short = local.bridge_name(name)[:8]  # "xt" + 6 hex digits
    found += [f"link {line.split(':')[1].strip()}" for line in links.splitlines()
              if line.split(":")[1].strip().startswith(short)]
    # Zombies (state Z) are not processes that run: this VM's init does not reap them.
    # -ww: without a terminal (pytest) ps cuts lines at 80 columns, before a long tmp path's cluster name
    ps = subprocess.run(["ps", "-ww", "-eo", "stat=,args="], capture_output=True, text=True).stdout
    found += [f"process {line}" for line in ps.splitlines()
              if not line.strip().startswith("Z") and f"/clusters/{name}/" in line]
    return found


def train_args(tiny, output_dir, batch: int, steps: int, *extra: str) -> list[str]:
    """The flags of a short textual-inversion run of ``tiny`` (the ``tiny`` fixture: the model and data);
    ``extra`` last: it may override the defaults here (the last flag wins)."""
    return ["--model", str(tiny["model"]), "--data-dir", str(tiny["data"]), "--placeholder-token", "<cat-toy>",
            "--initializer-token", "toy", "--resolution", "32", "--train-batch-size", str(batch),
            "--max-train-steps", str(steps), "--learning-rate", "5e-3", "--seed", "7", "--output-dir", str(output_dir),
            "--checkpointing-steps", "0", "--save-steps", "0", "--no-random-flip", *extra]


def trainer_pids(netns: str, include_hydra: bool = False) -> list[int]:
    """The live rank processes (and with ``include_hydra``, Hydra's and mpiexec's) in network namespace ``netns``."""
    out = subprocess.run(["ip", "netns", "pids", netns], capture_output=True, text=True).stdout
    found = []
    for pid in map(int, out.split()):
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().split(")")[-1].split()[0] == "Z":
                    continue  # a zombie runs nothing (this VM's init does not reap them)
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if "xeontune.train" in cmd or (include_hydra and ("hydra" in cmd or "mpiexec" in cmd)):
            found.append(pid)
    return found


def kill_and_time(proc: subprocess.Popen, pids: list[int], timeout: float = 60) -> tuple[int, float]:
    """SIGKILL ``pids`` (a rank's processes) and wait for the job ``proc`` to end: its exit status, and the
    seconds from the kill to its end."""
    killed_at = time.monotonic()
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    return proc.wait(timeout=timeout), time.monotonic() - killed_at


@contextlib.contextmanager
def stopped_on_exit(proc: subprocess.Popen) -> Iterator[subprocess.Popen]:
    """``proc`` killed on the way out if it still runs: a failed assertion leaves no job behind."""
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def trainers_left(cluster, seconds: float) -> dict[str, list[int]]:
    """Each node's rank, Hydra and mpiexec processes still alive after up to ``seconds`` (done as soon as
    none are)."""
    left = {node.name: [0] for node in cluster.nodes}
    deadline = time.monotonic() + seconds
    while any(left.values()) and time.monotonic() < deadline:
        left = {node.name: trainer_pids(node.resource_id, include_hydra=True) for node in cluster.nodes}
        time.sleep(0.1)
    return left


def assert_nothing_left(name: str) -> None:
    """Nothing of local cluster ``name`` runs or exists any more, and it has no record."""
    from xeontune.cluster import state

    time.sleep(0.5)
    assert leftovers(name) == [], leftovers(name)
    assert not state.exists(name)


_counts: dict[str, Iterator[int]] = {}


def unique_cluster_name(prefix: str) -> str:
    """``prefix``, this process's id and a count of the names made with ``prefix``: unique to this test run
    (other test runs use namespaces on this machine at the same time)."""
    count = _counts.setdefault(prefix, itertools.count())
    return f"{prefix}{os.getpid() % 100000}-{next(count)}"


def torn_down(name: str) -> None:
    """Whatever is left of local cluster ``name`` (its record, namespaces, links, processes) is torn down."""
    from xeontune.cluster import state

    if state.exists(name) or leftovers(name):
        from xeontune.cluster import manage

        manage.teardown(name, "local")
