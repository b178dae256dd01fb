"""The `localhost` provider for real: three ranks on this machine with Hydra's fork launcher (no root)."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest

from tests.cluster.clusterlib import REPO, cli, train_args
from tests.trainlib import OFFLINE
from xeontune.cluster import files, manage, providers
from xeontune.job import start as launcher

pytestmark = [pytest.mark.slow, pytest.mark.solo]  # localhost jobs: this machine to themselves


def test_three_ranks_all_reduce_on_localhost(xeontune_home):
    record, written = manage.up(providers.ClusterSpec(name="solo", num_nodes=3), "localhost")
    try:
        assert written == {} and not (files.files_dir(record) / "hosts").exists()  # no SSH, no hosts file
        plan = launcher.build_plan(record, 3, 1, "gloo", [], module="tests.cluster.allreduce_probe")
        launcher.preflight(record, plan)
        proc = subprocess.run(plan.argv, cwd=REPO, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        lines = [line for line in proc.stdout.splitlines() if "probe rank=" in line]
        assert len(lines) == 3 and all("ok=True" in line and "master=127.0.0.1" in line for line in lines)
    finally:
        assert manage.teardown("solo").ok


def test_teardown_stops_a_detached_job_whose_ranks_run_here(xeontune_home, tiny_model, sample_images, tmp_path):
    """"Nothing left running": the job's runner, mpirun and ranks ran on after `teardown` had deleted the
    cluster and the job's record (so `logs` and `fetch` could no longer reach them)."""
    from xeontune.job import record as job_record

    tiny = {"model": tiny_model, "data": sample_images}
    assert cli("cluster", "up", "--provider", "localhost", "-n", "1", "--name", "busy").returncode == 0
    try:
        started = cli("launch", "--name", "busy", "--detach", "--",
                      *train_args(tiny, tmp_path / "out", 1, 100_000, "--mixed-precision", "fp32"), env=OFFLINE)
        assert started.returncode == 0, started.stdout + started.stderr
        job = job_record.load_job("busy")
        metrics = tmp_path / "out" / "metrics.jsonl"
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and not (metrics.is_file() and metrics.read_text().count("\n") >= 2):
            time.sleep(0.5)
        assert metrics.is_file() and Path(f"/proc/{job.pid}").exists()
        # a second job would share the cores (and MASTER_PORT) with this one: refused, as on the other providers
        second = cli("launch", "--name", "busy", "--", *train_args(tiny, tmp_path / "out2", 1, 1), env=OFFLINE)
        assert second.returncode == 2 and "training already" in second.stderr, second.stdout + second.stderr
        assert not (tmp_path / "out2").exists()
    finally:
        down = cli("teardown", "--name", "busy", timeout=120)
    assert down.returncode == 0 and f"stopping job {job.id}" in down.stderr, down.stdout + down.stderr
    assert not Path(f"/proc/{job.pid}").exists()
    ranks = subprocess.run(["pgrep", "-f", f"xeontune.train.*{tmp_path / 'out'}"], capture_output=True, text=True)
    assert ranks.stdout.strip() == "", ranks.stdout


def test_status_lists_the_other_clusters_past_a_damaged_record(xeontune_home):
    from xeontune.cluster import state

    for name in ("good", "bad"):
        assert cli("cluster", "up", "--provider", "localhost", "-n", "1", "--name", name).returncode == 0
    (state.cluster_dir("bad") / "cluster.json").write_text("{ truncated")
    try:
        listed = cli("cluster", "status")
        assert listed.returncode == 2 and "cluster 'good'" in listed.stdout, listed.stdout + listed.stderr
        assert "warning:" in listed.stderr and "bad" in listed.stderr
        alone = cli("cluster", "status", "--name", "bad")  # asked by name: the error itself
        assert alone.returncode == 2 and alone.stderr.startswith("error:") and alone.stderr.count("\n") == 1
    finally:
        for name in ("good", "bad"):
            cli("teardown", "--name", name, "--provider", "localhost")


def test_logs_follow_ends_on_a_job_whose_status_file_is_not_a_number(xeontune_home, tmp_path):
    """It waited forever: the runner was gone and its rc file held no number (a damaged disk, a hand edit)."""
    from xeontune.job import record as job_record

    assert cli("cluster", "up", "--provider", "localhost", "-n", "1", "--name", "odd").returncode == 0
    try:
        gone = subprocess.Popen(["true"])
        gone.wait()
        job_dir = tmp_path / "job"
        job_dir.mkdir()
        (job_dir / "log").write_text("step 1/2\n")
        (job_dir / "pid").write_text(f"{gone.pid}\n")
        (job_dir / "rc").write_text("garbage\n")
        job_record.save_job(job_record.JobInfo(id="j1", cluster="odd", output_dir=str(tmp_path / "out"),
                                               local_output_dir=str(tmp_path / "out"), job_dir=str(job_dir),
                                               detached=True, pid=gone.pid))
        follow = cli("logs", "--name", "odd", "-f", timeout=60)
        assert follow.returncode == 1 and "step 1/2" in follow.stdout, follow.stdout + follow.stderr
        assert "without an exit status" in follow.stderr
    finally:
        cli("teardown", "--name", "odd")
