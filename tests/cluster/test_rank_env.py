"""Every engine gives its ranks the one shared environment (``engines.env.every_rank_env``), whatever
else it adds: read from each engine's plan (plans have no side effects), and from the pods' manifests."""

from __future__ import annotations

import pytest

from tests.cluster.kubelib import BASE, TRAIN, args_of
from xeontune.cluster.state import ClusterRecord, Node
from xeontune.job import spec as job_spec
from xeontune.job import start
from xeontune.job.engines import kubernetes as k8s
from xeontune.job.engines.env import every_rank_env

RECORDS = {  # a cluster of each engine, as `cluster up` records it
    "mpirun": ClusterRecord(name="sky", provider="aws", key_path="/k/id", known_hosts_path="/k/known_hosts",
                            work_dir="/opt/xt/work", venv="/opt/xt/venv", cores_per_node=4,
                            nodes=[Node("node0", "head", "172.31.0.10", public_ip="3.3.3.3"),
                                   Node("node1", "worker", "172.31.0.11")]),
    "srun": ClusterRecord(name="hpc", provider="slurm", cores_per_node=4,
                          extra={"partition": "debug", "nodes": "2", "cpus_per_node": "4"}),
    "ray": ClusterRecord(name="rc", provider="ray", address="10.0.0.5:6379", extra={"cpus": "4,4"}),
}


@pytest.mark.parametrize("engine", sorted(RECORDS))
def test_every_engines_ranks_get_the_shared_environment(engine, xeontune_home, monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    record = RECORDS[engine]
    request = job_spec.read_request(TRAIN, backend="gloo", remote=True)
    spec = job_spec.launch_spec(record, request, num_processes=2)
    plan = start.plan_for(record, spec)
    shared = every_rank_env("gloo")
    assert shared.items() <= plan.env.items(), (engine, plan.env)
    # a node's 4 cores for its 1 rank: each engine derives the threads itself
    assert plan.env.get("OMP_NUM_THREADS") == "4", plan.env


def test_the_pods_get_the_shared_environment():
    job = k8s.job_from_args(args_of("-n", "2", *BASE, "--", *TRAIN))
    [indexed] = [doc for doc in job.docs if doc["kind"] == "Job"]
    [container] = indexed["spec"]["template"]["spec"]["containers"]
    env = {item["name"]: item.get("value") for item in container["env"]}
    assert every_rank_env("gloo").items() <= env.items(), env
