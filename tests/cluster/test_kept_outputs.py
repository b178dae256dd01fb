"""Outputs kept on a head for fetching (issue 29): the autostop watcher's day of grace counts from
the job's end, a failed or unstarted job leaves no mark behind on a reused cluster, and a new job
on a cluster kept for fetching is refused until its outputs are fetched.

Real parts: the detached runner (`python -m xeontune.job.process`), the watcher on a namespace
cluster, `run` / `launch` / `fetch` as fresh processes on namespace clusters.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.cluster.clusterlib import REPO, cli, leftovers, train_args
from tests.trainlib import OFFLINE
from xeontune.cluster import autostop, autostop_watch, manage, state
from xeontune.cluster.providers import ClusterSpec
from xeontune.errors import UserError
from xeontune.job import record as job_record
from xeontune.job import spec as job_spec
from xeontune.job import start
from xeontune.job.record import UNFETCHED

HOUR = 3600.0
IDLE_S = 6
OWN_NAME_PREFIX = "k"  # own_name (conftest.py): k<pid>-<part of the test's name>


def backdate(path: Path, age_s: float) -> None:
    then = time.time() - age_s
    os.utime(path, (then, then))


def kept_job(jobs: Path, name: str, started_ago: float, ended_ago: float | None) -> Path:
    """A job dir as `run` and the runner leave it: the mark and the log from its start, its `rc`
    written when it ended (``ended_ago``; None: no rc)."""
    job = jobs / name
    job.mkdir(parents=True)
    (job / UNFETCHED).write_text("x\n")
    backdate(job / UNFETCHED, started_ago)
    (job / "log").write_text("x\n")
    backdate(job / "log", started_ago if ended_ago is None else ended_ago)  # its last line
    if ended_ago is not None:
        (job / "rc").write_text("0\n")
        backdate(job / "rc", ended_ago)
    return job


def test_the_days_grace_counts_from_the_jobs_end_not_its_start(tmp_path):
    """A 25-hour job whose laptop is gone was let go 30 min after its end: the day counted from its
    start (the mark's time). It counts from its end (its rc file), or from its last sign of life
    when its runner died without one; a job whose runner still runs is always held."""
    work = tmp_path / "work"
    jobs = work / "jobs"
    kept_job(jobs, "long", started_ago=25 * HOUR, ended_ago=600)
    kept_job(jobs, "stale", started_ago=50 * HOUR, ended_ago=25 * HOUR)
    kept_job(jobs, "dead", started_ago=30 * HOUR, ended_ago=None)  # runner killed: no rc, log silent since
    assert autostop_watch.unfetched_jobs(str(work)) == ["job long's outputs not fetched yet"]

    # a real runner that started its job 30 h ago (its mark says so) and still runs
    running = jobs / "running"
    started = subprocess.run([sys.executable, "-m", "xeontune.job.process", "--job-dir", str(running), "--",
                              "sleep", "60"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert started.returncode == 0, started.stderr
    pid = int(started.stdout.split()[-1])
    try:
        (running / UNFETCHED).write_text("x\n")
        for file in (UNFETCHED, "log", "pid"):
            backdate(running / file, 30 * HOUR)
        assert autostop_watch.unfetched_jobs(str(work)) == ["job long's outputs not fetched yet",
                                                            "job running's outputs not fetched yet"]
    finally:
        os.kill(pid, signal.SIGTERM)  # the runner passes it on, then writes the job's rc
        deadline = time.monotonic() + 30
        while not (running / "rc").exists() and time.monotonic() < deadline:
            time.sleep(0.1)
    assert (running / "rc").exists()
    assert "job running's outputs not fetched yet" in autostop_watch.unfetched_jobs(str(work))  # it just ended
    assert autostop_watch.unfetched_jobs(str(work), now=time.time() + autostop_watch.FETCH_WAIT_S + 60) == []


@pytest.mark.slow
@pytest.mark.root
def test_the_heads_watcher_waits_a_day_after_a_long_jobs_end(own_name, xeontune_home, monkeypatch):
    """The watcher itself, on the head of a namespace cluster: a 25-hour job that ended a minute ago
    with its outputs unfetched keeps the cluster; once its end is more than a day ago, the cluster
    removes itself."""
    monkeypatch.setenv(autostop.IDLE_S_ENV, str(IDLE_S))
    record, _ = manage.up(ClusterSpec(name=own_name, num_nodes=2, autostop_minutes=1), "local")
    job = kept_job(Path(record.work_dir) / "jobs", "long", started_ago=25 * HOUR, ended_ago=60)
    log = Path(autostop.log_path(record))
    time.sleep(IDLE_S + 4)
    assert state.exists(own_name) and leftovers(own_name), "the cluster removed itself with the outputs unfetched"
    assert "busy: job long's outputs not fetched yet" in log.read_text()
    backdate(job / "rc", 25 * HOUR)
    backdate(job / "log", 25 * HOUR)
    deadline = time.monotonic() + IDLE_S + 40
    while (state.exists(own_name) or leftovers(own_name)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not state.exists(own_name) and leftovers(own_name) == []


# --- on a reused cluster --------------------------------------------------------------------------


def marks(record) -> list[Path]:
    return sorted(Path(record.work_dir, "jobs").glob(f"*/{UNFETCHED}"))


@pytest.mark.slow
@pytest.mark.root
def test_a_failed_job_that_wrote_nothing_leaves_no_mark_on_a_reused_cluster(local_cluster, tiny, tmp_path):
    """A failed `run` on a reused cluster (its job stopped before its first file) left its job's
    mark, so the head's autostop kept the cluster billing for a day."""
    (tmp_path / "no-model").mkdir()  # a folder here, so run starts the job; the ranks find no pipeline in it
    proc = cli("run", "--provider", "local", "--name", local_cluster.name, "--",
               *train_args({**tiny, "model": tmp_path / "no-model"}, tmp_path / "out", 1, 2), env=OFFLINE)
    assert proc.returncode != 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"training failed (exit {proc.returncode}); the job wrote no outputs: nothing to fetch" in proc.stdout, \
        proc.stdout[-3000:]
    assert "was there before this run and is kept" in proc.stdout.strip().splitlines()[-1]
    assert marks(local_cluster) == []
    assert autostop_watch.unfetched_jobs(local_cluster.work_dir) == []


@pytest.mark.slow
@pytest.mark.root
def test_a_job_that_did_not_start_leaves_no_mark(local_cluster, tiny, tmp_path, monkeypatch):
    """`run` marks its job before the runner starts on the head; when the runner does not start, the
    mark goes too (nothing will ever be there to fetch)."""
    request = job_spec.read_request(train_args(tiny, tmp_path / "out", 1, 2), remote=False)
    spec = job_spec.launch_spec(local_cluster, request)

    def refused(record, plan, job) -> None:
        assert Path(job.unfetched_path).is_file()  # marked before the start
        raise UserError(f"could not start the detached job on {record.head.name}: refused by the test")

    monkeypatch.setattr(start, "start_detached", refused)
    with pytest.raises(UserError, match="refused by the test"):
        start.start(local_cluster, spec, detached=True, hold_for_fetch=True)
    assert marks(local_cluster) == []


@pytest.mark.slow
@pytest.mark.root
def test_a_cluster_kept_for_fetching_refuses_a_new_job_until_fetched(own_name, tiny, tmp_path):
    """`run`'s laptop went away (SIGKILL) while its job trained: the job ended on the head and the
    cluster stays, holding its outputs. A new job there replaced its record, and `fetch` could no
    longer reach them. Now `launch` and `run --name` are refused (one line, saying how to fetch);
    after the fetch the next job starts."""
    log = tmp_path / "run.log"
    argv = [sys.executable, "-m", "xeontune.cli", "run", "--provider", "local", "-n", "2", "--name", own_name, "--",
            *train_args(tiny, tmp_path / "first", 1, 4, "--mixed-precision", "fp32")]
    proc = subprocess.Popen(argv, cwd=REPO, stdout=log.open("w"), stderr=subprocess.STDOUT,
                            env={**os.environ, **OFFLINE})
    try:
        deadline = time.monotonic() + 180
        while not list(state.cluster_dir(own_name).glob("work/runs/*/train_config.json")):
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.2)
    finally:
        proc.kill()  # the laptop is gone; the job goes on, detached on the head
        proc.wait()
    kept = job_record.load_job(own_name)
    deadline = time.monotonic() + 300
    while not Path(kept.rc_path).exists() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert Path(kept.rc_path).read_text().strip() == "0", Path(kept.log_path).read_text()[-3000:]
    assert Path(kept.unfetched_path).is_file() and (Path(kept.output_dir) / "learned_embeds.safetensors").is_file()

    second = cli("launch", "--name", own_name, "--", *train_args(tiny, tmp_path / "second", 1, 1), env=OFFLINE)
    assert second.returncode == 2, second.stdout[-3000:] + second.stderr[-3000:]
    assert second.stderr.count("\n") == 1 and "Traceback" not in second.stderr, second.stderr
    assert f"holds the outputs of job {kept.id}, which were not fetched yet" in second.stderr
    assert f"xeontune fetch --name {own_name}" in second.stderr
    reused = cli("run", "--provider", "local", "--name", own_name, "--",
                 *train_args(tiny, tmp_path / "third", 1, 1), env=OFFLINE)
    assert reused.returncode == 2 and f"holds the outputs of job {kept.id}" in reused.stderr, reused.stderr
    assert job_record.load_job(own_name) == kept  # the kept job's record is untouched
    assert not (tmp_path / "second").exists() and not (tmp_path / "third").exists()

    fetched = cli("fetch", "--name", own_name, "--output-dir", str(tmp_path / "fetched"))
    assert fetched.returncode == 0, fetched.stdout + fetched.stderr
    assert (tmp_path / "fetched" / "learned_embeds.safetensors").read_bytes() == \
        (Path(kept.output_dir) / "learned_embeds.safetensors").read_bytes()
    assert not Path(kept.unfetched_path).exists()
    again = cli("launch", "--name", own_name, "--", *train_args(tiny, tmp_path / "second", 1, 1), env=OFFLINE)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert (tmp_path / "second" / "learned_embeds.safetensors").is_file()
