"""The `slurm` provider: a cluster that exists already, whose scheduler places the ranks.

`up` creates nothing: it checks that this machine can submit (``sbatch`` on PATH), that the
partition exists, and reads its nodes' CPUs and memory (``sinfo``) so that ``--ppn auto`` follows the
same ranks-per-node rule as elsewhere. Its engine is ``srun`` (xeontune/job/engines/srun.py): a job
is ONE batch job whose script runs one ``srun`` task per rank; this module asks Slurm about jobs
(``scontrol``) for it, for `cluster status` and for `teardown`, which is ``scancel`` of the jobs
the record holds (idempotent). The state dir and the outputs must be on the
filesystem that the nodes share, as the venv is: nothing is copied, `fetch` has nothing to do.
"""

from __future__ import annotations

import math
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass

from xeontune.cluster import state
from xeontune.cluster.providers import ClusterSpec, NodeStatus, Provider, ProviderOption, TeardownReport
from xeontune.cluster.state import ClusterRecord, Node
from xeontune.errors import UserError

TIMEOUT_S = 60.0
# Job states in which the job is not over yet (a preempted job with --requeue comes back as PENDING).
ACTIVE = {"PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "SUSPENDED", "REQUEUED", "REQUEUE_HOLD",
          "REQUEUE_FED", "RESIZING", "SIGNALING", "STAGE_OUT", "RESV_DEL_HOLD", "STOPPED"}
# Slurm's own word that a job is over: its final states, or GONE (slurmctld answered that it no longer
# knows the job: purged MinJobAge after its end). Anything else, UNKNOWN above all, is not an end.
FINAL = frozenset({"COMPLETED", "CANCELLED", "FAILED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "BOOT_FAIL",
                   "DEADLINE", "OUT_OF_MEMORY", "REVOKED"})
GONE = "GONE"
UNKNOWN = "UNKNOWN"  # scontrol failed or timed out: Slurm said nothing about the job
UNUSABLE = ("down", "drain", "fail", "inval", "maint", "future", "unk")
CANCEL_WAIT_S = 60.0
SETTLE_S = 2.0  # a second look at an ended state, so a requeue's passing FAILED is not taken as the end


def _tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        raise UserError(f"no {name} on PATH: --provider slurm submits from a Slurm login node (install Slurm's "
                        "client commands here, or run xeontune where `sinfo` works)")
    return path


def _run(*argv: str) -> subprocess.CompletedProcess[str]:
    try:
        return subprocess.run([_tool(argv[0]), *argv[1:]], capture_output=True, text=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise UserError(f"{argv[0]} did not answer in {TIMEOUT_S:.0f} s: is slurmctld up?") from None


def one_line(text: str) -> str:
    return " ".join(text.split())[:400] or "no output"


@dataclass
class SlurmNode:
    name: str
    cpus: int
    cores: int  # physical: CPUs over threads per core
    memory_mb: int
    state: str

    @property
    def usable(self) -> bool:
        return not self.state.lower().rstrip("*~#!%$@^-").startswith(UNUSABLE)


def _partitions() -> str:
    """``scontrol show partition -o``; UserError with scontrol's own words when it fails."""
    out = _run("scontrol", "show", "partition", "-o")
    if out.returncode != 0:
        raise UserError(f"scontrol show partition failed: {one_line(out.stderr or out.stdout)}")
    return out.stdout


def default_partition() -> str:
    for line in _partitions().splitlines():
        if re.search(r"\bDefault=YES\b", line) and (m := re.search(r"\bPartitionName=(\S+)", line)):
            return m[1]
    raise UserError("this Slurm cluster has no default partition: pass --partition (see `sinfo -s`)")


def partition_nodes(partition: str) -> list[SlurmNode]:
    """The partition's nodes with their CPUs, physical cores and memory (``sinfo``); UserError if unknown."""
    known = _run("scontrol", "show", "partition", "-o", partition)
    if known.returncode != 0 or "PartitionName=" not in known.stdout:
        names = [m[1] for m in re.finditer(r"\bPartitionName=(\S+)", _partitions())]
        raise UserError(f"unknown Slurm partition {partition!r} (partitions: {', '.join(names) or 'none'})")
    out = _run("sinfo", "-h", "-N", "-p", partition, "-o", "%N|%c|%m|%Z|%T")
    if out.returncode != 0:
        raise UserError(f"sinfo -p {partition} failed: {one_line(out.stderr)}")
    nodes: dict[str, SlurmNode] = {}
    for line in out.stdout.splitlines():
        parts = line.strip().split("|")
        if len(parts) != 5 or not parts[1].isdigit():
            continue
        threads = int(parts[3]) if parts[3].isdigit() and int(parts[3]) > 0 else 1
        memory = int(parts[2]) if parts[2].isdigit() else 0
        nodes[parts[0]] = SlurmNode(parts[0], int(parts[1]), max(int(parts[1]) // threads, 1), memory, parts[4])
    return list(nodes.values())


class Slurm(Provider):
    name = "slurm"
    remote = False  # the ranks read this machine's paths (shared filesystem) and run from this venv
    uses_ssh = False
    needs_bootstrap = False
    engine = "srun"  # xeontune/job/engines/srun.py: one batch job, one srun task per rank
    one_job_at_a_time = False  # Slurm queues each job until its nodes are free
    wait_timeout_s = 1.0
    default_iface = ""
    autostop_note = "a Slurm cluster is the scheduler's: a job ends at its --time limit, nothing idles here"
    options = (ProviderOption("--partition", "the partition (default: the cluster's default partition)"),
               ProviderOption("--time", "the job's time limit, as sbatch --time takes it (2:00:00)"),
               ProviderOption("--account", "the account the job is charged to"))

    def up(self, spec: ClusterSpec) -> ClusterRecord:
        _tool("sbatch")
        if spec.num_nodes < 1:
            raise UserError("-n (ranks) must be at least 1")
        partition = spec.option("partition") or default_partition()
        nodes = partition_nodes(partition)
        usable = [n for n in nodes if n.usable]
        if not usable:
            raise UserError(f"Slurm partition {partition!r} has no node that can run a job "
                            f"({', '.join(sorted({n.state for n in nodes})) or 'no nodes'})")
        capacity = sum(n.cpus for n in usable)
        if spec.num_nodes > capacity:
            raise UserError(f"-n {spec.num_nodes} is more ranks than Slurm partition {partition!r} can hold "
                            f"({len(usable)} node(s), {capacity} CPUs in all; a rank needs at least one)")
        extra = {"partition": partition, "ranks": str(spec.num_nodes), "nodes": str(len(usable)),
                 "cpus_per_node": str(min(n.cpus for n in usable)), "jobs": ""}
        for key in ("account", "time"):
            if spec.option(key):
                extra[key] = str(spec.option(key))
        memory = min(n.memory_mb for n in usable) * 2**20
        record = ClusterRecord(
            name=spec.name, provider=self.name,
            nodes=[Node(partition, "head", "-", resource_id=f"partition {partition}")],
            ssh_user=os.environ.get("USER") or "root",
            work_dir=str(state.cluster_dir(spec.name) / "work"),  # on the shared filesystem, as the state dir
            cores_per_node=min(n.cores for n in usable), memory_per_node=memory or None, extra=extra)
        state.save(record)
        return record

    def wait(self, record: ClusterRecord, timeout_s: float) -> None:
        return None

    def query(self, record: ClusterRecord) -> list[NodeStatus]:
        """The partition's line shows the last job's state (``scontrol show job``)."""
        jobs = [j for j in record.extra.get("jobs", "").split(",") if j]
        if not jobs:
            return [NodeStatus(record.head.name, f"no job submitted (partition {record.extra.get('partition')})")]
        job = jobs[-1]
        info, failure = ask_job(job)
        if info is None:
            return [NodeStatus(record.head.name, f"job {job}: Slurm did not answer ({failure})")]
        how = info.get("JobState", "gone (purged by slurmctld)")
        where = info.get("NodeList") if info.get("NodeList") not in (None, "(null)") else info.get("Reason", "")
        return [NodeStatus(record.head.name, f"job {job} {how}{f' ({where})' if where else ''}")]

    def terminate(self, name: str, record: ClusterRecord | None, region: str | None = None) -> TeardownReport:
        """scancel every job of the record that Slurm has not said is over; wait until it says so. A job
        Slurm does not answer about is not taken for ended: the teardown then fails and keeps the record."""
        report = TeardownReport(searched=["Slurm jobs of this cluster's record"])
        if record is None:
            return report  # jobs are found only through the record (job names are not unique)
        jobs = [j for j in record.extra.get("jobs", "").split(",") if j]
        live = [j for j in jobs if not ended(job_state(j))]
        if not live:
            return report
        out = _run("scancel", *live)
        if out.returncode != 0 and "Invalid job id" not in out.stderr:
            report.failed += [f"Slurm job {j}: scancel: {one_line(out.stderr)}" for j in live]
            return report
        deadline = time.monotonic() + CANCEL_WAIT_S
        while time.monotonic() < deadline and not all(ended(job_state(j)) for j in live):
            time.sleep(0.5)
        for j in live:
            if not ended(how := job_state(j)):
                report.failed.append(f"Slurm job {j}: still {how} {CANCEL_WAIT_S:.0f} s after scancel")
            else:
                report.deleted.append(f"Slurm job {j} (scancel)")
        return report

    def slots(self, record: ClusterRecord, ppn: int) -> int:
        return int(record.extra.get("ranks", "1"))

    def slots_text(self, record: ClusterRecord, ppn: int) -> str:
        return f"-n {self.slots(record, ppn)} of `run`"

    def layout(self, record: ClusterRecord, ranks: int, ppn: int) -> tuple[int, int, int]:
        """(nodes, tasks per node, CPUs per task) for ``ranks`` at up to ``ppn`` per node; UserError when
        the partition cannot. Fewer ranks than ``ppn`` share a node's cores among themselves."""
        partition = record.extra.get("partition", "")
        have = int(record.extra.get("nodes", "1"))
        cpus = int(record.extra.get("cpus_per_node", "1"))
        nodes = math.ceil(ranks / ppn)
        if ppn > cpus:
            raise UserError(f"--ppn {ppn} is more ranks per node than partition {partition!r} has CPUs ({cpus})")
        if nodes > have:
            raise UserError(f"-n {ranks} at --ppn {ppn} needs {nodes} nodes; Slurm partition {partition!r} has "
                            f"{have} that can run jobs (at most {have * ppn} ranks at --ppn {ppn})")
        per_node = math.ceil(ranks / nodes)
        return nodes, per_node, max((record.cores_per_node or 1) // per_node, 1)


def ask_job(job_id: str) -> tuple[dict[str, str] | None, str]:
    """``scontrol show job -o``'s fields, and why not: ({}, ...) once slurmctld answered that it no
    longer knows the job, (None, scontrol's words) when scontrol failed (Slurm said nothing)."""
    try:
        out = _run("scontrol", "show", "job", "-o", job_id)
    except UserError as exc:  # no answer within TIMEOUT_S
        return None, str(exc)
    if out.returncode == 0 and "JobState=" in out.stdout:
        return dict(m.groups() for m in re.finditer(r"(\w+)=(\S*)", out.stdout)), ""
    words = one_line(out.stderr or out.stdout)
    return ({} if "Invalid job id" in words else None), words


def job_info(job_id: str) -> dict[str, str]:
    """``scontrol show job -o``'s fields; empty when Slurm does not say (forgotten, or no answer)."""
    return ask_job(job_id)[0] or {}


def job_state(job_id: str) -> str:
    """PENDING, RUNNING, COMPLETED, CANCELLED, FAILED, ...; GONE once slurmctld forgot the job, UNKNOWN
    when scontrol failed."""
    info, _ = ask_job(job_id)
    return UNKNOWN if info is None else info.get("JobState", GONE)


def ended(state_name: str) -> bool:
    """Slurm said the job is over (module constants FINAL and GONE)."""
    return state_name in FINAL or state_name == GONE


_unanswered: dict[str, float] = {}  # job id -> when Slurm first failed to answer about it, while it fails


def _followed_state(job_id: str) -> str:
    """``job_state`` for a job being followed: says once when Slurm stops answering, and once when it
    answers again (the job is followed meanwhile, never taken for ended)."""
    info, why = ask_job(job_id)
    if info is None:
        if job_id not in _unanswered:
            _unanswered[job_id] = time.monotonic()
            print(f"xeontune: Slurm did not answer about job {job_id} ({why}); following it until Slurm says "
                  "it ended", file=sys.stderr, flush=True)
        return UNKNOWN
    if (since := _unanswered.pop(job_id, None)) is not None:
        print(f"xeontune: Slurm answers again about job {job_id} (after {time.monotonic() - since:.0f} s)",
              file=sys.stderr, flush=True)
    return info.get("JobState", GONE)


PROVIDER = Slurm()
