"""Engines: how a job's ranks are started, declared once, and the registry that routes a name to one.

A provider supplies nodes and says how to reach them; an engine starts the ranks on them. Each
engine is one module that defines ``ENGINE``, an instance of an ``Engine`` subclass, made known by
one ``register(name, module)`` call (the built-in ones at the end of this file). A provider names
its engine (``Provider.engine``); `xeontune train --nproc-per-node` uses ``elastic`` with no
provider at all.

Two shapes of job, both behind the same few calls:

- a process job (``scheduled`` False: mpirun, Ray's driver): ``plan`` gives the one command that
  is the job. The job wing runs it attached (``process.run_attached``: signals forwarded to the
  ranks) or detached (``process.detach_argv``: its own session, log and exit status in the job's
  dir), and follows and stops it through those files and the runner's pid (SIGINT): the engine
  has nothing more to do.
- a scheduler's job (``scheduled`` True: srun): ``plan`` gives the submit command and the script it
  submits; ``submit`` hands the job over, ``ended`` asks the scheduler, ``stop`` cancels.

``plan`` has no side effects: `launch --dry-run` prints exactly what ``start`` runs. The rank
environment every engine gives (``env.every_rank_env``) is their shared part.

Modules are imported on first use, so Ray stays an optional extra.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from xeontune.registry import Registry

if TYPE_CHECKING:
    from xeontune.cluster.state import ClusterRecord
    from xeontune.job.record import JobInfo
    from xeontune.job.spec import LaunchSpec


@dataclass
class Plan:
    """What `launch --dry-run` prints and ``start`` runs: no side effects made it."""

    argv: list[str]  # exactly what runs on this machine (a scheduler's job: the submit command)
    world_size: int
    backend: str
    env: dict[str, str] = field(default_factory=dict)  # what every rank gets
    program: str = ""  # the launcher itself where it runs (mpirun's path on the head)
    inner: list[str] = field(default_factory=list)  # the command as the head runs it (argv, unwrapped)
    wdir: str = ""  # where relative train paths (--output-dir) point
    script: str = ""  # printed after the command by --dry-run: the batch script a scheduler's job submits

    @property
    def mpirun(self) -> str:  # the name the job wing and its tests have always used
        return self.program


class Engine:
    """One way of starting ranks. ``name`` is what ``Provider.engine`` names."""

    name: str = ""
    # True: a scheduler runs the job (``submit``, ``ended``, ``stop`` ask it); False: the plan's argv
    # is the job, run by this machine (or, through ``ssh -tt``, by the head).
    scheduled: bool = False

    def plan(self, record: ClusterRecord, spec: LaunchSpec, job: JobInfo) -> Plan:
        """The command (and environment) that starts ``spec``'s ranks as ``job`` (its dir, log and
        exit-status paths; `--dry-run` passes one whose id is ``<job id>``). --env values wait in
        ``<job.job_dir>/env``, never on a command line."""
        raise NotImplementedError

    def preflight(self, record: ClusterRecord, plan: Plan) -> None:
        """One-line UserErrors before anything is recorded or started (a launcher missing, a node silent)."""

    # --- a scheduler's job (``scheduled``) ------------------------------------------------------

    def submit(self, record: ClusterRecord, plan: Plan, job: JobInfo) -> None:
        """Hand the job over as ``plan`` (this engine's, already through ``preflight``) starts it; its
        log goes to ``job.log_path``, its exit status to ``job.rc_path``.
        Sets ``job.scheduler_id``. Raise UserError when the scheduler refuses it."""
        raise NotImplementedError

    def ended(self, record: ClusterRecord, job: JobInfo) -> str | None:
        """None while the job is queued or runs; once it ended, the scheduler's word for how."""
        raise NotImplementedError

    def stop(self, record: ClusterRecord, job: JobInfo) -> None:
        """Stop the job on every rank (the scheduler's cancel)."""
        raise NotImplementedError


_REGISTRY: Registry[Engine] = Registry("engine", "ENGINE", Engine)
register, unregister, names, get = _REGISTRY.register, _REGISTRY.unregister, _REGISTRY.names, _REGISTRY.get


def for_cluster(record: ClusterRecord) -> Engine:
    """The engine that starts ranks on the cluster's nodes: its provider's (``Provider.engine``)."""
    from xeontune.cluster import providers

    return get(providers.get(record.provider).engine)


register("mpirun", "xeontune.job.engines.mpirun")
register("srun", "xeontune.job.engines.srun")
register("ray", "xeontune.job.engines.ray")
