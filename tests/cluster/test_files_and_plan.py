"""Fast tests (no root, no cluster): generated files, keys, known_hosts, the mpirun command, CLI errors."""

from __future__ import annotations

import os
import shlex
import stat
import sys
from pathlib import Path

import pytest

from xeontune import hardware
from xeontune.cli import main
from xeontune.cluster import files, manage, ssh, state
from xeontune.cluster.state import ClusterRecord, Node
from xeontune.errors import UserError
from xeontune.job import spec as job_spec
from xeontune.job import start as launcher
from xeontune.train.ranks import frozen_weight_bytes

# the options every job needs (a hub id for the model, a folder that exists for the data)
REQUIRED = ["--model", "org/model", "--data-dir", str(Path(__file__).parent), "--placeholder-token", "<t>",
            "--initializer-token", "toy"]


@pytest.fixture
def record(xeontune_home) -> ClusterRecord:
    cdir = state.cluster_dir("demo")
    rec = ClusterRecord(
        name="demo", provider="local", key_path=str(cdir / "id_ed25519"), known_hosts_path=str(cdir / "known_hosts"),
        work_dir=str(cdir / "work"), iface="eth0",
        nodes=[Node("node0", "head", "10.231.9.11", resource_id="xeontune-demo-node0"),
               Node("node1", "worker", "10.231.9.12", resource_id="xeontune-demo-node1"),
               Node("node2", "worker", "10.231.9.13", resource_id="xeontune-demo-node2")])
    state.save(rec)
    return rec


def cloud_record(xeontune_home) -> ClusterRecord:
    return ClusterRecord(
        name="sky", provider="aws", key_path="/k/id", known_hosts_path="/k/known_hosts", work_dir="/opt/xt/work",
        iface="ens5", remote_key_path="/opt/xt/id", remote_known_hosts_path="/opt/xt/known_hosts",
        venv="/opt/xt/venv", cores_per_node=16,
        nodes=[Node("node0", "head", "172.31.0.10", public_ip="3.3.3.3"), Node("node1", "worker", "172.31.0.11")])


def test_keypair_is_private_and_openssh(tmp_path):
    line = ssh.generate_keypair(tmp_path / "id", comment="c")
    assert stat.S_IMODE(os.stat(tmp_path / "id").st_mode) == 0o600
    assert line.startswith("ssh-ed25519 ") and line.endswith(" c")
    assert (tmp_path / "id").read_text().startswith("-----BEGIN OPENSSH PRIVATE KEY-----")
    import paramiko

    assert paramiko.Ed25519Key.from_private_key_file(str(tmp_path / "id")).get_base64() == line.split()[1]


def test_pin_host_key_replaces_only_that_node(record, tmp_path):
    a, b, c = (ssh.generate_keypair(tmp_path / f"h{i}") for i in range(3))
    ssh.pin_host_key(record, record.nodes[0], a)
    ssh.pin_host_key(record, record.nodes[1], b)
    ssh.pin_host_key(record, record.nodes[0], c)  # re-pinned: the old key must go
    lines = Path(record.known_hosts_path).read_text().splitlines()
    assert lines == [f"node1,10.231.9.12 {' '.join(b.split()[:2])}", f"node0,10.231.9.11 {' '.join(c.split()[:2])}"]
    import paramiko

    keys = paramiko.HostKeys(record.known_hosts_path)
    assert keys.lookup("10.231.9.11")["ssh-ed25519"].get_base64() == c.split()[1]


def test_cluster_files(record):
    written = files.write_cluster_files(record)
    work = files.files_dir(record)
    assert (work / "hosts").read_text() == "10.231.9.11\n10.231.9.12\n10.231.9.13\n"
    config = (work / "ssh_config.internal").read_text()
    assert "StrictHostKeyChecking yes" in config and "StrictHostKeyChecking no" not in config
    assert f"UserKnownHostsFile {record.known_hosts_path}" in config and "ProxyJump" not in config
    assert os.access(work / "ssh", os.X_OK)
    assert shlex.split((work / "ssh").read_text().splitlines()[-1]) == [
        "exec", "ssh", "-F", str(work / "ssh_config.internal"), "$@"]
    # No accelerate configs: ranks take everything from mpirun's environment (docs/cluster.md).
    assert sorted(written) == ["hosts", "ssh", "ssh_config", "ssh_config.internal"]
    assert sorted(p.name for p in work.iterdir()) == sorted(written)


def test_cloud_ssh_configs_jump_through_the_head(xeontune_home):
    rec = cloud_record(xeontune_home)
    outside = files.ssh_config_text(rec, internal=False)
    assert "HostName 3.3.3.3" in outside and "ProxyJump node0" in outside
    inside = files.ssh_config_text(rec, internal=True)
    assert "HostName 172.31.0.10" in inside and "ProxyJump" not in inside and "IdentityFile /opt/xt/id" in inside


def test_launch_refuses_fused_backward_pass_on_several_ranks(record, capsys):
    """`launch` on any engine (the plan is the engine-free part): one process or a one-line error."""
    full = ["--model", "org/model", "--data-dir", REQUIRED[3], "--method", "full", "--instance-prompt", "a toy",
            "--fused-backward-pass"]
    with pytest.raises(UserError, match="--fused-backward-pass runs in one process, not 3 ranks"):
        job_spec.launch_spec(record, job_spec.read_request(["--", *full]), 3)
    assert job_spec.launch_spec(record, job_spec.read_request(["--", *full]), 1).ranks == 1
    assert main(["launch", "-n", "3", "--name", "demo", "--dry-run", "--", *full]) == 2
    assert "--fused-backward-pass runs in one process" in capsys.readouterr().err


def test_dry_run_is_the_command_that_runs(record, capsys, monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert main(["launch", "-n", "3", "--name", "demo", "--dry-run", "--", *REQUIRED, "--max-train-steps", "2"]) == 0
    argv = shlex.split(capsys.readouterr().out)
    spec = job_spec.launch_spec(record, job_spec.read_request(["--", *REQUIRED, "--max-train-steps", "2"]), 3)
    plan = launcher.plan_for(record, spec)
    assert argv == plan.argv
    assert argv[:6] == ["ip", "netns", "exec", "xeontune-demo-node0", "env", "-i"]
    genv = {argv[i + 1]: argv[i + 2] for i, a in enumerate(argv) if a == "-genv"}
    assert genv["MASTER_ADDR"] == "10.231.9.11" and genv["MASTER_PORT"] == "29500"
    assert genv["GLOO_SOCKET_IFNAME"] == "eth0"
    assert genv["OMP_NUM_THREADS"] == str(max(1, (os.cpu_count() or 1) // 3))
    assert "-genvnone" in argv and "-prepend-rank" in argv
    tail = argv[argv.index("-m") - 1:]
    # the merged options, as explicit flags, in the options' own order
    assert tail == [sys.executable, "-m", "xeontune.train", "--model", "org/model", "--data-dir", REQUIRED[3],
                    "--placeholder-token", "<t>", "--initializer-token", "toy", "--max-train-steps", "2"]
    assert genv["XEONTUNE_LAUNCH_DIST_BACKEND"] == "gloo"
    assert genv["XEONTUNE_LAUNCH_DIST_TIMEOUT"] == str(launcher.DEFAULT_DIST_TIMEOUT_S)


def test_env_values_are_never_in_a_command_line(record, capsys, xeontune_home):
    """Finding 9: `--env HF_TOKEN=...` travelled in mpirun's (and ssh's) arguments, visible in `ps` on
    this machine and the head, and `--dry-run` printed it. Now only its name is in the command; the
    value waits in a 0600 file in a 0700 job dir on the head, which the head's shell exports and
    deletes before mpirun passes the name on (-genvlist)."""
    secret = "hf_s3cr3t-value"
    state.save(cloud_record(xeontune_home))
    for name in ("demo", "sky"):
        assert main(["launch", "--name", name, "--dry-run", "--env", f"HF_TOKEN={secret}", "--env", "B=x y", "--",
                     *REQUIRED]) == 0
        out = capsys.readouterr().out
        assert secret not in out and "x y" not in out
        argv = shlex.split(out) if name == "demo" else shlex.split(shlex.split(out)[-1])
        assert argv[argv.index("-genvlist") + 1] == "HF_TOKEN,B" and "-genvnone" not in argv
        assert argv[argv.index("sh") + 1:argv.index("sh") + 3] == ["-c", launcher.SOURCE_AND_EXEC]
    job_dir = str(xeontune_home / "job")
    launcher.write_secret_env(record, job_dir, {"HF_TOKEN": secret, "B": "x y'z"})
    assert stat.S_IMODE(os.stat(job_dir).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(Path(job_dir) / "env").st_mode) == 0o600
    import subprocess

    shown = subprocess.run(["sh", "-c", launcher.SOURCE_AND_EXEC, str(Path(job_dir) / "env"), "sh", "-c",
                            'printf "%s|%s" "$HF_TOKEN" "$B"'], capture_output=True, text=True)
    assert shown.stdout == f"{secret}|x y'z" and not (Path(job_dir) / "env").exists()  # read once, then gone


def ranks_options(capsys, monkeypatch, *train_args: str):
    """What a rank of `launch --dry-run -- TRAIN_ARGS` parses: its arguments, under its -genv variables."""
    from xeontune.train.options import parse_args

    assert main(["launch", "-n", "3", "--name", "demo", "--dry-run", "--", *train_args]) == 0
    argv = shlex.split(capsys.readouterr().out)
    for i, a in enumerate(argv):
        if a == "-genv" and argv[i + 1].startswith("XEONTUNE_"):
            monkeypatch.setenv(argv[i + 1], argv[i + 2])
    return parse_args(argv[argv.index("xeontune.train") + 1:])


@pytest.mark.parametrize("spelling", ["kebab", "snake", "config"])
def test_the_users_dist_options_win_over_launchs_in_every_spelling(record, capsys, monkeypatch, tmp_path, spelling):
    required = REQUIRED
    monkeypatch.setattr(hardware, "ccl_available", lambda: (True, "ok"))  # ccl is checked up front now
    if spelling == "config":
        cfg = tmp_path / "run.yaml"
        cfg.write_text("dist_timeout: 300\ndist_backend: ccl\n")
        given = ["--config", str(cfg)]
    else:
        sep = "-" if spelling == "kebab" else "_"
        given = [f"--dist{sep}timeout", "300", f"--dist{sep}backend", "ccl"]
    opts = ranks_options(capsys, monkeypatch, *required, *given)
    assert (opts.dist_timeout, opts.dist_backend) == (300, "ccl")


def test_launchs_dist_defaults_reach_the_ranks(record, capsys, monkeypatch):
    opts = ranks_options(capsys, monkeypatch, *REQUIRED)
    assert (opts.dist_timeout, opts.dist_backend) == (launcher.DEFAULT_DIST_TIMEOUT_S, "gloo")


def test_ccl_sets_its_variables(record, monkeypatch):
    monkeypatch.setattr(hardware, "ccl_available", lambda: (True, "ok"))
    plan = launcher.build_plan(record, 2, 1, "auto", ["--dist-timeout", "9"])
    assert plan.backend == "ccl" and plan.env["CCL_ATL_TRANSPORT"] == "ofi" and plan.env["CCL_WORKER_COUNT"] == "1"
    assert plan.env["XEONTUNE_LAUNCH_DIST_BACKEND"] == "ccl"
    assert plan.argv[-2:] == ["--dist-timeout", "9"]


def test_ccl_without_bindings_is_a_user_error(record, monkeypatch):
    monkeypatch.setattr(hardware, "ccl_available", lambda: (False, "it does not import"))
    with pytest.raises(UserError, match="oneccl_bindings_for_pytorch"):
        launcher.build_plan(record, 2, 1, "ccl", [])
    with pytest.raises(UserError, match="oneccl_bindings_for_pytorch"):  # given after --: checked before any rank
        job_spec.read_request([*REQUIRED, "--dist-backend", "ccl"])
    with pytest.raises(UserError, match="give one"):
        job_spec.read_request([*REQUIRED, "--dist_backend", "ccl"], backend="gloo")
    assert launcher.build_plan(record, 2, 1, "auto", []).backend == "gloo"
    monkeypatch.setattr(hardware, "ccl_available", lambda: (True, "ok"))
    assert job_spec.read_request([*REQUIRED, "--dist-backend", "gloo"]).backend == "gloo"  # not auto's ccl


def test_cloud_plan_runs_on_the_head_over_ssh(xeontune_home):
    rec = cloud_record(xeontune_home)
    plan = launcher.build_plan(rec, 4, 2, "gloo", [])
    assert plan.argv[:4] == ["ssh", "-F", str(files.files_dir(rec) / "ssh_config"), "-tt"]
    remote = shlex.split(plan.argv[-1])
    assert remote[0] == "/opt/xt/venv/bin/mpirun" and "-f" in remote and remote[remote.index("-f") + 1] == "/opt/xt/work/hosts"
    assert remote[remote.index("-iface") + 1] == "ens5" and plan.env["OMP_NUM_THREADS"] == "8"
    assert "/opt/xt/venv/bin/python" in remote


@pytest.mark.parametrize(("argv", "message"), [
    (["launch", "-n", "4", "--name", "demo", "--dry-run", "--", *REQUIRED], "more ranks than cluster 'demo' holds (3 hosts x --ppn 1 = 3)"),
    (["launch", "-n", "1", "--name", "nope", "--dry-run"], "unknown cluster 'nope'"),
    (["cluster", "ssh", "node7", "--name", "demo"], "has no node 'node7'"),
    (["launch", "-n", "1", "--name", "demo", "--dry-run", "--env", "NOEQUALS"], "give KEY=VALUE, or export it"),
    (["launch", "-n", "1", "--name", "demo", "--dry-run", "--env", "=x"], "--env takes KEY=VALUE or KEY"),
])
def test_user_errors_are_one_line_exit_2(record, capsys, argv, message):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err


def test_missing_mpirun_is_a_user_error(record, monkeypatch):
    monkeypatch.setenv("XEONTUNE_MPIRUN", "/nonexistent/mpirun")
    plan = launcher.build_plan(record, 3, 1, "gloo", [])
    with pytest.raises(UserError, match=r"no mpirun on the head node \(looked for /nonexistent/mpirun\)"):
        launcher.preflight(record, plan)


def test_local_provider_says_what_is_missing(xeontune_home, monkeypatch, capsys):
    from xeontune.cluster.providers import local

    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    monkeypatch.setattr(local, "sshd_path", lambda: None)
    assert main(["cluster", "up", "--provider", "local", "-n", "2", "--name", "x"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "needs root" in err and "openssh-server" in err
    assert not state.exists("x")


def test_localhost_cluster_lifecycle(xeontune_home, capsys):
    assert main(["cluster", "up", "--provider", "localhost", "-n", "3", "--name", "solo"]) == 0
    assert "files in" not in capsys.readouterr().out  # the node is this machine: no SSH files
    rec = state.load("solo")
    assert not files.files_dir(rec).exists() or not any(files.files_dir(rec).iterdir())
    assert rec.provider == "localhost" and rec.extra["slots"] == "3"
    plan = launcher.build_plan(rec, 3, 1, "gloo", [])
    assert "-launcher" in plan.argv and plan.argv[plan.argv.index("-launcher") + 1] == "fork"
    assert plan.env["MASTER_ADDR"] == "127.0.0.1" and plan.env["GLOO_SOCKET_IFNAME"] == "lo"
    assert main(["cluster", "status"]) == 0
    assert "solo" in capsys.readouterr().out
    assert main(["cluster", "up", "--provider", "localhost", "-n", "3", "--name", "solo"]) == 2  # exists already
    assert main(["teardown", "--name", "solo"]) == 0
    assert not state.exists("solo")
    assert main(["teardown", "--name", "solo"]) == 0
    assert "nothing to tear down" in capsys.readouterr().out


def test_teardown_without_record_is_idempotent(xeontune_home, capsys):
    assert manage.teardown("ghost").ok
    assert main(["teardown", "--name", "ghost"]) == 0


def test_ppn_auto_follows_this_cpu_only_where_the_nodes_are_this_machine(
        xeontune_home, tiny_model, monkeypatch, fake_cpu):
    """`--pack-weights auto` and `--mixed-precision auto` depend on the CPU. Namespace "hosts" share this
    machine's: the per-rank memory follows this CPU's rules there. A cloud's or Slurm's nodes are other
    machines (their cores come from the provider or sinfo; a Slurm login node's CPU need not be its compute
    nodes'): packed weights stay counted and auto precision is sized as fp32, the safe side."""
    import dataclasses

    from xeontune.train import ranks

    seen: list[tuple[bool, str]] = []
    monkeypatch.setattr(ranks, "rank_memory",
                        lambda opts, precision, here=True: seen.append((here, precision)) or 10**9)
    args = ["--model", str(tiny_model), *REQUIRED[2:], "--mixed-precision", "auto"]
    cloud = cloud_record(xeontune_home)
    for record in (cloud, dataclasses.replace(cloud, provider="slurm"),
                   dataclasses.replace(cloud, provider="local", cores_per_node=None, memory_per_node=None)):
        job_spec.resolve_ppn(record, job_spec.read_request(args, "auto", remote=record.provider == "aws"))
    this_cpu = "bf16" if fake_cpu == "amx-xeon" else "fp32"
    assert seen == [(False, "fp32"), (False, "fp32"), (True, this_cpu)]


def test_ppn_auto_follows_the_ranks_per_node_rule(xeontune_home, capsys, tiny_model):
    """`launch --ppn auto` applies `train --nproc-per-node auto`'s rule to one node; ranks pin themselves
    to their own cores on real nodes, not on namespace "hosts" that share this machine's cores."""
    from xeontune import placement

    rec = cloud_record(xeontune_home)
    state.save(rec)
    args = ["--model", str(tiny_model), "--resolution", "512", *REQUIRED[2:]]

    def resolve_ppn(record: ClusterRecord, ppn: str, args: list[str]) -> int:
        return job_spec.resolve_ppn(record, job_spec.read_request(args, ppn, remote=True))
    assert resolve_ppn(rec, "auto", args) == 8  # 16 physical cores: 8 ranks x 2 (docs/performance.md)
    rec.cores_per_node = 2
    assert resolve_ppn(rec, "auto", args) == 2  # 2 cores: 2 x 1
    assert resolve_ppn(rec, "3", args) == 3
    rec.cores_per_node = 16
    # A node whose RAM holds fewer ranks than its cores would: memory decides.
    from xeontune.train import families

    per_rank = placement.rank_memory_bytes(frozen_weight_bytes(str(tiny_model), "fp32"),  # auto: sized as fp32
                                           families.get("sd").activation_bytes(512, "fp32"), 1)
    rec.memory_per_node = int(3.5 * per_rank / (1 - placement.RESERVED_FRACTION))
    assert resolve_ppn(rec, "auto", args) == 3
    rec.memory_per_node = 64 * 2**30
    assert resolve_ppn(rec, "auto", args) == 8
    state.save(rec)
    assert main(["launch", "--ppn", "auto", "--name", "sky", "--dry-run", "--", *args]) == 0
    remote = shlex.split(shlex.split(capsys.readouterr().out)[-1])
    assert remote[remote.index("-ppn") + 1] == "8" and remote[remote.index("-n") + 1] == "16"  # -n: every slot
    plan_env = launcher.build_plan(rec, 16, 8, "gloo", []).env
    assert plan_env[placement.PIN_ENV] == "1" and placement.SHARED_MACHINE_ENV not in plan_env  # 8 a node


def test_namespace_hosts_do_not_pin_share_the_memory_and_bad_ppn_is_one_line(record, capsys):
    """Namespace "hosts" share this machine's cores and memory: no rank pins itself, and every rank sizes
    its packing by its share of the machine among all the job's ranks (each namespace's mpirun would count
    its own only)."""
    from xeontune import placement

    env = launcher.build_plan(record, 3, 1, "gloo", []).env
    assert placement.PIN_ENV not in env and env[placement.SHARED_MACHINE_ENV] == "3"
    assert placement.local_ranks({**env, "MPI_LOCALNRANKS": "1"}) == 3
    assert main(["launch", "--ppn", "two", "--name", "demo", "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--ppn must be a positive number or auto" in err


def test_a_record_written_before_the_typed_fields_still_loads(xeontune_home):
    """Older state files kept these keys as strings in `extra`; they load into the typed fields."""
    from xeontune.io import atomic_write_json

    old = {  # the fields of the record before, as `up` wrote them
        "name": "old", "provider": "aws", "nodes": [{"name": "node0", "role": "head", "private_ip": "172.31.0.10",
                                                     "public_ip": None, "resource_id": "i-1"}],
        "ssh_user": "ubuntu", "key_path": "/k", "known_hosts_path": "/kh", "work_dir": "/opt/xeontune/work",
        "iface": None, "region": "us-east-1", "resources": [{"kind": "instance", "id": "i-1", "region": "us-east-1"}],
        "extra": {"venv": "/opt/xeontune/venv", "remote_key_path": "/opt/xeontune/keys/id_ed25519",
                  "cores_per_node": "8", "instance_type": "m7i.4xlarge", "skip_bootstrap": "1",
                  "mixed_precision": "bf16", "vpc": "vpc-1"},
    }
    atomic_write_json(state.record_path("old"), old)
    rec = state.load("old")
    assert (rec.venv, rec.remote_key_path, rec.cores_per_node, rec.instance_type, rec.skip_bootstrap) == (
        "/opt/xeontune/venv", "/opt/xeontune/keys/id_ed25519", 8, "m7i.4xlarge", True)
    assert rec.extra == {"vpc": "vpc-1"}  # the provider's own key stays; the precision is no longer recorded
    state.save(rec)
    assert state.load("old") == rec


def test_a_name_with_a_trailing_newline_is_refused(xeontune_home, capsys):
    with pytest.raises(UserError, match="invalid cluster name"):
        state.validate_name("demo\n")
    assert main(["cluster", "up", "--provider", "localhost", "--name", "demo\n"]) == 2
    assert "invalid cluster name" in capsys.readouterr().err
    assert not (xeontune_home / "clusters").exists() or not any((xeontune_home / "clusters").iterdir())


def test_up_and_teardown_of_a_busy_name_fail_at_once_naming_the_holder(xeontune_home, capsys):
    import subprocess
    import time

    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time\nfrom xeontune.cluster import state\n"
         "with state.locked('busy', 'cluster up'):\n    print('held', flush=True)\n    time.sleep(60)\n"],
        stdout=subprocess.PIPE, text=True, env={**os.environ, "XEONTUNE_HOME": str(xeontune_home)})
    try:
        assert holder.stdout.readline().strip() == "held"
        start = time.monotonic()
        assert main(["cluster", "up", "--provider", "localhost", "--name", "busy"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"cluster 'busy' is busy: pid {holder.pid} (`xeontune cluster up`)" in err
        assert main(["teardown", "--name", "busy"]) == 2
        assert f"pid {holder.pid}" in capsys.readouterr().err
        assert time.monotonic() - start < 10  # at once, not after the holder is done
        assert not state.exists("busy")
    finally:
        holder.kill()
        holder.wait()
    assert main(["cluster", "up", "--provider", "localhost", "--name", "busy"]) == 0  # released with its holder
    assert main(["teardown", "--name", "busy"]) == 0


def test_remote_ranks_get_no_local_paths(record, xeontune_home, capsys, monkeypatch):
    """HF_HOME, HF_HUB_CACHE and LD_PRELOAD name files on this machine: ranks here get them,
    a cloud node never does (it has its own, or none); the offline switches go everywhere."""
    state.save(cloud_record(xeontune_home))
    for key, value in {"HF_HOME": "/home/me/hf", "HF_HUB_CACHE": "/home/me/hf/hub", "HF_HUB_OFFLINE": "1",
                       "LD_PRELOAD": "/home/me/lib/libtcmalloc.so"}.items():
        monkeypatch.setenv(key, value)
    assert main(["launch", "-n", "2", "--name", "sky", "--dry-run", "--", *REQUIRED]) == 0
    line = capsys.readouterr().out
    remote = shlex.split(shlex.split(line)[-1])
    genv = {remote[i + 1]: remote[i + 2] for i, a in enumerate(remote) if a == "-genv"}
    assert genv["HF_HUB_OFFLINE"] == "1" and "/home/me" not in line
    assert not {"HF_HOME", "HF_HUB_CACHE", "LD_PRELOAD"} & set(genv)
    assert main(["launch", "-n", "3", "--name", "demo", "--dry-run", "--", *REQUIRED]) == 0  # the namespace hosts share this machine
    argv = shlex.split(capsys.readouterr().out)
    genv = {argv[i + 1]: argv[i + 2] for i, a in enumerate(argv) if a == "-genv"}
    assert genv["HF_HOME"] == "/home/me/hf" and genv["LD_PRELOAD"] == "/home/me/lib/libtcmalloc.so"


def test_a_private_key_is_0600_before_its_first_byte_is_written(tmp_path, monkeypatch):
    modes: list[int] = []
    real = Path.write_text

    def watch(self, data, *args, **kwargs):
        if "PRIVATE KEY" in data:
            modes.append(stat.S_IMODE(os.stat(self).st_mode))
        return real(self, data, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", watch)
    old = os.umask(0)  # even a careless umask does not open it
    try:
        ssh.generate_keypair(tmp_path / "id")
    finally:
        os.umask(old)
    assert modes == [0o600] and stat.S_IMODE(os.stat(tmp_path / "id").st_mode) == 0o600


def test_ranks_launched_from_a_checkout_import_xeontune_from_it():
    """The ranks' PYTHONPATH is the folder holding the package (it was the package folder itself, which
    put xeontune's own modules, io.py among them, first on every rank's path)."""
    from xeontune.job import start

    root = start.rank_pythonpath()
    if root is None:  # installed into the venv, not run from a checkout: nothing to add
        assert Path(sys.prefix).resolve() in Path(start.__file__).resolve().parents
        return
    assert (Path(root) / "xeontune" / "job" / "start.py").resolve() == Path(start.__file__).resolve()
