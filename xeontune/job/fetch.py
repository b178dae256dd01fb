"""`xeontune fetch` and `xeontune logs`: a job's outputs and log, read from the cluster's head.

The head is read by SFTP through ``cluster/ssh.py`` (pinned known_hosts, like every other
connection), also for the local provider, whose head is a namespace reached by SSH like a cloud
node. The localhost provider has no SSH: its files are on this disk and are read in place.

What ``fetch`` copies from the job's --output-dir: the learned files (``learned_embeds*.safetensors``,
a LoRA's ``pytorch_lora_weights*.safetensors``: train/outputs.py names them),
``metrics.jsonl``, ``train_config.json``, ``validation/step-*.png``, ``pipeline/`` when one was
saved and, once the job has ended (or when `run` asks, before it deletes the cluster), its latest
complete ``checkpoint-N/``; a running job's checkpoint is left on the head, where the trainer may
be pruning it. The final result comes first and the step copies newest first, so a fetch cut
short keeps the newest learned weights. Every file lands through a temporary name and a rename
(``io.atomic_path``; the pipeline and the checkpoint as whole directories, ``io.atomic_dir``), so a
file in the destination is whole, and is fsynced with its folder: once ``fetch`` returns, the
outputs survive a crash of this machine, and `run` may delete the cluster. A name from the head
that is not a plain file name (``../x``, ``/x``) is refused: a compromised head cannot write
outside the destination.

A destination that holds another run (its files, a ``pipeline/`` or ``validation/`` of any
origin) is left alone without ``--overwrite``; with it, nothing of the older run stays (stale
step files, validation images, pipeline). Fetching the same job again (a peek while it runs,
then the final fetch) needs no ``--overwrite``: ``.xeontune-job`` in the destination names the
job it came from. Errors on either side (the head's SFTP, this disk, a dropped connection) are
one-line UserErrors.
"""

from __future__ import annotations

import contextlib
import os
import posixpath
import shutil
import signal
import stat
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from xeontune.errors import UserError
from xeontune.io import atomic_dir, atomic_path, atomic_write_text, fsync_path
from xeontune.job import record as job_record
from xeontune.job.record import JobInfo
from xeontune.train.outputs import (
    CHECKPOINT_COMPLETE,
    CHECKPOINT_RE,
    LEARNED_FILE_RE,
    METRICS,
    RESULT_FILES,
    RUN_FILE_RE,
    VALIDATION_IMAGE_RE,
)

if TYPE_CHECKING:
    import paramiko

    from xeontune.cluster.state import ClusterRecord

FOLLOW_INTERVAL_S = 1.0
MARKER = ".xeontune-job"  # in a fetch's destination: the id of the job its files came from
KEEPALIVE_S = 15  # SSH keepalive while fetching or following: a dead link is noticed, not waited on
SFTP_TIMEOUT_S = 60.0  # one SFTP request that gets no answer this long fails the fetch
RECONNECT_INTERVAL_S = 5.0  # `run` following its job: how often a lost connection is tried again
RESULTS = set(RESULT_FILES.values())  # each method's final result: learned_embeds, pytorch_lora_weights


class HeadError(UserError):
    """The head refused or lost a request (permission, a missing file, the connection)."""


class ConnectionLost(HeadError):
    """The head could not be reached, or the connection to it broke: worth trying again."""


class NoOutputs(HeadError):
    """The job's output dir on the head does not exist or holds nothing of a run yet."""


class DestinationError(UserError):
    """This machine cannot write the destination (permission, a full disk, not a directory)."""


def safe_name(name: str, where: str) -> str:
    """A name the head listed, refused unless it is one plain file name (no ``..``, no ``/``)."""
    if not name or name in (".", "..") or "/" in name or "\\" in name or "\0" in name:
        raise HeadError(f"the head listed an unsafe file name {name!r} in {where}: refused (nothing outside "
                        "the destination is written)")
    return name


class HeadFiles(Protocol):
    """Read access to the head's files, by absolute path as the head sees them."""

    def listdir(self, path: str) -> list[tuple[str, bool]] | None: ...  # (name, is_dir), None if missing
    def get(self, path: str, local: Path) -> None: ...
    def read(self, path: str, offset: int = 0) -> bytes | None: ...  # None if missing
    def exists(self, path: str) -> bool: ...
    def remove(self, path: str) -> None: ...


def _local_open(local: Path):  # noqa: ANN202 (a binary file)
    try:
        return open(local, "wb")  # noqa: SIM115 (closed by the caller's with)
    except OSError as exc:
        raise DestinationError(f"cannot write {local}: {exc.strerror or exc}") from None


class LocalFiles:
    """The head is this machine (localhost provider)."""

    def listdir(self, path: str) -> list[tuple[str, bool]] | None:
        p = Path(path)
        try:
            return [(c.name, c.is_dir()) for c in p.iterdir()] if p.is_dir() else None
        except OSError as exc:
            raise HeadError(f"cannot list {path}: {exc.strerror or exc}") from None

    def get(self, path: str, local: Path) -> None:
        with _local_open(local) as out:
            try:
                src = open(path, "rb")  # noqa: SIM115
            except OSError as exc:
                raise HeadError(f"cannot read {path}: {exc.strerror or exc}") from None
            with src:
                try:
                    shutil.copyfileobj(src, out)
                except OSError as exc:
                    raise DestinationError(f"cannot write {local}: {exc.strerror or exc}") from None

    def read(self, path: str, offset: int = 0) -> bytes | None:
        try:
            with open(path, "rb") as f:
                f.seek(offset)
                return f.read()
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise HeadError(f"cannot read {path}: {exc.strerror or exc}") from None

    def exists(self, path: str) -> bool:
        return os.path.exists(path)

    def remove(self, path: str) -> None:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        except OSError as exc:
            raise HeadError(f"cannot remove {path}: {exc.strerror or exc}") from None


class SftpFiles:
    """The head over SFTP (one connection, kept for the whole command). Its errors, and a dropped
    connection, become HeadErrors; this disk's become DestinationErrors."""

    def __init__(self, sftp: paramiko.SFTPClient, head: str = "the head") -> None:
        self.sftp = sftp
        self.head = head

    def _error(self, exc: BaseException, what: str, path: str) -> HeadError:
        if isinstance(exc, (PermissionError, FileNotFoundError)):
            return HeadError(f"{self.head} refused to {what} {path}: {exc.strerror or type(exc).__name__}")
        return ConnectionLost(f"lost the connection to {self.head} while trying to {what} {path}: "
                         f"{type(exc).__name__}: {exc}")

    @contextlib.contextmanager
    def _remote(self, what: str, path: str) -> Iterator[None]:
        try:
            yield
        except UserError:
            raise
        except Exception as exc:  # paramiko's SSHException, EOFError, socket errors, SFTP's OSErrors
            raise self._error(exc, what, path) from None

    def listdir(self, path: str) -> list[tuple[str, bool]] | None:
        with self._remote("list", path):
            try:
                return [(a.filename, stat.S_ISDIR(a.st_mode or 0)) for a in self.sftp.listdir_attr(path)]
            except FileNotFoundError:
                return None

    def get(self, path: str, local: Path) -> None:
        with _local_open(local) as out:
            with self._remote("read", path):
                src = self.sftp.open(path, "rb")
            with src:
                while True:
                    with self._remote("read", path):
                        chunk = src.read(1 << 20)
                    if not chunk:
                        break
                    try:
                        out.write(chunk)
                    except OSError as exc:
                        raise DestinationError(f"cannot write {local}: {exc.strerror or exc}") from None

    def read(self, path: str, offset: int = 0) -> bytes | None:
        with self._remote("read", path):
            try:
                f = self.sftp.open(path, "rb")
            except FileNotFoundError:
                return None
            with f:
                f.seek(offset)
                return f.read()

    def exists(self, path: str) -> bool:
        with self._remote("stat", path):
            try:
                self.sftp.stat(path)
                return True
            except FileNotFoundError:
                return False

    def remove(self, path: str) -> None:
        with self._remote("remove", path), contextlib.suppress(FileNotFoundError):
            self.sftp.remove(path)


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
        raise ConnectionLost(f"cannot reach the head {record.head.name} of cluster {record.name!r} by SSH: "
                        f"{type(exc).__name__}: {exc}") from None
    try:
        transport = client.get_transport()
        if transport is not None:
            transport.set_keepalive(KEEPALIVE_S)
        try:
            sftp = client.open_sftp()
        except Exception as exc:
            raise ConnectionLost(f"cannot open SFTP on {record.head.name}: {type(exc).__name__}: {exc}") from None
        channel = sftp.get_channel()
        if channel is not None:
            channel.settimeout(SFTP_TIMEOUT_S)
        try:
            yield SftpFiles(sftp, record.head.name)
        finally:
            with contextlib.suppress(Exception):
                sftp.close()
    finally:
        ssh.close(client)


# --- fetch -------------------------------------------------------------------------------------


@dataclass
class FetchReport:
    dest: Path
    files: list[str] = field(default_factory=list)  # relative paths written
    already_here: bool = False  # the job wrote straight into dest (a head that shares this disk)
    moved_from: Path | None = None  # the destination that refused, when the outputs went beside it


def holds_a_run(dest: Path) -> list[str]:
    """What of a run is already in ``dest`` (what --overwrite would replace): its files and
    checkpoints, and any ``pipeline/`` or non-empty ``validation/``, whatever made them."""
    if not dest.is_dir():
        return []
    found = sorted(p.name for p in dest.iterdir() if RUN_FILE_RE.match(p.name))
    found += sorted(f"{p.name}/" for p in dest.iterdir() if CHECKPOINT_RE.match(p.name) and p.is_dir())
    if (dest / "pipeline").exists():
        found.append("pipeline/")
    if (dest / "validation").is_dir() and any((dest / "validation").iterdir()):
        found.append("validation/")
    return found


def fetched_job(dest: Path) -> str | None:
    """The id of the job whose outputs an earlier fetch put in ``dest``."""
    try:
        return (dest / MARKER).read_text().strip() or None
    except OSError:
        return None


def check_destination(dest: Path, overwrite: bool, job_id: str | None = None) -> None:
    """DestinationError when ``dest`` is not a directory, or holds another run and --overwrite is not
    given. The same job's earlier fetch (``job_id``) is no other run."""
    if dest.exists() and not dest.is_dir():
        raise DestinationError(f"--output-dir {dest} exists and is not a directory")
    previous = holds_a_run(dest)
    if previous and not overwrite and not (job_id and fetched_job(dest) == job_id):
        raise DestinationError(f"--output-dir {dest} holds a run already ({', '.join(previous[:3])}); "
                               "pass --overwrite to replace it, or choose another --output-dir")


def beside(dest: Path, job_id: str) -> Path:
    """A fresh folder next to a destination that refused: ``<dest>-<job id>[-N]``."""
    candidate = dest.with_name(f"{dest.name}-{job_id}")
    n = 1
    while candidate.exists():
        n += 1
        candidate = dest.with_name(f"{dest.name}-{job_id}-{n}")
    return candidate


def _same_dir(a: str, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return os.path.normpath(a) == os.path.normpath(os.fspath(b))


def fetch(record: ClusterRecord, job: JobInfo, dest: Path, overwrite: bool = False,
          checkpoint: bool | None = None) -> FetchReport:
    """Copy the job's outputs from the head into ``dest`` (module docstring). ``checkpoint``: its
    latest complete checkpoint too (None: once the job has ended). NoOutputs when it wrote nothing."""
    from xeontune.cluster import providers

    dest = dest.expanduser().absolute()
    report = FetchReport(dest)
    if not providers.get(record.provider).remote and _same_dir(job.output_dir, dest):
        report.already_here = True  # the head shares this disk and wrote right here
        return report
    check_destination(dest, overwrite, job.id)
    try:
        _fetch_into(record, job, dest, report, checkpoint)
    except UserError:
        raise
    except OSError as exc:  # this disk: mkdir, rename, unlink (the head's errors are HeadErrors)
        raise DestinationError(f"cannot write into {dest}: {exc.strerror or exc}") from None
    return report


def fetch_order(name: str) -> tuple[int, int]:
    """The final result first (the embedding, or a LoRA's diffusers file and then its kohya twin), then
    the step copies newest first: a fetch cut short (a lost link, a full disk) keeps the newest
    learned weights. metrics.jsonl last: a running job appends to it."""
    if m := LEARNED_FILE_RE.match(name):
        return (0, 0 if name in RESULTS else 1) if m.group(2) is None else (1, -int(m.group(2)))
    return (3, 0) if name == METRICS else (2, 0)


def latest_checkpoint(head: HeadFiles, src: str, dirs: set[str]) -> str | None:
    """The newest ``checkpoint-N`` in ``src`` that is complete (its marker written)."""
    steps = sorted(((int(m.group(1)), name) for name in dirs if (m := CHECKPOINT_RE.match(name))), reverse=True)
    return next((name for _, name in steps if head.exists(posixpath.join(src, name, CHECKPOINT_COMPLETE))), None)


def _fetch_into(record: ClusterRecord, job: JobInfo, dest: Path, report: FetchReport,
                checkpoint: bool | None) -> None:
    src = job.output_dir
    earlier = fetched_job(dest)
    with head_files(record) as head:
        top = head.listdir(src)
        if top is None:
            raise NoOutputs(f"no outputs yet: {src} does not exist on {record.head.name} of cluster {record.name!r}")
        names = {safe_name(name, src) for name, is_dir in top if not is_dir and RUN_FILE_RE.match(name)}
        dirs = {safe_name(name, src) for name, is_dir in top if is_dir}
        ended = head.exists(job.rc_path)
        latest = latest_checkpoint(head, src, dirs) if (ended if checkpoint is None else checkpoint) else None
        if not names and latest is None:  # every run writes train_config.json first
            raise NoOutputs(f"no outputs yet: {src} on {record.head.name} of cluster {record.name!r} holds none")
        dest.mkdir(parents=True, exist_ok=True)
        atomic_write_text(dest / MARKER, job.id + "\n")
        for name in sorted(names, key=fetch_order):
            _get(head, posixpath.join(src, name), dest / name)
            report.files.append(name)
        if latest is not None:
            with atomic_dir(dest / latest, durable=True) as tmp:
                _get_tree(head, posixpath.join(src, latest), tmp)
            report.files.append(f"{latest}/")
        images: set[str] = set()
        if "validation" in dirs:
            where = posixpath.join(src, "validation")
            for name, is_dir in sorted(head.listdir(where) or []):
                if not is_dir and VALIDATION_IMAGE_RE.match(safe_name(name, where)):
                    _get(head, posixpath.join(where, name), dest / "validation" / name)
                    report.files.append(f"validation/{name}")
                    images.add(name)
        if "pipeline" in dirs and head.exists(posixpath.join(src, "pipeline", "model_index.json")):
            with atomic_dir(dest / "pipeline", durable=True) as tmp:
                count = _get_tree(head, posixpath.join(src, "pipeline"), tmp)
            report.files.append(f"pipeline/ ({count} files)")
        elif (dest / "pipeline").exists():  # an older run's (check_destination let it go: --overwrite)
            shutil.rmtree(dest / "pipeline") if (dest / "pipeline").is_dir() else (dest / "pipeline").unlink()
        if ended:  # the job has ended and its outputs are here: autostop need not wait
            head.remove(job.unfetched_path)
    # an older run's files that this run did not write would read as this run's
    for stale in dest.iterdir():
        if stale.is_file() and RUN_FILE_RE.match(stale.name) and stale.name not in names:
            stale.unlink()
        # older checkpoints: superseded by the one fetched now, or another run's (--overwrite)
        elif (stale.is_dir() and CHECKPOINT_RE.match(stale.name) and stale.name != latest
              and (latest is not None or earlier != job.id)):
            shutil.rmtree(stale)
    if (dest / "validation").is_dir():
        for stale in (dest / "validation").iterdir():
            if stale.is_file() and VALIDATION_IMAGE_RE.match(stale.name) and stale.name not in images:
                stale.unlink()
        fsync_path(dest / "validation")
    # the renames and deletions above, and dest's own entry (a fresh dest was made just now)
    fsync_path(dest)
    fsync_path(dest.parent)


def _get(head: HeadFiles, remote: str, local: Path) -> None:
    with atomic_path(local, durable=True) as tmp:  # on disk before `run` may delete the head's copy
        head.get(remote, tmp)


def _get_tree(head: HeadFiles, remote: str, local: Path) -> int:
    count = 0
    for name, is_dir in head.listdir(remote) or []:
        safe_name(name, remote)
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
    if report.moved_from is not None:
        print(f"{report.moved_from} refused the outputs; they went to {report.dest} instead")
    print(f"fetched {len(report.files)} item(s) from {record.head.name} of cluster {record.name!r} into {report.dest}: "
          f"{highlights(report.files)}")
    # a full fine-tune of a family without a single-file layout (SD3, Flux) ends in its pipeline folder alone
    if not RESULTS & set(report.files) and not any(f.startswith("pipeline/") for f in report.files):
        print(f"no {' or '.join(sorted(RESULTS))} yet: the job has not finished (or did not get that far)")


def highlights(files: list[str]) -> str:
    """What counts among fetched ``files`` (in fetch order): the final result, the step copies, the
    checkpoint; the first few names when there is none of those."""
    steps = [f for f in files if (m := LEARNED_FILE_RE.match(f)) and m.group(2) is not None]
    shown = [f for f in files if f in RESULTS]
    if steps:
        shown.append(f"{len(steps)} step cop{'y' if len(steps) == 1 else 'ies'} (newest: {steps[0]})")
    shown += [f for f in files if CHECKPOINT_RE.match(f.rstrip("/"))]
    return ", ".join(shown or files[:3]) or "nothing"


def fetch_command(name: str, output_dir: str | None, overwrite: bool) -> int:
    from xeontune.cluster import state

    record = state.load(state.validate_name(name))
    job = job_record.load_job(record.name)
    dest = Path(output_dir) if output_dir else Path(job.local_output_dir)
    print_report(record, fetch(record, job, dest, overwrite))
    return 0


# --- logs --------------------------------------------------------------------------------------


def logs_command(name: str, follow: bool) -> int:
    """Print the detached job's log; with ``follow``, keep printing until it ends, then exit with
    its exit status (1 when the job ended without writing one: it was killed)."""
    from xeontune.cluster import state

    record = state.load(state.validate_name(name))
    job = job_record.load_job(record.name)
    if not job.detached:
        raise UserError(f"job {job.id} on cluster {name!r} was launched attached: its output went to the "
                        "terminal that launched it; `xeontune launch --detach` keeps a log on the head")
    try:
        return _follow(record, job, follow)
    except HeadError as exc:
        raise HeadError(f"{exc}; the job goes on: follow it again with `xeontune logs --name {name} -f`") from None


def _status(rc_text: bytes | None) -> int | None:
    """A job's exit status from its ``rc`` file; None when there is none or it is not a number."""
    return int(rc_text) if rc_text is not None and rc_text.strip().lstrip(b"-").isdigit() else None


def _dropped_if(lenient: bool) -> contextlib.AbstractContextManager[object]:
    """Output that cannot be written, dropped where ``lenient``: `run`'s terminal may be gone (a hang-up,
    a closed window: every write to it fails), and the job's end, its fetch and the teardown matter
    more than the job's output."""
    return contextlib.suppress(OSError) if lenient else contextlib.nullcontext()


def _follow(record: ClusterRecord, job: JobInfo, follow: bool, pos: list[int] | None = None,
            connected: Callable[[], None] | None = None, lenient: bool = False) -> int:
    """Print the log from ``pos[0]`` on (kept there across connections); return the job's status.
    ``lenient`` (`run`): output that cannot be written is dropped (``_dropped_if``)."""
    from xeontune.job import engines

    out = sys.stdout.buffer
    pos = pos if pos is not None else [0]
    engine = engines.for_cluster(record)
    scheduler = engine if engine.scheduled and job.scheduler_id else None
    with head_files(record) as head:
        if connected:
            connected()
        while True:
            rc_text = head.read(job.rc_path)  # read before the log: the log is then complete
            chunk = head.read(job.log_path, pos[0]) or b""
            if chunk:
                with _dropped_if(lenient):
                    out.write(chunk)
                    out.flush()
                pos[0] += len(chunk)
            if (rc := _status(rc_text)) is not None:
                if follow:
                    with _dropped_if(lenient):
                        print(f"xeontune: job {job.id} exited with status {rc}", file=sys.stderr, flush=True)
                return rc
            if not follow:
                return 0
            ended = scheduler.ended(record, job) if scheduler else None
            if ended is not None:
                time.sleep(0.5)  # its script may have written its status just now
                if _status(head.read(job.rc_path)) is None:
                    with _dropped_if(lenient):
                        print(f"xeontune: job {job.id} ({record.provider} job {job.scheduler_id}) ended {ended} "
                              "without an exit status (cancelled, or killed at its time limit?)", file=sys.stderr)
                    return 1
                continue
            pid = (head.read(job.pid_path) or b"").strip()
            if pid.isdigit() and not head.exists(f"/proc/{int(pid)}"):
                time.sleep(0.5)  # it may have written its status just now
                if _status(head.read(job.rc_path)) is None:  # none, or not a number: it waited forever on that
                    with _dropped_if(lenient):
                        print(f"xeontune: job {job.id} ended without an exit status (killed?)", file=sys.stderr)
                    return 1
                continue
            time.sleep(FOLLOW_INTERVAL_S)


def follow_job(record: ClusterRecord, job: JobInfo, reconnect_s: float, say: Callable[[str], None],
               pos: list[int] | None = None) -> int | None:
    """`run`'s view of its detached job: the log until the job ends, then its exit status. A lost
    connection is tried again (every RECONNECT_INTERVAL_S) for ``reconnect_s`` from when it was
    lost, and the log goes on where it stopped; None when it did not come back (the job goes on).
    ``pos``: where the log goes on from, kept there (`run` follows again after stopping the job on a
    signal: the log goes on, not from its start)."""
    pos = [0] if pos is None else pos
    lost_since: list[float] = []

    def connected() -> None:
        if lost_since:
            say(f"reconnected to {record.head.name}; the job went on meanwhile")
            lost_since.clear()

    while True:
        try:
            return _follow(record, job, True, pos, connected, lenient=True)
        except HeadError as exc:
            now = time.monotonic()
            if not lost_since:
                lost_since.append(now)
                say(f"{exc}; trying again for up to {reconnect_s:.0f} s (the job goes on on the head)")
            if now - lost_since[0] >= reconnect_s:
                return None
            time.sleep(RECONNECT_INTERVAL_S)


def stop_job(record: ClusterRecord, job: JobInfo) -> None:
    """SIGINT to the detached job's runner on the head: it passes it on to every rank (a second one
    stops the job hard; ``process.run_attached``)."""
    from xeontune.cluster import providers, ssh
    from xeontune.job import engines

    engine = engines.for_cluster(record)
    if engine.scheduled:
        engine.stop(record, job)
        return
    provider = providers.get(record.provider)
    if not job.pid:
        raise HeadError(f"job {job.id} has no recorded pid on {record.head.name}")
    if provider.uses_ssh:
        rc, out, err = ssh.run(record, record.head, ["kill", "-INT", str(job.pid)], timeout_s=30)
        if rc != 0:
            raise HeadError(f"could not signal job {job.id} on {record.head.name}: {(err or out).strip()[:200]}")
    else:
        os.kill(job.pid, signal.SIGINT)
