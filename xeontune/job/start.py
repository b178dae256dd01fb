"""Starting a job: one Hydra `mpirun` over SSH that starts `python -m xeontune.train` on every rank.

``start`` is what `xeontune launch`, `launch --detach` and `run` call, with a ``LaunchSpec``
(job/spec.py). ``build_plan`` is the one place that builds the command; ``--dry-run`` prints
exactly what ``run_plan`` executes. Where mpirun runs is the provider's to say (``Provider.wrap_launch`` and
``launcher_args``): on a remote cluster, on the head through ``ssh -F <cluster ssh_config> -tt
node0 ...``; on the local namespace hosts, inside the head's namespace; on localhost, right here
with Hydra's fork launcher.

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

import argparse
import os
import posixpath
import shlex
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from xeontune import hardware, placement
from xeontune.cluster import files, providers, state
from xeontune.cluster.providers import Provider
from xeontune.cluster.state import ClusterRecord
from xeontune.errors import UserError
from xeontune.job import process
from xeontune.job import record as job_record
from xeontune.job.record import JobInfo
from xeontune.job.spec import (
    JobRequest,
    LaunchSpec,
    choose_backend,
    head_output_dir,
    launch_spec,
    read_request,
    strip_dashes,
)
from xeontune.train import forecast
from xeontune.train.options import LAUNCH_DEFAULTS_ENV

# The caller's variables that ranks inherit when set: switches, on every provider ...
PASSTHROUGH_ENV = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE")
# ... and paths on this machine, only to ranks that run on it (never to a remote node).
LOCAL_PATH_ENV = ("HF_HOME", "HF_HUB_CACHE", "LD_PRELOAD")
DEFAULT_DIST_TIMEOUT_S = 30
# Exports the --env file's variables, deletes the file, then runs the rest (``$0``: the file).
SOURCE_AND_EXEC = 'set -a && . "$0" && set +a && rm -f "$0" && exec "$@"'
SSH_CHECK_TIMEOUT_S = 15.0
STOP_GRACE_S = 20.0


@dataclass
class LaunchPlan:
    argv: list[str]  # exactly what runs on this machine
    mpirun: str  # mpirun's path on the head
    world_size: int
    backend: str
    env: dict[str, str] = field(default_factory=dict)  # what every rank gets via -genv
    inner: list[str] = field(default_factory=list)  # mpirun's command as the head runs it (argv, unwrapped)
    wdir: str = ""  # mpirun's -wdir: relative train paths (--output-dir) are relative to it


def mpirun_path(record: ClusterRecord, provider: Provider) -> str:
    """mpirun on the head: $XEONTUNE_MPIRUN, else the nodes' venv's (Hydra needs the same path on
    every host), else, where ranks run on this machine, the one ``doctor`` reports."""
    if provider.remote and not os.environ.get(hardware.MPIRUN_ENV):
        return f"{record.venv or sys.prefix}/bin/mpirun"
    return hardware.find_mpirun() or str(Path(sys.prefix) / "bin" / "mpirun")


def python_path(record: ClusterRecord, provider: Provider) -> str:
    return f"{record.venv or sys.prefix}/bin/python" if provider.remote else sys.executable


def threads_per_rank(record: ClusterRecord, provider: Provider, world_size: int, ppn: int) -> int | None:
    """Cores a rank may use. Ranks of a provider that is not remote all share this machine's cores;
    on a remote node it is the node's cores (``record.cores_per_node``, set by the provider) over
    ``--ppn``. None when unknown: torch then uses the node's own core count."""
    if "OMP_NUM_THREADS" in os.environ:
        return max(1, int(os.environ["OMP_NUM_THREADS"]))
    if not provider.remote:
        return int(hardware.launch_env(world_size, allocator="none")["OMP_NUM_THREADS"])
    cores = record.cores_per_node or 0
    return max(1, cores // ppn) if cores else None


def every_rank_env(backend: str) -> dict[str, str]:
    """What every rank gets, however it is started (mpirun here, or a scheduler's srun)."""
    return {
        # c10d warns on every rank that namespaces share a hostname; real errors still show.
        "TORCH_CPP_LOG_LEVEL": "ERROR",
        # Ranks train on CPU only. A GPU they can see makes accelerate's barrier pick
        # cuda:<local rank> ("invalid device ordinal" on ranks 1..N); --env may still override it.
        "CUDA_VISIBLE_DEVICES": "",
        # Launch's choices reach the ranks as defaults, below --config and the command line: appended
        # flags would override a value given in --config or in another spelling (--dist_timeout).
        LAUNCH_DEFAULTS_ENV["dist_backend"]: backend,
        LAUNCH_DEFAULTS_ENV["dist_timeout"]: str(DEFAULT_DIST_TIMEOUT_S),
    }


def rank_pythonpath() -> str | None:
    """The source tree, when xeontune runs from a checkout rather than an installed package."""
    pkg_parent = Path(__file__).resolve().parents[2]  # xeontune/job/start.py -> the checkout
    if Path(sys.prefix).resolve() in pkg_parent.parents:
        return None
    return str(pkg_parent)


def build_plan(record: ClusterRecord, num_processes: int, ppn: int, backend: str, train_args: list[str],
               extra_env: dict[str, str] | None = None, workdir: str | None = None,
               module: str = "xeontune.train", secret_env_file: str | None = None) -> LaunchPlan:
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
    return LaunchPlan(argv=provider.wrap_launch(record, argv), mpirun=mpirun, world_size=num_processes, backend=chosen,
                      env=env, inner=argv, wdir=wdir)


def preflight(record: ClusterRecord, plan: LaunchPlan) -> None:
    """One-line UserErrors before anything starts: mpirun missing on the head, a node not answering SSH."""
    provider = providers.get(record.provider)
    provider.check_launch(record)
    if not provider.remote and not (os.path.isfile(plan.mpirun) and os.access(plan.mpirun, os.X_OK)):
        raise UserError(f"no mpirun on the head node (looked for {plan.mpirun}); install MPICH's Hydra "
                        "with `pip install mpich` in this venv, or set XEONTUNE_MPIRUN")
    if not provider.uses_ssh:
        return
    from xeontune.cluster import ssh

    # re-raises the UserError that names the node, without waiting for the others
    ssh.on_every_node(record.nodes, lambda node: ssh.wait_for_ssh(record, node, SSH_CHECK_TIMEOUT_S, 0.5), workers=16)
    if provider.remote:
        rc, _, _ = ssh.run(record, record.head, ["test", "-x", plan.mpirun], timeout_s=4 * SSH_CHECK_TIMEOUT_S)
        if rc != 0:
            raise UserError(f"no mpirun on the head node {record.head.name} (looked for {plan.mpirun})")


def run_plan(plan: LaunchPlan) -> int:
    """Run mpirun, stream its (rank-prefixed) output, return the job's exit code.

    Hydra stops every rank when one dies and exits non-zero. SIGINT (Ctrl-C), SIGTERM and SIGHUP
    to this process are passed on so that every rank stops through its own KeyboardInterrupt
    (``process.run_attached``: how, and why not simply to the process group); after a grace period,
    or at a second signal, the job is stopped hard.
    """
    rc, sig = process.run_attached(plan.argv, grace_s=STOP_GRACE_S)
    if sig is not None:
        print(f"interrupted ({signal.Signals(sig).name}): the job was stopped on every rank", file=sys.stderr)
        return 128 + int(sig)  # like a shell's status for a job stopped by that signal
    return rc




# --- one start for `launch`, `launch --detach` and `run` ---------------------------------------


def plan_for(record: ClusterRecord, spec: LaunchSpec, job_dir: str | None = None) -> LaunchPlan:
    """The command for ``spec``; --env values wait in ``<job_dir>/env`` (``write_secret_env``)."""
    env_file = posixpath.join(job_dir or posixpath.join(record.work_dir, "jobs", "<job id>"), "env")
    return build_plan(record, spec.ranks, spec.ppn, spec.backend, spec.rank_args, spec.env,
                      secret_env_file=env_file if spec.env else None)


def write_secret_env(record: ClusterRecord, job_dir: str, env: dict[str, str]) -> None:
    """The --env values, in a 0600 file in a 0700 job dir on the head (never in a command line)."""
    text = "".join(f"{key}={shlex.quote(value)}\n" for key, value in env.items())
    put_head_text(record, posixpath.join(job_dir, "env"), text)


def put_head_text(record: ClusterRecord, path: str, text: str) -> None:
    """Write ``text`` into ``path`` on the head: a 0600 file in a 0700 dir, private before its first byte."""
    job_dir = posixpath.dirname(path)
    if not providers.get(record.provider).remote:  # the head's disk is this one
        os.makedirs(job_dir, mode=0o700, exist_ok=True)
        os.chmod(job_dir, 0o700)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(text)
        return
    from xeontune.cluster import ssh

    client = ssh.connect(record, record.head)
    try:
        sftp = client.open_sftp()
        try:
            ssh.sftp_makedirs(sftp, job_dir)
            sftp.chmod(job_dir, 0o700)
            with sftp.open(path, "w") as f:
                f.chmod(0o600)  # before the first byte
                f.write(text)
        finally:
            sftp.close()
    finally:
        ssh.close(client)


def start(record: ClusterRecord, spec: LaunchSpec, detached: bool, local_output_dir: Path | None = None,
          say: Callable[[str], None] = print, hold_for_fetch: bool = False) -> tuple[JobInfo, int]:
    """Check, record and start the job. Attached: returns when it ends, with its exit code;
    detached: once it runs on the head (exit code 0). The record is written before it starts,
    so `fetch` and `logs` find the job whatever happens to this process. ``hold_for_fetch``
    (`run`): the head's autostop waits until the outputs are fetched (``record.UNFETCHED``)."""
    job_id = job_record.new_job_id()
    job_dir = posixpath.join(record.work_dir, "jobs", job_id)
    if providers.get(record.provider).schedules_jobs:
        return start_scheduled(record, spec, job_id, job_dir, detached, local_output_dir, say)
    plan = plan_for(record, spec, job_dir)
    preflight(record, plan)
    check_no_other_job(record)
    output_dir = head_output_dir(spec, plan.wdir)
    check_kept_outputs(record, output_dir, hold_for_fetch)
    job = JobInfo(id=job_id, cluster=record.name, output_dir=output_dir,
                  local_output_dir=str(local_output_dir or spec.request.local_output_dir), job_dir=job_dir,
                  detached=detached, started=time.time(), world_size=plan.world_size,
                  overwrite=spec.request.options.overwrite)
    job_record.save_job(job)
    if spec.env:
        write_secret_env(record, job_dir, spec.env)
    if hold_for_fetch:
        put_head_text(record, job.unfetched_path, f"{job.local_output_dir}\n")
    if detached:
        try:
            start_detached(record, plan, job)
        except UserError:  # it did not start: nothing of it for the head's autostop to wait for
            if hold_for_fetch:
                forget_mark(record, job)
            raise
        job_record.save_job(job)
        return job, 0
    say(f"launching {plan.world_size} rank(s) on cluster {record.name!r} ({record.provider}, backend {plan.backend}, "
        f"OMP_NUM_THREADS={plan.env.get('OMP_NUM_THREADS', 'node default')})")
    return job, run_plan(plan)


def start_scheduled(record: ClusterRecord, spec: LaunchSpec, job_id: str, job_dir: str, detached: bool,
                    local_output_dir: Path | None, say: Callable[[str], None]) -> tuple[JobInfo, int]:
    """A batch scheduler's job (``Provider.schedules_jobs``): submitted, then followed through its
    output file until it ends (attached), or left to the scheduler (detached). Its log is always a
    file, so `logs -f` follows either. Ctrl-C while attached cancels it."""
    from xeontune.job import fetch

    provider = providers.get(record.provider)
    job = JobInfo(id=job_id, cluster=record.name, output_dir=head_output_dir(spec, os.getcwd()),
                  local_output_dir=str(local_output_dir or spec.request.local_output_dir), job_dir=job_dir,
                  detached=True, started=time.time(), world_size=spec.ranks, overwrite=spec.request.options.overwrite)
    provider.submission(record, spec, job)  # every refusal that needs no scheduler, before anything is written
    job_record.save_job(job)
    if spec.env:
        write_secret_env(record, job_dir, spec.env)
    provider.submit(record, spec, job)
    job_record.save_job(job)
    say(f"submitted {record.provider} job {job.scheduler_id}: {spec.ranks} rank(s), "
        f"{min(spec.ranks, spec.ppn)} per node, backend {spec.backend}; log: {job.log_path}")
    if detached:
        return job, 0
    try:
        rc = fetch.follow_job(record, job, 0.0, say)
    except KeyboardInterrupt:
        say(f"interrupted: cancelling {record.provider} job {job.scheduler_id}")
        provider.stop_job(record, job)
        raise
    return job, 1 if rc is None else rc


def forget_mark(record: ClusterRecord, job: JobInfo, ended_only: bool = False) -> None:
    """Remove the job's ``record.UNFETCHED`` mark (nothing of it is left to fetch; ``ended_only``:
    unless it still runs). Best effort: an unreachable head keeps it, and its autostop then waits
    at most a day from the job's end."""
    from xeontune.job import fetch

    if not providers.get(record.provider).uses_ssh:  # `run` marks only jobs on a head reached by SSH
        return
    try:
        with fetch.head_files(record) as head:
            if not ended_only or head.exists(job.rc_path):
                head.remove(job.unfetched_path)
    except UserError:
        pass


def check_kept_outputs(record: ClusterRecord, output_dir: str, hold_for_fetch: bool = False) -> None:
    """Refuse a new job while the cluster holds outputs that `run` kept for fetching (its last job's
    ``record.UNFETCHED`` mark is on the head): the new job's record would replace that job's, and
    `xeontune fetch` could no longer reach them. A job that resumes in that job's output dir takes
    its outputs over (with ``hold_for_fetch``, its own mark replaces the old one); an ended job that
    wrote nothing holds nothing (its mark goes)."""
    from xeontune.job import fetch
    from xeontune.train.outputs import CHECKPOINT_RE, RUN_FILE_RE

    if not providers.get(record.provider).uses_ssh or not job_record.record_path(record.name).is_file():
        return
    try:
        last = job_record.load_job(record.name)
    except UserError:  # unreadable: no fetch can reach that job through it either
        return
    with fetch.head_files(record) as head:
        if not head.exists(last.unfetched_path):
            return
        if posixpath.normpath(last.output_dir) == posixpath.normpath(output_dir):
            if hold_for_fetch:
                head.remove(last.unfetched_path)
            return
        if head.exists(last.rc_path) and not any(
                RUN_FILE_RE.match(name) or (is_dir and CHECKPOINT_RE.match(name))
                for name, is_dir in head.listdir(last.output_dir) or []):
            head.remove(last.unfetched_path)
            return
    raise UserError(f"cluster {record.name!r} holds the outputs of job {last.id}, which were not fetched yet: fetch "
                    f"them first with `xeontune fetch --name {record.name}` (into {last.local_output_dir}, or "
                    "--output-dir DIR); a new job now would replace the record that fetch reads")


def check_no_other_job(record: ClusterRecord) -> None:
    """Refuse a second job while one trains on the cluster: both would use MASTER_PORT, and a
    `run`'s sync and teardown would pull the data and nodes from under the first."""
    provider = providers.get(record.provider)
    if not provider.uses_ssh:  # localhost: the ranks would share this machine's cores with the running ones
        from xeontune.cluster.autostop_watch import training_processes

        if found := training_processes():
            raise UserError(f"cluster {record.name!r} is this machine, which is training already "
                            f"({'; '.join(found)[:200]}); wait for it (`xeontune logs --name {record.name} -f` "
                            "for a detached job) or stop it")
        return
    from xeontune.cluster import ssh

    probe = [python_path(record, provider), "-c",
             "from xeontune.cluster.autostop_watch import training_processes as t; print('; '.join(t()))"]
    pythonpath = None if provider.remote else rank_pythonpath()
    if pythonpath:
        probe = ["env", f"PYTHONPATH={pythonpath}", *probe]
    rc, out, err = ssh.run(record, record.head, probe, timeout_s=60)
    if rc != 0:
        raise UserError(f"could not check {record.head.name} of cluster {record.name!r} for a running job: "
                        f"{((err or out).strip().splitlines() or ['no output'])[-1]}")
    if out.strip():
        raise UserError(f"cluster {record.name!r} is running a job already ({out.strip()[:200]}); wait for it "
                        f"(`xeontune logs --name {record.name} -f`) or use another cluster")


def start_detached(record: ClusterRecord, plan: LaunchPlan, job: JobInfo) -> None:
    """Start the job on the head, detached (``process``: its own session, log and exit status)."""
    from xeontune.cluster import ssh

    provider = providers.get(record.provider)
    if provider.uses_ssh:
        # the runner runs on the head, in its login: it starts the unwrapped mpirun command there
        runner = process.detach_argv(python_path(record, provider), job.job_dir, plan.inner)
        pythonpath = None if provider.remote else rank_pythonpath()
        if pythonpath:
            runner = ["env", f"PYTHONPATH={pythonpath}", *runner]
        rc, out, err = ssh.run(record, record.head, runner, timeout_s=60)
    else:
        import subprocess

        proc = subprocess.run(process.detach_argv(sys.executable, job.job_dir, plan.argv), capture_output=True,
                              text=True, timeout=60, cwd=plan.wdir or None)
        rc, out, err = proc.returncode, proc.stdout, proc.stderr
    pid = out.strip().splitlines()[-1] if out.strip() else ""
    if rc != 0 or not pid.isdigit() or pid == "0":
        last = (err.strip() or out.strip() or "no output").splitlines()[-1]
        raise UserError(f"could not start the detached job on {record.head.name}: {last[:300]}")
    job.pid = int(pid)


def launch_command(args: argparse.Namespace) -> int:
    """`xeontune launch`: the spec, then one start (attached, or --detach)."""
    record = state.load(state.validate_name(args.name))
    provider = providers.get(record.provider)
    request: JobRequest = read_request(list(args.train_args), str(args.ppn), args.dist_backend,
                                       list(getattr(args, "env", None) or []), remote=provider.remote)
    spec = launch_spec(record, request, args.num_processes)
    if args.dry_run:
        if provider.schedules_jobs:  # the submit command, then the batch script it submits
            job_dir = posixpath.join(record.work_dir, "jobs", "<job id>")
            job = JobInfo(id="<job id>", cluster=record.name, output_dir=head_output_dir(spec, os.getcwd()),
                          local_output_dir=str(spec.request.local_output_dir), job_dir=job_dir)
            argv, script = provider.submission(record, spec, job)
            print(shlex.join(argv))
            print(script, end="")
            return 0
        print(shlex.join(plan_for(record, spec).argv))
        return 0
    detached = bool(getattr(args, "detach", False))
    job, rc = start(record, spec, detached, say=lambda text: print(text, file=sys.stderr, flush=True))
    if detached and provider.schedules_jobs:
        print(f"follow it: xeontune logs --name {record.name} -f    cancel it: xeontune teardown --name {record.name}")
    elif detached:
        name = record.name
        print(f"started job {job.id} ({job.world_size} rank(s)) on cluster {name!r}, detached (pid {job.pid} on "
              f"{record.head.name}); log: {job.log_path}")
        print(f"follow it: xeontune logs --name {name} -f    outputs: xeontune fetch --name {name}")
    return rc
