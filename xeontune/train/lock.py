"""One run per --output-dir: rank 0 holds an exclusive lock on the folder for the run's whole life.

The lock is ``flock`` on a file in the folder (``outputs.RUN_LOCK``): the kernel drops it when the
holding process dies, however it dies, so a lock left by a dead run never blocks the next one, and on
NFS Linux maps ``flock`` to a POSIX lock that the server arbitrates across the nodes that share the
disk. The file also names its holder (host, pid, start), so that a second run's refusal can say who
holds the folder. Where the filesystem has no locks at all (ENOLCK/EOPNOTSUPP) that record is the
lock: a holder on this host is checked for life; one on another host is trusted, and the message says
how to clear it.

On release the holder deletes the file while it still holds the lock; a run that opened the old file
meanwhile finds, once it has the lock, that its file is no longer the one at the path, and tries again.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path

from xeontune.errors import UserError
from xeontune.train.outputs import RUN_LOCK

log = logging.getLogger("xeontune.train")

_NO_LOCKS = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS)
_held: dict[Path, OutputDirLock] = {}  # this process's locks: a second setup() of one run (bench) takes it again


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    return True


def _describe(holder: dict) -> str:
    if not holder:
        return "another run"
    return (f"another run (pid {holder.get('pid', '?')} on host {holder.get('host', '?')}, "
            f"started {holder.get('started', '?')})")


def _read_holder(fd: int) -> dict:
    try:
        raw = os.pread(fd, 4096, 0)
        holder = json.loads(raw.decode()) if raw.strip() else {}
    except (OSError, ValueError):
        return {}
    return holder if isinstance(holder, dict) else {}


@dataclass
class OutputDirLock:
    path: Path  # the lock file
    fd: int
    created_dir: bool  # the run made --output-dir: removed on release if the run left it empty

    def release(self) -> None:
        if self.fd < 0:
            return
        _held.pop(self.path.parent.resolve(), None)
        with contextlib.suppress(OSError):
            os.unlink(self.path)  # while still held: see the module's docstring
        os.close(self.fd)
        self.fd = -1
        if self.created_dir:
            with contextlib.suppress(OSError):
                self.path.parent.rmdir()  # only if empty: a run that failed before writing anything


def acquire(output_dir: Path, flag: str = "--output-dir") -> OutputDirLock:
    """Lock ``output_dir`` (made if missing) for this process, or raise UserError naming the holder."""
    key = output_dir.resolve() if output_dir.exists() else None
    if key is not None and key in _held:
        return _held[key]
    created = not output_dir.exists()
    try:
        output_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"{flag} {output_dir}: cannot create it ({e.strerror})") from None
    path = output_dir / RUN_LOCK
    while True:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise UserError(f"{flag} {output_dir}: cannot write in it ({e.strerror})") from None
        try:
            holder = _lock_or_refuse(fd, path, output_dir, flag)
            if os.path.exists(path) and os.path.samestat(os.fstat(fd), os.stat(path)):
                break
        except BaseException:
            os.close(fd)
            if created:
                with contextlib.suppress(OSError):
                    output_dir.rmdir()
            raise
        os.close(fd)  # the holder deleted the file as we waited on it: lock the one at the path now
    if holder:
        log.info("%s %s: took over the lock left by %s, which is no longer running",
                 flag, output_dir, _describe(holder).removeprefix("another run "))
    mine = {"host": socket.gethostname(), "pid": os.getpid(),
            "started": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
    data = json.dumps(mine).encode()
    os.ftruncate(fd, 0)
    os.pwrite(fd, data, 0)
    lock = OutputDirLock(path, fd, created)
    _held[output_dir.resolve()] = lock
    return lock


def _lock_or_refuse(fd: int, path: Path, output_dir: Path, flag: str) -> dict:
    """Take the lock on ``fd``; return the record a dead holder left there ({} if none)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise UserError(f"{flag} {output_dir} is in use by {_describe(_read_holder(fd))}: wait for it to "
                        f"end, or pick another {flag}") from None
    except OSError as e:
        if e.errno not in _NO_LOCKS:
            raise
        holder = _read_holder(fd)  # no locks on this filesystem: the record is the lock
        if holder and holder.get("host") == socket.gethostname():
            if _alive(int(holder.get("pid", 0))) and holder.get("pid") != os.getpid():
                raise UserError(f"{flag} {output_dir} is in use by {_describe(holder)}: wait for it to "
                                f"end, or pick another {flag}") from None
        elif holder:
            raise UserError(f"{flag} {output_dir} is in use by {_describe(holder)} (this filesystem has no "
                            f"locks, so it cannot be checked from here): if that run has ended, delete "
                            f"{path}") from None
        return holder
    return _read_holder(fd)  # a holder that still held it would have kept the lock: this one died


def release(output_dir: Path) -> None:
    """Release this process's lock on ``output_dir``, if it holds one."""
    if output_dir.exists() and (lock := _held.get(output_dir.resolve())) is not None:
        lock.release()
