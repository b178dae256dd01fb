"""`xeontune fetch` and `xeontune logs`: a job's outputs and log, read from the cluster's head.

The head is read by SFTP through ``cluster/ssh.py`` (pinned known_hosts, like every other
connection), also for the local provider, whose head is a namespace reached by SSH like a cloud
node. The localhost provider has no SSH: its files are on this disk and are read in place.

What ``fetch`` copies from the job's --output-dir: ``learned_embeds*.safetensors``,
``metrics.jsonl``, ``train_config.json``, ``validation/step-*.png`` and ``pipeline/`` when one
was saved; not checkpoints (resume on the cluster). Every file lands through a temporary name and
a rename (``io.atomic_path``; the pipeline as a whole directory, ``io.atomic_dir``), so a file in
the destination is whole. A destination that holds a run already is left alone without
``--overwrite``. A running job can be fetched: what it has written so far comes back.
"""

from __future__ import annotations

import contextlib
import os
import posixpath
import re
import shutil
import stat
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from xeontune.errors import UserError
from xeontune.io import atomic_dir, atomic_path

if TYPE_CHECKING:
    import paramiko

    from xeontune.cluster.state import ClusterRecord
    from xeontune.jobs import JobInfo

TOP_FILES = re.compile(r"^(learned_embeds(-steps-\d+)?\.safetensors|metrics\.jsonl|train_config\.json)$")
VALIDATION_FILES = re.compile(r"^step-\d{6,}-\d+\.png$")  # validation.IMAGE_NAME_RE (without torch)
FOLLOW_INTERVAL_S = 1.0


class HeadFiles(Protocol):
    """Read access to the head's files, by absolute path as the head sees them."""

    def listdir(self, path: str) -> list[tuple[str, bool]] | None: ...  # (name, is_dir), None if missing
    def get(self, path: str, local: Path) -> None: ...
    def read(self, path: str, offset: int = 0) -> bytes | None: ...  # None if missing
    def exists(self, path: str) -> bool: ...


class LocalFiles:
    """The head is this machine (localhost provider)."""

    def listdir(self, path: str) -> list[tuple[str, bool]] | None:
        p = Path(path)
        return [(c.name, c.is_dir()) for c in p.iterdir()] if p.is_dir() else None

    def get(self, path: str, local: Path) -> None:
        shutil.copyfile(path, local)

    def read(self, path: str, offset: int = 0) -> bytes | None:
        try:
            with open(path, "rb") as f:
                f.seek(offset)
                return f.read()
        except FileNotFoundError:
            return None

    def exists(self, path: str) -> bool:
        return os.path.exists(path)


class SftpFiles:
    """The head over SFTP (one connection, kept for the whole command)."""

    def __init__(self, sftp: paramiko.SFTPClient) -> None:
        self.sftp = sftp

    def listdir(self, path: str) -> list[tuple[str, bool]] | None:
        try:
            return [(a.filename, stat.S_ISDIR(a.st_mode or 0)) for a in self.sftp.listdir_attr(path)]
        except FileNotFoundError:
            return None

    def get(self, path: str, local: Path) -> None:
        self.sftp.get(path, os.fspath(local))

    def read(self, path: str, offset: int = 0) -> bytes | None:
        try:
            with self.sftp.open(path, "rb") as f:
                f.seek(offset)
                return f.read()
        except FileNotFoundError:
            return None

    def exists(self, path: str) -> bool:
        try:
            self.sftp.stat(path)
            return True
        except FileNotFoundError:
            return False


@contextlib.contextmanager
def head_files(record: ClusterRecord) -> Iterator[HeadFiles]:
    from xeontune.cluster import providers, ssh

    if not providers.get(record.provider).uses_ssh:
        yield LocalFiles()
        return
    try:
        client = ssh.connect(record, record.head)
    except UserError:
        raise
    except Exception as exc:  # a stopped node, a refused key: one line that names the head
        raise UserError(f"cannot reach the head {record.head.name} of cluster {record.name!r} by SSH: "
                        f"{type(exc).__name__}: {exc}") from None
    try:
        sftp = client.open_sftp()
        try:
            yield SftpFiles(sftp)
        finally:
            sftp.close()
    finally:
        ssh.close(client)


# --- fetch -------------------------------------------------------------------------------------


@dataclass
class FetchReport:
    dest: Path
    files: list[str] = field(default_factory=list)  # relative paths written
    already_here: bool = False  # the job wrote straight into dest (a head that shares this disk)


def holds_a_run(dest: Path) -> list[str]:
    """The run files already in ``dest`` (what --overwrite would replace)."""
    if not dest.is_dir():
        return []
    found = sorted(p.name for p in dest.iterdir() if TOP_FILES.match(p.name))
    if (dest / "pipeline" / "model_index.json").is_file():
        found.append("pipeline/")
    return found


def check_destination(dest: Path, overwrite: bool) -> None:
    """UserError when ``dest`` holds a run and --overwrite is not given (or it is not a directory)."""
    if dest.exists() and not dest.is_dir():
        raise UserError(f"--output-dir {dest} exists and is not a directory")
    previous = holds_a_run(dest)
    if previous and not overwrite:
        raise UserError(f"--output-dir {dest} holds a run already ({', '.join(previous[:3])}); "
                        "pass --overwrite to replace it, or choose another --output-dir")


def _same_dir(a: str, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return os.path.normpath(a) == os.path.normpath(os.fspath(b))


def fetch(record: ClusterRecord, job: JobInfo, dest: Path, overwrite: bool = False) -> FetchReport:
    """Copy the job's outputs from the head into ``dest`` (module docstring)."""
    from xeontune.cluster import providers

    dest = dest.expanduser().absolute()
    report = FetchReport(dest)
    if not providers.get(record.provider).remote and _same_dir(job.output_dir, dest):
        report.already_here = True  # the head shares this disk and wrote right here
        return report
    check_destination(dest, overwrite)
    src = job.output_dir
    with head_files(record) as head:
        top = head.listdir(src)
        if top is None:
            raise UserError(f"no outputs yet: {src} does not exist on {record.head.name} of cluster {record.name!r}")
        names = {name for name, is_dir in top if not is_dir and TOP_FILES.match(name)}
        dirs = {name for name, is_dir in top if is_dir}
        dest.mkdir(parents=True, exist_ok=True)
        # metrics.jsonl last among the files: a running job appends to it, so it is as new as can be
        for name in sorted(names, key=lambda n: n == "metrics.jsonl"):
            _get(head, posixpath.join(src, name), dest / name)
            report.files.append(name)
        if "validation" in dirs:
            for name, is_dir in sorted(head.listdir(posixpath.join(src, "validation")) or []):
                if not is_dir and VALIDATION_FILES.match(name):
                    _get(head, posixpath.join(src, "validation", name), dest / "validation" / name)
                    report.files.append(f"validation/{name}")
        if "pipeline" in dirs and head.exists(posixpath.join(src, "pipeline", "model_index.json")):
            with atomic_dir(dest / "pipeline") as tmp:
                count = _get_tree(head, posixpath.join(src, "pipeline"), tmp)
            report.files.append(f"pipeline/ ({count} files)")
    # an older run's step files that this run did not write would read as this run's
    for stale in dest.iterdir():
        if stale.is_file() and TOP_FILES.match(stale.name) and stale.name not in names:
            stale.unlink()
    return report


def _get(head: HeadFiles, remote: str, local: Path) -> None:
    with atomic_path(local) as tmp:
        head.get(remote, tmp)


def _get_tree(head: HeadFiles, remote: str, local: Path) -> int:
    count = 0
    for name, is_dir in head.listdir(remote) or []:
        if is_dir:
            (local / name).mkdir(exist_ok=True)
            count += _get_tree(head, posixpath.join(remote, name), local / name)
        else:
            head.get(posixpath.join(remote, name), local / name)  # inside atomic_dir's temporary dir
            count += 1
    return count


def print_report(record: ClusterRecord, report: FetchReport) -> None:
    if report.already_here:
        print(f"the job wrote its outputs straight into {report.dest} (the head shares this disk): nothing to copy")
        return
    weights = [f for f in report.files if f.startswith("learned_embeds")]
    print(f"fetched {len(report.files)} item(s) from {record.head.name} of cluster {record.name!r} into {report.dest}"
          + (f": {', '.join(weights[:3])}{' ...' if len(weights) > 3 else ''}" if weights else ""))
    if "learned_embeds.safetensors" not in report.files:
        print("no learned_embeds.safetensors yet: the job has not finished (or did not get that far)")


def fetch_command(name: str, output_dir: str | None, overwrite: bool) -> int:
    from xeontune import jobs
    from xeontune.cluster import state

    record = state.load(state.validate_name(name))
    job = jobs.load_job(record.name)
    dest = Path(output_dir) if output_dir else Path(job.local_output_dir)
    print_report(record, fetch(record, job, dest, overwrite))
    return 0


# --- logs --------------------------------------------------------------------------------------


def logs_command(name: str, follow: bool) -> int:
    """Print the detached job's log; with ``follow``, keep printing until it ends, then exit with
    its exit status (1 when the job ended without writing one: it was killed)."""
    from xeontune import jobs
    from xeontune.cluster import state

    record = state.load(state.validate_name(name))
    job = jobs.load_job(record.name)
    if not job.detached:
        raise UserError(f"job {job.id} on cluster {name!r} was launched attached: its output went to the "
                        "terminal that launched it; `xeontune launch --detach` keeps a log on the head")
    out = sys.stdout.buffer
    offset = 0
    with head_files(record) as head:
        while True:
            rc_text = head.read(job.rc_path)  # read before the log: the log is then complete
            chunk = head.read(job.log_path, offset) or b""
            if chunk:
                out.write(chunk)
                out.flush()
                offset += len(chunk)
            if rc_text is not None and rc_text.strip().lstrip(b"-").isdigit():
                rc = int(rc_text)
                if follow:
                    print(f"xeontune: job {job.id} exited with status {rc}", file=sys.stderr)
                return rc
            if not follow:
                return 0
            pid = (head.read(job.pid_path) or b"").strip()
            if pid.isdigit() and not head.exists(f"/proc/{int(pid)}"):
                time.sleep(0.5)  # it may have written its status just now
                if head.read(job.rc_path) is None:
                    print(f"xeontune: job {job.id} ended without an exit status (killed?)", file=sys.stderr)
                    return 1
                continue
            time.sleep(FOLLOW_INTERVAL_S)
