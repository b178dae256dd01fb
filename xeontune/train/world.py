"""Rank, world size and rendezvous from the scheduler that started this process.

Under mpirun the ranks read Hydra's PMI_RANK / PMI_SIZE (accelerate knows those names); under
torch's elastic launcher, RANK / WORLD_SIZE. Under Slurm's ``srun`` a rank has only Slurm's names,
so ``adopt_slurm`` gives it the standard ones (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
MASTER_ADDR, MASTER_PORT) before anything reads them: ``srun xeontune train ...`` in a user's own
batch script then needs no launcher at all. Names already set win (an mpirun inside a Slurm job, or
a user's MASTER_ADDR), except srun's own PMI_RANK / PMI_SIZE: a site's ``MpiDefault=pmi2`` (or
``srun --mpi=pmi2``) gives them to every task, equal to Slurm's rank and task count, and without the
other names such a task could not find rank 0 ("MASTER_ADDR expected").

A pod of a Kubernetes Indexed Job has ``JOB_COMPLETION_INDEX``, its index; ``adopt_indexed_job``
makes it the RANK of a job whose pods say how many ranks there are (WORLD_SIZE, which the manifests of
`xeontune launch --provider kubernetes` set with MASTER_ADDR, the index-0 pod's DNS name
``<job>-0.<service>``, and MASTER_PORT). Without WORLD_SIZE an Indexed Job's pods are independent
trainings (a sweep), each a world of its own, and nothing is adopted. Names already set win here too.
A hand-written Job without MASTER_ADDR gets the index-0 pod's name from this pod's own (``<job>-<i>``
in the ``subdomain`` of a headless Service: ``<job>-<i>.<service>.<namespace>.svc...``).
``adopt`` is the one call the trainer makes: Slurm's names in an srun step, else an Indexed Job's,
whose pods then wait for each other (``wait_for_pods``): unlike srun's tasks they start as each
node pulls the image, minutes apart, and joining the process group waits only --dist-timeout.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable, MutableMapping

from xeontune.errors import UserError

# A port every task of one job step derives alike (from the job and step ids), outside Linux's
# ephemeral range (32768-60999).
_PORT_BASE, _PORT_SPAN = 12000, 20000
INDEXED_JOB_PORT = 29500  # an Indexed Job's MASTER_PORT when its pods do not say (torch's default)
POD_WAIT_ENV = "XEONTUNE_POD_WAIT_S"  # how long an Indexed Job's pods wait for each other to start
POD_WAIT_S = 900.0  # image pulls on fresh nodes, a pod scheduled once another job ends


def in_srun_step(env: MutableMapping[str, str]) -> bool:
    """True in a task that ``srun`` started (the batch script itself has no step's task count)."""
    return "SLURM_PROCID" in env and env.get("SLURM_STEP_NUM_TASKS", "").isdigit()


def tasks_per_node(spec: str) -> list[int]:
    """Slurm's compressed task counts, ``2(x3),1`` -> [2, 2, 2, 1]."""
    counts: list[int] = []
    for part in spec.split(","):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if not match:
            raise ValueError(f"not a Slurm tasks-per-node list: {spec!r}")
        counts += [int(match[1])] * int(match[2] or 1)
    return counts


def first_node_address(nodelist: str) -> str:
    """The address of the first node of a Slurm node list, as Slurm itself reaches it (NodeAddr,
    which is the node's name unless the cluster's slurm.conf says otherwise)."""
    scontrol = shutil.which("scontrol")
    if scontrol is None:
        raise UserError("running under srun, but scontrol is not on PATH to find the first node's address; "
                        "set MASTER_ADDR in the batch script")
    names = subprocess.run([scontrol, "show", "hostnames", nodelist], capture_output=True, text=True,
                           timeout=60, check=False)
    first = names.stdout.split()[0] if names.returncode == 0 and names.stdout.split() else ""
    if not first:
        raise UserError(f"scontrol show hostnames {nodelist} failed: {names.stderr.strip() or 'no hosts'}; "
                        "set MASTER_ADDR in the batch script")
    node = subprocess.run([scontrol, "show", "node", "-o", first], capture_output=True, text=True,
                          timeout=60, check=False)
    found = re.search(r"\bNodeAddr=(\S+)", node.stdout) if node.returncode == 0 else None
    return found[1] if found else first


def another_launchers_ranks(env: MutableMapping[str, str]) -> bool:
    """True where a launcher inside the srun step set the ranks (torchrun's RANK, Open MPI's, Hydra's
    PMI_RANK): they win. Slurm's own PMI plugin sets PMI_RANK and PMI_SIZE to the step's SLURM_PROCID
    and task count. Hydra's differ wherever a node runs more than one rank (its proxies, one per node,
    are the step's tasks); where they agree, adopting Slurm's names gives the same ranks."""
    if "RANK" in env or "OMPI_COMM_WORLD_RANK" in env:
        return True
    if "PMI_RANK" not in env:
        return False
    tasks = env["SLURM_STEP_NUM_TASKS"]
    return env["PMI_RANK"] != env["SLURM_PROCID"] or env.get("PMI_SIZE", tasks) != tasks


def adopt_slurm(env: MutableMapping[str, str] | None = None) -> bool:
    """In an srun task of more than one task, set the standard rank variables from Slurm's (module
    docstring). True if it did."""
    env = os.environ if env is None else env
    if not in_srun_step(env) or another_launchers_ranks(env):
        return False
    world = int(env["SLURM_STEP_NUM_TASKS"])
    if world <= 1:
        return False
    node_index = int(env.get("SLURM_NODEID", "0"))
    per_node = tasks_per_node(env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE") or str(world))
    env["RANK"] = env["SLURM_PROCID"]
    env["WORLD_SIZE"] = str(world)
    env["LOCAL_RANK"] = env.get("SLURM_LOCALID", "0")
    env["LOCAL_WORLD_SIZE"] = str(per_node[node_index] if node_index < len(per_node) else 1)
    if "MASTER_ADDR" not in env:
        env["MASTER_ADDR"] = first_node_address(env.get("SLURM_STEP_NODELIST") or env["SLURM_JOB_NODELIST"])
    if "MASTER_PORT" not in env:
        job, step = int(env.get("SLURM_JOB_ID", "0")), int(env.get("SLURM_STEP_ID", "0") or 0)
        env["MASTER_PORT"] = str(_PORT_BASE + (job * 16 + step) % _PORT_SPAN)
    return True


def adopt_indexed_job(env: MutableMapping[str, str] | None = None,
                      fqdn: Callable[[], str] = socket.getfqdn) -> bool:
    """In a pod of a Kubernetes Indexed Job of more than one rank, set RANK (its JOB_COMPLETION_INDEX),
    LOCAL_RANK, LOCAL_WORLD_SIZE (one rank per pod) and, unless set, MASTER_ADDR / MASTER_PORT (module
    docstring). True if it did. ``fqdn``: this pod's fully qualified host name."""
    env = os.environ if env is None else env
    index = env.get("JOB_COMPLETION_INDEX", "")
    if not index.isdigit() or in_srun_step(env):
        return False
    if any(name in env for name in ("RANK", "PMI_RANK", "OMPI_COMM_WORLD_RANK")):
        return False  # a launcher inside the pod (torchrun, mpirun) set the ranks: they win
    world = env.get("WORLD_SIZE", "")
    if not world.isdigit() or int(world) <= 1:
        return False
    if int(index) >= int(world):
        raise UserError(f"JOB_COMPLETION_INDEX {index} is not below WORLD_SIZE {world}: the Job's completions "
                        "and the pods' WORLD_SIZE must be the same number")
    env["RANK"] = index
    env["LOCAL_RANK"] = "0"
    env["LOCAL_WORLD_SIZE"] = "1"
    if "MASTER_ADDR" not in env:
        env["MASTER_ADDR"] = first_pod_address(index, fqdn())
    if "MASTER_PORT" not in env:
        env["MASTER_PORT"] = str(INDEXED_JOB_PORT)
    return True


def first_pod_address(index: str, fqdn: str) -> str:
    """The index-0 pod's DNS name from this pod's, ``<job>-<index>.<service>...``."""
    host, _, domain = fqdn.partition(".")
    if not host.endswith(f"-{index}") or not domain:
        raise UserError(f"an Indexed Job's rank needs MASTER_ADDR (the index-0 pod's DNS name, <job>-0.<service>), "
                        f"and this pod's name {fqdn!r} is not <job>-{index}.<service>: give the Job's pods a "
                        "headless Service as their subdomain, or set MASTER_ADDR")
    return f"{host[: -len(index)]}0.{domain}"


def wait_for_pods(env: MutableMapping[str, str] | None = None, say: Callable[[str], None] | None = None) -> None:
    """Return once every pod of the job runs this (after adopt_indexed_job), at most $XEONTUNE_POD_WAIT_S
    (default 15 min) after this pod started; then a one-line UserError. A barrier on a TCPStore of rank 0's,
    one port above MASTER_PORT (below it at 65535): the process group's own rendezvous, right after,
    waits only --dist-timeout (seconds), so the pods must reach it together."""
    from datetime import timedelta

    from torch.distributed import TCPStore

    env = os.environ if env is None else env
    say = say or (lambda line: (sys.stderr.write(line + "\n"), sys.stderr.flush()))
    rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
    addr, port = env["MASTER_ADDR"], int(env["MASTER_PORT"])
    port = port + 1 if port < 65535 else port - 1
    wait_s = float(env.get(POD_WAIT_ENV) or POD_WAIT_S)
    start = time.monotonic()
    deadline, told = start + wait_s, False

    def tick(started: int) -> None:
        nonlocal told
        if time.monotonic() > deadline:
            raise UserError(f"rank {rank}: {started} of the job's {world} pods started within {wait_s:.0f} s "
                            f"({POD_WAIT_ENV}); `kubectl describe pods` says why the others did not (CPUs or "
                            "memory to schedule them, the image pull, the volume claim)")
        if not told and time.monotonic() - start > 30:
            told = True
            say(f"rank {rank}: waiting for the job's other pods to start ({started} of {world} so far)")
        time.sleep(0.2 if started else 1.0)

    if rank != 0:
        while True:  # quietly, until rank 0's name resolves and its store listens (torch's retries log)
            try:
                socket.create_connection((addr, port), timeout=5).close()
                break
            except OSError:
                tick(0)
    timeout = timedelta(seconds=max(60.0, deadline - time.monotonic() + 60))
    store = TCPStore(addr, port, world, rank == 0, timeout, wait_for_workers=False)
    store.add("pods", 1)
    while (started := store.add("pods", 0)) < world:
        tick(started)
    store.add("seen", 1)
    while rank == 0 and (seen := store.add("seen", 0)) < world:  # the store outlives every pod's last look
        tick(seen)
    del store


def adopt(env: MutableMapping[str, str] | None = None, wait: bool = True) -> str | None:
    """The scheduler whose rank names were adopted ("slurm", "kubernetes"), or None. ``wait``: an
    Indexed Job's pods wait for each other (``wait_for_pods``)."""
    env = os.environ if env is None else env
    if adopt_slurm(env):
        return "slurm"
    if adopt_indexed_job(env):
        if wait:
            wait_for_pods(env)
        return "kubernetes"
    return None
