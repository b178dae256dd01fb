"""Atomic writers: every file the project writes whole goes through here, so nothing is half-written.

The one file written piecemeal is the trainer's ``metrics.jsonl``: appended a line per step, so a
crash loses at most the line being written (a resume drops a line cut short). Throwaway files in a
temporary directory (the tokenizer files ``models`` reads back at once) need no atomicity either.
Two writers do not come here, for a reason: the bf16 weight copies keep their own rename
(``components._write_copy``: ranks racing to write one, the first rename wins and the others discard
theirs), and the job's private files on the head (``job.start.put_head_text``) are written in place,
locally or over SFTP: created 0600 before their first byte, and whole before the job that reads them
starts, so nothing can read them half-written.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from xeontune.errors import DiskFullError

# A full disk, a full quota, a read-only mount: the user's to fix, and said in one line (io.disk_errors).
DISK_ERRNOS = {errno.ENOSPC: "no space left on the device", errno.EDQUOT: "disk quota exceeded",
               errno.EROFS: "the filesystem is read-only"}
# safetensors' Rust writer raises its own error and puts the OS error's text in the message
_DISK_ERROR_TEXT = {"No space left on device": errno.ENOSPC, "StorageFull": errno.ENOSPC,
                    "Disk quota exceeded": errno.EDQUOT, "QuotaExceeded": errno.EDQUOT,
                    "Read-only file system": errno.EROFS, "ReadOnlyFilesystem": errno.EROFS}


CACHE_ENV = "XEONTUNE_CACHE"


NO_LOCKS = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS)  # a filesystem without flock


@contextlib.contextmanager
def flocked(lock: Path, waiting_for: str) -> Iterator[None]:
    """An exclusive flock on ``lock`` (created, never deleted: a few bytes): the kernel drops it when the
    holder dies, however it dies, so a dead holder never blocks the next one. Logs once that it waits for
    ``waiting_for``. Where the filesystem has no locks, none."""
    import fcntl
    import logging

    with disk_errors(lock):
        lock.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logging.getLogger("xeontune").info("waiting for %s", waiting_for)
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError as exc:
            if exc.errno not in NO_LOCKS:
                raise
        yield
    finally:
        os.close(fd)  # releases the lock


def cache_root() -> Path:
    """The project's cache on this machine: $XEONTUNE_CACHE, or ~/.cache/xeontune (bf16 weight copies,
    exported datasets, latents)."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "xeontune")


def _free_space(path: Path) -> str:
    for p in (path, *path.parents):
        try:
            free = shutil.disk_usage(p).free
        except OSError:
            continue
        return f"{free / 2**20:.1f} MB" if free < 2**30 else f"{free / 2**30:.1f} GB"
    return "unknown"


@contextlib.contextmanager
def disk_errors(path: str | os.PathLike[str]) -> Iterator[None]:
    """Turn a full disk (or quota, or a read-only mount) while writing ``path`` into one line that names
    the file and the space left: a DiskFullError, not a traceback."""
    try:
        yield
    except DiskFullError:
        raise
    except OSError as exc:
        if exc.errno not in DISK_ERRNOS:
            raise
        code = exc.errno
    except Exception as exc:
        code = next((n for text, n in _DISK_ERROR_TEXT.items() if text in str(exc)), None)
        if code is None:
            raise
    else:
        return
    target = Path(path)
    raise DiskFullError(f"cannot write {target}: {DISK_ERRNOS[code]} ({_free_space(target.parent)} free there)") \
        from None


def _umask() -> int:
    current = os.umask(0)
    os.umask(current)
    return current


def fsync_path(path: str | os.PathLike[str]) -> None:
    """Flush a file's or a directory's contents (a directory's: its entries, i.e. renames) to disk."""
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if os.path.isdir(path) else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(root: Path) -> None:
    for dirpath, _dirnames, filenames in os.walk(root):
        for name in filenames:
            fsync_path(os.path.join(dirpath, name))
        fsync_path(dirpath)


def file_in_the_way(folder: str | os.PathLike[str]) -> Path | None:
    """``folder`` itself or the nearest folder above it that exists as a file: creating ``folder``
    would fail there (NotADirectoryError / FileExistsError), so callers refuse it up front."""
    path = Path(folder)
    return next((p for p in (path, *path.parents) if p.exists() and not p.is_dir()), None)


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike[str], mode: int | None = None, durable: bool = False) -> Iterator[Path]:
    """Yield a temporary path next to ``path``; rename it over ``path`` only if the block succeeds.

    ``durable``: fsync the file before the rename and the directory after it, so that after a power
    loss ``path`` holds either the old or the whole new content (a rename alone may reach the disk
    before the data does, leaving an empty file)."""
    target = Path(path)
    with disk_errors(target):
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp_name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
        os.close(fd)
    tmp = Path(tmp_name)
    try:
        with disk_errors(target):
            yield tmp
            # after the writer: mkstemp makes 0600, and some writers (safetensors' save_file) make it anew
            os.chmod(tmp, mode if mode is not None else 0o666 & ~_umask())
            if durable:
                fsync_path(tmp)
            os.replace(tmp, target)
            if durable:
                fsync_path(target.parent)
    finally:
        if tmp.exists():
            tmp.unlink()


def atomic_write_text(path: str | os.PathLike[str], text: str, mode: int | None = None) -> None:
    with atomic_path(path, mode) as tmp:
        tmp.write_text(text)


def atomic_write_json(path: str | os.PathLike[str], obj: Any, mode: int | None = None) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=True) + "\n", mode)


@contextlib.contextmanager
def atomic_dir(path: str | os.PathLike[str], durable: bool = False) -> Iterator[Path]:
    """Yield a temporary directory that replaces ``path`` (a directory) when the block succeeds; its
    files then get the usual mode (0666 less the umask).

    ``durable``: fsync every file and directory in it before the rename, and the parent after it."""
    target = Path(path)
    with disk_errors(target):
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent))
    os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp makes 0700; the result should look like a normal dir
    try:
        with disk_errors(target):
            yield tmp
            _finish_dir(tmp, target, durable)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def _finish_dir(tmp: Path, target: Path, durable: bool) -> None:
    """atomic_dir's end: modes, fsyncs, and the rename over ``target``."""
    for file in tmp.rglob("*"):  # safetensors' save_file makes its files 0600: outputs are the user's to share
        if file.is_file() and not file.is_symlink():
            os.chmod(file, 0o666 & ~_umask())
    if durable:
        _fsync_tree(tmp)
    if target.exists():
        old = target.with_name(f".{target.name}.old")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(target, old)
        os.replace(tmp, target)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, target)
    if durable:
        fsync_path(target.parent)


@contextlib.contextmanager
def atomic_paths(paths: list[Path], durable: bool = False) -> Iterator[list[Path]]:
    """``atomic_path`` for files that belong together (a method's result in its several layouts): each
    is written to its temporary path, and only when all are written are they renamed, one after another,
    so a failed write (a full disk) leaves every final name as it was."""
    with contextlib.ExitStack() as stack:
        yield [stack.enter_context(atomic_path(p, durable=durable)) for p in paths]
