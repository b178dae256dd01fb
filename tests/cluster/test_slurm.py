"""`srun xeontune train` in a user's own batch script, against a real Slurm (tests/cluster/slurmlib.py):
the trainer takes its rank, world size and master address from Slurm's environment."""

from __future__ import annotations

import shlex
import subprocess
import sys

import pytest
from safetensors.torch import load_file

from tests.cluster import slurmlib
from xeontune.train import world


def test_tasks_per_node_expands_slurms_compressed_lists():
    assert world.tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    assert world.tasks_per_node("4") == [4]
    with pytest.raises(ValueError):
        world.tasks_per_node("2(x)")


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
