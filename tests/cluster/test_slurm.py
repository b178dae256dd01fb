"""`srun xeontune train` in a user's own batch script, against a real Slurm (tests/cluster/slurmlib.py):
the trainer takes its rank, world size and master address from Slurm's environment."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file

from tests.cluster import slurmlib
from xeontune.errors import UserError
from xeontune.train import world


def test_tasks_per_node_expands_slurms_compressed_lists():
    assert world.tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    assert world.tasks_per_node("4") == [4]
    with pytest.raises(ValueError):
        world.tasks_per_node("2(x)")


def test_fewer_ranks_than_ppn_share_the_nodes_cores_among_themselves():
    from xeontune.cluster.providers.slurm import PROVIDER
    from xeontune.cluster.state import ClusterRecord

    record = ClusterRecord(name="l", provider="slurm", cores_per_node=32,
                           extra={"partition": "p", "nodes": "2", "cpus_per_node": "32"})
    assert PROVIDER.layout(record, 3, 8) == (1, 3, 10)  # not 4 CPUs each, 20 of 32 idle
    assert PROVIDER.layout(record, 12, 8) == (2, 6, 5)
    assert PROVIDER.layout(record, 16, 8) == (2, 8, 4)
    with pytest.raises(UserError, match="needs 3 nodes"):
        PROVIDER.layout(record, 17, 8)


def test_an_srun_task_gets_the_standard_names_and_the_batch_script_does_not():
    task = {"SLURM_PROCID": "4", "SLURM_STEP_NUM_TASKS": "5", "SLURM_LOCALID": "1", "SLURM_NODEID": "1",
            "SLURM_STEP_TASKS_PER_NODE": "3,2", "SLURM_JOB_ID": "77", "SLURM_STEP_ID": "0", "MASTER_ADDR": "n1"}
    assert world.adopt_slurm(task)
    assert (task["RANK"], task["WORLD_SIZE"], task["LOCAL_RANK"], task["LOCAL_WORLD_SIZE"]) == ("4", "5", "1", "2")
    assert task["MASTER_ADDR"] == "n1"  # the user's own wins
    assert 12000 <= int(task["MASTER_PORT"]) < 32768  # the same for every task of the step, not ephemeral
    batch = {"SLURM_PROCID": "0", "SLURM_NTASKS": "3", "SLURM_JOB_ID": "77"}  # the batch script itself
    assert not world.adopt_slurm(batch) and "RANK" not in batch
    under_mpirun = {**task, "PMI_RANK": "2"}
    del under_mpirun["RANK"]
    assert not world.adopt_slurm(under_mpirun) and "RANK" not in under_mpirun
    alone = {"SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "1"}
    assert not world.adopt_slurm(alone) and "RANK" not in alone


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    slurmlib.require_slurm()
    cluster = slurmlib.start(tmp_path_factory.mktemp("slurm"), nodes=3)
    yield cluster
    slurmlib.stop(cluster)


def _batch(tmp_path, name: str, body: str) -> str:
    script = tmp_path / f"{name}.sh"
    script.write_text("#!/bin/bash\nset -euo pipefail\n" + body)
    return str(script)


@pytest.mark.slow
@pytest.mark.root
def test_srun_in_a_hand_written_batch_script_trains_what_one_process_with_three_times_the_batch_does(
        slurm, tiny_model, sample_images, tmp_path):
    """3 srun tasks on 3 Slurm nodes, batch 1 each = 1 process with batch 3 (fp32: exact), with no
    launcher: the ranks found each other from SLURM_* alone."""
    common = ["--model", str(tiny_model), "--data-dir", str(sample_images), "--placeholder-token", "<toy-bot>",
              "--initializer-token", "toy", "--resolution", "64", "--max-train-steps", "3", "--checkpointing-steps", "0", "--save-steps", "0",
                          "--mixed-precision", "fp32", "--learning-rate", "5e-3", "--no-random-flip"]
    train = [sys.executable, "-m", "xeontune.cli", "train", *common]
    body = ("export HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1\n"
            f"srun --nodes 3 --ntasks 3 {shlex.join(train)} --train-batch-size 1 "
            f"--output-dir {shlex.quote(str(tmp_path / 'srun'))}\n")
    script = _batch(tmp_path, "train", body)
    out = tmp_path / "job.out"
    done = slurm.run("sbatch", "--wait", "--nodes", "3", "--ntasks", "3", "--output", str(out),
                     "--chdir", str(tmp_path), script, timeout=600)
    log = out.read_text() if out.exists() else ""
    assert done.returncode == 0, done.stdout + done.stderr + log[-4000:] + slurm.log()
    one = subprocess.run([*train, "--train-batch-size", "3", "--output-dir", str(tmp_path / "one")],
                                  capture_output=True, text=True, timeout=600, env={**slurm.env, "HF_HUB_OFFLINE": "1"})
    assert one.returncode == 0, one.stderr[-3000:]
    got = load_file(str(tmp_path / "srun" / "learned_embeds.safetensors"))
    want = load_file(str(tmp_path / "one" / "learned_embeds.safetensors"))
    assert max(float((got[k] - want[k]).abs().max()) for k in want) <= 1e-5
    assert all(float(want[k].abs().max()) > 0 for k in want)
    assert slurm.jobs() == []  # nothing left behind


# --- `--provider slurm`: xeontune submits the batch job itself ----------------------------------

def _options(tiny_model, sample_images, out, steps: int = 2) -> list[str]:
    return ["--", "--model", str(tiny_model), "--data-dir", str(sample_images), "--placeholder-token", "<toy-bot>",
            "--initializer-token", "toy", "--resolution", "64", "--max-train-steps", str(steps),
            "--checkpointing-steps", "0", "--save-steps", "0", "--mixed-precision", "fp32", "--no-random-flip",
            "--output-dir", str(out)]


@pytest.fixture
def on_slurm(slurm, xeontune_home, monkeypatch, tmp_path):
    """The CLI in this process, talking to the test's Slurm; tasks share the machine's 2 cores."""
    monkeypatch.setenv("SLURM_CONF", slurm.env["SLURM_CONF"])
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.chdir(tmp_path)
    return slurm


def _error_line(capsys) -> str:
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


def test_run_without_sbatch_on_path_is_one_line(xeontune_home, monkeypatch, tmp_path, capsys):
    from xeontune.cli import main

    monkeypatch.setenv("PATH", str(tmp_path))
    assert main(["run", "--provider", "slurm", "-n", "3", "--", "--model", "org/m", "--placeholder-token", "<t>",
                 "--initializer-token", "toy", "--data-dir", str(tmp_path), "--output-dir", str(tmp_path / "out")]) == 2
    assert "no sbatch on PATH" in _error_line(capsys)


def test_a_failing_scontrol_is_reported_in_its_own_words(monkeypatch):
    """Not "no default partition" or "unknown partition (partitions: none)" when scontrol itself failed."""
    from xeontune.cluster.providers import slurm

    def scontrol_fails(*argv):
        return subprocess.CompletedProcess(argv, 1, "", "scontrol: fatal: Could not establish a configuration source")

    monkeypatch.setattr(slurm, "_run", scontrol_fails)
    for call in (slurm.default_partition, lambda: slurm.partition_nodes("p1")):
        with pytest.raises(UserError, match="scontrol show partition failed: .*configuration source"):
            call()


@pytest.mark.slow
@pytest.mark.root
def test_slurm_refusals_are_one_line_errors_before_anything_runs(on_slurm, tiny_model, sample_images, tmp_path,
                                                                  capsys):
    from xeontune.cli import main

    opts = _options(tiny_model, sample_images, tmp_path / "out")
    assert main(["run", "--provider", "slurm", "-n", "3", "--partition", "nope", *opts]) == 2
    assert "unknown Slurm partition 'nope' (partitions: debug)" in _error_line(capsys)
    assert main(["run", "--provider", "slurm", "-n", "4", *opts]) == 2  # 3 nodes of 1 CPU
    assert "-n 4 is more ranks than Slurm partition 'debug' can hold (3 node(s), 3 CPUs" in _error_line(capsys)
    assert main(["run", "--provider", "slurm", "-n", "2", "--ppn", "2", *opts]) == 2
    assert "--ppn 2 is more ranks per node than partition 'debug' has CPUs (1)" in _error_line(capsys)
    assert main(["run", "--provider", "slurm", "-n", "3", "--time", "banana", *opts]) == 2
    line = _error_line(capsys)
    assert line.startswith("error: Slurm refused the job: sbatch: error: Invalid --time specification"), line
    assert on_slurm.jobs() == [] and not (tmp_path / "out").exists()


@pytest.mark.slow
@pytest.mark.root
def test_run_provider_slurm_trains_three_ranks_and_leaves_no_job(on_slurm, tiny_model, sample_images, tmp_path,
                                                                capsys):
    """One batch job, one srun task per rank (the 3-rank result equals one process with 3x the batch:
    the hand-written script's test above); the outputs are written in place, the record is gone."""
    from xeontune.cli import main
    from xeontune.cluster import state

    out = tmp_path / "out"
    rc = main(["run", "--provider", "slurm", "-n", "3", "--ppn", "auto", "--name", "sl", "--time", "10:00",
               *_options(tiny_model, sample_images, out)])
    text = capsys.readouterr()
    assert rc == 0, text.out[-3000:] + text.err[-3000:] + on_slurm.log()
    assert "submitted slurm job" in text.out and "3 rank(s), 1 per node" in text.out  # auto: 1 CPU a node
    assert json.loads((out / "train_config.json").read_text())["world_size"] == 3
    assert load_file(str(out / "learned_embeds.safetensors"))
    assert on_slurm.jobs() == [] and not state.exists("sl")


def _rank_pids(marker: str) -> list[int]:
    """The rank processes whose command line names ``marker`` (their unique --output-dir)."""
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            cmd = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        # not srun's own processes, whose command lines hold the rank's
        if proc.name.isdigit() and cmd[1:3] == [b"-m", b"xeontune.train"] and marker.encode() in cmd:
            pids.append(int(proc.name))
    return pids


def _start_long_job(name: str, tiny_model, sample_images, out, slurm, capsys) -> list[int]:
    from xeontune.cli import main

    assert main(["cluster", "up", "--provider", "slurm", "-n", "3", "--name", name]) == 0
    assert "ssh_config" not in capsys.readouterr().out  # no SSH, no hosts file: Slurm places the ranks
    assert main(["launch", "--dry-run", "--name", name, *_options(tiny_model, sample_images, out)]) == 0
    lines = capsys.readouterr().out.splitlines()
    sbatch = shlex.split(next(line for line in lines if line.startswith("sbatch ")))
    assert sbatch[:3] == ["sbatch", "--parsable", f"--job-name=xeontune-{name}"] and sbatch[-1].endswith("job.sbatch")
    srun = shlex.split(next(line for line in lines if line.startswith("srun ")))
    assert srun[:6] == ["srun", "--kill-on-bad-exit=1", "--nodes=3", "--ntasks=3", "--ntasks-per-node=1",
                        "--cpus-per-task=1"]
    assert srun[6:9] == [sys.executable, "-m", "xeontune.train"] and "<toy-bot>" in srun  # quoted in the script
    assert main(["launch", "--detach", "--name", name, *_options(tiny_model, sample_images, out, steps=100000)]) == 0
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and len(_rank_pids(str(out))) < 3:
        time.sleep(0.5)
    pids = _rank_pids(str(out))
    assert len(pids) == 3, slurm.log()
    return pids


def _gone(pids: list[int], within_s: float) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if not any(Path(f"/proc/{pid}").exists() for pid in pids):
            return True
        time.sleep(0.5)
    return False


@pytest.mark.slow
@pytest.mark.root
def test_teardown_scancels_the_job_and_every_task_ends_within_60s(on_slurm, tiny_model, sample_images, tmp_path,
                                                                 capsys):
    from xeontune.cli import main

    pids = _start_long_job("cx", tiny_model, sample_images, tmp_path / "out", on_slurm, capsys)
    assert main(["cluster", "status", "--name", "cx"]) == 0
    assert re.search(r"job \d+ RUNNING \(n\[1-3\]\)", capsys.readouterr().out)
    started = time.monotonic()
    assert main(["teardown", "--name", "cx"]) == 0
    assert re.search(r"deleted Slurm job \d+ \(scancel\)", capsys.readouterr().out)
    assert _gone(pids, 60 - (time.monotonic() - started)) and on_slurm.jobs() == []
    assert main(["teardown", "--name", "cx"]) == 0  # idempotent
    assert "nothing to tear down" in capsys.readouterr().out


@pytest.mark.slow
@pytest.mark.root
def test_a_killed_task_ends_the_job_with_a_clear_error_within_60s(on_slurm, tiny_model, sample_images, tmp_path,
                                                                 capsys):
    from xeontune.cli import main

    pids = _start_long_job("kx", tiny_model, sample_images, tmp_path / "out", on_slurm, capsys)
    capsys.readouterr()
    os.kill(pids[-1], signal.SIGKILL)
    started = time.monotonic()
    assert main(["logs", "--name", "kx", "-f"]) != 0
    assert time.monotonic() - started < 60
    # the script wrote its status; Slurm may list the job a moment longer (COMPLETING)
    while on_slurm.jobs() and time.monotonic() - started < 60:
        time.sleep(0.2)
    assert _gone(pids, 5) and on_slurm.jobs() == []
    captured = capsys.readouterr()
    assert "xeontune: srun ended with status" in captured.out and "a rank failed or was killed" in captured.out
    assert main(["teardown", "--name", "kx"]) == 0


@pytest.mark.slow
@pytest.mark.root
@pytest.mark.parametrize("how", ["notice", "requeue"])
def test_a_requeued_job_resumes_by_itself_to_the_vectors_of_a_straight_run(
        how, on_slurm, tiny_model, sample_images, tmp_path, capsys):
    """notice: SIGUSR1 to every task (what --signal=USR1@120 sends before the time limit; here scancel -s)
    makes rank 0 checkpoint, the ranks stop, and the batch script requeues the job. requeue: `scontrol
    requeue` mid-run (SIGTERM, as a preemption sends): rank 0 checkpoints in the grace time (KillWait),
    and Slurm requeues the job. No periodic checkpoints: the job resumes from the one the signal made."""
    from xeontune.cli import main
    from xeontune.job import record

    out, steps = tmp_path / "out", 16
    assert main(["cluster", "up", "--provider", "slurm", "-n", "3", "--name", "rq"]) == 0
    assert main(["launch", "--detach", "--name", "rq", *_options(tiny_model, sample_images, out, steps)]) == 0
    job = record.load_job("rq")
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and len(_lines(out / "metrics.jsonl")) < 5:
        time.sleep(0.2)
    if how == "notice":
        assert on_slurm.run("scancel", "-s", "USR1", job.scheduler_id).returncode == 0
    else:
        assert on_slurm.run("scontrol", "requeue", job.scheduler_id).returncode == 0
    # Slurm 22.05 holds a requeued job for about 120 s (Reason=BeginTime), so that its first run's
    # slurmstepds are gone before it starts again: release it as soon as they are (earlier, the new
    # run's launch can fail on a node still cleaning up the old one: the job then ends FAILED)
    while time.monotonic() < deadline + 60 and ("Reason=BeginTime" not in on_slurm.run(
            "scontrol", "show", "job", "-o", job.scheduler_id).stdout or _stepds(job.scheduler_id)):
        time.sleep(0.2)
    assert on_slurm.run("scontrol", "update", f"JobId={job.scheduler_id}", "StartTime=now").returncode == 0
    capsys.readouterr()
    assert main(["logs", "--name", "rq", "-f"]) == 0, on_slurm.log()
    log = capsys.readouterr().out
    signalled = re.search(r"checkpoint-(\d+) written on (SIGUSR1|SIGTERM): stopped, to resume from it", log)
    assert signalled and signalled[2] == ("SIGUSR1" if how == "notice" else "SIGTERM"), log[-3000:]
    assert 5 <= int(signalled[1]) < steps
    assert (f"requeueing job {job.scheduler_id}" in log) == (how == "notice"), log[-3000:]
    assert f"xeontune: Slurm job {job.scheduler_id}, restart 1: resuming from the newest complete checkpoint" in log
    # the restarted run's forecast counts what the restart lost: at least the ~0.2+ s it waited to start again
    assert re.search(r"forecast: step \d+/16, .*; 1 restart lost about \d+ (s|min) \(waiting to start again", log)
    straight = subprocess.run(
        [sys.executable, "-m", "xeontune.cli", "train", *_options(tiny_model, sample_images, tmp_path / "one", steps)[1:],
         "--train-batch-size", "3"], capture_output=True, text=True, timeout=600, env=dict(os.environ))
    assert straight.returncode == 0, straight.stderr[-3000:]
    got = load_file(str(out / "learned_embeds.safetensors"))
    want = load_file(str(tmp_path / "one" / "learned_embeds.safetensors"))
    assert max(float((got[k] - want[k]).abs().max()) for k in want) <= 1e-5
    assert on_slurm.jobs() == []
    assert main(["teardown", "--name", "rq"]) == 0


@pytest.mark.root
def test_a_restarted_job_resumes_its_checkpoint_or_starts_its_own_run_over(on_slurm, tiny_model, sample_images,
                                                                          tmp_path, capsys):
    """The batch script's restart branch, run by bash with an srun that records its arguments: a
    requeued job resumes from its newest checkpoint; one stopped before its first checkpoint starts
    over (--overwrite) where this job wrote the run, and never overwrites another run's output dir."""
    from xeontune.cli import main
    from xeontune.cluster import state

    out = tmp_path / "out"
    assert main(["cluster", "up", "--provider", "slurm", "-n", "3", "--name", "rs"]) == 0
    capsys.readouterr()
    assert main(["launch", "--dry-run", "--name", "rs", *_options(tiny_model, sample_images, out)]) == 0
    script = capsys.readouterr().out.split("\n", 1)[1]  # after the sbatch command line
    job_dir = tmp_path / "job"
    job_dir.mkdir()
    script = script.replace(f"{state.load('rs').work_dir}/jobs/<job id>", str(job_dir))
    (tmp_path / "job.sbatch").write_text(script)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(f"#!/bin/sh\nprintf '%s\\n' \"$@\" > {tmp_path / 'srun-args'}\n")
    (bin_dir / "srun").chmod(0o755)

    def flags_after(restarts: int) -> list[str]:
        env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": "7",
               "SLURM_RESTART_COUNT": str(restarts)}
        done = subprocess.run(["bash", str(tmp_path / "job.sbatch")], env=env, capture_output=True, text=True,
                              timeout=60)
        assert done.returncode == 0, done.stdout + done.stderr
        args = (tmp_path / "srun-args").read_text().splitlines()
        return [a for a in args if a in ("--overwrite", "--resume-from-checkpoint", "latest")]

    assert flags_after(0) == []  # the first run
    out.mkdir()
    time.sleep(0.05)
    (out / "train_config.json").write_text("{}")  # what that run wrote before it was stopped
    assert flags_after(1) == ["--overwrite"]
    (out / "checkpoint-4").mkdir()
    assert flags_after(2) == ["--resume-from-checkpoint", "latest"]
    (out / "checkpoint-4").rmdir()
    first_start = (job_dir / "started").stat().st_mtime
    os.utime(out / "train_config.json", (first_start - 60, first_start - 60))  # another run's, from before
    assert flags_after(1) == []  # the trainer then refuses the dir, as for any run
    assert main(["teardown", "--name", "rs"]) == 0


def _stepds(job_id: str) -> list[str]:
    """slurmstepd processes still serving job ``job_id`` (its batch script or a step)."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            cmd = (proc / "cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        if proc.name.isdigit() and cmd.startswith(f"slurmstepd: [{job_id}."):
            found.append(cmd)
    return found


def _lines(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []
