"""One run per --output-dir: a second run is refused in one line naming the first, a dead run's lock
is taken over, and a failed or finished run leaves no lock behind."""

from __future__ import annotations

import errno
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.one_line import one_line_error
from xeontune.cli import main
from xeontune.errors import UserError
from xeontune.train import lock
from xeontune.train.outputs import METRICS, RUN_CONFIG, RUN_LOCK


def wait_for_holder(path: Path, timeout: float = 120) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            holder = json.loads(path.read_text())
        except (OSError, ValueError):
            holder = None
        if holder:
            return holder
        time.sleep(0.1)
    raise AssertionError(f"no lock record at {path}")


@pytest.mark.slow
def test_a_second_run_in_the_same_output_dir_is_refused_naming_the_first(capsys, base_args, tmp_path, caplog):
    out = tmp_path / "out"
    # run A holds the dir and rests where a slow model load would (after its output-dir check)
    first = subprocess.Popen([sys.executable, "-m", "xeontune.train", *base_args, "--mixed-precision", "fp32"],
                             env={**os.environ, "XEONTUNE_TEST_PAUSE": "setup:0:300", "XEONTUNE_ALLOCATOR": "none"},
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        holder = wait_for_holder(out / RUN_LOCK)
        assert holder["pid"] == first.pid and holder["host"] == socket.gethostname()
        # run B: one line that names A's host and pid; nothing of B's lands in the dir
        line = one_line_error(capsys, ["train", *base_args, "--mixed-precision", "fp32"])
        assert "is in use by another run" in line and f"pid {first.pid} on host {socket.gethostname()}" in line
        assert sorted(p.name for p in out.iterdir()) == [RUN_LOCK]
        # --overwrite does not get past it either
        line = one_line_error(capsys, ["train", *base_args, "--mixed-precision", "fp32", "--overwrite"])
        assert f"pid {first.pid}" in line
        assert first.poll() is None, first.stderr.read()
    finally:
        first.send_signal(signal.SIGKILL)  # dies holding the lock: its file stays, its lock goes
        first.wait()
    assert (out / RUN_LOCK).is_file()
    # run C: the dead run's lock is detected and taken over, and C trains to the end
    caplog.set_level("INFO", logger="xeontune.train")
    assert main(["train", *base_args, "--mixed-precision", "fp32"]) == 0
    assert f"took over the lock left by (pid {first.pid} on host" in caplog.text
    assert (out / RUN_CONFIG).is_file() and len((out / METRICS).read_text().splitlines()) == 3
    assert not (out / RUN_LOCK).exists(), "a finished run leaves no lock"


def test_a_run_that_fails_its_checks_leaves_neither_lock_nor_dir(capsys, base_args, tmp_path, monkeypatch):
    out = tmp_path / "deeper" / "out"
    taken = []
    acquire = lock.acquire
    monkeypatch.setattr(lock, "acquire", lambda path: taken.append(path) or acquire(path))
    args = [*base_args[:-1], str(out), "--model", str(tmp_path / "no-model")]  # found after the lock
    one_line_error(capsys, ["train", *args])
    assert taken == [out] and not out.exists()
    monkeypatch.undo()
    lock.acquire(out).release()  # and the dir is free: this process takes it and gives it back
    assert not out.exists()


def test_a_lock_is_taken_again_by_its_own_process_and_released_once(tmp_path):
    first = lock.acquire(tmp_path / "out")
    assert lock.acquire(tmp_path / "out") is first  # bench sets one run up several times
    assert json.loads((tmp_path / "out" / RUN_LOCK).read_text())["pid"] == os.getpid()
    lock.release(tmp_path / "out")
    assert not (tmp_path / "out").exists()  # made by the lock and left empty: removed
    lock.release(tmp_path / "out")  # twice: nothing to do


def test_a_second_open_of_the_lock_file_in_another_process_is_refused(tmp_path):
    held = lock.acquire(tmp_path / "out")
    try:
        code = ("import sys; from pathlib import Path; from xeontune.train import lock\n"
                "try:\n    lock.acquire(Path(sys.argv[1]))\nexcept Exception as e:\n    print(e)\n")
        proc = subprocess.run([sys.executable, "-c", code, str(tmp_path / "out")], capture_output=True,
                              text=True, timeout=120, check=True)
        assert f"is in use by another run (pid {os.getpid()} on host {socket.gethostname()}" in proc.stdout
    finally:
        held.release()


def test_a_lock_deleted_while_waited_on_is_taken_at_its_new_file(tmp_path, monkeypatch):
    """The holder deletes the file as it releases: a run that locked the old inode tries again."""
    out = tmp_path / "out"
    out.mkdir()
    real_flock = lock.fcntl.flock
    swapped = []

    def flock_then_swap(fd, op):
        real_flock(fd, op)
        if not swapped:  # as if the holder released between our open and our flock
            swapped.append(os.fstat(fd).st_ino)
            os.unlink(out / RUN_LOCK)
            (out / RUN_LOCK).write_text("")

    monkeypatch.setattr(lock.fcntl, "flock", flock_then_swap)
    held = lock.acquire(out)
    try:
        assert os.fstat(held.fd).st_ino == os.stat(out / RUN_LOCK).st_ino != swapped[0]
    finally:
        held.release()


@pytest.fixture
def no_flock(monkeypatch):
    def refuse(_fd, _op):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(lock.fcntl, "flock", refuse)


def write_record(out: Path, **record) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / RUN_LOCK).write_text(json.dumps({"started": "then", **record}))


def test_without_locks_a_live_holder_on_this_host_is_refused(tmp_path, no_flock):
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        write_record(tmp_path / "out", host=socket.gethostname(), pid=sleeper.pid)
        with pytest.raises(UserError, match=f"pid {sleeper.pid} on host"):
            lock.acquire(tmp_path / "out")
    finally:
        sleeper.kill()
        sleeper.wait()
    held = lock.acquire(tmp_path / "out")  # now dead: taken over
    assert json.loads((tmp_path / "out" / RUN_LOCK).read_text())["pid"] == os.getpid()
    held.release()


def test_without_locks_a_holder_on_another_host_is_refused_with_the_way_out(tmp_path, no_flock):
    write_record(tmp_path / "out", host="node-7", pid=4242)
    with pytest.raises(UserError, match=r"pid 4242 on host node-7.*cannot be checked.*delete .*"
                                        + RUN_LOCK.replace(".", r"\.")):
        lock.acquire(tmp_path / "out")
