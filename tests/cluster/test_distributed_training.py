"""Textual-inversion training across a real 3-host local cluster, through `xeontune launch`.

One rank per network namespace, over real sshd, Hydra mpirun and gloo, on the tiny offline model.
The equality test pins fp32 (`auto` is bf16 on an AMX Xeon, where batch 3 in one process and batch 1
on three ranks run different kernels and round differently); bf16 has its own test with a tolerance.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time

import pytest
import torch

from tests.bf16_bounds import BF16_LOSS_RTOL, BF16_VECTOR_RTOL
from tests.checks import initializer_row, load_vectors, moved_from_initializer
from tests.cluster.clusterlib import (
    REPO,
    cli,
    kill_and_time,
    stopped_on_exit,
    train_args,
    trainer_pids,
    trainers_left,
)
from tests.trainlib import OFFLINE, train_in_process

pytestmark = [pytest.mark.slow, pytest.mark.root]


def train_alone(tiny, output_dir, batch: int, steps: int, *extra: str) -> None:
    train_in_process(train_args(tiny, output_dir, batch, steps, *extra))


def launch(cluster, tiny, output_dir, batch: int, steps: int, *extra: str,
           launch_env: tuple[str, ...] = ()) -> subprocess.CompletedProcess[str]:
    env_flags = [f for pair in launch_env for f in ("--env", pair)]
    dist = cli("launch", "-n", "3", "--name", cluster.name, *env_flags, "--",
               *train_args(tiny, output_dir, batch, steps, *extra), env=OFFLINE)
    assert dist.returncode == 0, dist.stdout[-3000:] + dist.stderr[-3000:]
    return dist


def losses(output_dir) -> list[float]:
    return [json.loads(line)["loss"] for line in (output_dir / "metrics.jsonl").read_text().splitlines()]


# One 3-rank fp32 run, two tests: the one that compares it with a single process, and the straight run
# that a resume without a shared filesystem must end at. --scale-lr: equal results with one process also
# prove it counts the world size (lr x b x 3 ranks on the cluster, lr x 3b x 1 process alone). The warmup
# runs past the resume's checkpoint (step 2): the scheduler's state must cross it too.
FP32_STEPS = 4
FP32_COMMON = ("--scale-lr", "--mixed-precision", "fp32", "--lr-scheduler", "constant_with_warmup",
               "--lr-warmup-steps", "3", "--num-vectors", "2")


@pytest.fixture(scope="module")
def fp32_run(local_cluster, tiny_model, sample_images, tmp_path_factory):
    """The 3-rank run of FP32_STEPS steps (batch 1 a rank): its CompletedProcess, output dir, and seconds."""
    out = tmp_path_factory.mktemp("fp32-run") / "dist"
    start = time.monotonic()
    dist = launch(local_cluster, {"model": tiny_model, "data": sample_images}, out, 1, FP32_STEPS, *FP32_COMMON)
    return dist, out, time.monotonic() - start


def test_three_ranks_match_one_process_with_three_times_the_batch(fp32_run, tiny, tmp_path):
    b, steps = 1, FP32_STEPS
    dist, dist_dir, launch_s = fp32_run
    train_alone(tiny, tmp_path / "one", 3 * b, steps, *FP32_COMMON)

    got, want = load_vectors(dist_dir), load_vectors(tmp_path / "one")
    assert got.keys() == want.keys()
    diff = max(float((got[k] - want[k]).abs().max()) for k in got)
    assert diff <= 1e-5, f"max abs difference {diff}"
    moved = moved_from_initializer(tiny["model"], want["<cat-toy>"])
    # two runs that learned nothing agree too: the reference moved 100x the tolerance at least
    assert moved >= 100 * 1e-5, f"moved {moved:.2e} from the initializer"

    # only rank 0 logs: one metrics line per step, each with the bytes really all-reduced
    lines = [json.loads(line) for line in (dist_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == list(range(1, steps + 1))
    sent = [r["allreduce_bytes"] for r in lines]
    assert all(0 < s <= 16 * 1024 for s in sent), sent
    # every output line of the job carries its rank
    tagged = [line for line in dist.stdout.splitlines() if line.strip()]
    assert tagged and all(line.startswith("[") for line in tagged)
    print(f"3-rank launch of {steps} steps: {launch_s:.1f} s; allreduce_bytes per step: {sent}; max diff {diff:.2e} "
          f"(moved {moved:.2e} from the initializer)")


def test_sdxl_three_ranks_match_one_process_and_load_into_diffusers(local_cluster, sdxl_model, sample_images,
                                                                   tmp_path):
    """`launch -n 3` trains SDXL (both text encoders' rows all-reduced) like one process with 3x the
    batch, and writes the clip_l / clip_g file that StableDiffusionXLPipeline loads, one call per encoder."""
    from diffusers import StableDiffusionXLPipeline

    xl = {"model": sdxl_model, "data": sample_images}
    launch(local_cluster, xl, tmp_path / "dist", 1, 3, "--scale-lr", "--mixed-precision", "fp32")
    train_alone(xl, tmp_path / "one", 3, 3, "--scale-lr", "--mixed-precision", "fp32")
    got, want = load_vectors(tmp_path / "dist"), load_vectors(tmp_path / "one")
    assert sorted(got) == sorted(want) == ["clip_g", "clip_l"]
    diff = max(float((got[k] - want[k]).abs().max()) for k in got)
    # each encoder's rows moved from the initializer's ("toy") by 100x the tolerance: not two runs that
    # learned nothing (in one encoder or both)
    rows = {"clip_l": initializer_row(sdxl_model, "toy"),
            "clip_g": initializer_row(sdxl_model, "toy", "tokenizer_2", "text_encoder_2")}
    moved = {k: float((want[k] - rows[k]).abs().max()) for k in rows}
    print(f"SDXL, 3 ranks vs 1 process: max abs diff {diff:.2e}; moved from the initializer: "
          + ", ".join(f"{k} {v:.2e}" for k, v in moved.items()))
    assert diff <= 1e-5, f"max abs difference {diff}"
    assert min(moved.values()) >= 100 * 1e-5, moved
    sent = [json.loads(line)["allreduce_bytes"] for line in (tmp_path / "dist" / "metrics.jsonl").read_text().splitlines()]
    assert sent == [(32 + 64) * 4 + 4] * 3  # one row per encoder and the loss
    pipe = StableDiffusionXLPipeline.from_pretrained(str(xl["model"]))
    pipe.load_textual_inversion(got["clip_l"], token="<cat-toy>", text_encoder=pipe.text_encoder, tokenizer=pipe.tokenizer)
    pipe.load_textual_inversion(got["clip_g"], token="<cat-toy>", text_encoder=pipe.text_encoder_2,
                                tokenizer=pipe.tokenizer_2)
    for tokenizer, encoder, key in ((pipe.tokenizer, pipe.text_encoder, "clip_l"),
                                    (pipe.tokenizer_2, pipe.text_encoder_2, "clip_g")):
        row = encoder.get_input_embeddings().weight[tokenizer.convert_tokens_to_ids("<cat-toy>")]
        assert torch.equal(row, got[key][0])


# bf16 tolerances: tests/bf16_bounds.py, where they were measured


def test_three_ranks_match_one_process_in_bf16(local_cluster, tiny, tmp_path):
    """bf16 on every CPU (emulated where there is no AMX/AVX512-BF16): the same, within bf16's rounding."""
    steps = 3
    launch(local_cluster, tiny, tmp_path / "dist", 1, steps, "--mixed-precision", "bf16")
    train_alone(tiny, tmp_path / "one", 3, steps, "--mixed-precision", "bf16")
    for d in ("dist", "one"):
        assert json.loads((tmp_path / d / "train_config.json").read_text())["precision"] == "bf16"

    dist_losses, one_losses = losses(tmp_path / "dist"), losses(tmp_path / "one")
    assert len(dist_losses) == len(one_losses) == steps
    loss_rel = max(abs(a - b) / abs(b) for a, b in zip(dist_losses, one_losses, strict=True))
    init = initial_vector(tiny["model"])
    dist, one = (load_vectors(tmp_path / d)["<cat-toy>"] for d in ("dist", "one"))
    moved = float((one - init).norm())
    vector_rel = float((dist - one).norm()) / moved
    largest = float((one - init).abs().max())
    print(f"bf16, 3 ranks vs 1 process: loss rel diff {loss_rel:.2e}, vector diff {vector_rel:.3f} of the distance "
          f"moved ({moved:.2e}; the largest value moved {largest:.2e})")
    assert largest >= 100 * 1e-5  # as the fp32 tests': far above what rounding alone moves
    assert loss_rel <= BF16_LOSS_RTOL, (dist_losses, one_losses)
    assert vector_rel <= BF16_VECTOR_RTOL


def initial_vector(model):
    """The row of the initializer token ("toy") in the base model's text encoder."""
    return initializer_row(model, "toy")


def test_allreduce_stays_small_at_sd15_text_width(local_cluster, sample_images, tmp_path):
    """4 vectors at SD1.5's 768-wide text encoder: what the process group really sends per step."""
    import dataclasses

    from xeontune import models

    model = models.build_pipeline("tiny", tmp_path / "tiny-768",
                                  dims=dataclasses.replace(models.DIMS["tiny"], text_hidden=768, text_heads=12))
    tiny = {"model": model, "data": sample_images}
    dist = cli("launch", "-n", "3", "--name", local_cluster.name, "--",
               *train_args(tiny, tmp_path / "dist", 1, 2, "--num-vectors", "4"), env=OFFLINE)
    assert dist.returncode == 0, dist.stdout[-3000:] + dist.stderr[-3000:]
    lines = [json.loads(line) for line in (tmp_path / "dist" / "metrics.jsonl").read_text().splitlines()]
    sent = [r["allreduce_bytes"] for r in lines]
    assert all(4 * 768 * 4 <= s <= 16 * 1024 for s in sent), sent
    print(f"allreduce_bytes per step, 4 vectors x 768: {sent}")


def test_killing_one_rank_ends_the_job(local_cluster, tiny, tmp_path):
    out_dir = tmp_path / "run"
    argv = [sys.executable, "-m", "xeontune.cli", "launch", "-n", "3", "--name", local_cluster.name, "--",
            *train_args(tiny, out_dir, 1, 10_000)]
    log = tmp_path / "launch.log"
    proc = subprocess.Popen(argv, cwd=REPO, stdout=log.open("w"), stderr=subprocess.STDOUT,
                            env={**os.environ, **OFFLINE})
    victim_ns = local_cluster.nodes[1].resource_id
    with stopped_on_exit(proc):
        deadline = time.monotonic() + 180
        metrics = out_dir / "metrics.jsonl"
        while time.monotonic() < deadline and proc.poll() is None:
            if metrics.is_file() and metrics.read_text().count("\n") >= 1:
                break  # training is under way on every rank (step 1's all-reduce took all three)
            time.sleep(0.1)
        assert proc.poll() is None, "the job ended before the kill:\n" + log.read_text()[-3000:]
        victims = trainer_pids(victim_ns)
        assert victims, "no training process in node1's namespace"
        rc, took = kill_and_time(proc, victims)
    assert rc != 0 and took < 60
    left = trainers_left(local_cluster, 1)  # the same second as before, but done as soon as all are gone
    for name, pids in left.items():
        assert pids == [], f"processes left on {name}"
    print(f"job exited {rc} {took:.1f} s after rank 1 was killed")


def test_ranks_outwait_slow_loading_and_rank0_working_alone(local_cluster, tiny, tmp_path):
    """Waits twice the 3 s step timeout: node1 loads its model 6 s late, and rank 0 works alone for 6 s
    at the step-1 checkpoint and again at the end (as validation or saving a real pipeline does for
    minutes). The job must survive; the short timeout still guards the steps."""
    out = tmp_path / "run"
    start = time.monotonic()
    launch(local_cluster, tiny, out, 1, 2, "--dist-timeout", "3", "--checkpointing-steps", "1",
           launch_env=("XEONTUNE_TEST_PAUSE=setup:1:6,alone:0:6",))
    took = time.monotonic() - start
    assert [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()] == [1, 2]
    assert (out / "checkpoint-1" / "state.pt").is_file() and (out / "learned_embeds.safetensors").is_file()
    assert took >= 18  # the three pauses really happened
    print(f"job with 18 s of pauses under a 3 s step timeout: {took:.1f} s")


def sshd_pid(netns: str) -> int:
    out = subprocess.run(["ip", "netns", "pids", netns], capture_output=True, text=True, check=True).stdout
    for pid in out.split():
        with contextlib.suppress(OSError), open(f"/proc/{pid}/cmdline", "rb") as f:
            if b"sshd" in f.read():
                return int(pid)
    raise AssertionError(f"no sshd in {netns}")


@contextlib.contextmanager
def hidden_from_workers(cluster, path):
    """Nodes without a shared filesystem: every worker sees an empty tmpfs at ``path``.

    A node's sshd runs in a mount namespace of its own (`ip netns exec` makes one), and so does every
    rank it starts; a tmpfs mounted there hides ``path`` on that node alone. Rank 0 runs on node0."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "only-on-node0").write_text("")
    pids = [sshd_pid(node.resource_id) for node in cluster.nodes[1:]]
    mounted = []
    try:
        for pid in pids:
            assert os.readlink(f"/proc/{pid}/ns/mnt") != os.readlink("/proc/self/ns/mnt")
            subprocess.run(["nsenter", "-t", str(pid), "-m", "mount", "-t", "tmpfs", "-o", "size=16m",
                            "xeontune-test", str(path)], check=True)
            mounted.append(pid)
            seen = subprocess.run(["nsenter", "-t", str(pid), "-m", "ls", "-A", str(path)], capture_output=True,
                                  text=True, check=True).stdout
            assert seen == "", seen
        yield
    finally:
        for pid in mounted:
            subprocess.run(["nsenter", "-t", str(pid), "-m", "umount", str(path)], check=False)


def test_resume_without_a_shared_filesystem_matches_a_straight_run(local_cluster, fp32_run, tiny, tmp_path):
    """2 steps, then a resume to 4 (inside the lr warmup: its state crosses the checkpoint too), on nodes
    where only rank 0 sees the output dir, equal the straight 4 steps of fp32_run (which wrote no
    checkpoints: writing them must not change the training either)."""
    assert FP32_STEPS == 4
    common = (*FP32_COMMON, "--checkpointing-steps", "2")
    out = tmp_path / "resumed"
    with hidden_from_workers(local_cluster, out):
        launch(local_cluster, tiny, out, 1, 2, *common)
        assert (out / "checkpoint-2" / "state.pt").is_file()
        launch(local_cluster, tiny, out, 1, 4, *common, "--resume-from-checkpoint", "latest")

    got, want = load_vectors(out), load_vectors(fp32_run[1])
    at_two = torch_load_vectors(out / "checkpoint-2")
    moved = float((want["<cat-toy>"] - at_two).abs().max())
    diff = float((got["<cat-toy>"] - want["<cat-toy>"]).abs().max())
    print(f"resume on 3 ranks without a shared filesystem: max abs diff {diff:.2e} (steps 3-4 moved {moved:.2e})")
    assert moved > 1e-4
    assert diff <= 1e-6
    assert [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()] == list(range(1, 5))


def torch_load_vectors(path):
    import torch

    return torch.load(path / "state.pt", weights_only=True)["vectors"]


def test_a_resume_error_on_rank_0_ends_the_job_at_once(local_cluster, tiny, tmp_path):
    """Rank 0 alone resolves the checkpoint: its one-line error must end the job, not leave the other
    ranks waiting at a barrier with a long timeout."""
    (tmp_path / "empty").mkdir()
    start = time.monotonic()
    dist = cli("launch", "-n", "3", "--name", local_cluster.name, "--",
               *train_args(tiny, tmp_path / "empty", 1, 4, "--resume-from-checkpoint", "latest"), env=OFFLINE,
               timeout=120)
    took = time.monotonic() - start
    errors = [line for line in (dist.stdout + dist.stderr).splitlines() if "error:" in line]
    assert dist.returncode != 0 and took < 60, (took, dist.stdout[-2000:], dist.stderr[-2000:])
    assert len(errors) == 1 and "no checkpoint in" in errors[0], errors
    assert "Traceback" not in dist.stdout + dist.stderr, (dist.stdout + dist.stderr)[-3000:]
