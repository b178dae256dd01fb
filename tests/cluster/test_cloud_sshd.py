"""Cloud nodes' sshd drops a vanished client within minutes (issue 29): what the bootstrap of an
aws or azure node asks for, what the node script writes, and what a real sshd makes of it.

Only the namespace nodes' sshd config was checked (tests/cluster/test_local_cluster.py); the cloud
path was a line of the script that no test ran. Here the node script runs as on a node, writing
into a drop-in folder of the test's own (never this machine's /etc/ssh), and `sshd -T` reads it
back through an `Include` placed as Ubuntu's sshd_config places it.
"""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
from pathlib import Path

from tests.cluster.clusterlib import require_installed
from xeontune.cluster import bootstrap
from xeontune.cluster.providers import local
from xeontune.cluster.state import ClusterRecord, Node


def record(provider: str) -> ClusterRecord:
    return ClusterRecord(name="c", provider=provider, nodes=[Node("node0", "head", "10.0.0.4")],
                         ssh_user="ubuntu", work_dir="/opt/xeontune/work")


def test_cloud_nodes_are_bootstrapped_with_keepalives_and_namespace_nodes_are_not():
    for provider in ("aws", "azure"):
        options = bootstrap.options_for(record(provider), None)
        argv = bootstrap.node_argv(record(provider), options, "/tmp/b/bootstrap-node.sh", "/tmp/b/x.whl")
        assert argv[argv.index("--client-alive") + 1] == "/etc/ssh/sshd_config.d", argv
    # namespace nodes share this machine's /etc/ssh: their own sshd configs carry the keepalives
    argv = bootstrap.node_argv(record("local"), bootstrap.options_for(record("local"), None), "s", "w")
    assert "--client-alive" not in argv


def test_the_node_script_writes_keepalives_that_sshd_applies(tmp_path):
    sshd = local.sshd_path()
    require_installed(None if sshd and shutil.which("ssh-keygen") else "needs openssh-server (scripts/install-test-deps.sh)")
    (tmp_path / "home").mkdir()
    drop_in = tmp_path / "sshd_config.d"
    user = pwd.getpwuid(os.getuid()).pw_name
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path / "home")}
    for _ in range(2):  # idempotent
        done = subprocess.run(["bash", str(bootstrap.NODE_SCRIPT), "--root", str(tmp_path / "opt"), "--user", user,
                               "--client-alive", str(drop_in)], capture_output=True, text=True, env=env, timeout=60)
        assert done.returncode == 0, done.stderr
    assert [p.name for p in drop_in.iterdir()] == ["60-xeontune.conf"]
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(tmp_path / "host_key")], check=True)
    # as Ubuntu's sshd_config: the drop-ins first (sshd keeps the first value it reads), its own lines after
    main = tmp_path / "sshd_config"
    main.write_text(f"Include {drop_in}/*.conf\nHostKey {tmp_path / 'host_key'}\nClientAliveInterval 0\n"
                    "ClientAliveCountMax 3\n")
    if os.geteuid() == 0:
        Path("/run/sshd").mkdir(exist_ok=True)  # sshd -T checks its privilege separation dir (as the local provider)
    shown = subprocess.run([sshd, "-T", "-f", str(main)], capture_output=True, text=True)
    assert shown.returncode == 0, shown.stderr
    settings = dict(line.split(" ", 1) for line in shown.stdout.splitlines() if " " in line)
    assert (settings["clientaliveinterval"], settings["clientalivecountmax"]) == ("30", "4")
