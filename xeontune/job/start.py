"""Starting a job: the engine's plan, recorded, then started: one start for `launch`,
`launch --detach` and `run`.

``start`` takes a ``LaunchSpec`` (job/spec.py) and the cluster's record; the cluster's provider
names the engine that starts its ranks (``Provider.engine``, xeontune/job/engines/). The job's
record is written before anything starts, so `fetch` and `logs` find the job whatever happens to
this process. A process job (mpirun; Ray's driver) is the plan's command: run attached here with
signals passed on to every rank (``run_plan``), or detached on the head (``start_detached``:
``process.detach_argv``, its own session, log and exit status). A scheduler's job (srun) is
submitted and followed through its log (``start_scheduled``). ``plan_for`` is what `--dry-run`
prints: exactly what ``start`` runs.
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
from pathlib import Path

from xeontune.cluster import providers, state
from xeontune.cluster.state import ClusterRecord
from xeontune.errors import UserError
from xeontune.job import engines, process
from xeontune.job import record as job_record
from xeontune.job.engines import Engine, Plan
from xeontune.job.engines.env import DEFAULT_DIST_TIMEOUT_S as DEFAULT_DIST_TIMEOUT_S  # re-exported: the
from xeontune.job.engines.env import python_path, rank_pythonpath  # names launch's callers have always used
from xeontune.job.engines.mpirun import SOURCE_AND_EXEC as SOURCE_AND_EXEC
from xeontune.job.engines.mpirun import build_plan as build_plan
from xeontune.job.record import JobInfo
from xeontune.job.spec import (
    JobRequest,
    LaunchSpec,
    head_output_dir,
    launch_spec,
    read_request,
)

STOP_GRACE_S = 20.0
SSH_CHECK_TIMEOUT_S = 15.0


def preflight(record: ClusterRecord, plan: Plan) -> None:
    """One-line UserErrors before anything is recorded or started: this machine cannot launch there
    (``Provider.check_launch``), the engine's own (mpirun missing), a node does not answer SSH (named)."""
    provider = providers.get(record.provider)
    provider.check_launch(record)
    engines.for_cluster(record).preflight(record, plan)
    if provider.uses_ssh:
        from xeontune.cluster import ssh

        # re-raises the UserError that names the node, without waiting for the others
        ssh.on_every_node(record.nodes, lambda node: ssh.wait_for_ssh(record, node, SSH_CHECK_TIMEOUT_S, 0.5),
                          workers=16)


def run_plan(plan: Plan) -> int:
    """Run mpirun, stream its (rank-prefixed) output, return the job's exit code.

    Hydra stops every rank when one dies and exits non-zero: one line then says so, and that the
    completed checkpoints are kept. SIGINT (Ctrl-C), SIGTERM and SIGHUP
    to this process are passed on so that every rank stops through its own KeyboardInterrupt
    (``process.run_attached``: how, and why not simply to the process group); after a grace period,
    or at a second signal, the job is stopped hard.
    """
    rc, sig = process.run_attached(plan.argv, grace_s=STOP_GRACE_S)
    if sig is not None:
        print(f"interrupted ({signal.Signals(sig).name}): the job was stopped on every rank", file=sys.stderr)
        return 128 + int(sig)  # like a shell's status for a job stopped by that signal
    if rc not in (0, UserError.exit_code):  # a rank's own mistake to correct has said so in one line
        print(f"the job ended with exit status {rc}: a rank failed or was lost and the others were stopped (what "
              "they wrote is above); the checkpoints it completed are kept: --resume-from-checkpoint latest goes "
              "on from the newest", file=sys.stderr)
    return rc




# --- one start for `launch`, `launch --detach` and `run` ---------------------------------------


def plan_for(record: ClusterRecord, spec: LaunchSpec, job: JobInfo | None = None) -> Plan:
    """What starts ``spec`` as ``job`` (`--dry-run`: a job whose id is ``<job id>``); --env values wait
    in ``<job dir>/env`` (``write_secret_env``)."""
    return engines.for_cluster(record).plan(record, spec, job or new_job(record, spec, "<job id>"))


def new_job(record: ClusterRecord, spec: LaunchSpec, job_id: str, wdir: str | None = None,
            local_output_dir: Path | None = None, detached: bool = False) -> JobInfo:
    """The job's record, before its start: its dir on the head, where its outputs go."""
    return JobInfo(id=job_id, cluster=record.name, output_dir=head_output_dir(spec, wdir or os.getcwd()),
                   local_output_dir=str(local_output_dir or spec.request.local_output_dir),
                   job_dir=posixpath.join(record.work_dir, "jobs", job_id), detached=detached, started=time.time(),
                   world_size=spec.ranks, overwrite=spec.request.options.overwrite)


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
    engine = engines.for_cluster(record)
    job = new_job(record, spec, job_record.new_job_id(), local_output_dir=local_output_dir, detached=detached)
    if engine.scheduled:
        return start_scheduled(record, spec, engine, job, detached, say)
    plan = engine.plan(record, spec, job)
    preflight(record, plan)
    check_no_other_job(record)
    job.output_dir = head_output_dir(spec, plan.wdir)  # relative to where the plan's command runs
    check_kept_outputs(record, job.output_dir, hold_for_fetch)
    job_record.save_job(job)
    if spec.env:
        write_secret_env(record, job.job_dir, spec.env)
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
    say(f"launching {plan.world_size} rank(s) on cluster {record.name!r} ({record.provider}, {engine.name}, backend "
        f"{plan.backend}, OMP_NUM_THREADS={plan.env.get('OMP_NUM_THREADS', 'node default')})")
    return job, run_plan(plan)


def start_scheduled(record: ClusterRecord, spec: LaunchSpec, engine: Engine, job: JobInfo, detached: bool,
                    say: Callable[[str], None]) -> tuple[JobInfo, int]:
    """A scheduler's job (``Engine.scheduled``): submitted, then followed through its log file until
    it ends (attached), or left to the scheduler (detached). Its log is always a file, so `logs -f`
    follows either. Ctrl-C while attached cancels it."""
    from xeontune.job import fetch

    job.detached = True  # the scheduler holds it, whatever becomes of this process
    plan = engine.plan(record, spec, job)  # the plan's own refusals (the partition's shape), then
    preflight(record, plan)  # the provider's and the engine's (sbatch missing), before anything is written
    job_record.save_job(job)
    if spec.env:
        write_secret_env(record, job.job_dir, spec.env)
    engine.submit(record, plan, job)
    job_record.save_job(job)
    say(f"submitted {record.provider} job {job.scheduler_id}: {spec.ranks} rank(s), "
        f"{min(spec.ranks, spec.ppn)} per node, backend {spec.backend}; log: {job.log_path}")
    if detached:
        return job, 0
    try:
        rc = fetch.follow_job(record, job, 0.0, say)
    except KeyboardInterrupt:
        say(f"interrupted: cancelling {record.provider} job {job.scheduler_id}")
        engine.stop(record, job)
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
    if not provider.one_job_at_a_time:
        return
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


def start_detached(record: ClusterRecord, plan: Plan, job: JobInfo) -> None:
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
    if args.dry_run:  # the command; a scheduler's: then the batch script it submits
        plan = plan_for(record, spec)
        print(shlex.join(plan.argv))
        print(plan.script, end="")
        return 0
    detached = bool(getattr(args, "detach", False))
    job, rc = start(record, spec, detached, say=lambda text: print(text, file=sys.stderr, flush=True))
    if detached and engines.for_cluster(record).scheduled:
        print(f"follow it: xeontune logs --name {record.name} -f    cancel it: xeontune teardown --name {record.name}")
    elif detached:
        name = record.name
        print(f"started job {job.id} ({job.world_size} rank(s)) on cluster {name!r}, detached (pid {job.pid} on "
              f"{record.head.name}); log: {job.log_path}")
        print(f"follow it: xeontune logs --name {name} -f    outputs: xeontune fetch --name {name}")
    return rc
