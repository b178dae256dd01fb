"""The mpirun engine: one Hydra `mpirun` that starts `python -m xeontune.train` on every rank.

``build_plan`` is the one place that builds the command; ``--dry-run`` prints exactly what the job
wing runs (attached: ``process.run_attached``; detached: ``process.detach_argv`` on the head). Where
mpirun runs is the provider's to say (``Provider.wrap_launch`` and ``launcher_args``): on a remote
cluster, on the head through ``ssh -F <cluster ssh_config> -tt node0 ...``; on the local namespace
hosts, inside the head's namespace; on localhost, right here with Hydra's fork launcher.

Every rank gets, with ``-genvnone`` so nothing else leaks in from the caller's shell:
MASTER_ADDR (the head's private address), MASTER_PORT, GLOO_SOCKET_IFNAME (the cluster's
interface), OMP_NUM_THREADS (the cores a rank may use), PATH/HOME as the
node has them, the caller's HF_* offline switches when set, and, only where ranks run on this
machine (a provider that is not ``remote``), its HF_* cache paths and LD_PRELOAD (a path here
means nothing, or something else, on a cloud node), CCL_* for the
ccl backend, launch's backend and step timeout as XEONTUNE_LAUNCH_DIST_* (defaults that the
user's --dist-backend / --dist-timeout override in any spelling or in --config), an empty
CUDA_VISIBLE_DEVICES (ranks train on CPU; a visible GPU trips accelerate's barrier), the cluster's
price as XEONTUNE_COST_PER_HOUR (rank 0's time-and-cost forecast, train/forecast.py), and each
``--env KEY=VALUE`` last, so it overrides any of these. Hydra adds PMI_RANK / PMI_SIZE, which
accelerate reads.
"""

from __future__ import annotations

import os
import posixpath
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from xeontune import hardware, placement
from xeontune.cluster import files, providers
from xeontune.cluster.providers import Provider
from xeontune.cluster.state import ClusterRecord
from xeontune.errors import UserError
from xeontune.job.engines import Engine, Plan
from xeontune.job.engines.env import (
    LOCAL_PATH_ENV,
    PASSTHROUGH_ENV,
    every_rank_env,
    python_path,
    rank_pythonpath,
    threads_per_rank,
)
from xeontune.job.spec import choose_backend, strip_dashes
from xeontune.train import forecast

if TYPE_CHECKING:
    from xeontune.job.record import JobInfo
    from xeontune.job.spec import LaunchSpec

# Exports the --env file's variables, deletes the file, then runs the rest (``$0``: the file).
SOURCE_AND_EXEC = 'set -a && . "$0" && set +a && rm -f "$0" && exec "$@"'
HEAD_CHECK_TIMEOUT_S = 60.0
HEAD_SSH_WAIT_S = 15.0


def mpirun_path(record: ClusterRecord, provider: Provider) -> str:
    """mpirun on the head: $XEONTUNE_MPIRUN, else the nodes' venv's (Hydra needs the same path on
    every host), else, where ranks run on this machine, the one ``doctor`` reports."""
    if provider.remote and not os.environ.get(hardware.MPIRUN_ENV):
        return f"{record.venv or sys.prefix}/bin/mpirun"
    return hardware.find_mpirun() or str(Path(sys.prefix) / "bin" / "mpirun")


def build_plan(record: ClusterRecord, num_processes: int, ppn: int, backend: str, train_args: list[str],
               extra_env: dict[str, str] | None = None, workdir: str | None = None,
               module: str = "xeontune.train", secret_env_file: str | None = None) -> Plan:
    """The whole command and environment; no side effects. ``module`` is what each rank runs
    with ``python -m`` (tests launch small probes through the same path).

    With ``secret_env_file`` (what `launch` and `run` use), ``extra_env`` (the user's --env) never
    appears in a command line: the values wait in that 0600 file on the head (``write_secret_env``),
    a shell there exports them into mpirun's environment and deletes the file, and Hydra passes
    those names on (``-genvlist`` instead of ``-genvnone``) through its own connections."""
    if num_processes < 1 or ppn < 1:
        raise UserError("-n and --ppn must be at least 1")
    provider = providers.get(record.provider)
    if num_processes > provider.slots(record, ppn):
        raise UserError(f"-n {num_processes} is more ranks than cluster {record.name!r} holds "
                        f"({provider.slots_text(record, ppn)})")
    train_args = strip_dashes(train_args)
    chosen = choose_backend(backend)
    remote = provider.remote
    iface = provider.iface(record)

    env: dict[str, str] = {
        "MASTER_ADDR": record.head.private_ip,
        "MASTER_PORT": str(files.MASTER_PORT),
        "GLOO_SOCKET_IFNAME": iface,
        **every_rank_env(chosen),
        # No PYTHONUNBUFFERED: unbuffered print() writes text and newline separately, and Hydra's
        # -prepend-rank then glues lines of different ranks together.
    }
    threads = threads_per_rank(record, provider, num_processes, ppn)
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    if not provider.hosts_share_cores:
        # Each rank pins itself to its own slice of its node's physical cores (placement.py). Not
        # for namespace "hosts": they share this machine's cores, and each would pin to the first.
        env[placement.PIN_ENV] = "1"
    else:  # nor its memory: each rank's packing fit check takes its share of all of it (placement.local_ranks)
        env[placement.SHARED_MACHINE_ENV] = str(num_processes)
    if not remote:
        env["PATH"] = os.environ.get("PATH", "/usr/bin:/bin")
        env["HOME"] = os.environ.get("HOME", "/root")
        if "XEONTUNE_CACHE" in os.environ:  # where the bf16 weight copies live (this machine's path)
            env["XEONTUNE_CACHE"] = os.environ["XEONTUNE_CACHE"]
        pythonpath = rank_pythonpath()
        if pythonpath:
            env["PYTHONPATH"] = pythonpath
    if not remote and "LD_PRELOAD" not in os.environ:
        # tcmalloc (else jemalloc) when this machine has it: 1.2-1.4x faster steps (performance.md).
        # Cloud ranks preload it themselves at start (xeontune.train re-executes with it).
        preload = hardware.launch_env(1).get("LD_PRELOAD")
        if preload:
            env["LD_PRELOAD"] = preload
    for key in PASSTHROUGH_ENV + (() if remote else LOCAL_PATH_ENV):
        if key in os.environ:
            env[key] = os.environ[key]
    if chosen == "ccl":
        env.update({"CCL_ATL_TRANSPORT": "ofi", "CCL_WORKER_COUNT": "1"})
    cost = provider.cost_per_hour(record)
    if cost is not None:  # rank 0's forecast turns the time left into money (train/forecast.py)
        env[forecast.COST_ENV] = f"{cost:.4f}"
    secret = dict(extra_env or {}) if secret_env_file else {}
    env.update({} if secret_env_file else (extra_env or {}))
    for key in secret:
        env.pop(key, None)  # --env overrides launch's own value

    mpirun = mpirun_path(record, provider)
    wdir = workdir or (record.work_dir if remote else os.getcwd())
    argv = [mpirun, "-n", str(num_processes), *provider.launcher_args(record, ppn)]
    argv += ["-iface", iface, "-wdir", wdir, "-prepend-rank"]
    argv += ["-genvlist", ",".join(secret)] if secret else ["-genvnone"]
    for key, value in env.items():
        argv += ["-genv", key, value]
    argv += [python_path(record, provider), "-m", module, *train_args]

    # -genvnone governs only ranks reached over SSH; the head's rank is forked by mpirun and
    # would inherit this shell's whole environment. `env -i` gives it the same clean slate.
    base = [f"{k}={os.environ[k]}" for k in ("PATH", "HOME", "USER", "LOGNAME", "LANG") if k in os.environ]
    if secret:  # inside `env -i`, which would clear what the shell exports
        argv = ["sh", "-c", SOURCE_AND_EXEC, str(secret_env_file), *argv]
    if not remote:
        argv = ["env", "-i", *base, *argv]
    return Plan(argv=provider.wrap_launch(record, argv), program=mpirun, world_size=num_processes, backend=chosen,
                env=env, inner=argv, wdir=wdir)


def preflight(record: ClusterRecord, plan: Plan) -> None:
    """One-line UserErrors before anything starts: mpirun missing on the head (on a remote one, asked
    over SSH; then the job wing checks that every node answers, job/start.py's ``preflight``)."""
    provider = providers.get(record.provider)
    if not provider.remote and not (os.path.isfile(plan.mpirun) and os.access(plan.mpirun, os.X_OK)):
        raise UserError(f"no mpirun on the head node (looked for {plan.mpirun}); install MPICH's Hydra "
                        "with `pip install mpich` in this venv, or set XEONTUNE_MPIRUN")
    if provider.remote:
        from xeontune.cluster import ssh

        ssh.wait_for_ssh(record, record.head, HEAD_SSH_WAIT_S, 0.5)  # a silent head: one line naming it
        rc, _, _ = ssh.run(record, record.head, ["test", "-x", plan.mpirun], timeout_s=HEAD_CHECK_TIMEOUT_S)
        if rc != 0:
            raise UserError(f"no mpirun on the head node {record.head.name} (looked for {plan.mpirun})")


class Mpirun(Engine):
    name = "mpirun"

    def plan(self, record: ClusterRecord, spec: LaunchSpec, job: JobInfo) -> Plan:
        return build_plan(record, spec.ranks, spec.ppn, spec.backend, spec.rank_args, spec.env,
                          secret_env_file=posixpath.join(job.job_dir, "env") if spec.env else None)

    def preflight(self, record: ClusterRecord, plan: Plan) -> None:
        preflight(record, plan)


ENGINE = Mpirun()
