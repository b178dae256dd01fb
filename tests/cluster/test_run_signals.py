"""Signals to a real `xeontune run`, sent as a user's terminal or a scheduler sends them (issue 29).

- Ctrl-C to `run --provider slurm` against a real slurmctld and slurmd (the module's ``slurm``
  fixture): the SIGINT goes to the command's whole process group, as a terminal sends it. The job
  must be cancelled for real (`scancel`; Slurm then says CANCELLED and lists nothing), what it wrote
  stays in --output-dir (the ranks write it there: docs/slurm.md), and `run` exits 130.
- SIGTERM (`kill`) and SIGHUP (a closed terminal: the pty's master is closed, so the kernel hangs up
  the command's controlling terminal and every later write to it fails) to `run --provider local -n 2`
  on network namespaces while the job trains: as docs/quickstart.md promises, what the job wrote
  (the step copies, the latest checkpoint) is copied into --output-dir before the cluster is
  deleted, nothing of the cluster is left, and `run` exits 128 + the signal's number.

Every command is a fresh process started as a user starts it, and never outlives its test.
"""

from __future__ import annotations

import contextlib
import os
import re
import select
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.checks import rank_pids, wait_while_running
from tests.cluster.clusterlib import REPO, leftovers
from tests.trainlib import OFFLINE
from xeontune.cluster import state

pytestmark = [pytest.mark.slow, pytest.mark.root]

CLUSTER_NAME_PREFIX = "sg"  # cluster_name (conftest.py): sg<pid>-<count>
FOREVER = "100000"  # --max-train-steps: the job only ends by the signal


def train_options(model: Path, data: Path, out: Path, *extra: str) -> list[str]:
    """Tiny, fp32, 32 px: a step takes a fraction of a second on 2 shared cores."""
    return ["--model", str(model), "--data-dir", str(data), "--placeholder-token", "<toy-bot>",
            "--initializer-token", "toy", "--resolution", "32", "--train-batch-size", "1", "--max-train-steps",
            FOREVER, "--learning-rate", "5e-3", "--seed", "7", "--mixed-precision", "fp32", "--no-random-flip",
            "--output-dir", str(out), *extra]


def lines(path: Path) -> int:
    return path.read_text().count("\n") if path.is_file() else 0


@contextlib.contextmanager
def never_outlives(proc: subprocess.Popen) -> Iterator[subprocess.Popen]:
    try:
        yield proc
    finally:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


# --- Ctrl-C of `run --provider slurm` --------------------------------------------------------------


@pytest.fixture
def on_slurm(slurm, xeontune_home) -> Iterator:
    """The module's real Slurm; a test that failed leaves no job of it running (cancelled, and over,
    before the daemons stop)."""
    yield slurm
    if left := slurm.jobs():
        slurm.run("scancel", *left)
        deadline = time.monotonic() + 60
        while slurm.jobs() and time.monotonic() < deadline:
            time.sleep(0.5)


def test_ctrl_c_of_run_on_slurm_cancels_the_job_and_leaves_its_checkpoint(on_slurm, tiny_model, sample_images,
                                                                          tmp_path):
    """`run --provider slurm -n 2` trains; Ctrl-C (SIGINT to its process group: `run` and any scontrol
    it has running) must scancel the job: its ranks get Slurm's SIGTERM, rank 0 checkpoints within
    KillWait (docs/slurm.md: "a cancelled job leaves that checkpoint to resume from by hand"), Slurm
    says CANCELLED and lists no job, no rank is left, the step copies stay, and `run` exits 130 after
    saying which job it cancelled. The ranks run under slurmd, out of reach of the terminal's
    signal: a `run` that did not cancel would leave the job training (no --max-train-steps ends it)."""
    slurm = on_slurm
    out = tmp_path / "out"
    log = tmp_path / "run.log"
    argv = [sys.executable, "-m", "xeontune.cli", "run", "--provider", "slurm", "-n", "2", "--name", "cc",
            "--time", "10:00", "--", *train_options(tiny_model, sample_images, out, "--checkpointing-steps", "0",
                                                    "--save-steps", "2")]
    # rank 0's port, which sbatch passes on (a name already set wins over the one derived from the job
    # id): other real Slurms on this machine (other test runs) number their jobs from 1 as well
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = str(free.getsockname()[1])
    env = {**slurm.env, **OFFLINE, "OMP_NUM_THREADS": "1", "MASTER_PORT": port}
    proc = subprocess.Popen(argv, cwd=tmp_path, env=env, start_new_session=True, stdin=subprocess.DEVNULL,
                            stdout=log.open("w"), stderr=subprocess.STDOUT)
    with never_outlives(proc):
        wait_while_running(proc, lambda: lines(out / "metrics.jsonl") >= 3 and len(rank_pids(str(out))) == 2,
                           "2 ranks training", lambda: log.read_text() + slurm.log())
        submitted = re.search(r"submitted slurm job (\d+)", log.read_text())
        assert submitted, log.read_text()
        job_id = submitted[1]
        assert job_id in slurm.jobs()
        trained = lines(out / "metrics.jsonl")
        sent = time.monotonic()
        os.killpg(proc.pid, signal.SIGINT)  # the terminal's Ctrl-C
        rc = proc.wait(timeout=120)
        took = time.monotonic() - sent
    text = log.read_text()
    assert rc == 130 and took < 60, (rc, took, text[-3000:])
    assert f"interrupted: cancelling slurm job {job_id}" in text, text[-3000:]
    assert text.strip().splitlines()[-1].startswith("deleted cluster 'cc' (slurm)"), text[-3000:]
    # cancelled for real, and over by the time `run` returned: nothing queued, running or completing
    assert slurm.jobs() == [], slurm.run("squeue").stdout
    shown = slurm.run("scontrol", "show", "job", "-o", job_id).stdout
    assert "JobState=CANCELLED" in shown, shown
    deadline = time.monotonic() + 10
    while rank_pids(str(out)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert rank_pids(str(out)) == []
    assert not state.exists("cc")
    # what the job wrote stays where the ranks wrote it, with the checkpoint of Slurm's SIGTERM
    assert lines(out / "metrics.jsonl") >= trained and (out / "train_config.json").is_file()
    assert (out / "learned_embeds-steps-2.safetensors").is_file()
    checkpoints = [p for p in out.glob("checkpoint-*") if (p / "complete.json").is_file()]
    assert len(checkpoints) == 1 and int(checkpoints[0].name.split("-")[1]) >= trained, sorted(os.listdir(out))
    assert (checkpoints[0] / "state.pt").is_file()
    print(f"Ctrl-C of `run --provider slurm`: job {job_id} cancelled, `run` exited 130 in {took:.1f} s")


# --- SIGTERM and SIGHUP to `run --provider local` ---------------------------------------------------

def local_run_argv(name: str, model: Path, data: Path, out: Path) -> list[str]:
    return [sys.executable, "-m", "xeontune.cli", "run", "--provider", "local", "-n", "2", "--name", name, "--",
            *train_options(model, data, out, "--checkpointing-steps", "2", "--save-steps", "2")]


class Head:
    """The job's output dir on the head (the namespace nodes share this disk)."""

    def __init__(self, name: str) -> None:
        self.runs = state.cluster_dir(name) / "work" / "runs"

    def steps(self) -> int:
        return max((lines(p) for p in self.runs.glob("*/metrics.jsonl")), default=0)

    def newest_checkpoint(self) -> int:
        """The newest complete checkpoint's step (0: none yet)."""
        return max((int(p.parent.name.split("-")[1]) for p in self.runs.glob("*/checkpoint-*/complete.json")),
                   default=0)

    def training(self) -> bool:
        """Both ranks past their first checkpoint and step copy (step 2), and training on."""
        return self.steps() >= 3 and self.newest_checkpoint() >= 2


def assert_fetched_and_nothing_left(name: str, out: Path, checkpoint_at_signal: int) -> None:
    """What the job wrote is here (the newest checkpoint at least as new as at the signal, complete;
    step copies, metrics and config), and nothing of the cluster is left."""
    fetched = sorted(out.glob("checkpoint-*"))
    assert len(fetched) == 1, sorted(os.listdir(out)) if out.is_dir() else "no output dir"
    assert {p.name for p in fetched[0].iterdir()} == {"state.pt", "complete.json"}
    assert int(fetched[0].name.split("-")[1]) >= checkpoint_at_signal
    assert (out / "learned_embeds-steps-2.safetensors").is_file()
    assert lines(out / "metrics.jsonl") >= 3 and (out / "train_config.json").is_file()
    deadline = time.monotonic() + 5
    while leftovers(name) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert leftovers(name) == [] and not state.exists(name), leftovers(name)


def test_sigterm_to_run_stops_the_job_fetches_what_it_wrote_and_deletes_the_cluster(
        cluster_name, tiny_model, sample_images, tmp_path):
    """`kill PID` (SIGTERM) while 2 ranks train: the job is stopped on every rank through the runner
    (each rank's own KeyboardInterrupt), the checkpoint and step copies are fetched and `run` says so,
    the cluster is deleted (the last line), and `run` exits 143."""
    out = tmp_path / "out"
    log = tmp_path / "run.log"
    proc = subprocess.Popen(local_run_argv(cluster_name, tiny_model, sample_images, out), cwd=REPO,
                            env={**os.environ, **OFFLINE}, start_new_session=True, stdin=subprocess.DEVNULL,
                            stdout=log.open("w"), stderr=subprocess.STDOUT)
    head = Head(cluster_name)
    with never_outlives(proc):
        wait_while_running(proc, head.training, "2 ranks past their first checkpoint", log.read_text)
        at_signal = head.newest_checkpoint()
        sent = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=120)
        took = time.monotonic() - sent
    text = log.read_text()
    assert rc == 143 and took < 60, (rc, took, text[-3000:])
    assert "interrupted (SIGTERM): stopping the job on every rank" in text, text[-3000:]
    # each rank left through its KeyboardInterrupt (the runner passed SIGINT on), not a SIGKILL
    assert sorted(line.split()[0] for line in text.splitlines() if "interrupted (SIGINT): stopped" in line) == \
        ["[0]", "[1]"], text[-3000:]
    assert f"interrupted (SIGTERM): fetching what the job wrote into {out} before anything is deleted" in text
    assert f"interrupted (SIGTERM); fetched what it wrote into {out}: " in text, text[-3000:]
    assert text.strip().splitlines()[-1].startswith(f"deleted cluster {cluster_name!r} (local)"), text[-3000:]
    assert "Traceback" not in text, text[-3000:]
    # the log goes on after the signal, not again from its start
    first_line = next(line for line in text.splitlines() if line.startswith("[0]"))
    assert text.count(first_line + "\n") == 1, text[-3000:]
    assert_fetched_and_nothing_left(cluster_name, out, at_signal)
    print(f"SIGTERM to `run`: stopped, fetched and deleted, exit 143, in {took:.1f} s")


def test_a_closed_terminal_stops_the_job_fetches_what_it_wrote_and_deletes_the_cluster(
        cluster_name, tiny_model, sample_images, tmp_path):
    """SIGHUP as a closed terminal window sends it: `run`'s controlling terminal is a pty whose master
    is closed mid-training, so the kernel hangs it up (SIGHUP to `run`, the session leader) and
    every later write to it fails. `run` must still stop the job, fetch what it wrote, delete the
    cluster and exit 129 (the output of a gone terminal is dropped, not a reason to stop)."""
    out = tmp_path / "out"
    master, slave = os.openpty()
    # a session of its own whose controlling terminal is the pty (sh, the session leader, opens it by name)
    argv = ["sh", "-c", 'exec "$@" <"$0" >"$0" 2>&1', os.ttyname(slave),
            *local_run_argv(cluster_name, tiny_model, sample_images, out)]
    proc = subprocess.Popen(argv, cwd=REPO, env={**os.environ, **OFFLINE}, start_new_session=True,
                            stdin=slave, stdout=slave, stderr=slave)
    os.close(slave)
    seen = bytearray()

    def drain() -> None:  # the terminal shows what `run` prints (a full pty would block it)
        if select.select([master], [], [], 0.2)[0]:
            with contextlib.suppress(OSError):
                seen.extend(os.read(master, 65536))

    head = Head(cluster_name)
    with never_outlives(proc):
        try:
            wait_while_running(proc, head.training, "2 ranks past their first checkpoint",
                               lambda: seen.decode(errors="replace"), tick=drain)
            at_signal = head.newest_checkpoint()
        finally:
            os.close(master)  # the terminal goes away
        sent = time.monotonic()
        rc = proc.wait(timeout=120)
        took = time.monotonic() - sent
    assert rc == 129 and took < 60, (rc, took, seen.decode(errors="replace")[-3000:])
    assert_fetched_and_nothing_left(cluster_name, out, at_signal)
    print(f"closed terminal (SIGHUP) of `run`: stopped, fetched and deleted, exit 129, in {took:.1f} s")
