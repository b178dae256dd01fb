"""The detached runner (`python -m xeontune.job.process`, what `launch --detach` and `run` start on a
head): a stop that comes the moment its pid is out still ends with the job's exit status in ``rc``,
which `logs`, `fetch` and the autostop watcher read. Real processes, no cluster."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.cluster.clusterlib import REPO


def test_a_stop_right_after_the_pid_is_written_still_leaves_the_exit_status(tmp_path: Path) -> None:
    for attempt in range(5):
        job_dir = tmp_path / f"job{attempt}"
        starter = subprocess.Popen([sys.executable, "-m", "xeontune.job.process", "--job-dir", str(job_dir), "--",
                                    "sleep", "60"], cwd=REPO, stdout=subprocess.PIPE, text=True)
        pid_file = job_dir / "pid"
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # the tightest loop a user's `xeontune stop` could hope for
            try:
                text = pid_file.read_text()
            except FileNotFoundError:
                continue
            if text.endswith("\n"):
                break
        pid = int(pid_file.read_text())
        os.kill(pid, signal.SIGTERM)
        starter.communicate(timeout=30)
        deadline = time.monotonic() + 30
        while not (job_dir / "rc").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert (job_dir / "rc").exists(), f"attempt {attempt}: the runner died without writing rc"
        assert (job_dir / "rc").read_text() == f"{128 + signal.SIGTERM}\n"
