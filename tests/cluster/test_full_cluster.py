"""Full fine-tuning across a real 3-host local cluster: `run --provider local -n 3` fetching the pipeline
and the single file; the UNet wrapped in DDP (gradients all-reduced in buckets during the backward), 3
ranks of batch 1 equal to one process of batch 3 (fp32). On SD1 alone: what a family changes (the
pipeline's parts, the single file's layout) is written by rank 0 as in one process, and test_full.py
checks it for every family; nothing of the cluster's path depends on the family."""

from __future__ import annotations

import json

import pytest
import torch

from tests.cluster.clusterlib import assert_nothing_left, cli
from tests.trainlib import OFFLINE, full_args, train_in_process, unet_weights

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
