"""Full fine-tuning across a real 3-host local cluster: `run --provider local -n 3` fetching the pipeline
and the single file; the UNet wrapped in DDP (gradients all-reduced in buckets during the backward), 3
ranks of batch 1 equal to one process of batch 3 (fp32); a rank lost inside the bf16 exchange ends the job
with its last checkpoint whole. On SD1 alone: what a family changes (the
pipeline's parts, the single file's layout) is written by rank 0 as in one process, and test_full.py
checks it for every family; nothing of the cluster's path depends on the family."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from tests.cluster.clusterlib import (
    REPO,
    assert_nothing_left,
    cli,
    kill_and_time,
    stopped_on_exit,
    trainer_pids,
    trainers_left,
)
from tests.trainlib import OFFLINE, full_args, train_in_process, unet_weights
from xeontune.train import checkpoint

pytestmark = [pytest.mark.slow, pytest.mark.root]


def test_run_on_three_nodes_fetches_the_pipeline_and_the_single_file(root_home, cluster_name, tiny_model,
                                                                      sample_images, tmp_path):
    from diffusers import StableDiffusionPipeline

    model = tiny_model
    out = tmp_path / "out"
    proc = cli("run", "--provider", "local", "-n", "3", "--name", cluster_name, "--",
               *full_args(model, sample_images, out, 1, 3, "--checkpointing-steps", "3", "--scale-lr"), env=OFFLINE)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert (out / "model.safetensors").is_file() and (out / "checkpoint-3").is_dir()
    trained, base = unet_weights(out / "pipeline"), unet_weights(model)
    assert max(float((trained[k] - base[k]).abs().max()) for k in base) > 1e-4
    # 3 ranks of batch 1 train what one process of batch 3 does (fp32)
    train_in_process(full_args(model, sample_images, tmp_path / "one", 3, 3, "--scale-lr"))
    want = unet_weights(tmp_path / "one" / "pipeline")
    diff = max(float((trained[k] - want[k]).abs().max()) for k in want)
    moved = max(float((want[k] - base[k]).abs().max()) for k in want)
    scale = max(float(want[k].abs().max()) for k in want)
    assert diff <= 1e-5 * scale and moved >= 100 * 1e-5 * scale, (diff, moved, scale)
    # DDP sends the whole UNet's gradients each step (and the loss)
    unet_bytes = sum(t.numel() * t.element_size() for t in want.values())
    sent = [json.loads(line)["allreduce_bytes"] - 4 for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(sent) == 3 and all(n >= unet_bytes for n in sent), (unet_bytes, sent)
    # diffusers loads the single file, and it is the fetched folder
    single = StableDiffusionPipeline.from_single_file(str(out / "model.safetensors"), config=str(model), local_files_only=True)
    assert all(torch.equal(single.unet.state_dict()[k], v) for k, v in trained.items())
    assert_nothing_left(cluster_name)


def test_a_rank_lost_inside_the_bf16_exchange_ends_every_rank_and_keeps_the_last_checkpoint(
        local_cluster, tiny_model, sample_images, tmp_path):
    """Full fine-tuning on 3 ranks with bf16 gradients on the wire (the all-to-alls from the backward, the
    all-gathers from their callbacks, each kind on a group of its own) and a checkpoint every step: rank 1
    frozen until the others wait on it inside an exchange, then killed. The job ends non-zero within 60 s,
    no rank is left on any node, one line says so, and the newest checkpoint is whole (it loads)."""
    out = tmp_path / "out"
    argv = [sys.executable, "-m", "xeontune.cli", "launch", "-n", "3", "--name", local_cluster.name, "--",
            *full_args(tiny_model, sample_images, out, 1, 10_000, "--grad-compression", "bf16",
                       "--checkpointing-steps", "1", "--checkpoints-total-limit", "2")]
    log = tmp_path / "launch.log"
    proc = subprocess.Popen(argv, cwd=REPO, stdout=log.open("w"), stderr=subprocess.STDOUT, env={**os.environ, **OFFLINE})
    with stopped_on_exit(proc):
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and proc.poll() is None and len(checkpoint.list_checkpoints(out)) < 1:
            time.sleep(0.1)
        assert proc.poll() is None and checkpoint.list_checkpoints(out), log.read_text()[-3000:]
        victims = trainer_pids(local_cluster.nodes[1].resource_id)
        assert victims, "no training process in node1's namespace"
        for pid in victims:
            os.kill(pid, signal.SIGSTOP)
        time.sleep(3)  # the others reach the next exchange and wait on the frozen rank inside it
        assert proc.poll() is None, log.read_text()[-3000:]
        rc, took = kill_and_time(proc, victims)
    assert rc != 0 and took < 60, (rc, took, log.read_text()[-3000:])
    said = [line for line in log.read_text().splitlines() if line.startswith("the job ended with exit status")]
    assert len(said) == 1 and "the checkpoints it completed are kept" in said[0], log.read_text()[-3000:]
    left = trainers_left(local_cluster, 5)
    assert not any(left.values()), left
    step, newest = checkpoint.list_checkpoints(out)[-1]
    assert checkpoint.load(newest).step == step
    print(f"job exited {rc} {took:.1f} s after rank 1 was killed; checkpoint-{step} kept")
