"""The SSH/SFTP bootstrap (xeontune/cluster/bootstrap.py + scripts/bootstrap-node.sh) against the
local provider's namespace hosts: real sshd, real SFTP, the wheel built from this checkout.

The namespaces have no route to a package index, so the script runs in its --offline mode (a venv
over the system's site-packages, the wheel without dependencies); what it proves is the path every
cloud bootstrap takes: same absolute venv path on every node, this exact code installed there,
the training data synced.
"""

from __future__ import annotations

import dataclasses
import os
import pwd
import subprocess

import pytest

from xeontune.cluster import bootstrap, ssh


@pytest.mark.slow
@pytest.mark.root
def test_bootstrap_installs_the_wheel_and_syncs_data_on_every_node(local_cluster, sample_images, tmp_path):
    record = local_cluster
    root = str(tmp_path / "opt-xeontune")  # one absolute path, the same on every node
    bootstrap.run(record, bootstrap.BootstrapOptions(root=root, offline=True, data_dir=str(sample_images),
                                                     parallel=False, timeout_s=300))
    images = sorted(p.name for p in sample_images.iterdir())
    for node in record.nodes:
        rc, out, err = ssh.run(record, node, [f"{root}/venv/bin/python", "-c",
                                              "import sys, xeontune; print(sys.prefix); print(xeontune.__file__)"])
        assert rc == 0, (node.name, err)
        prefix, module = out.split()
        assert prefix == f"{root}/venv" and module.startswith(f"{root}/venv/lib/"), (node.name, out)
        rc, out, err = ssh.run(record, node, ["ls", bootstrap.data_target(record, str(sample_images))])
        assert rc == 0 and out.split() == images, (node.name, out, err)
    # Idempotent: a second run over the same nodes succeeds too.
    bootstrap.run(record, bootstrap.BootstrapOptions(root=root, offline=True, parallel=False, timeout_s=300))


@pytest.mark.slow
@pytest.mark.root
def test_a_data_sync_leaves_exactly_the_folders_files_keyed_on_its_path(local_cluster, tmp_path):
    """Finding 3: a reused cluster trained on stale images: the sync never deleted, and its target
    was keyed on the folder's base name alone (``a/data`` and ``b/data`` shared one copy)."""
    from xeontune.job import run

    one = dataclasses.replace(local_cluster, nodes=[local_cluster.head])  # the nodes share this disk
    a, b = tmp_path / "a" / "data", tmp_path / "b" / "data"
    for folder, names in ((a, ["1.png", "2.png"]), (b, ["3.png"])):
        folder.mkdir(parents=True)
        for name in names:
            (folder / name).write_bytes(name.encode())
    first, other = run.sync_data(one, str(a)), run.sync_data(one, str(b))
    assert first != other and os.listdir(other) == ["3.png"]
    (a / "2.png").unlink()
    (a / "4.png").write_bytes(b"4")
    assert run.sync_data(one, str(a)) == first == run.remote_data_dir(one, str(a))
    assert sorted(os.listdir(first)) == ["1.png", "4.png"]
    assert not os.path.exists(f"{first}.sync")


@pytest.mark.slow
@pytest.mark.root
def test_the_head_interface_is_found_by_its_private_address(local_cluster):
    record = dataclasses.replace(local_cluster, iface=None)
    bootstrap._record_iface(record)
    assert record.iface == "eth0"  # what the namespace hosts use; ens5 / eth0 on EC2 / Azure


@pytest.mark.slow
@pytest.mark.root
def test_bootstrap_names_the_node_that_failed(local_cluster, tmp_path):
    with pytest.raises(Exception, match=r"bootstrap of node node0 failed .*--root must be absolute"):
        bootstrap.run(local_cluster, bootstrap.BootstrapOptions(root="relative/path", offline=True, parallel=False))


def _node_script(tmp_path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path / "home")}
    return subprocess.run(["bash", str(bootstrap.NODE_SCRIPT), *args], capture_output=True, text=True, env=env,
                          timeout=60)


def test_node_script_makes_the_head_key_once_and_authorizes_a_key_once(tmp_path):
    """The cloud-only steps, run here as the script runs on a node (HOME is the login user's)."""
    (tmp_path / "home").mkdir()
    root, key = tmp_path / "opt", tmp_path / "opt" / "keys" / "id_ed25519"
    user = pwd.getpwuid(os.getuid()).pw_name
    first = _node_script(tmp_path, "--root", str(root), "--user", user, "--make-cluster-key", str(key))
    assert first.returncode == 0, first.stderr
    assert first.stdout.startswith("ssh-ed25519 ") and key.stat().st_mode & 0o777 == 0o600
    again = _node_script(tmp_path, "--root", str(root), "--user", user, "--make-cluster-key", str(key))
    assert again.stdout == first.stdout  # idempotent: the key is made once
    line = first.stdout.strip()
    for _ in range(2):
        done = _node_script(tmp_path, "--root", str(root), "--user", user, "--authorize-key", line)
        assert done.returncode == 0, done.stderr
    authorized = tmp_path / "home" / ".ssh" / "authorized_keys"
    assert authorized.read_text().splitlines() == [line]
    assert authorized.stat().st_mode & 0o777 == 0o600
    bad = _node_script(tmp_path, "--root", "relative", "--user", user)
    assert bad.returncode == 2 and "--root must be absolute" in bad.stderr
