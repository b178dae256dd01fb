"""Ranks per node: how many data-parallel ranks one machine runs, and which cores each one gets.

On a Xeon, one process scales badly with threads: the SD UNet's forward+backward at 512 px on a
16-core AMX host gave 0.77 images/s as 1 x 16 threads and 1.83 as 8 ranks x 2 threads
(docs/performance.md). Data parallelism inside a node is nearly free here because a step
all-reduces only the new token's vectors (a few KB). So a node runs several ranks, each pinned to
its own physical cores, and ``auto`` picks how many.

Nothing here imports torch: a rank pins itself before torch starts its OpenMP threads (threads
inherit the affinity of the thread that creates them; ``sched_setaffinity(0)`` moves only the
calling thread).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

SYSFS_CPU = Path("/sys/devices/system/cpu")
SYSFS_NODE = Path("/sys/devices/system/node")
# Set by the launcher for ranks that own their host's cores (not for namespace "hosts" that share one).
PIN_ENV = "XEONTUNE_PIN_CORES"
SHARED_MACHINE_ENV = "XEONTUNE_RANKS_ON_THIS_MACHINE"  # set where a job's hosts share one machine
# Launchers name a rank's place on its host differently: torch elastic, then MPICH/Intel MPI Hydra, Open MPI.
_LOCAL_RANK_VARS = ("LOCAL_RANK", "MPI_LOCALRANKID", "OMPI_COMM_WORLD_LOCAL_RANK")
_LOCAL_SIZE_VARS = ("LOCAL_WORLD_SIZE", "MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE")


@dataclass(frozen=True)
class Core:
    cpu: int  # the logical CPU that stands for this physical core (its first hyperthread)
    numa_node: int


def _cpu_list(text: str) -> list[int]:
    """'0-3,8,10-11' -> [0, 1, 2, 3, 8, 10, 11] (the sysfs list format)."""
    cpus: list[int] = []
    for part in text.strip().split(","):
        if part:
            lo, _, hi = part.partition("-")
            cpus += range(int(lo), int(hi or lo) + 1)
    return cpus


def physical_cores(allowed: set[int] | None = None, cpu_dir: Path = SYSFS_CPU,
                   node_dir: Path = SYSFS_NODE) -> list[Core]:
    """One entry per physical core this process may use, ordered by NUMA node, socket and core id,
    so that consecutive slices stay on one NUMA node. Hyperthread siblings are left out: two ranks'
    threads on one core's siblings would fight for its AMX unit."""
    allowed = set(os.sched_getaffinity(0)) if allowed is None else allowed
    node_of: dict[int, int] = {}
    for node in node_dir.glob("node[0-9]*"):
        for cpu in _cpu_list((node / "cpulist").read_text()):
            node_of[cpu] = int(node.name[4:])
    seen: dict[tuple[int, int, int], int] = {}
    for cpu in sorted(allowed):
        topo = cpu_dir / f"cpu{cpu}" / "topology"
        try:
            package = int((topo / "physical_package_id").read_text())
            core = int((topo / "core_id").read_text())
        except (OSError, ValueError):  # no topology (some containers): each CPU is its own core
            package, core = 0, cpu
        seen.setdefault((node_of.get(cpu, 0), package, core), cpu)
    return [Core(cpu=cpu, numa_node=key[0]) for key, cpu in sorted(seen.items())]


def core_slices(cores: list[Core], ranks: int) -> list[list[int]]:
    """Split cores into ``ranks`` equal, consecutive slices (left-over cores stay idle, so every
    rank runs at the same speed and none waits for a slower one at the all-reduce)."""
    if not 1 <= ranks <= len(cores):
        raise ValueError(f"cannot give {ranks} ranks a core each out of {len(cores)}")
    per_rank = len(cores) // ranks
    return [[c.cpu for c in cores[i * per_rank:(i + 1) * per_rank]] for i in range(ranks)]


def _first_int(env: Mapping[str, str], names: tuple[str, ...]) -> int | None:
    for name in names:
        if env.get(name, "").isdigit():
            return int(env[name])
    return None


def local_ranks(env: Mapping[str, str] | None = None) -> int:
    """How many ranks of this job share this host's memory, this one included (1 outside a launch):
    the launcher's local size, or all the job's ranks where its "hosts" are namespaces of one machine
    (SHARED_MACHINE_ENV, which the job sets for them: each namespace's mpirun counts its own ranks only)."""
    env = os.environ if env is None else env
    return max(_first_int(env, _LOCAL_SIZE_VARS) or 1, _first_int(env, (SHARED_MACHINE_ENV,)) or 1)


def pin_this_rank(env: Mapping[str, str] | None = None) -> list[int] | None:
    """When the launcher asked for it (``XEONTUNE_PIN_CORES=1``), pin this process to its slice of
    the host's physical cores and set OMP_NUM_THREADS to the slice's size. Call it before torch is
    imported. Returns the CPUs pinned to, or None when not asked or there is nothing to split."""
    env = os.environ if env is None else env
    if env.get(PIN_ENV) != "1":
        return None
    local_rank, local_size = _first_int(env, _LOCAL_RANK_VARS), _first_int(env, _LOCAL_SIZE_VARS)
    if local_rank is None or not local_size or local_rank >= local_size:
        return None
    cores = physical_cores()
    if local_size > len(cores):
        return None  # more ranks than cores: leave it to the OS rather than stack ranks on a core
    cpus = core_slices(cores, local_size)[local_rank]
    os.sched_setaffinity(0, cpus)
    os.environ["OMP_NUM_THREADS"] = str(len(cpus))
    return cpus


# --- how many ranks: the `auto` rule -----------------------------------------------------------

# `--gradient-checkpointing`: the share of the estimate a rank still holds. The same count kept
# 0.05-0.14x of the bytes (SD1.5 and SDXL, 256-1024 px) and the tiny models 0.22-0.25x at 64 px;
# the block being recomputed, the text encoders and torch's own do not shrink, hence more.
CHECKPOINTED_ACTIVATION_SHARE = 0.3
RESERVED_FRACTION = 0.1  # of available memory, left to the OS, page cache and the launcher


@dataclass(frozen=True)
class RankPlan:
    ranks: int
    cores_per_rank: int
    why: str


def threads_per_rank_rule(physical: int) -> int:
    """Threads per rank: 2 from 4 physical cores up, else 1.

    Measured (docs/performance.md, "Ranks per node"): on 16 AMX cores at 512 px, 8 x 2 gave the most
    images/s of 1/2/4/8 ranks (1.83 vs 1.45 for 4 x 4 and 0.77 for 1 x 16); on 2 cores at 256 px,
    2 x 1 beat 1 x 2.
    """
    return 2 if physical >= 4 else 1


def rank_memory_bytes(weight_bytes: int, per_image_bytes: float, batch_size: int,
                      checkpointing: bool = False) -> int:
    """What one rank holds: its frozen weights in the training dtype plus the step's activations
    (``per_image_bytes``: the model family's measured figure at the run's resolution and precision, less
    under gradient checkpointing)."""
    activations = per_image_bytes * batch_size
    activations *= CHECKPOINTED_ACTIVATION_SHARE if checkpointing else 1.0
    return int(weight_bytes + activations)


def auto_ranks(physical: int, numa_nodes: int, available_bytes: int, per_rank_bytes: int) -> RankPlan:
    """The ``--nproc-per-node auto`` rule: one rank per ``threads_per_rank_rule`` cores, as many as
    memory holds, rounded down to a multiple of the NUMA nodes so no rank straddles two."""
    by_cores = max(physical // threads_per_rank_rule(physical), 1)
    usable = available_bytes * (1 - RESERVED_FRACTION)
    by_memory = max(int(usable // per_rank_bytes), 1) if per_rank_bytes > 0 else by_cores
    ranks = min(by_cores, by_memory)
    if numa_nodes > 1 and ranks >= numa_nodes:
        ranks -= ranks % numa_nodes
    limit = "cores" if ranks == by_cores else f"memory ({usable / 1e9:.0f} GB for {per_rank_bytes / 1e9:.1f} GB a rank)"
    return RankPlan(ranks=ranks, cores_per_rank=max(physical // ranks, 1),
                    why=f"{physical} physical cores, {numa_nodes} NUMA node(s); limited by {limit}")


def available_memory_bytes(meminfo: Path = Path("/proc/meminfo"), cgroup: Path = Path("/sys/fs/cgroup")) -> int:
    """MemAvailable, bounded by what is left under a cgroup v2 memory limit when one is set: the limit
    less the group's usage, its file pages counted as available as MemAvailable counts them."""
    available = 0
    for line in meminfo.read_text().splitlines():
        if line.startswith("MemAvailable:"):
            available = int(line.split()[1]) * 1024
    try:
        limit = (cgroup / "memory.max").read_text().strip()
        if limit.isdigit():
            used = int((cgroup / "memory.current").read_text())
            stat = dict(line.split() for line in (cgroup / "memory.stat").read_text().splitlines() if line.strip())
            available = min(available, max(int(limit) - used + int(stat.get("file", 0)), 0))
    except (OSError, ValueError):
        pass
    return available


def anonymous_bytes(status: Path = Path("/proc/self/status")) -> int:
    """This process's anonymous resident memory (RssAnon): what it holds beyond file-backed pages,
    which MemAvailable already counts as available."""
    for line in status.read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    return 0
