"""The record of a cluster's last job (``job.json`` in its state dir), written before the job starts.

It says where the job's files (``job_dir``: log, pid, rc) and outputs are on the head and where
`fetch` puts them on this machine, for `xeontune logs`, `xeontune fetch` and `run`'s own fetch.
A record that cannot be read (corrupt, or from an older xeontune) is a one-line error.
"""

from __future__ import annotations

import dataclasses
import json
import os
import posixpath
import time
from dataclasses import dataclass
from pathlib import Path

from xeontune.cluster import state
from xeontune.errors import UserError
from xeontune.io import atomic_write_json

RECORD_VERSION = 2
# In a job's dir on the head while `run` has not fetched its outputs: the autostop watcher waits
# for it (cluster/autostop_watch.py), for at most a day.
UNFETCHED = "unfetched"


@dataclass
class JobInfo:
    """The last job launched on a cluster, as this machine knows it."""

    id: str  # also the name of its files' dir on the head: <work_dir>/jobs/<id>
    cluster: str
    output_dir: str  # the job's --output-dir as the head sees it (absolute)
    local_output_dir: str  # where `fetch` puts the outputs by default (absolute, on this machine)
    job_dir: str  # <work_dir>/jobs/<id> on the head: log, pid, rc
    detached: bool = False
    started: float = 0.0
    world_size: int = 0
    overwrite: bool = False  # the job's --overwrite: `fetch` may replace a run in local_output_dir
    pid: int = 0  # a detached job's runner on the head
    scheduler_id: str = ""  # the batch scheduler's job id (slurm), where one started the job
    version: int = RECORD_VERSION

    @property
    def log_path(self) -> str:
        return posixpath.join(self.job_dir, "log")

    @property
    def rc_path(self) -> str:
        return posixpath.join(self.job_dir, "rc")

    @property
    def pid_path(self) -> str:
        return posixpath.join(self.job_dir, "pid")

    @property
    def unfetched_path(self) -> str:
        return posixpath.join(self.job_dir, UNFETCHED)


def new_job_id() -> str:
    return time.strftime("%Y%m%d-%H%M%S") + f"-{os.getpid() % 100000:05d}-{os.urandom(2).hex()}"


def record_path(cluster: str) -> Path:
    return state.cluster_dir(cluster) / "job.json"


def save_job(job: JobInfo) -> None:
    atomic_write_json(record_path(job.cluster), dataclasses.asdict(job), mode=0o600)


def load_job(cluster: str) -> JobInfo:
    path = record_path(cluster)
    if not path.is_file():
        raise UserError(f"no job was launched on cluster {cluster!r} from this machine; "
                        f"start one with `xeontune launch --name {cluster} -- <train options>`")
    unreadable = f"the job record {path} cannot be read"
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UserError(f"{unreadable} ({type(exc).__name__}: {str(exc)[:120]}); delete it and launch again") from None
    if not isinstance(data, dict):
        raise UserError(f"{unreadable} (not a JSON object); delete it and launch again")
    if not isinstance(data.get("version", 0), int) or data.get("version", 0) > RECORD_VERSION:
        raise UserError(f"{unreadable}: a newer xeontune wrote it (version {data.get('version')!r}); use that one")
    fields = {f.name: f for f in dataclasses.fields(JobInfo)}
    required = [n for n, f in fields.items() if f.default is dataclasses.MISSING]
    missing = [n for n in required if not isinstance(data.get(n), str)]
    if missing:
        raise UserError(f"{unreadable}: it lacks {', '.join(missing)} (written by an older xeontune?); "
                        "delete it and launch again")
    job = JobInfo(**{k: v for k, v in data.items() if k in fields})
    if job.cluster != cluster:
        raise UserError(f"{unreadable}: it names cluster {job.cluster!r}, not {cluster!r}")
    return job
