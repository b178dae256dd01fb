"""`--provider local --link-rate RATE` (and `--link-delay`): each node's link shaped with tc, so that a
cluster on this machine has a real cluster's bandwidth (issue 49: scaling measured on shaped links).
Measured with a real TCP transfer between two namespace hosts."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from tests.cluster.clusterlib import cli, leftovers
from xeontune.cluster import manage, providers

pytestmark = [pytest.mark.slow, pytest.mark.root]

CLUSTER_NAME_PREFIX = "ls"

# Node 1 receives until the sender closes, then prints the seconds from its first byte to its last.
RECEIVE = """
import socket, sys, time
server = socket.create_server((sys.argv[1], 5701))
print("ready", flush=True)
conn, _ = server.accept()
first, got = None, 0
while chunk := conn.recv(1 << 16):
    first = first or time.perf_counter()
    got += len(chunk)
print(got, time.perf_counter() - first, flush=True)
"""
SEND = """
import socket, sys
with socket.create_connection((sys.argv[1], 5701)) as conn:
    conn.sendall(b"x" * int(sys.argv[2]))
"""


def netns_python(ns: str, code: str, *args: str) -> list[str]:
    return ["ip", "netns", "exec", ns, sys.executable, "-c", code, *args]


def transfer_seconds(record, size: int) -> float:
    """Seconds node 1 took to receive ``size`` bytes that node 0 sent it over TCP."""
    receiver = record.nodes[1]
    proc = subprocess.Popen(netns_python(receiver.resource_id, RECEIVE, receiver.private_ip), stdout=subprocess.PIPE,
                            text=True)
    try:
        assert proc.stdout and proc.stdout.readline().strip() == "ready"
        subprocess.run(netns_python(record.nodes[0].resource_id, SEND, receiver.private_ip, str(size)), check=True,
                       timeout=120)
        got, seconds = proc.stdout.readline().split()
        assert int(got) == size
        return float(seconds)
    finally:
        proc.kill()
        proc.wait()


def test_link_rate_holds_a_transfer_to_the_rate_each_end_shaped(cluster_name):
    """40 Mbit/s: 3 MB take 0.6 s (unshaped, the same veths carry them in milliseconds)."""
    record, _ = manage.up(providers.ClusterSpec(name=cluster_name, num_nodes=2, options={"link_rate": "40mbit"}),
                          "local")
    assert record.extra["link_rate"] == "40mbit"
    for node in record.nodes:  # the node's own end (what it sends) and the bridge's (what it gets)
        inside = subprocess.run(["ip", "netns", "exec", node.resource_id, "tc", "qdisc", "show", "dev", "eth0"],
                                capture_output=True, text=True, check=True).stdout
        assert "tbf" in inside and "rate 40Mbit" in inside, inside
    size = 3_000_000
    seconds = transfer_seconds(record, size)
    rate = size * 8 / seconds
    print(f"3 MB at --link-rate 40mbit: {seconds:.2f} s ({rate / 1e6:.1f} Mbit/s)")
    assert 30e6 <= rate <= 41e6, rate  # TCP's headers and start take some of it; never more than the rate
    manage.teardown(cluster_name, "local")
    assert not leftovers(cluster_name)


def test_link_delay_delays_each_packet_or_says_the_kernel_cannot_and_bad_values_are_one_line(cluster_name):
    """--link-delay needs netem: where the kernel has it, a TCP connect (one round trip) takes twice the
    delay; where it does not, `cluster up` says so in one line and leaves nothing. A rate or delay tc
    cannot read is one line before anything is made."""
    for flag, value in (("--link-rate", "fast"), ("--link-rate", "0gbit"), ("--link-delay", "1 hour")):
        done = cli("cluster", "up", "--provider", "local", "-n", "2", "--name", cluster_name, flag, value)
        errors = [line for line in done.stderr.splitlines() if line.startswith("error: ")]
        assert done.returncode == 2 and len(errors) == 1 and flag in errors[0], done.stderr
        assert not leftovers(cluster_name)

    done = cli("cluster", "up", "--provider", "local", "-n", "2", "--name", cluster_name, "--link-delay", "20ms")
    if done.returncode != 0:
        errors = [line for line in done.stderr.splitlines() if line.startswith("error: ")]
        assert len(errors) == 1 and "netem" in errors[0], done.stderr
        assert "Traceback" not in done.stderr
        assert not leftovers(cluster_name)
        return
    from xeontune.cluster import state

    record = state.load(cluster_name)
    connect = ("import socket, sys, time\nstart = time.perf_counter()\n"
               "socket.create_connection((sys.argv[1], 22)).close()\nprint(time.perf_counter() - start)")
    took = float(subprocess.run(netns_python(record.nodes[0].resource_id, connect, record.nodes[1].private_ip),
                                capture_output=True, text=True, check=True).stdout)
    assert took >= 2 * 0.020 * 0.95, took
    started = time.monotonic()
    manage.teardown(cluster_name, "local")
    assert not leftovers(cluster_name), time.monotonic() - started
