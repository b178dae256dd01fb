"""The srun engine: a job is ONE Slurm batch job whose script runs one ``srun`` task per rank.

``plan`` writes nothing: it is the sbatch command and the generated script (``--dry-run`` prints
both). The script runs ``python -m xeontune.train`` with the launch spec's merged options (every
value through ``shlex.quote``); each task takes its rank from Slurm's environment (train/world.py).
The job's output file is the job's log, and the script writes srun's exit status beside it, so
`logs -f` follows it like any detached job. The script also carries the restart rules: a requeued
job resumes from the newest checkpoint it wrote, and a job that Slurm preempted (SIGTERM) or
warned of its time limit (SIGUSR1) requeues itself. Asking Slurm about a job (``scontrol``) is the
Slurm provider's (cluster/providers/slurm.py), which `cluster status` and `teardown` use too.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from xeontune.cluster import state
from xeontune.cluster.providers import slurm
from xeontune.cluster.state import ClusterRecord
from xeontune.errors import UserError
from xeontune.io import atomic_write_text
from xeontune.job.engines import Engine, Plan
from xeontune.job.engines.env import every_rank_env, rank_pythonpath
from xeontune.train import forecast, preempt
from xeontune.train.outputs import CHECKPOINT_COMPLETE

if TYPE_CHECKING:
    from xeontune.job.record import JobInfo
    from xeontune.job.spec import LaunchSpec

GRACE_S = 120  # seconds between Slurm's notice (SIGUSR1) and its time limit: a checkpoint's time
MARK = "preempted"  # in the job's dir: the ranks stopped on the notice (SIGUSR1), the script requeues the job
REQUEUED = "requeued"  # in the job's dir: the batch script requeued its own job (notice or preemption)
REQUEUE_WINDOW_S = 60.0  # how long after that file an ended state is taken for the requeue's passage
ENV_FILE = "env"  # in the job's dir: the --env values, read at every (re)start, deleted once the job is over


class Srun(Engine):
    name = "srun"
    scheduled = True

    def plan(self, record: ClusterRecord, spec: LaunchSpec, job: JobInfo) -> Plan:
        """The sbatch command and the batch script it submits (``--dry-run`` prints both); every
        refusal that needs no scheduler (the partition's shape) comes from here, before anything is written."""
        nodes, per_node, cpus_per_task = slurm.PROVIDER.layout(record, spec.ranks, spec.ppn)
        env = {
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS") or str(cpus_per_task),
            **every_rank_env(spec.backend),
            preempt.ENV: "1",  # SIGUSR1 (--signal) or SIGTERM (preemption): checkpoint, stop, requeue, resume
        }
        if pythonpath := rank_pythonpath():  # xeontune from a checkout, not installed in the venv
            env["PYTHONPATH"] = pythonpath
        shape = [f"--nodes={nodes}", f"--ntasks={spec.ranks}", f"--ntasks-per-node={per_node}",
                 f"--cpus-per-task={cpus_per_task}"]
        rank = [sys.executable, "-m", "xeontune.train", *spec.rank_args]
        q = shlex.quote
        env_file = q(os.path.join(job.job_dir, ENV_FILE))
        mark, requeued = q(os.path.join(job.job_dir, MARK)), q(os.path.join(job.job_dir, REQUEUED))
        started = q(os.path.join(job.job_dir, "started"))
        rc_path, rc_tmp = q(job.rc_path), q(job.rc_path + ".tmp")
        out_dir = q(job.output_dir)  # quoted, so only the checkpoint-* after it is ever a pattern
        explicit = bool(spec.request.options.resume_from_checkpoint)
        # A restarted job resumes from the newest complete checkpoint that THIS job wrote (newer than its
        # first start): not from another run's, nor again from an explicit --resume-from-checkpoint PATH
        # (the last one on srun's command line wins). One stopped before its first checkpoint starts over
        # (--overwrite), but only where this job wrote the run and no checkpoint was named.
        restart = [
            'if [ "${SLURM_RESTART_COUNT:-0}" -gt 0 ]; then',
            "  newest='' newest_step=-1",
            f"  for dir in {out_dir}/checkpoint-*; do",
            '    step=${dir##*/checkpoint-}',
            "    case $step in ''|*[!0-9]*) continue ;; esac",
            f'    if [ -f "$dir"/{q(CHECKPOINT_COMPLETE)} ] && [ "$dir" -nt {started} ] && '
            '[ "$step" -gt "$newest_step" ]; then',
            '      newest=$dir newest_step=$step',
            "    fi",
            "  done",
            '  if [ -n "$newest" ]; then',
            '    resume=(--resume-from-checkpoint "$newest")',
            '    echo "xeontune: Slurm job $SLURM_JOB_ID, restart $SLURM_RESTART_COUNT: resuming from $newest, the newest '
            'checkpoint this job wrote"',
            *([] if explicit else [
                f"  elif [ {out_dir}/train_config.json -nt {started} ]; then",
                '    resume=(--overwrite)',
                '    echo "xeontune: Slurm job $SLURM_JOB_ID, restart $SLURM_RESTART_COUNT: no checkpoint yet, starting over"',
            ]),
            "  fi",
            "fi",
        ]
        # A preemption (PreemptMode=REQUEUE, GraceTime > 0) sends SIGTERM to the job's steps only: the
        # ranks checkpoint and exit 143, and this script goes on while Slurm still counts the job as
        # running, preempted (PreemptTime set, not before this run's StartTime). Slurm would requeue it
        # only at the end of GraceTime, and an ended job never: so the script requeues it now. A scancel,
        # an `scontrol requeue` or the time limit kill this script as well: none of them comes here.
        preempted = [
            "preempted() {",
            "  local job start at since=' StartTime=([^ ]+)' preempt=' PreemptTime=([0-9][^ ]*)'",
            '  job=$(SLURM_TIME_FORMAT=standard scontrol show job -o "$SLURM_JOB_ID" 2>/dev/null) || return 1',
            '  [[ $job =~ $since ]] && start=${BASH_REMATCH[1]} || return 1',
            '  [[ $job =~ $preempt ]] && at=${BASH_REMATCH[1]} || return 1',
            '  [[ ! $at < $start ]]  # one time format: the strings order as the times',
            "}",
            "requeue() {",
            '  echo "xeontune: $1; requeueing job $SLURM_JOB_ID to resume from its newest checkpoint"',
            f"  : > {requeued}",
            '  scontrol requeue "$SLURM_JOB_ID" && exit 0',
            f"  rm -f {requeued}",
            '  echo "xeontune: scontrol requeue $SLURM_JOB_ID failed: resume it by hand (its checkpoints stay)" >&2',
            "}",
        ]
        wdir = os.getcwd()  # as mpirun's -wdir: a relative --output-dir is relative to where the job started
        lines = [
            "#!/bin/bash",
            f"# written by xeontune: job {job.id} of cluster {record.name}",
            f"cd {q(wdir)} || exit 2",
            *(f"export {key}={q(value)}" for key, value in env.items()),
            f"if [ -f {env_file} ]; then set -a; . {env_file}; set +a; fi  # --env, never in argv",
            f"export {preempt.MARK_ENV}={mark}",
            f"rm -f {mark} {requeued} {rc_path}  # a requeued job's earlier run may have left them",
            # for the forecast's time lost to restarts (train/forecast.py)
            f"[ -s {started} ] || date +%s > {started}",
            f'export {forecast.JOB_STARTED_ENV}="$(cat {started})" {forecast.RUN_STARTED_ENV}="$(date +%s)" '
            f'{forecast.RESTARTS_ENV}="${{SLURM_RESTART_COUNT:-0}}"',
            "resume=()",
            *restart,
            # a rank that dies ends the step at once (the others would wait for it in a collective)
            f'srun --kill-on-bad-exit=1 {shlex.join(shape)} {shlex.join(rank)} "${{resume[@]}}"',
            "rc=$?",
            *preempted,
            f"if [ -e {mark} ]; then requeue \"checkpointed on Slurm's notice\"; fi",
            'if [ "$rc" -ne 0 ] && preempted; then requeue "preempted by Slurm (srun ended with status $rc)"; fi',
            'if [ "$rc" -ne 0 ]; then echo "xeontune: srun ended with status $rc: a rank failed or was killed '
            '(its error is above)" >&2; fi',
            f"rm -f {env_file}  # over for good: the --env values go",
            f"printf '%s\\n' \"$rc\" > {rc_tmp} && mv -f {rc_tmp} {rc_path}",
            'exit "$rc"',
        ]
        # --requeue: preemption requeues the job; --signal: the ranks' notice GRACE_S before the time limit
        argv = ["sbatch", "--parsable", f"--job-name=xeontune-{record.name}", *shape, f"--output={job.log_path}",
                "--open-mode=append", f"--chdir={wdir}", "--requeue", f"--signal=USR1@{GRACE_S}"]
        for key, flag in (("partition", "--partition"), ("account", "--account"), ("time", "--time")):
            if record.extra.get(key):
                argv.append(f"{flag}={record.extra[key]}")
        return Plan(argv=[*argv, os.path.join(job.job_dir, "job.sbatch")], world_size=spec.ranks, backend=spec.backend,
                    env=env, program="sbatch", wdir=wdir, script="\n".join(lines) + "\n")

    def preflight(self, record: ClusterRecord, plan: Plan) -> None:
        slurm._tool("sbatch")  # no sbatch here: one line, before the job is recorded

    def submit(self, record: ClusterRecord, plan: Plan, job: JobInfo) -> None:
        os.makedirs(job.job_dir, mode=0o700, exist_ok=True)
        atomic_write_text(Path(plan.argv[-1]), plan.script, mode=0o700)
        out = slurm._run(*plan.argv)
        job_id = out.stdout.strip().split(";")[0]
        if out.returncode != 0 or not job_id.isdigit():
            raise UserError(f"Slurm refused the job: {slurm.one_line(out.stderr or out.stdout)}")
        job.scheduler_id = job_id
        record.extra["jobs"] = ",".join(j for j in (*record.extra.get("jobs", "").split(","), job_id) if j)
        state.save(record)

    def ended(self, record: ClusterRecord, job: JobInfo) -> str | None:
        """Slurm's final state for the job, or None while it is not over: only Slurm's own word ends a
        job (FINAL, or GONE), never a failing or slow scontrol. A job that requeues itself passes through
        an ended state (seen: FAILED) for a moment: while its script's requeue is fresh, and until a
        second look agrees, it has not ended. Once it has, its --env file goes."""
        with contextlib.suppress(OSError):
            if time.time() - os.stat(os.path.join(job.job_dir, REQUEUED)).st_mtime < REQUEUE_WINDOW_S:
                return None  # its script has just requeued it
        if not slurm.ended(slurm._followed_state(job.scheduler_id)):
            return None
        time.sleep(slurm.SETTLE_S)
        how = slurm._followed_state(job.scheduler_id)
        if not slurm.ended(how):
            return None
        with contextlib.suppress(FileNotFoundError):
            os.remove(os.path.join(job.job_dir, ENV_FILE))
        return how

    def stop(self, record: ClusterRecord, job: JobInfo) -> None:
        if job.scheduler_id:
            slurm._run("scancel", job.scheduler_id)


ENGINE = Srun()
