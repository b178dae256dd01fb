"""Autostop and the rank environment on real local clusters (network namespaces, sshd, Hydra).

The idle time is seconds here (XEONTUNE_AUTOSTOP_IDLE_S) instead of `--autostop` minutes. The
clusters that remove themselves are made for their test; the 3-node module cluster
(``local_cluster``) checks what ranks receive and the power-off path of a cloud head.
"""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.checks import wait_until
from tests.cluster.clusterlib import REPO, cli, leftovers, process_alive
from xeontune.cluster import autostop, autostop_watch, files, manage, ssh, state
from xeontune.cluster.providers import ClusterSpec
from xeontune.job import spec as job_spec
from xeontune.job import start as launcher

pytestmark = [pytest.mark.slow, pytest.mark.root]

PROBE = "tests.cluster.allreduce_probe"
IDLE_S = 6
OWN_NAME_PREFIX = "a"  # own_name (conftest.py): a<pid>-<part of the test's name>


def test_an_idle_cluster_removes_itself(own_name, xeontune_home):
    """`cluster up` returns and nothing of xeontune runs on the caller's side: the watcher in the
    head's namespace removes namespaces, links, sshds, itself and the record."""
    out = cli("cluster", "up", "--provider", "local", "-n", "3", "--name", own_name, "--autostop", "1",
              env={"XEONTUNE_HOME": str(xeontune_home), autostop.IDLE_S_ENV: str(IDLE_S)})
    assert out.returncode == 0, out.stderr
    assert "autostop: the head stops the cluster after 1 min idle" in out.stdout
    record = state.load(own_name)
    assert record.autostop_minutes == 1
    watchers = [line for line in leftovers(own_name) if "xeontune.cluster.autostop" in line]
    assert len(watchers) == 1
    pid = int(subprocess.run(["pgrep", "-f", f"autostop_watch --name {own_name} "], capture_output=True, text=True).stdout.split()[0])
    assert os.stat(f"/proc/{pid}/ns/net").st_ino == os.stat(f"/run/netns/{record.head.resource_id}").st_ino  # on the head
    started = time.monotonic()
    assert wait_until(lambda: not leftovers(own_name) and not state.exists(own_name), IDLE_S + 40), leftovers(own_name)
    took = time.monotonic() - started
    assert took >= IDLE_S - 1  # not before the idle time
    summary = (xeontune_home / "autostop.log").read_text()
    assert f"removed idle cluster {own_name!r}" in summary
    print(f"removed itself {took:.1f} s after `up` returned (idle time {IDLE_S} s)")


def test_a_busy_cluster_stays_until_it_is_idle(own_name, xeontune_home, monkeypatch, tmp_path):
    """An open SSH session to the head, then a job (mpirun on the head, ranks on every node), each
    for longer than the idle time: the cluster stays. Then it goes."""
    monkeypatch.setenv(autostop.IDLE_S_ENV, str(IDLE_S))
    record, _ = manage.up(ClusterSpec(name=own_name, num_nodes=3, autostop_minutes=1), "local")
    log = Path(autostop.log_path(record))

    client = ssh.connect(record, record.head, timeout_s=15)
    try:
        time.sleep(IDLE_S + 4)
        assert state.exists(own_name) and len(leftovers(own_name)) > 3
    finally:
        ssh.close(client)
    assert "busy: 1 ssh connection(s)" in log.read_text()

    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    plan = launcher.build_plan(record, 3, 1, "gloo", ["--sleep", str(IDLE_S + 8), "--pid-dir", str(pid_dir)],
                             module=PROBE)
    job = subprocess.Popen(plan.argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert wait_until(lambda: len(list(pid_dir.glob("*.pid"))) == 3 or job.poll() is not None, 90)
        assert job.wait(timeout=120) == 0, job.stdout.read()[-3000:] if job.stdout else ""
        assert state.exists(own_name), "removed while the job ran"
    finally:
        if job.poll() is None:
            job.kill()
            job.wait()
    text = log.read_text()
    assert re.search(r"busy: pid \d+ (mpirun|hydra_pmi_proxy)", text), text
    ended = time.monotonic()
    assert wait_until(lambda: not leftovers(own_name) and not state.exists(own_name), IDLE_S + 40), leftovers(own_name)
    print(f"removed {time.monotonic() - ended:.1f} s after the job ended (idle time {IDLE_S} s)")


def test_teardown_stops_the_watcher_too(own_name, xeontune_home, monkeypatch):
    monkeypatch.setenv(autostop.IDLE_S_ENV, "3600")
    manage.up(ClusterSpec(name=own_name, num_nodes=2, autostop_minutes=60), "local")
    assert [line for line in leftovers(own_name) if "xeontune.cluster.autostop" in line]
    out = cli("teardown", "--name", own_name, env={"XEONTUNE_HOME": str(xeontune_home)})
    assert out.returncode == 0, out.stderr
    assert leftovers(own_name) == []


# --- on the module's 3-node cluster -----------------------------------------------------------


def shown(stdout: str, var: str) -> dict[str, str]:
    """netns -> the value of ``var`` that the rank there printed."""
    return {m.group(1): m.group(2) for m in re.finditer(rf"show rank=\d netns=(\S+) {var}=(.*)$", stdout, re.M)}


def test_env_reaches_every_rank_on_every_node(local_cluster):
    given = job_spec.parse_env(["XT_MARK=a b;c", "CUDA_VISIBLE_DEVICES=", "PYTHONPATH=" + str(REPO)])
    namespaces = {os.readlink(f"/proc/{_pid_in(n.resource_id)}/ns/net") for n in local_cluster.nodes}
    show = ["--show", "XT_MARK", "--show", "CUDA_VISIBLE_DEVICES", "--show", "PYTHONPATH"]
    local = launcher.build_plan(local_cluster, 3, 1, "gloo", show, given, module=PROBE)
    # the cloud path too: mpirun started on the head over `ssh -tt`, the command line quoted once more
    cloudy = dataclasses.replace(local_cluster, provider="aws", venv=sys.prefix)
    remote = launcher.build_plan(cloudy, 3, 1, "gloo", show, given, workdir=str(REPO), module=PROBE)
    for plan in (local, remote):
        proc = subprocess.run(plan.argv, cwd=REPO, capture_output=True, text=True, timeout=120,
                              stdin=subprocess.DEVNULL)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
        assert shown(proc.stdout, "XT_MARK") == dict.fromkeys(namespaces, "'a b;c'")
        assert shown(proc.stdout, "CUDA_VISIBLE_DEVICES") == dict.fromkeys(namespaces, "''")
        assert shown(proc.stdout, "PYTHONPATH") == dict.fromkeys(namespaces, repr(str(REPO)))



def _pid_in(netns: str | None) -> int:
    """A process in ``netns`` (its sshd), to read the namespace id the ranks there report."""
    out = subprocess.run(["ip", "netns", "pids", netns or ""], capture_output=True, text=True).stdout.split()
    return int(out[0])


def test_poweroff_reaches_every_worker_through_the_heads_config(local_cluster, tmp_path):
    """The cloud head's stop, with a harmless command in place of shutdown (these "nodes" are this
    machine): each worker runs it over the head's ssh config, then the head itself."""
    marks = tmp_path / "off"
    marks.touch(mode=0o666)
    cmd = ("sh", "-c", f"readlink /proc/self/ns/net >> {marks}")
    workers = [n.name for n in local_cluster.nodes if n.role != "head"]
    assert autostop_watch.poweroff(str(files.files_dir(local_cluster) / "ssh_config.internal"), workers, cmd) == 0
    lines = marks.read_text().split()
    assert len(lines) == 3
    worker_ns = {os.readlink(f"/proc/{_pid_in(n.resource_id)}/ns/net") for n in local_cluster.nodes if n.role != "head"}
    assert set(lines[:2]) == worker_ns and lines[2] == os.readlink("/proc/self/ns/net")  # workers, then the head



def test_a_worker_that_does_not_power_off_keeps_the_head_up_and_says_so(local_cluster, tmp_path, capsys):
    """Finding 4: a worker's failed power-off was ignored and the head powered off anyway (that
    worker billing on, unseen), and a failed shutdown of the head itself went unnoticed."""
    marks = tmp_path / "off"
    marks.touch(mode=0o666)
    cmd = ("sh", "-c", f"readlink /proc/self/ns/net >> {marks}")
    slept: list[float] = []
    assert autostop_watch.poweroff(str(tmp_path / "no_such_config"), ["node1"], cmd, attempts=3, retry_s=7,
                                   sleep=slept.append) == 1
    assert slept == [7, 7] and marks.read_text() == ""  # tried three times; the head never ran its shutdown
    out = capsys.readouterr().out
    assert out.count("could not power off node1 (exit") == 3 and "FAILED: could not power off node1 after 3" in out
    assert autostop_watch.poweroff(str(tmp_path / "no_such_config"), [], ("false",)) == 1
    assert "FAILED: the head's own shutdown exited 1" in capsys.readouterr().out


def test_a_cloud_head_starts_its_watcher_detached_over_ssh(local_cluster):
    """What `up` does on aws, on the namespace head: the SSH command returns at once and the watcher
    lives on, in the head's namespace, in its own session. (Idle time 1 h, and it is stopped here:
    its power-off would run on this machine. The module's teardown kills it in any case.)"""
    name = f"{local_cluster.name}-c"[:31]
    cloudy = dataclasses.replace(local_cluster, name=name, provider="aws", venv=sys.prefix)
    pid = None
    try:
        os.environ[autostop.IDLE_S_ENV] = "3600"
        started = time.monotonic()
        assert autostop.install(cloudy, 60) is True
        assert time.monotonic() - started < 20
        assert state.load(name).autostop_minutes == 60
        found = subprocess.run(["pgrep", "-f", f"autostop_watch --name {name} --action poweroff"],
                               capture_output=True, text=True).stdout.split()
        assert len(found) == 1
        pid = int(found[0])
        head_ns = os.stat(f"/run/netns/{local_cluster.head.resource_id}").st_ino
        assert os.stat(f"/proc/{pid}/ns/net").st_ino == head_ns
        # a session of its own (double fork: its leader has exited), not the SSH session's
        sid = os.getsid(pid)
        assert sid not in (os.getsid(0), pid)
        # the leader exits right after its fork: a moment later at most (CI saw it still there once)
        assert wait_until(lambda: not process_alive(sid), timeout_s=10, poll_s=0.1), sid
        # its first line comes once its imports are done (seconds on a busy 2-core machine)
        said = f"watching cluster {name!r} (pid {pid}): poweroff after 3600s idle"
        log_file = Path(autostop.log_path(cloudy))
        assert wait_until(lambda: log_file.is_file() and said in log_file.read_text(), 30), log_file.read_text()
        assert "--workers node1,node2" in log_file.read_text()
    finally:
        os.environ.pop(autostop.IDLE_S_ENV, None)
        if pid:
            os.kill(pid, 9)
        state.delete(name)


def test_status_says_when_the_watcher_is_not_running(own_name, xeontune_home, monkeypatch):
    """Finding 4: a watcher that failed (a power-off or the head's own shutdown that failed, a crash)
    went unnoticed while `cluster status` still said autostop was on."""
    monkeypatch.setenv(autostop.IDLE_S_ENV, "3600")
    record, _ = manage.up(ClusterSpec(name=own_name, num_nodes=1, autostop_minutes=60), "local")
    env = {"XEONTUNE_HOME": str(xeontune_home)}
    shown = cli("cluster", "status", "--name", own_name, env=env)
    assert shown.returncode == 0 and "autostop: after 60 min idle, watcher running" in shown.stdout, shown.stdout
    pid = int(subprocess.run(["pgrep", "-f", f"autostop_watch --name {own_name} "], capture_output=True,
                             text=True).stdout.split()[0])
    os.kill(pid, 9)
    assert wait_until(lambda: not process_alive(pid), 10)
    with open(autostop.log_path(record), "a") as log:
        log.write("2026-11-23 21:00:00 autostop: FAILED: the head's own shutdown exited 1\n")
    shown = cli("cluster", "status", "--name", own_name, env=env)
    assert "its watcher is NOT running; its log ends: 2026-11-23 21:00:00 autostop: FAILED" in shown.stdout, \
        shown.stdout
