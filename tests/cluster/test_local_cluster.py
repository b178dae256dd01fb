"""A real 3-host cluster on this machine: namespaces, sshd, pinned keys, Hydra over SSH, gloo.

The ranks run tests/cluster/allreduce_probe.py through the same launch path as training (see
test_distributed_training.py for the trainer itself). Tests run in file order; the last one
tears the cluster down and checks nothing is left.
"""

from __future__ import annotations

import dataclasses
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import paramiko
import pytest

from tests.cluster.clusterlib import REPO, cli, kill_and_time, leftovers, process_alive, stopped_on_exit
from xeontune.cluster import files, manage, ssh, state
from xeontune.errors import UserError
from xeontune.job import start as launcher

pytestmark = [pytest.mark.slow, pytest.mark.root]

PROBE = "tests.cluster.allreduce_probe"


def probe_plan(record, *probe_args: str, n: int = 3):
    return launcher.build_plan(record, n, 1, "gloo", list(probe_args), module=PROBE)


def test_up_writes_files_and_pins_host_keys(local_cluster):
    record = local_cluster
    work = files.files_dir(record)
    assert (work / "hosts").read_text().split() == [n.private_ip for n in record.nodes]
    assert record.nodes[0].role == "head"
    # No accelerate configs: ranks take everything from mpirun's environment (docs/cluster.md).
    assert sorted(p.name for p in work.iterdir()) == ["hosts", "ssh", "ssh_config", "ssh_config.internal"]
    assert oct(os.stat(record.key_path).st_mode & 0o777) == "0o600"
    known = Path(record.known_hosts_path).read_text()
    for node in record.nodes:
        assert f"{node.name},{node.private_ip} ssh-ed25519 " in known
    for node in record.nodes:
        rc, out, _ = ssh.run(record, node, ["sh", "-c", "readlink /proc/self/ns/net; echo \"$1\"", "-", "a b;c"])
        assert rc == 0 and out.splitlines()[1] == "a b;c"  # argv survives quoting intact
    # each node is its own network namespace
    namespaces = {ssh.run(record, n, ["readlink", "/proc/self/ns/net"])[1] for n in record.nodes}
    assert len(namespaces) == 3


def test_sshd_drops_a_vanished_client_within_minutes(local_cluster):
    """Finding 4: nodes set no ClientAliveInterval, so a half-open connection from a laptop that
    vanished kept a "30 min" autostop cluster up for about 2 h 11 min. Read back from sshd itself."""
    from xeontune.cluster.providers import local

    run_dir = state.cluster_dir(local_cluster.name) / "sshd"
    shown = subprocess.run([local.sshd_path(), "-T", "-f", str(run_dir / "node0.conf")], capture_output=True,
                           text=True)
    assert shown.returncode == 0, shown.stderr
    settings = dict(line.split(" ", 1) for line in shown.stdout.splitlines() if " " in line)
    assert int(settings["clientaliveinterval"]) * int(settings["clientalivecountmax"]) <= 180
    script = (REPO / "scripts" / "bootstrap-node.sh").read_text()  # what cloud nodes get
    assert "ClientAliveInterval 30\\nClientAliveCountMax 4" in script


def test_a_changed_host_key_is_refused(local_cluster, tmp_path):
    record = local_cluster
    bad = state.ClusterRecord(**{**record.__dict__, "known_hosts_path": str(tmp_path / "known_hosts")})
    other = ssh.generate_keypair(tmp_path / "other_key")
    ssh.pin_host_key(bad, record.nodes[1], other)
    with pytest.raises(paramiko.SSHException):
        ssh.connect(bad, record.nodes[1], timeout_s=5)
    (tmp_path / "known_hosts").write_text("")  # unknown host: refused as well, never added
    with pytest.raises(paramiko.SSHException):
        ssh.connect(bad, record.nodes[1], timeout_s=5)
    assert (tmp_path / "known_hosts").read_text() == ""


def test_status_and_ssh_commands(local_cluster):
    name = local_cluster.name
    status = cli("cluster", "status", "--name", name)
    assert status.returncode == 0, status.stderr
    assert status.stdout.count("running") == 3
    out = cli("cluster", "ssh", "node2", "--name", name, "--", "ip", "-4", "-o", "addr", "show", "eth0")
    assert out.returncode == 0, out.stderr
    assert local_cluster.nodes[2].private_ip in out.stdout


def test_put_tree_copies_with_modes(local_cluster, tmp_path):
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    (src / "sub" / "secret").write_text("k")
    os.chmod(src / "sub" / "secret", 0o600)
    remote = str(tmp_path / "copied")
    assert ssh.put_tree(local_cluster, local_cluster.nodes[2], src, remote) == 1
    assert oct(os.stat(f"{remote}/sub/secret").st_mode & 0o777) == "0o600"


def test_put_tree_never_follows_a_link_out_of_the_tree(local_cluster, tmp_path, capsys):
    """A link to $HOME in a data dir would upload ~/.ssh to every node: links that leave the tree
    are skipped with a warning; links inside it are recreated as (relative) links."""
    home = tmp_path / "home"
    (home / ".ssh").mkdir(parents=True)
    (home / ".ssh" / "id_ed25519").write_text("secret")
    src = tmp_path / "data"
    (src / "imgs").mkdir(parents=True)
    (src / "imgs" / "a.png").write_text("a")
    (src / "home").symlink_to(home)  # out of the tree: a directory ...
    (src / "key").symlink_to(home / ".ssh" / "id_ed25519")  # ... and a file
    (src / "gone").symlink_to(tmp_path / "nothing")  # nowhere
    (src / "b.png").symlink_to("imgs/a.png")  # inside, relative
    (src / "pics").symlink_to(src / "imgs")  # inside, absolute
    remote = tmp_path / "copied"
    for _ in range(2):  # a re-run replaces its links
        assert ssh.put_tree(local_cluster, local_cluster.nodes[1], src, str(remote)) == 1
    assert sorted(p.name for p in remote.iterdir()) == ["b.png", "imgs", "pics"]
    assert os.readlink(remote / "b.png") == "imgs/a.png" and os.readlink(remote / "pics") == "imgs"
    assert (remote / "pics" / "a.png").read_text() == "a"
    err = capsys.readouterr().err
    for name in ("home", "key", "gone"):
        assert f"warning: not uploading {src / name}" in err
    assert "secret" not in "".join(p.read_text() for p in remote.rglob("*") if p.is_file())


def test_run_reads_a_large_stderr_and_stdout_together(local_cluster):
    """4 MB on stderr before a byte of stdout: more than paramiko's 2 MB window, so reading stdout
    to its end first would wait forever for a command blocked on its stderr."""
    script = "head -c 4000000 /dev/zero | tr '\\0' e >&2; echo done"
    rc, out, err = ssh.run(local_cluster, local_cluster.nodes[1], ["sh", "-c", script], timeout_s=60)
    assert (rc, out, len(err), set(err)) == (0, "done\n", 4_000_000, {"e"})


def test_gloo_allreduce_one_rank_per_host(local_cluster):
    plan = probe_plan(local_cluster, "--numel", "768", "--print-env")
    launcher.preflight(local_cluster, plan)
    start = time.monotonic()
    proc = subprocess.run(plan.argv, cwd=REPO, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "XT_CALLER_ONLY": "1"})
    elapsed = time.monotonic() - start
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = [line for line in proc.stdout.splitlines() if "probe rank=" in line]
    assert len(lines) == 3
    assert {re.search(r"^\[(\d)\]", line).group(1) for line in lines} == {"0", "1", "2"}  # rank prefix
    assert all("ok=True" in line and "sum=6.0" in line for line in lines)
    assert all(f"master={local_cluster.head.private_ip}" in line and "ifname=eth0" in line for line in lines)
    assert all(f"omp={max(1, (os.cpu_count() or 1) // 3)}" in line for line in lines)
    assert len({re.search(r"netns=(\S+)", line).group(1) for line in lines}) == 3
    envs = [line.split()[3:] for line in proc.stdout.splitlines() if " env rank=" in line]
    assert len(envs) == 3
    for names in envs:  # the caller's shell stays out of every rank, the forked head rank too
        assert "XT_CALLER_ONLY" not in names and {"MASTER_ADDR", "OMP_NUM_THREADS", "PMI_RANK"} <= set(names)
    print(f"3-rank launch + all-reduce: {elapsed:.1f} s")


def test_cloud_style_launch_runs_mpirun_on_the_head_over_ssh(local_cluster):
    """The path a cloud cluster takes (ssh -tt to the head, mpirun there), on the namespace hosts."""
    remote = dataclasses.replace(local_cluster, provider="aws", venv=sys.prefix)
    plan = launcher.build_plan(remote, 3, 1, "gloo", [], extra_env={"PYTHONPATH": str(REPO)}, workdir=str(REPO),
                             module=PROBE)
    assert plan.argv[0] == "ssh" and "OMP_NUM_THREADS" not in plan.env  # unknown node cores: torch decides
    launcher.preflight(remote, plan)
    proc = subprocess.run(plan.argv, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = [line for line in proc.stdout.splitlines() if "probe rank=" in line]
    assert len(lines) == 3 and all("ok=True" in line for line in lines)


# what every job needs: a hub id (never loaded by these tests) and a folder that exists here
JOB = ["--model", "org/model", "--data-dir", str(REPO), "--placeholder-token", "<t>", "--initializer-token", "toy"]


def test_dry_run_prints_the_command(local_cluster):
    out = cli("launch", "-n", "3", "--name", local_cluster.name, "--dry-run", "--", *JOB, "--max-train-steps", "2")
    assert out.returncode == 0, out.stderr
    line = out.stdout.strip()
    assert line.startswith(f"ip netns exec {local_cluster.head.resource_id} ")
    for part in ("-launcher ssh", "-iface eth0", "-ppn 1", f"-genv MASTER_ADDR {local_cluster.head.private_ip}",
                 "-genv GLOO_SOCKET_IFNAME eth0", "-genv OMP_NUM_THREADS", "-m xeontune.train --model org/model",
                 "--max-train-steps 2",
                 "-genv XEONTUNE_LAUNCH_DIST_BACKEND gloo", "-genv XEONTUNE_LAUNCH_DIST_TIMEOUT 30"):
        assert part in line


def test_killing_one_rank_stops_the_job(local_cluster, tmp_path):
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    plan = probe_plan(local_cluster, "--sleep", "300", "--pid-dir", str(pid_dir), "--dist-timeout", "20")
    proc = subprocess.Popen(plan.argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    with stopped_on_exit(proc):
        deadline = time.monotonic() + 90
        while len(list(pid_dir.glob("*.pid"))) < 3 and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.2)
        assert len(list(pid_dir.glob("*.pid"))) == 3, "ranks did not start"
        time.sleep(2)  # mid-run: the ranks are in their all-reduce loop
        pids = {int(p.read_text()) for p in pid_dir.glob("*.pid")}
        rc, took = kill_and_time(proc, [int((pid_dir / "rank1.pid").read_text())])
    assert rc != 0
    assert took < 60
    time.sleep(1)
    alive = [p for p in pids if process_alive(p)]
    assert not alive, f"rank processes still running: {alive}"
    for node in local_cluster.nodes:
        out = subprocess.run(["ip", "netns", "pids", node.resource_id], capture_output=True, text=True).stdout
        cmds = [_cmdline(int(p)) for p in out.split()]
        assert not [c for c in cmds if "allreduce_probe" in c or "hydra" in c], cmds
    print(f"job ended {took:.1f} s after a rank was killed, rc={rc}")



def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def test_ctrl_c_stops_every_rank(local_cluster, tmp_path):
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    script = (
        "import sys\n"
        "from xeontune.job import start as launcher\n"
        "from xeontune.cluster import state\n"
        f"r = state.load({local_cluster.name!r})\n"
        f"p = launcher.build_plan(r, 3, 1, 'gloo', ['--sleep', '300', '--pid-dir', {str(pid_dir)!r}], module={PROBE!r})\n"
        "sys.exit(launcher.run_plan(p))\n"
    )
    # its own session, so the SIGINT below reaches the launcher and mpirun like a terminal's Ctrl-C
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=REPO, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 90
        while len(list(pid_dir.glob("*.pid"))) < 3 and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.2)
        pids = {int(p.read_text()) for p in pid_dir.glob("*.pid")}
        assert len(pids) == 3, "ranks did not start"
        time.sleep(1)
        os.killpg(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, err[-2000:]
    time.sleep(1)
    assert not [p for p in pids if process_alive(p)]


def test_missing_mpirun_is_a_one_line_error(local_cluster):
    out = cli("launch", "-n", "3", "--name", local_cluster.name, "--", *JOB, "--max-train-steps", "1",
              env={"XEONTUNE_MPIRUN": "/nonexistent/bin/mpirun"})
    assert out.returncode == 2
    assert out.stderr.strip().count("\n") == 0 and "no mpirun on the head node" in out.stderr


def test_too_many_ranks_is_a_one_line_error(local_cluster):
    out = cli("launch", "-n", "4", "--name", local_cluster.name, "--", *JOB, "--max-train-steps", "1")
    assert out.returncode == 2 and out.stderr.count("\n") == 1
    assert "3 hosts x --ppn 1 = 3" in out.stderr


def test_unreachable_node_is_named(local_cluster, monkeypatch):
    node = local_cluster.nodes[2]
    subprocess.run(["ip", "-n", node.resource_id, "link", "set", "eth0", "down"], check=True)
    monkeypatch.setattr(launcher, "SSH_CHECK_TIMEOUT_S", 4.0)
    try:
        plan = probe_plan(local_cluster)
        with pytest.raises(UserError, match=rf"node {node.name} \({node.private_ip}\).*did not answer SSH"):
            launcher.preflight(local_cluster, plan)
    finally:
        subprocess.run(["ip", "-n", node.resource_id, "link", "set", "eth0", "up"], check=True)
    ssh.wait_for_ssh(local_cluster, node, timeout_s=30)


def test_teardown_leaves_nothing(local_cluster):
    name = local_cluster.name
    assert leftovers(name)  # the cluster is there before
    out = cli("teardown", "--name", name)
    assert out.returncode == 0, out.stderr
    assert leftovers(name) == []
    assert not state.exists(name)
    again = cli("teardown", "--name", name)
    assert again.returncode == 0 and "nothing to tear down" in again.stdout


def test_teardown_after_a_crashed_up_and_a_lost_state_file(root_home, monkeypatch):
    """An `up` that dies half-way (here: sshd fails to start) leaves a record teardown can use,
    and with the record gone too, teardown still finds everything by the cluster's name."""
    from xeontune.cluster.providers import ClusterSpec, local

    name = f"t{os.getpid() % 100000}-crash"
    monkeypatch.setattr(local, "sshd_path", lambda: "/bin/false")
    try:
        with pytest.raises(UserError, match="creating local cluster .* failed: .*kept .*teardown --name"):
            manage.up(ClusterSpec(name=name, num_nodes=2), "local", keep_on_failure=True)
        assert state.exists(name) and leftovers(name)  # namespace, bridge and veth exist
        state.delete(name)  # the state file is lost as well
        with pytest.raises(UserError, match="left .* on this machine"):
            manage.up(ClusterSpec(name=name, num_nodes=2), "local")
    finally:
        out = cli("teardown", "--name", name, env={"XEONTUNE_HOME": str(root_home)})
    assert out.returncode == 0, out.stderr
    assert "deleted netns" in out.stdout and "deleted bridge" in out.stdout
    assert leftovers(name) == []


def test_a_stale_record_never_tears_down_another_cluster_of_its_name(root_home, tmp_path, monkeypatch):
    """Finding 12: the local provider tore down by name only. A record of an older cluster of the same
    name (here: in another state dir, with that cluster's id) deleted the cluster that holds the name
    now; only what carries the record's cluster id (the aliases of the bridge and of each namespace's
    lo) is deleted."""
    from xeontune.cluster import providers
    from xeontune.cluster.providers import ClusterSpec, local

    name = f"t{os.getpid() % 100000}-id"
    record, _ = manage.up(ClusterSpec(name=name, num_nodes=2), "local")
    try:
        assert record.cluster_id and local.link_alias(local.bridge_name(name)) == local.owner_tag(record.cluster_id)
        stale = dataclasses.replace(record, cluster_id="0123456789ab")
        monkeypatch.setenv("XEONTUNE_HOME", str(tmp_path / "other-home"))
        report = providers.get("local").terminate(name, stale)
        assert report.deleted == [] and len(report.searched) == 2, report
        assert sorted(x.split()[0] for x in leftovers(name) if not x.startswith("process")) == \
            ["link", "link", "link", "netns", "netns"]  # the bridge, two veths and both namespaces stay
        monkeypatch.setenv("XEONTUNE_HOME", str(root_home))
        assert ssh.run(record, record.nodes[1], ["true"])[0] == 0  # its sshds too
    finally:
        monkeypatch.setenv("XEONTUNE_HOME", str(root_home))
        down = manage.teardown(name, "local")
    assert down.ok and any(x.startswith("bridge") for x in down.deleted)
    assert leftovers(name) == []


def test_a_crashed_up_is_rolled_back_by_default(root_home, monkeypatch):
    from xeontune.cluster.providers import ClusterSpec, local

    name = f"t{os.getpid() % 100000}-undo"
    monkeypatch.setattr(local, "sshd_path", lambda: "/bin/false")
    try:
        with pytest.raises(UserError, match="creating local cluster .* failed: .*rolled back: nothing was left running"):
            manage.up(ClusterSpec(name=name, num_nodes=2), "local")
        assert leftovers(name) == [] and not state.exists(name)
    finally:
        if leftovers(name):
            manage.teardown(name, "local")


@pytest.mark.parametrize("fault", ["world-writable", "other-owner"])
def test_a_state_dir_others_could_write_is_refused_before_sshd_trusts_it(root_home, fault):
    from xeontune.cluster.providers import ClusterSpec

    name = f"t{os.getpid() % 100000}-perm{fault[0]}"
    root_home.mkdir(parents=True, exist_ok=True)
    if fault == "world-writable":
        os.chmod(root_home, 0o777)
        expected = rf"{re.escape(str(root_home))} is group- or world-writable \(mode 0777\)"
    else:
        os.chown(root_home, 4242, 4242)
        expected = rf"{re.escape(str(root_home))} is owned by uid 4242, not by you"
    try:
        with pytest.raises(UserError, match=expected):
            manage.up(ClusterSpec(name=name, num_nodes=1), "local")
        assert leftovers(name) == [] and not state.exists(name)
    finally:
        os.chmod(root_home, 0o755)
        os.chown(root_home, 0, 0)
        if leftovers(name) or state.exists(name):
            manage.teardown(name, "local")
