"""A provider is one module plus one registration: a fake one, kept under tests/, runs `cluster up`,
`launch --dry-run`, `cluster status` and `teardown` through the CLI without any other file knowing it."""

from __future__ import annotations

import shlex

import pytest

from tests.cluster import fake_provider
from xeontune.cli import main
from xeontune.cluster import files, providers, state


@pytest.fixture
def fake(xeontune_home):
    providers.register("fake", fake_provider.__name__)
    fake_provider.CALLS.clear()
    yield fake_provider.CALLS
    providers.unregister("fake")


def test_a_registered_provider_runs_the_whole_flow(fake, capsys):
    assert main(["cluster", "up", "--provider", "fake", "-n", "2", "--name", "seam"]) == 0
    out = capsys.readouterr().out
    assert fake == [("up", 2), ("wait", 7.0)]  # its own wait timeout, no bootstrap
    assert "estimated cost: $1.00/hour" in out and "next: xeontune launch -n 2 --name seam" in out
    record = state.load("seam")
    assert record.provider == "fake" and record.extra == {"rack": "r1"}
    assert (files.files_dir(record) / "hosts").read_text() == "192.0.2.10\n192.0.2.11\n"

    # The defaults of a remote provider: mpirun from the nodes' venv, on the head over SSH.
    job = ["--model", "org/model", "--data-dir", "/srv/data", "--placeholder-token", "<t>", "--initializer-token", "toy"]
    assert main(["launch", "-n", "4", "--ppn", "2", "--name", "seam", "--dry-run", "--", *job, "--max-train-steps", "1"]) == 0
    argv = shlex.split(capsys.readouterr().out)
    assert argv[:6] == ["ssh", "-F", str(files.files_dir(record) / "ssh_config"), "-tt", "node0", "--"]
    remote = shlex.split(argv[6])
    assert remote[:9] == ["/srv/fake/venv/bin/mpirun", "-n", "4", "-f", "/srv/fake/work/hosts", "-ppn", "2",
                          "-launcher", "ssh"]
    assert remote[remote.index("-iface") + 1] == "fk0" and remote[remote.index("-wdir") + 1] == "/srv/fake/work"
    genv = {remote[i + 1]: remote[i + 2] for i, a in enumerate(remote) if a == "-genv"}
    assert genv["OMP_NUM_THREADS"] == "2" and genv["GLOO_SOCKET_IFNAME"] == "fk0"  # 4 cores / --ppn 2
    assert genv["MASTER_ADDR"] == "192.0.2.10" and "PATH" not in genv  # the node's own PATH
    assert remote[remote.index("-m") - 1] == "/srv/fake/venv/bin/python"

    assert main(["launch", "-n", "5", "--ppn", "2", "--name", "seam", "--dry-run", "--", *job]) == 2
    assert "(2 hosts x --ppn 2 = 4)" in capsys.readouterr().err

    assert main(["cluster", "status", "--name", "seam"]) == 0
    assert capsys.readouterr().out.count("humming") == 2

    assert main(["teardown", "--name", "seam"]) == 0
    out = capsys.readouterr().out
    assert "deleted fake node fake-0" in out and "deleted fake node fake-1" in out
    assert fake[-1] == ("terminate", "r1") and not state.exists("seam")


def test_up_names_where_the_nodes_hold_the_data(fake, capsys, tmp_path, monkeypatch):
    """A bootstrapped cluster's nodes hold --data-dir at a path of their own (its name and a digest of
    the path here): `up` says which, and the next command carries it (the docs' guess was wrong)."""
    from xeontune.cluster import bootstrap

    data = tmp_path / "my-concept"
    data.mkdir()
    synced = []
    monkeypatch.setattr(fake_provider.Fake, "needs_bootstrap", True)
    monkeypatch.setattr(bootstrap, "run", lambda record, options: synced.append(options.data_dir))
    assert main(["cluster", "up", "--provider", "fake", "-n", "2", "--name", "data", "--data-dir", str(data)]) == 0
    out = capsys.readouterr().out
    node_data = bootstrap.data_target(state.load("data"), str(data))
    assert synced == [str(data)] and node_data.startswith("/srv/fake/work/data/my-concept-")
    assert f"is copied to {node_data} on every node" in out
    assert f"next: xeontune launch -n 2 --name data -- --data-dir {node_data} <train options>" in out
    assert main(["teardown", "--name", "data"]) == 0


def test_an_unregistered_provider_is_refused(fake, capsys):
    providers.unregister("fake")
    with pytest.raises(SystemExit):  # argparse: not among the choices, which come from the registry
        main(["cluster", "up", "--provider", "fake", "-n", "1", "--name", "seam"])
    assert "invalid choice: 'fake'" in capsys.readouterr().err
    assert not state.exists("seam") and fake == []
