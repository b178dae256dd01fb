"""A pod of a Kubernetes Indexed Job: the trainer takes its rank from JOB_COMPLETION_INDEX (train/world.py),
names already set win, and Slurm's adoption is unchanged."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from xeontune.errors import UserError
from xeontune.train import world

# What a pod of `launch --provider kubernetes`'s Job has (its manifest's env, and the Job controller's index).
POD = {"JOB_COMPLETION_INDEX": "2", "WORLD_SIZE": "3", "MASTER_ADDR": "tj-0.tj", "MASTER_PORT": "29500",
       "HOSTNAME": "tj-2"}


def no_fqdn() -> str:
    raise AssertionError("MASTER_ADDR was given: the pod's own name must not be looked up")


def test_the_index_is_the_rank_of_one_rank_per_pod():
    pod = dict(POD)
    assert world.adopt_indexed_job(pod, fqdn=no_fqdn)
    assert (pod["RANK"], pod["WORLD_SIZE"], pod["LOCAL_RANK"], pod["LOCAL_WORLD_SIZE"]) == ("2", "3", "0", "1")
    assert (pod["MASTER_ADDR"], pod["MASTER_PORT"]) == ("tj-0.tj", "29500")
    first = {**POD, "JOB_COMPLETION_INDEX": "0"}
    assert world.adopt(first, wait=False) == "kubernetes" and first["RANK"] == "0"


def test_names_already_set_win():
    for launcher in ("RANK", "PMI_RANK", "OMPI_COMM_WORLD_RANK"):  # torchrun or mpirun inside the pod
        pod = {**POD, launcher: "5"}
        assert not world.adopt_indexed_job(pod, fqdn=no_fqdn)
        assert pod.get("RANK") == ("5" if launcher == "RANK" else None)
    own_port = {**POD, "MASTER_PORT": "4242"}
    assert world.adopt_indexed_job(own_port, fqdn=no_fqdn) and own_port["MASTER_PORT"] == "4242"


def test_an_indexed_job_without_a_world_size_is_independent_runs():
    """An Indexed Job may be a sweep of separate trainings: without WORLD_SIZE (or with 1) each pod is its own
    world, as a plain `xeontune train`."""
    for pod in ({"JOB_COMPLETION_INDEX": "1"}, {"JOB_COMPLETION_INDEX": "1", "WORLD_SIZE": "1"}, {}):
        before = dict(pod)
        assert world.adopt(pod) is None and pod == before


def test_a_hand_written_job_finds_rank_0_by_its_own_name_or_says_what_is_missing():
    pod = {"JOB_COMPLETION_INDEX": "12", "WORLD_SIZE": "16"}
    assert world.adopt_indexed_job(pod, fqdn=lambda: "train-12.ranks.team-a.svc.cluster.local")
    assert pod["MASTER_ADDR"] == "train-0.ranks.team-a.svc.cluster.local" and pod["MASTER_PORT"] == "29500"
    with pytest.raises(UserError, match="needs MASTER_ADDR") as err:  # no subdomain: no DNS name for rank 0
        world.adopt_indexed_job({"JOB_COMPLETION_INDEX": "1", "WORLD_SIZE": "2"}, fqdn=lambda: "train-1")
    assert "\n" not in str(err.value)
    with pytest.raises(UserError, match="not below WORLD_SIZE"):
        world.adopt_indexed_job({**POD, "JOB_COMPLETION_INDEX": "3"}, fqdn=no_fqdn)


def test_slurm_is_unaffected():
    task = {"SLURM_PROCID": "4", "SLURM_STEP_NUM_TASKS": "5", "SLURM_LOCALID": "1", "SLURM_NODEID": "1",
            "SLURM_STEP_TASKS_PER_NODE": "3,2", "SLURM_JOB_ID": "77", "SLURM_STEP_ID": "0", "MASTER_ADDR": "n1"}
    alone = dict(task)
    assert world.adopt(alone) == "slurm"
    # an srun step inside a pod that happens to have an index: Slurm's names, as before
    both = {**task, "JOB_COMPLETION_INDEX": "0", "WORLD_SIZE": "9"}
    assert world.adopt(both) == "slurm"
    assert both["RANK"] == alone["RANK"] == "4" and both["WORLD_SIZE"] == "5"
    assert not world.adopt_indexed_job({**task, "JOB_COMPLETION_INDEX": "0", "WORLD_SIZE": "5"}, fqdn=no_fqdn)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1] - 1  # wait_for_pods listens one above MASTER_PORT


def pod_env(rank: int, port: int, size: int = 2, wait_s: float = 30) -> dict[str, str]:
    return {"RANK": str(rank), "WORLD_SIZE": str(size), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
            "XEONTUNE_POD_WAIT_S": str(wait_s)}


def test_pods_wait_for_each_other_before_joining_the_group():
    """Rank 0's pod starts 2 s after rank 1's (its node pulled the image later): both go on together."""
    port, done = free_port(), {}

    def pod(rank: int, delay: float) -> None:
        time.sleep(delay)
        world.wait_for_pods(pod_env(rank, port), say=lambda line: None)
        done[rank] = time.monotonic()

    threads = [threading.Thread(target=pod, args=(1, 0.0)), threading.Thread(target=pod, args=(0, 2.0))]
    start = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert sorted(done) == [0, 1] and done[1] - start >= 2.0 and abs(done[1] - done[0]) < 1.5, done


@pytest.mark.parametrize("rank", [0, 1])
def test_a_pod_that_never_starts_is_a_one_line_error(rank):
    start = time.monotonic()
    with pytest.raises(UserError, match=r"of the job's 2 pods started within 2 s") as err:
        world.wait_for_pods(pod_env(rank, free_port(), wait_s=2), say=lambda line: None)
    assert "\n" not in str(err.value) and time.monotonic() - start < 15


def test_the_trainer_reads_an_indexed_jobs_environment():
    """`python -m xeontune.train` in a pod adopts the Indexed Job's names before anything else: an index
    that is no rank of the job is its one-line error, before any option is read."""
    import os
    import subprocess
    import sys

    env = {**os.environ, **POD, "JOB_COMPLETION_INDEX": "5", "XEONTUNE_ALLOCATOR": "none"}
    proc = subprocess.run([sys.executable, "-m", "xeontune.train", "--help"], capture_output=True, text=True,
                          timeout=120, env=env)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines() == [
        "error: JOB_COMPLETION_INDEX 5 is not below WORLD_SIZE 3: the Job's completions and the pods' WORLD_SIZE "
        "must be the same number"]
