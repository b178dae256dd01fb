"""`srun xeontune train` in a user's own batch script, against a real Slurm (tests/cluster/slurmlib.py):
the trainer takes its rank, world size and master address from Slurm's environment."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file

from tests.checks import EMBEDS, References, assert_same_vectors, lines, rank_pids, wait_for_lines
from tests.cluster import slurmlib
from tests.trainlib import assert_same_unet, full_args, train_in_process
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


def test_a_task_of_srun_with_pmi2_adopts_slurms_names_and_an_mpirun_inside_the_job_keeps_its_own():
    """MpiDefault=pmi2 (or srun --mpi=pmi2) gives every task PMI_RANK / PMI_SIZE, Slurm's own rank and task
    count: not a launcher of its own, so the task still gets MASTER_ADDR and the rest (it could not find
    rank 0 otherwise: "MASTER_ADDR expected"). Hydra's PMI_RANK, two ranks per node on two nodes, differs."""
    step = {"SLURM_PROCID": "2", "SLURM_STEP_NUM_TASKS": "3", "SLURM_LOCALID": "0", "SLURM_NODEID": "2",
            "SLURM_STEP_TASKS_PER_NODE": "1(x3)", "SLURM_JOB_ID": "77", "SLURM_STEP_ID": "0", "MASTER_ADDR": "n1"}
    pmi2 = {**step, "PMI_RANK": "2", "PMI_SIZE": "3", "PMI_FD": "6", "PMI_JOBID": "77.0"}  # a pmi2 task's
    assert world.adopt_slurm(pmi2)
    assert (pmi2["RANK"], pmi2["WORLD_SIZE"], pmi2["LOCAL_WORLD_SIZE"]) == ("2", "3", "1") and pmi2["MASTER_PORT"]
    hydra = {**step, "SLURM_PROCID": "1", "SLURM_STEP_NUM_TASKS": "2", "SLURM_STEP_TASKS_PER_NODE": "1(x2)",
             "PMI_RANK": "2", "PMI_SIZE": "4"}  # rank 2 of 4 under mpirun -ppn 2, on the second node
    assert not world.adopt_slurm(hydra) and "RANK" not in hydra
    first = {**hydra, "SLURM_PROCID": "0", "PMI_RANK": "0"}  # its rank 0: the rank agrees, the size does not
    assert not world.adopt_slurm(first) and "RANK" not in first


@pytest.fixture(scope="module")
def references(tmp_path_factory) -> References:
    """Straight runs (one process, 3x the batch), each trained once for the tests that compare with it."""
    return References(tmp_path_factory.mktemp("straight"))


def _srun_train(tiny_model, sample_images) -> list[str]:
    """The training command line of the srun tests (fp32, a learning rate that moves the vectors)."""
    return [sys.executable, "-m", "xeontune.cli", "train", "--model", str(tiny_model), "--data-dir",
            str(sample_images), "--placeholder-token", "<toy-bot>", "--initializer-token", "toy", "--resolution",
            "32", "--max-train-steps", "3", "--checkpointing-steps", "0", "--save-steps", "0", "--mixed-precision",
            "fp32", "--learning-rate", "5e-3", "--no-random-flip"]


def _srun_straight(references: References, slurm, train: list[str]) -> Path:
    return references.train([*train, "--train-batch-size", "3"],
                            env={**slurm.env, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"})


def _batch(tmp_path, name: str, body: str) -> str:
    script = tmp_path / f"{name}.sh"
    script.write_text("#!/bin/bash\nset -euo pipefail\n" + body)
    return str(script)


@pytest.mark.slow
@pytest.mark.root
def test_srun_in_a_hand_written_batch_script_trains_what_one_process_with_three_times_the_batch_does(
        slurm, tiny_model, sample_images, tmp_path, references):
    """3 srun tasks on 3 Slurm nodes, batch 1 each = 1 process with batch 3 (fp32: exact), with no
    launcher: the ranks found each other from SLURM_* alone."""
    train = _srun_train(tiny_model, sample_images)
    body = ("export HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1\n"
            f"srun --nodes 3 --ntasks 3 {shlex.join(train)} --train-batch-size 1 "
            f"--output-dir {shlex.quote(str(tmp_path / 'srun'))}\n")
    script = _batch(tmp_path, "train", body)
    out = tmp_path / "job.out"
    # sbatch --wait looks again after 2, 8, then 32 s while that is under half of MinJobAge (its own
    # slurm.conf's): told 4 s, every 2 s (the controller keeps its 300 s)
    done = subprocess.run(["sbatch", "--wait", "--nodes", "3", "--ntasks", "3", "--output", str(out), "--chdir",
                           str(tmp_path), script], capture_output=True, text=True, timeout=600,
                          env=slurm.client_env(MinJobAge=4))
    log = out.read_text() if out.exists() else ""
    assert done.returncode == 0, done.stdout + done.stderr + log[-4000:] + slurm.log()
    assert_same_vectors(tmp_path / "srun", _srun_straight(references, slurm, train))  # and the reference trained
    assert slurm.jobs() == []  # nothing left behind


@pytest.mark.slow
@pytest.mark.root
def test_srun_with_the_pmi2_plugin_trains_what_one_process_with_three_times_the_batch_does(
        slurm, tiny_model, sample_images, tmp_path, references):
    """Sites with MpiDefault=pmi2: Debian's Slurm has the plugin (mpi_pmi2.so), and `srun --mpi=pmi2`
    gives every task PMI_RANK and PMI_SIZE. The 3 tasks still train together (before: "MASTER_ADDR
    expected" on every rank), the same vectors as one process with 3x the batch (fp32: exact)."""
    srun = ["srun", "--mpi=pmi2", "--nodes", "3", "--ntasks", "3", "--kill-on-bad-exit=1"]
    probe = slurm.run(*srun, "sh", "-c", 'echo "$SLURM_PROCID $PMI_RANK $PMI_SIZE"', timeout=120)
    assert probe.returncode == 0, probe.stderr + slurm.log()
    assert sorted(probe.stdout.splitlines()) == ["0 0 3", "1 1 3", "2 2 3"]
    train = _srun_train(tiny_model, sample_images)
    env = {**slurm.env, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    ranks = subprocess.run([*srun, *train, "--train-batch-size", "1", "--output-dir", str(tmp_path / "pmi2")],
                           capture_output=True, text=True, timeout=600, env=env)
    assert ranks.returncode == 0, ranks.stdout[-2000:] + ranks.stderr[-3000:]
    assert json.loads((tmp_path / "pmi2" / "train_config.json").read_text())["world_size"] == 3
    assert_same_vectors(tmp_path / "pmi2", _srun_straight(references, slurm, train))
    assert slurm.jobs() == []


# --- `--provider slurm`: xeontune submits the batch job itself ----------------------------------

def _options(tiny_model, sample_images, out: Path | None, steps: int = 2, resolution: int = 32) -> list[str]:
    """`--` and the training options (``out`` None: no --output-dir)."""
    return ["--", "--model", str(tiny_model), "--data-dir", str(sample_images), "--placeholder-token", "<toy-bot>",
            "--initializer-token", "toy", "--resolution", str(resolution), "--max-train-steps", str(steps),
            "--checkpointing-steps", "0", "--save-steps", "0", "--mixed-precision", "fp32", "--no-random-flip",
            *(["--output-dir", str(out)] if out else [])]


def _straight(references: References, tiny_model, sample_images, steps: int) -> Path:
    """The requeue and preemption tests' reference: one process with 3x the batch, the same steps."""
    return references.train([sys.executable, "-m", "xeontune.cli", "train", "--train-batch-size", "3",
                             *_options(tiny_model, sample_images, None, steps)[1:]])


@pytest.fixture
def on_slurm(slurm, xeontune_home, monkeypatch, tmp_path):
    """The CLI in this process, talking to the test's Slurm; tasks share the machine's 2 cores."""
    monkeypatch.setenv("SLURM_CONF", slurm.env["SLURM_CONF"])
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.chdir(tmp_path)
    yield slurm
    # A test that failed with its job running must not hold the module's three nodes: every test after
    # it would wait behind that job and fail too (seen once: a 100000-step job ran on for 26 minutes).
    left = slurm.jobs(settle_s=5)
    if left:
        slurm.run("scancel", "--full", "--quiet", *left)
        deadline = time.monotonic() + 60
        while slurm.jobs(settle_s=5) and time.monotonic() < deadline:
            time.sleep(0.5)


def _error_line(capsys) -> str:
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


def test_run_without_sbatch_on_path_is_one_line(xeontune_home, monkeypatch, tmp_path, capsys, sample_images):
    from xeontune.cli import main

    monkeypatch.setenv("PATH", str(tmp_path))
    assert main(["run", "--provider", "slurm", "-n", "3", "--", "--model", "org/m", "--placeholder-token", "<t>",
                 "--initializer-token", "toy", "--data-dir", str(sample_images), "--output-dir",
                 str(tmp_path / "out")]) == 2
    assert "no sbatch on PATH" in _error_line(capsys)


def test_launch_on_a_slurm_cluster_without_sbatch_here_is_one_line_and_records_no_job(xeontune_home, monkeypatch,
                                                                                       tmp_path, capsys):
    """The engine's preflight: checked before the job is recorded or its script written."""
    from xeontune.cli import main
    from xeontune.cluster import state
    from xeontune.job import record

    state.save(state.ClusterRecord(name="hpc", provider="slurm", cores_per_node=1,
                                   extra={"partition": "debug", "nodes": "3", "cpus_per_node": "1"}))
    monkeypatch.setenv("PATH", str(tmp_path))
    assert main(["launch", "--name", "hpc", "-n", "3", "--", "--model", "org/m", "--placeholder-token", "<t>",
                 "--initializer-token", "toy", "--data-dir", str(tmp_path), "--output-dir",
                 str(tmp_path / "out")]) == 2
    assert "no sbatch on PATH" in _error_line(capsys)
    assert not record.record_path("hpc").exists()


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
                                                                capsys, references):
    """One batch job, one srun task per rank: the 3-rank result equals one process with 3x the batch
    (fp32), as in the hand-written script's test above; the outputs are written in place, the record is gone."""
    from xeontune.cli import main
    from xeontune.cluster import state

    out = tmp_path / "out"
    rc = main(["run", "--provider", "slurm", "-n", "3", "--ppn", "auto", "--name", "sl", "--time", "10:00",
               *_options(tiny_model, sample_images, out)])
    text = capsys.readouterr()
    assert rc == 0, text.out[-3000:] + text.err[-3000:] + on_slurm.log()
    assert "submitted slurm job" in text.out and "3 rank(s), 1 per node" in text.out  # auto: 1 CPU a node
    assert json.loads((out / "train_config.json").read_text())["world_size"] == 3
    # the file holds the placeholder's vector, as one process with the 3 ranks' batches together learns
    # it (and that reference moved from its initializer: not two runs that learned nothing)
    assert list(load_file(str(out / EMBEDS))) == ["<toy-bot>"]
    assert_same_vectors(out, _straight(references, tiny_model, sample_images, 2))
    assert on_slurm.jobs() == [] and not state.exists("sl")


@pytest.mark.slow
@pytest.mark.root
def test_run_provider_slurm_fine_tunes_the_whole_unet_with_a_sharded_optimizer_as_one_process_does(
        on_slurm, tiny_model, sample_images, tmp_path, capsys):
    """Issue 49: `--method full --shard optimizer` through Slurm unchanged: 3 srun tasks of batch 1, each
    keeping a third of AdamW's state, train the UNet one process with batch 3 trains (fp32)."""
    from xeontune.cli import main

    out = tmp_path / "out"
    rc = main(["run", "--provider", "slurm", "-n", "3", "--name", "sl-full", "--time", "10:00", "--",
               *full_args(tiny_model, sample_images, out, 1, 3, "--shard", "optimizer", "--scale-lr")])
    text = capsys.readouterr()
    assert rc == 0, text.out[-3000:] + text.err[-3000:] + on_slurm.log()
    assert json.loads((out / "train_config.json").read_text())["world_size"] == 3
    train_in_process(full_args(tiny_model, sample_images, tmp_path / "one", 3, 3, "--scale-lr"))
    assert_same_unet(out / "pipeline", tmp_path / "one" / "pipeline", tiny_model)
    assert on_slurm.jobs() == []


def _start_long_job(name: str, tiny_model, sample_images, out, slurm, capsys) -> list[int]:
    from xeontune.cli import main

    # A node still ending an earlier test's job (its slurmstepds in KillWait) may start this job's task late:
    # CI once saw two of three ranks for 120 s right after a teardown's scancel. Start on idle nodes.
    deadline = time.monotonic() + 60
    while _stepds("") and time.monotonic() < deadline:
        time.sleep(0.2)
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
    return _wait_for_ranks(out, slurm)


def _wait_for_ranks(out: Path, slurm, count: int = 3, timeout_s: float = 300) -> list[int]:
    """The pids of the job's ranks, once ``count`` of them run; on a timeout, what ran instead. (300 s: on a
    loaded 2-core CI host one node's task twice ran late: once more than 120 s, once more than 300 s after its
    siblings. Both times the listing taken at the timeout showed all three running, the late one's pid between
    theirs. `_step_children` tells, next time, what the late task waited on.)"""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and len(rank_pids(str(out))) < count:
        time.sleep(0.5)
    pids = rank_pids(str(out))
    if len(pids) < count:
        waiting = _step_children()
        assert len(pids) >= count, (
            f"ranks {pids}; tasks not yet exec'd or just exec'd:\n{waiting}\nslurmstepds {_stepds('')}; "
            f"steps {slurm.run('squeue', '--steps', '-o', '%i %j %T %N').stdout}; ranks found after this "
            f"listing {rank_pids(str(out))}; processes:\n{slurmlib.processes('slurmstepd', sys.executable)}\n"
            f"{slurm.log()}")
    return pids


def _step_children() -> str:
    """Each child of a slurmstepd: pid, state, what it sleeps on in the kernel, its command line's first
    words and its kernel stack (read as root)."""
    stepds, lines = set(), []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and (proc / "cmdline").read_bytes().startswith(b"slurmstepd: ["):
                stepds.add(proc.name)
        except OSError:
            continue
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            stat = (proc / "stat").read_text().rsplit(")", 1)[1].split()
            if stat[1] not in stepds:
                continue
            cmd = (proc / "cmdline").read_bytes().split(b"\0")[:3]
            wchan = (proc / "wchan").read_text()
            stack = (proc / "stack").read_text().replace("\n", " | ") if os.geteuid() == 0 else ""
        except (OSError, ValueError) as e:  # gone, or not text
            lines.append(f"{proc.name}: {e}")
            continue
        lines.append(f"{proc.name} ppid {stat[1]} {stat[0]} wchan {wchan} {cmd} {stack[:600]}")
    return "\n".join(lines)


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
        how, on_slurm, tiny_model, sample_images, tmp_path, capsys, references):
    """notice: SIGUSR1 to every task (what --signal=USR1@120 sends before the time limit; here scancel -s)
    makes rank 0 checkpoint, the ranks stop, and the batch script requeues the job. requeue: `scontrol
    requeue` mid-run (SIGTERM to the whole job, batch script included): rank 0 checkpoints in the grace
    time (KillWait), and Slurm requeues the job (a real preemption: below). No periodic checkpoints: the job resumes from the one the signal made."""
    from xeontune.cli import main
    from xeontune.job import record

    out, steps = tmp_path / "out", 16
    assert main(["cluster", "up", "--provider", "slurm", "-n", "3", "--name", "rq"]) == 0
    assert main(["launch", "--detach", "--name", "rq", *_options(tiny_model, sample_images, out, steps)]) == 0
    job = record.load_job("rq")
    deadline = time.monotonic() + 120
    wait_for_lines(out / "metrics.jsonl", 5, timeout_s=120)
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
    assert (f"xeontune: Slurm job {job.scheduler_id}, restart 1: resuming from {out}/checkpoint-{signalled[1]}, "
            "the newest checkpoint this job wrote") in log
    # the restarted run's forecast counts what the restart lost: at least the ~0.2+ s it waited to start again
    assert re.search(r"forecast: step \d+/16, .*; 1 restart lost about \d+ (s|min) \(waiting to start again", log)
    assert_same_vectors(out, _straight(references, tiny_model, sample_images, steps))
    assert on_slurm.jobs() == []
    assert main(["teardown", "--name", "rq"]) == 0


# The CLI's own slurm.conf (Slurm.client_env) says MessageTimeout=4: with slurmctld down, an `scontrol
# show job ID` fails after about 6 s (connect failure; 18 s with Slurm's default of 10). Before, two such
# failed looks 2 s apart ended `run`: the controller stays down long enough for that (2 x 6 + 2 = 14 s,
# asserted below from `run`'s own count), with a margin, and the job outlives the outage.
MESSAGE_TIMEOUT_S = 4
FAILED_LOOK_S = 2 * (MESSAGE_TIMEOUT_S - 1)
OUTAGE_S = 20.0


@pytest.mark.slow
@pytest.mark.root
def test_slurm_not_answering_mid_run_is_not_the_end_of_the_job(on_slurm, tiny_model, sample_images, tmp_path,
                                                                capsys, monkeypatch):
    """slurmctld stopped for real mid-run (every scontrol fails: connect failure), then started again:
    `run` follows the job through it, says so, and the job trains to its end. Before, two failing
    scontrol calls 2 s apart counted as the job gone: `run` ended and cancelled the healthy job."""
    from xeontune.cli import main
    from xeontune.cluster.providers import slurm as provider

    out, steps = tmp_path / "out", 20
    client = on_slurm.client_env(MessageTimeout=MESSAGE_TIMEOUT_S)
    monkeypatch.setenv("SLURM_CONF", client["SLURM_CONF"])
    # rank 0 waits this long before its final outputs: the job ends well after the controller is back
    monkeypatch.setenv("XEONTUNE_TEST_PAUSE", f"alone:0:{OUTAGE_S + 10:.0f}")
    seen: dict[str, object] = {}

    def outage_mid_run() -> None:
        wait_for_lines(out / "metrics.jsonl", 2, timeout_s=180)
        slurmlib.stop_controller(on_slurm)
        down = time.monotonic()
        try:
            seen["steps"] = len(lines(out / "metrics.jsonl"))
            seen["scontrol"] = subprocess.run(["scontrol", "show", "job", "-o"], capture_output=True, text=True,
                                              timeout=60, env=client).stderr
            time.sleep(max(0.0, OUTAGE_S - (time.monotonic() - down)))
        finally:
            slurmlib.start_controller(on_slurm)

    outage = threading.Thread(target=outage_mid_run, daemon=True)
    outage.start()
    rc = main(["run", "--provider", "slurm", "-n", "3", "--name", "so",
               *_options(tiny_model, sample_images, out, steps)])
    outage.join(120)
    text = capsys.readouterr()
    assert "Unable to contact slurm controller" in str(seen["scontrol"])  # Slurm said nothing, for real
    assert rc == 0, text.out[-3000:] + text.err[-3000:] + on_slurm.log()
    assert seen["steps"] < steps  # the job was training when the controller went
    assert re.search(r"Slurm did not answer about job \d+ \(.*\); following it until Slurm says it ended", text.err)
    again = re.search(r"Slurm answers again about job \d+ \(after (\d+) s\)", text.err)
    # silent from `run`'s first failed look for longer than the second look (SETTLE_S later) took to fail
    assert again and int(again[1]) >= provider.SETTLE_S + FAILED_LOOK_S, text.err[-3000:]
    assert len(lines(out / "metrics.jsonl")) == steps and load_file(str(out / EMBEDS))
    assert on_slurm.jobs() == []


@pytest.fixture
def on_preemptible_slurm(tmp_path_factory, xeontune_home, monkeypatch, tmp_path):
    """A Slurm of its own whose `urgent` partition preempts the default one's jobs (PreemptMode=REQUEUE,
    GraceTime 20 s, slurmlib.PREEMPTION), with the CLI of this process talking to it."""
    slurmlib.require_slurm()
    cluster = slurmlib.start(tmp_path_factory.mktemp("slurm-preempt"), nodes=3, preemption=True)
    monkeypatch.setenv("SLURM_CONF", cluster.env["SLURM_CONF"])
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.chdir(tmp_path)
    yield cluster
    slurmlib.stop(cluster)


@pytest.mark.slow
@pytest.mark.root
def test_a_job_preempted_by_a_higher_priority_job_requeues_and_resumes_to_a_straight_runs_vectors(
        on_preemptible_slurm, tiny_model, sample_images, tmp_path, capsys, references, monkeypatch):
    """A real preemption: a job of the `urgent` partition on the same three nodes. Slurm sends SIGTERM to
    the job's steps only; rank 0 checkpoints in the grace time, the ranks exit 143, and the batch script
    (which Slurm leaves running) requeues the job; the urgent job runs, then this one resumes from its
    checkpoint and ends with a straight run's vectors. Before: FAILED with status 143, never restarted."""
    from xeontune.cli import main
    from xeontune.job import record

    slurm = on_preemptible_slurm
    out, steps = tmp_path / "out", 16
    # rank 0 rests 1 s after each step's outputs (a step copy each step): the preemption, a scheduling pass
    # or two away, lands mid-run; without it CI's 0.08 s steps ended the job first (COMPLETED, never preempted)
    monkeypatch.setenv("XEONTUNE_TEST_PAUSE", "alone:0:1")
    options = [*_options(tiny_model, sample_images, out, steps), "--save-steps", "1"]  # the last one counts
    assert main(["cluster", "up", "--provider", "slurm", "-n", "3", "--name", "pe"]) == 0
    assert main(["launch", "--detach", "--name", "pe", *options]) == 0
    job = record.load_job("pe")
    wait_for_lines(out / "metrics.jsonl", 5, timeout_s=120)
    urgent = slurm.run("sbatch", "--parsable", "--partition", "urgent", "--nodes", "3", "--ntasks", "3",
                       "--output", str(tmp_path / "urgent.out"), "--wrap", "echo urgent ran on $SLURM_JOB_NODELIST")
    assert urgent.returncode == 0, urgent.stderr
    urgent_id = urgent.stdout.strip().split(";")[0]
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and slurm.run("squeue", "-h", "-j", urgent_id).stdout.strip():
        time.sleep(0.2)
    assert (tmp_path / "urgent.out").read_text().startswith("urgent ran on n[1-3]")
    # requeued, not ended: Slurm 22.05 holds it for about 120 s (Reason=BeginTime); release it once the
    # first run's slurmstepds are gone
    shown = slurm.run("scontrol", "show", "job", "-o", job.scheduler_id).stdout
    assert "JobState=PENDING" in shown and "Reason=BeginTime" in shown, shown + Path(job.log_path).read_text()[-3000:]
    while time.monotonic() < deadline and _stepds(job.scheduler_id):
        time.sleep(0.2)
    assert slurm.run("scontrol", "update", f"JobId={job.scheduler_id}", "StartTime=now").returncode == 0
    capsys.readouterr()
    assert main(["logs", "--name", "pe", "-f"]) == 0, slurm.log()
    log = capsys.readouterr().out
    signalled = re.search(r"checkpoint-(\d+) written on SIGTERM: stopped, to resume from it", log)
    assert signalled and 5 <= int(signalled[1]) < steps, log[-3000:]
    assert re.search(rf"xeontune: preempted by Slurm \(srun ended with status \d+\); requeueing job {job.scheduler_id}",
                     log), log[-3000:]
    assert (f"xeontune: Slurm job {job.scheduler_id}, restart 1: resuming from {out}/checkpoint-{signalled[1]}, "
            "the newest checkpoint this job wrote") in log
    assert_same_vectors(out, _straight(references, tiny_model, sample_images, steps))
    assert slurm.jobs() == []
    assert main(["teardown", "--name", "pe"]) == 0


@pytest.mark.slow
@pytest.mark.root
def test_the_env_file_of_a_cancelled_job_is_deleted_once_slurm_says_it_ended(on_slurm, tiny_model, sample_images,
                                                                             tmp_path, capsys):
    """`launch --env` values wait in a 0600 file on the shared filesystem, which every (re)start of the
    batch script reads: the ranks get them; once Slurm says the job ended (here: scancel), it is gone."""
    from xeontune.cli import main
    from xeontune.job import record

    out = tmp_path / "out"
    assert main(["cluster", "up", "--provider", "slurm", "-n", "3", "--name", "ev"]) == 0
    assert main(["launch", "--detach", "--name", "ev", "--env", "XT_SECRET=s3cret",
                 *_options(tiny_model, sample_images, out, 100000)]) == 0
    job = record.load_job("ev")
    env_file = Path(job.job_dir) / "env"
    pids = _wait_for_ranks(out, on_slurm, count=1)  # one rank's environment tells; a late one is cancelled too
    assert env_file.exists(), on_slurm.log()
    environ, deadline = b"", time.monotonic() + 30
    while not environ and time.monotonic() < deadline:  # it reads empty while a rank execs itself anew (tcmalloc)
        environ = Path(f"/proc/{pids[0]}/environ").read_bytes()
        time.sleep(0.1)
    assert b"XT_SECRET=s3cret" in environ
    assert on_slurm.run("scancel", job.scheduler_id).returncode == 0
    assert main(["logs", "--name", "ev", "-f"]) == 1
    assert "ended CANCELLED without an exit status" in capsys.readouterr().err
    assert not env_file.exists()
    assert main(["teardown", "--name", "ev"]) == 0


class BatchScript:
    """The batch script `launch --dry-run` prints, run by bash with an srun and an scontrol that record
    their arguments (srun exits with ``srun_rc``, after leaving the ranks' notice mark if asked;
    ``scontrol show job`` answers ``job``, ``scontrol requeue`` succeeds)."""

    def __init__(self, text: str, root: Path) -> None:
        self.root, self.job_dir, bin_dir = root, root / "job", root / "bin"
        self.job_dir.mkdir()
        bin_dir.mkdir()
        self.path = root / "job.sbatch"
        self.path.write_text(text)
        q = shlex.quote
        (bin_dir / "srun").write_text(f"""#!/bin/sh
printf '%s\\n' "$@" > {q(str(root / 'srun-args'))}
printf '%s' "$XT_SECRET" > {q(str(root / 'srun-secret'))}
[ -z "$FAKE_MARK" ] || : > "$XEONTUNE_PREEMPT_MARK"
exit "${{FAKE_SRUN_RC:-0}}"
""")
        (bin_dir / "scontrol").write_text(f"""#!/bin/sh
echo "$*" >> {q(str(root / 'scontrol-args'))}
[ "$1" != show ] || printf '%s\\n' "$FAKE_JOB"
""")
        for tool in ("srun", "scontrol"):
            (bin_dir / tool).chmod(0o755)
        self.env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": "7"}

    def run(self, restarts: int = 0, srun_rc: int = 0, mark: bool = False,
            job: str = "") -> subprocess.CompletedProcess[str]:
        (self.root / "scontrol-args").unlink(missing_ok=True)
        env = {**self.env, "SLURM_RESTART_COUNT": str(restarts), "FAKE_SRUN_RC": str(srun_rc),
               "FAKE_MARK": "1" if mark else "", "FAKE_JOB": job}
        return subprocess.run(["bash", str(self.path)], env=env, capture_output=True, text=True, timeout=60)

    def srun_args(self, restarts: int = 0) -> list[str]:
        done = self.run(restarts)
        assert done.returncode == 0, done.stdout + done.stderr
        return (self.root / "srun-args").read_text().splitlines()

    def flags(self, restarts: int) -> list[str]:
        """--overwrite and every --resume-from-checkpoint with its value, in the order srun got them."""
        args = self.srun_args(restarts)
        return [a for i, a in enumerate(args) if a in ("--overwrite", "--resume-from-checkpoint")
                or (i and args[i - 1] == "--resume-from-checkpoint")]

    def scontrol_calls(self) -> list[str]:
        calls = self.root / "scontrol-args"
        return calls.read_text().splitlines() if calls.exists() else []


def _batch_script(name: str, tiny_model, sample_images, out: Path, tmp_path: Path, capsys,
                  *extra: str) -> BatchScript:
    from xeontune.cli import main
    from xeontune.cluster import state

    assert main(["cluster", "up", "--provider", "slurm", "-n", "3", "--name", name]) == 0
    capsys.readouterr()
    assert main(["launch", "--dry-run", "--name", name, *_options(tiny_model, sample_images, out), *extra]) == 0
    text = capsys.readouterr().out.split("\n", 1)[1]  # after the sbatch command line
    root = tmp_path / "script"
    root.mkdir()
    return BatchScript(text.replace(f"{state.load(name).work_dir}/jobs/<job id>", str(root / "job")), root)


def _checkpoint(out: Path, step: int, complete: bool = True, mtime: float | None = None) -> Path:
    """A checkpoint dir as the trainer leaves it (complete: with its marker); ``mtime``: written then."""
    from xeontune.train.outputs import CHECKPOINT_COMPLETE

    path = out / f"checkpoint-{step}"
    path.mkdir(parents=True)
    if complete:
        (path / CHECKPOINT_COMPLETE).write_text("{}")
    if mtime is not None:
        os.utime(path, (mtime, mtime))
    return path


@pytest.mark.slow  # a real Slurm (the module's slurm fixture): not in `make test-fast`
@pytest.mark.root
@pytest.mark.parametrize("out_name", ["out", "out [v1]*?"])
def test_a_restarted_job_resumes_its_checkpoint_or_starts_its_own_run_over(
        out_name, on_slurm, tiny_model, sample_images, tmp_path, capsys):
    """The batch script's restart branch: a requeued job resumes from the newest complete checkpoint it
    wrote; one stopped before its first checkpoint starts over (--overwrite) where this job wrote the
    run, and never resumes or overwrites another run's. An output dir named with [ ] * ? is a path,
    not a pattern (taken for one, no checkpoint was found: --overwrite, and the checkpoints went)."""
    from xeontune.cli import main

    out = tmp_path / out_name
    script = _batch_script("rs", tiny_model, sample_images, out, tmp_path, capsys)
    assert script.flags(0) == []  # the first run
    out.mkdir()
    time.sleep(0.05)
    (out / "train_config.json").write_text("{}")  # what that run wrote before it was stopped
    assert script.flags(1) == ["--overwrite"]
    four = _checkpoint(out, 4)
    _checkpoint(out, 6, complete=False)  # stopped while writing it: not a checkpoint to resume
    assert script.flags(2) == ["--resume-from-checkpoint", str(four)]
    for path in out.glob("checkpoint-*"):
        shutil.rmtree(path)
    first_start = (script.job_dir / "started").stat().st_mtime
    os.utime(out / "train_config.json", (first_start - 60, first_start - 60))  # another run's, from before
    _checkpoint(out, 9, mtime=first_start - 60)  # and its checkpoint: not this job's to resume
    assert script.flags(1) == []  # the trainer then refuses the dir, as for any run
    assert main(["teardown", "--name", "rs"]) == 0


@pytest.mark.slow  # a real Slurm (the module's slurm fixture): not in `make test-fast`
@pytest.mark.root
def test_a_restart_resumes_from_the_newest_checkpoint_not_the_one_named_at_submission(
        on_slurm, tiny_model, sample_images, tmp_path, capsys):
    """`--resume-from-checkpoint PATH` starts the job; a restart after the job wrote checkpoints of its
    own resumes from the newest of them (the last flag on the command line wins), not from PATH again."""
    from xeontune.cli import main
    from xeontune.train.options import read_options

    named = _checkpoint(tmp_path / "earlier", 2)
    out = tmp_path / "out"
    script = _batch_script("rn", tiny_model, sample_images, out, tmp_path, capsys,
                           "--resume-from-checkpoint", str(named))
    assert script.flags(0) == ["--resume-from-checkpoint", str(named)]
    out.mkdir()
    time.sleep(0.05)
    (out / "train_config.json").write_text("{}")  # this job's, with no checkpoint yet: PATH again, no --overwrite
    assert script.flags(1) == ["--resume-from-checkpoint", str(named)]
    six = _checkpoint(out, 6)
    _checkpoint(out, 8, complete=False)
    assert script.flags(2) == ["--resume-from-checkpoint", str(named), "--resume-from-checkpoint", str(six)]
    args = script.srun_args(2)
    options, _ = read_options(args[args.index("xeontune.train") + 1:])
    assert options.resume_from_checkpoint == str(six)
    assert main(["teardown", "--name", "rn"]) == 0


PREEMPTED_JOB = ("JobId=7 JobName=xeontune-x UserId=root(0) JobState=RUNNING Reason=None Requeue=1 Restarts=0 "
                 "RunTime=00:00:40 SubmitTime=2026-11-25T17:59:50 StartTime=2026-11-25T18:00:00 EndTime=Unknown "
                 "PreemptEligibleTime=2026-11-25T18:00:00 PreemptTime={} SuspendTime=None NodeList=n[1-3]")


@pytest.mark.slow  # a real Slurm (the module's slurm fixture): not in `make test-fast`
@pytest.mark.root
def test_the_script_requeues_a_preempted_job_and_no_other_failure(on_slurm, tiny_model, sample_images, tmp_path,
                                                                  capsys):
    """After srun: the ranks' notice mark, or a failed srun while Slurm says this run is being preempted
    (PreemptTime since its StartTime), requeue the job; a failure without a preemption, an earlier run's
    preemption, or a run that finished in the grace time end it with srun's status."""
    from xeontune.cli import main

    script = _batch_script("pq", tiny_model, sample_images, tmp_path / "out", tmp_path, capsys)
    rc_file = script.job_dir / "rc"

    def requeued() -> bool:
        return "requeue 7" in script.scontrol_calls()

    now = PREEMPTED_JOB.format("2026-11-25T18:00:30")
    done = script.run(srun_rc=143, job=now)
    assert requeued() and done.returncode == 0 and not rc_file.exists(), done.stdout + done.stderr
    assert "xeontune: preempted by Slurm (srun ended with status 143); requeueing job 7" in done.stdout
    assert (script.job_dir / "requeued").exists()  # `run` takes the requeue's passing FAILED for what it is
    for srun_rc, job in ((143, PREEMPTED_JOB.format("None")), (143, PREEMPTED_JOB.format("2026-11-25T17:58:00")),
                         (143, ""), (0, now)):
        done = script.run(srun_rc=srun_rc, job=job)
        assert not requeued() and done.returncode == srun_rc and rc_file.read_text() == f"{srun_rc}\n"
        assert not (script.job_dir / "requeued").exists()
    done = script.run(srun_rc=75, mark=True)  # Slurm's notice: the ranks checkpointed and left the mark
    assert requeued() and "checkpointed on Slurm's notice; requeueing job 7" in done.stdout
    assert main(["teardown", "--name", "pq"]) == 0


@pytest.mark.slow  # a real Slurm (the module's slurm fixture): not in `make test-fast`
@pytest.mark.root
def test_the_env_file_stays_for_a_requeue_and_goes_when_the_job_is_over(on_slurm, tiny_model, sample_images,
                                                                         tmp_path, capsys):
    from xeontune.cli import main

    script = _batch_script("ef", tiny_model, sample_images, tmp_path / "out", tmp_path, capsys)
    env_file = script.job_dir / "env"
    env_file.write_text("XT_SECRET=s3cret\n")  # as `launch --env XT_SECRET` writes it
    assert script.run(srun_rc=75, mark=True).returncode == 0 and "requeue 7" in script.scontrol_calls()
    assert env_file.exists()  # the requeued run reads it again
    assert script.run(restarts=1, srun_rc=1).returncode == 1
    assert (tmp_path / "script" / "srun-secret").read_text() == "s3cret" and not env_file.exists()
    assert main(["teardown", "--name", "ef"]) == 0


def _stepds(job_id: str) -> list[str]:
    """slurmstepd processes still serving job ``job_id`` (its batch script or a step; "": any job)."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            cmd = (proc / "cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        if proc.name.isdigit() and cmd.startswith(f"slurmstepd: [{job_id}." if job_id else "slurmstepd: ["):
            found.append(cmd)
    return found
