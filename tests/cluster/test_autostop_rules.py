"""Autostop's rules and the rank environment, without a cluster: what counts as busy, the idle
clock, the watcher's command per provider, the flag's errors, and what `launch` gives every rank.
(The real clusters are in test_autostop.py and test_aws_autostop.py.)"""

from __future__ import annotations

import shlex
import socket

import pytest

from xeontune.cli import main
from xeontune.cluster import autostop, autostop_watch, manage, providers, state
from xeontune.cluster.state import ClusterRecord, Node
from xeontune.errors import UserError
from xeontune.job import spec as job_spec
from xeontune.job import start as launcher
from xeontune.train import forecast


def test_training_programs_are_busy_and_others_are_not():
    busy = [["/opt/xeontune/venv/bin/mpirun", "-n", "3"], ["/usr/bin/hydra_pmi_proxy", "--control-port", "x"],
            ["/opt/v/bin/python", "-m", "xeontune.train", "--model", "m"], ["/opt/v/bin/xeontune", "train"],
            ["python3", "-m", "xeontune.cli", "train", "--model", "m"], ["mpiexec.hydra", "-n", "2"]]
    idle = [[], ["/usr/sbin/sshd", "-D"], ["python", "-m", "xeontune.cluster.autostop", "--name", "train"],
            ["/opt/v/bin/xeontune", "cluster", "status"], ["bash", "-c", "echo mpirun"]]
    assert all(autostop_watch.is_training(a) for a in busy)
    assert not any(autostop_watch.is_training(a) for a in idle)


def test_only_inbound_established_connections_on_the_port_count():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    port = server.getsockname()[1]
    assert autostop_watch.ssh_connections(port) == 0  # a listener is no session
    client = socket.create_connection(("127.0.0.1", port))
    accepted, _ = server.accept()
    # two ESTABLISHED entries exist; only the accepted end has the port as its local port
    assert autostop_watch.ssh_connections(port) == 1
    client.close()
    accepted.close()
    server.close()
    assert autostop_watch.ssh_connections(port) == 0


def test_the_idle_clock_restarts_whenever_something_runs():
    now = [0.0]
    seen = iter([["ssh"], [], [], ["mpirun"], [], [], [], [], [], []])
    stops = []

    def sleep(s: float) -> None:
        now[0] += s

    def busy() -> list[str]:
        stops.append(now[0])
        return next(seen)

    autostop_watch.watch(idle_s=25, poll_s=10, busy=busy, clock=lambda: now[0], sleep=sleep)
    # busy at t=0 and t=30; idle from then on: it stops at the first poll 25 s after t=30
    assert stops[-1] == 60.0 and len(stops) == 7


def test_watcher_command_per_action(tmp_path):
    rec = ClusterRecord(name="sky", provider="aws", work_dir="/opt/xeontune/work", venv="/opt/xeontune/venv",
                        nodes=[Node("node0", "head", "172.31.0.10"), Node("node1", "worker", "172.31.0.11"),
                               Node("node2", "worker", "172.31.0.12")])
    argv = autostop.watcher_argv(rec, "/opt/xeontune/venv/bin/python", "poweroff", 1800)
    assert argv[:3] == ["/opt/xeontune/venv/bin/python", "-m", "xeontune.cluster.autostop_watch"]
    line = shlex.join(argv)
    assert "--idle-s 1800" in line and "--log /opt/xeontune/autostop.log" in line
    assert "--ssh-config /opt/xeontune/work/ssh_config.internal --workers node1,node2" in line


def test_idle_seconds_come_from_minutes_unless_a_test_overrides(monkeypatch):
    monkeypatch.delenv(autostop.IDLE_S_ENV, raising=False)
    assert autostop.idle_seconds(30) == 1800
    monkeypatch.setenv(autostop.IDLE_S_ENV, "4")
    assert autostop.idle_seconds(30) == 4 and autostop_watch.poll_seconds(4) == 0.5
    assert autostop_watch.poll_seconds(3600) == autostop_watch.MAX_POLL_S


def test_negative_autostop_is_a_one_line_error(xeontune_home, capsys):
    assert main(["cluster", "up", "--provider", "localhost", "--name", "neg", "--autostop", "-5"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--autostop takes minutes" in err
    assert not state.exists("neg")


@pytest.mark.parametrize("provider", ["azure", "localhost"])
def test_providers_without_autostop_say_so_and_record_nothing(xeontune_home, capsys, provider):
    rec = ClusterRecord(name="nostop", provider=provider, work_dir=str(xeontune_home / "w"),
                        nodes=[Node("node0", "head", "127.0.0.1")])
    state.save(rec)
    assert autostop.install(rec, 30) is False
    err = capsys.readouterr().err
    assert f"--autostop is not available on {provider}" in err
    assert providers.get(provider).autostop_note in err
    assert state.load("nostop").autostop_minutes == 0


def test_autostop_checks_passwordless_sudo_on_every_node_before_it_counts_on_it(xeontune_home, monkeypatch):
    """Finding 4: `sudo -n` was never checked; a node whose user needs a password for sudo kept
    billing after its watcher's power-off failed."""
    from xeontune.cluster import ssh

    rec = cloud_record()
    state.save(rec)
    asked = []

    def fake_run(record, node, argv, timeout_s=None, stdin=None):
        asked.append((node.name, argv))
        if node.name == "node2":
            return 1, "", "sudo: a password is required"
        return 0, "", ""

    monkeypatch.setattr(ssh, "run", fake_run)
    with pytest.raises(UserError, match="passwordless sudo for .* on node2 .*a password is required"):
        autostop.install(rec, 30)
    assert [name for name, _ in asked] == ["node0", "node1", "node2"]
    assert asked[0][1] == ["sh", "-c", autostop.CAN_SHUT_DOWN]  # nothing started before every node passed
    assert state.load("sky").autostop_minutes == 0


def test_localhost_up_with_autostop_warns_and_works(xeontune_home, capsys):
    assert main(["cluster", "up", "--provider", "localhost", "-n", "2", "--name", "solo", "--autostop", "10"]) == 0
    out, err = capsys.readouterr()
    assert "not available on localhost" in err and "autostop:" not in out
    assert manage.teardown("solo").ok


# --- what every rank gets ------------------------------------------------------------------------


def cloud_record() -> ClusterRecord:
    return ClusterRecord(name="sky", provider="aws", work_dir="/opt/xeontune/work", venv="/opt/xeontune/venv",
                         iface="ens5", instance_type="m7i.4xlarge", cores_per_node=8,
                         nodes=[Node("node0", "head", "172.31.0.10", public_ip="3.3.3.3"),
                                Node("node1", "worker", "172.31.0.11"), Node("node2", "worker", "172.31.0.12")])


def genv(argv: list[str]) -> dict[str, str]:
    return {argv[i + 1]: argv[i + 2] for i, a in enumerate(argv) if a == "-genv"}


def test_ranks_get_no_gpu_and_the_price_and_env_overrides_both(xeontune_home):
    rec = cloud_record()
    plan = launcher.build_plan(rec, 3, 1, "gloo", [])
    remote = shlex.split(plan.argv[-1])  # the mpirun line as the head runs it
    env = genv(remote)
    assert env["CUDA_VISIBLE_DEVICES"] == ""
    # 3 x m7i.4xlarge + disk + IPv4 = $2.45/h (the figure `cluster up` prints)
    assert float(env[forecast.COST_ENV]) == pytest.approx(providers.get("aws").cost_per_hour(rec), abs=1e-4)
    assert round(float(env[forecast.COST_ENV]), 2) == 2.45
    given = job_spec.parse_env(["CUDA_VISIBLE_DEVICES=0", "PYTHONPATH=/a b:/c", "EMPTY="])
    env = genv(shlex.split(launcher.build_plan(rec, 3, 1, "gloo", [], given).argv[-1]))
    assert env["CUDA_VISIBLE_DEVICES"] == "0" and env["PYTHONPATH"] == "/a b:/c" and env["EMPTY"] == ""


def test_a_free_cluster_passes_no_price(xeontune_home):
    rec = ClusterRecord(name="solo", provider="localhost", work_dir=str(xeontune_home), iface="lo",
                        nodes=[Node("node0", "head", "127.0.0.1")])
    assert forecast.COST_ENV not in launcher.build_plan(rec, 1, 1, "gloo", []).env


@pytest.mark.parametrize("bad", ["NOEQUALS", "=value", ""])
def test_bad_env_syntax_is_a_one_line_error(xeontune_home, capsys, bad):
    state.save(cloud_record())
    assert main(["launch", "--name", "sky", "--dry-run", "--env", bad, "--", "--max-train-steps", "1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "KEY=VALUE" in err  # NOEQUALS: unset here, so not taken from this environment
