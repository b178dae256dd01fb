"""SDXL (two text encoders) and SD2 (v-prediction) on their tiny built-in models.

As for SD1.5 (test_trainer.py), tests that compare runs for equality pin `--mixed-precision fp32`;
bf16 (emulated and slow without AMX, fine at this size) has a smoke test of its own and the 3-rank
comparison within bf16's bounds.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

from tests.bf16_bounds import BF16_LOSS_RTOL, BF16_VECTOR_RTOL
from tests.checks import initializer_row
from tests.held_out import held_out_loss as shared_held_out_loss
from tests.trainlib import train
from xeontune.errors import TrainingError, UserError
from xeontune.train import components, loop, tokens
from xeontune.train.data import SamplePlan, load_images_with_crops
from xeontune.train.images import crop_of
from xeontune.train.latent_cache import Latents
from xeontune.train.options import parse_args


@pytest.fixture
def xl_args(base_args, sdxl_model):
    return [*base_args[:1], str(sdxl_model), *base_args[2:]]


def split(vectors: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A run's vectors (clip_l | clip_g side by side) as the two encoders' rows: sdxl-tiny's are 32 and 64 wide."""
    assert vectors.shape[-1] == 32 + 64
    return vectors[:, :32], vectors[:, 32:]


# Two runs that learned nothing agree too: a comparison within ATOL counts only where the reference's
# vectors moved from their initializer by 100 times that, in each encoder.
ATOL = 1e-5
MOVED_FLOOR = 100 * ATOL


def moved_per_encoder(model, clip_l: torch.Tensor, clip_g: torch.Tensor) -> dict[str, float]:
    """The largest change of any element of each encoder's learned rows from the initializer token's
    ("toy") row in that encoder of the base ``model``."""
    rows = {"clip_l": initializer_row(model), "clip_g": initializer_row(model, "toy", "tokenizer_2", "text_encoder_2")}
    return {name: float((vectors - rows[name]).abs().max()) for name, vectors in (("clip_l", clip_l), ("clip_g", clip_g))}


# --- without training --------------------------------------------------------------------------


def test_the_family_comes_from_model_index(sdxl_model, tiny_model, tmp_path):
    assert components.pipeline_family(str(sdxl_model)).name == "sdxl"
    assert components.pipeline_family(str(tiny_model)).name == "sd"
    loaded = components.load(str(sdxl_model))
    assert loaded.family.name == "sdxl" and len(loaded.text_encoders) == 2 and len(loaded.tokenizers) == 2
    assert not any(p.requires_grad for e in loaded.text_encoders for p in e.parameters())
    broken = tmp_path / "broken"
    broken.mkdir()
    for item in sdxl_model.iterdir():
        if item.name != "text_encoder_2":
            (broken / item.name).symlink_to(item)
    with pytest.raises(UserError, match="missing: text_encoder_2"):
        components.load(str(broken))


def test_time_ids_record_the_crop_that_was_taken(tmp_path):
    """A 96x64 image in three bands (red | green | blue): --center-crop keeps the green middle. The
    recorded corner, applied to the image resized so that its short side is the resolution (SDXL's
    convention), cuts out what preprocess produced; the mirrored image's corner likewise."""
    image = Image.new("RGB", (96, 64))
    for x0, color in ((0, (255, 0, 0)), (16, (0, 255, 0)), (80, (0, 0, 255))):
        image.paste(color, (x0, 0, 96, 64))
    # texture inside the green band, so that a shifted crop differs too
    for x in range(16, 80, 4):
        image.paste((0, 255, x * 3), (x, 0, x + 2, 64))
    (tmp_path / "data").mkdir()
    image.save(tmp_path / "data" / "bands.png")

    pixels, _, crops = load_images_with_crops(tmp_path / "data", 32, center_crop=True)
    height, width, top, left, mirror_left = crops[0].tolist()
    assert (height, width, top, left, mirror_left) == (64, 96, 0, 8, 8) == crop_of(96, 64, 32, True)
    resized = torch.from_numpy(np.asarray(image.resize((48, 32), Image.BICUBIC), dtype="float32"))
    resized = resized.permute(2, 0, 1) / 127.5 - 1
    taken = resized[:, top:top + 32, left:left + 32]
    assert (taken - pixels[0]).abs().mean() < 0.05  # the same crop, resampled in another order
    assert (resized[:, :, 0:32] - pixels[0]).abs().mean() > 0.2  # the corner the crop did not take
    mirrored = resized.flip(-1)[:, top:top + 32, mirror_left:mirror_left + 32]
    assert (mirrored - pixels[0].flip(-1)).abs().mean() < 0.05
    assert crop_of(96, 64, 32, center_crop=False) == (64, 96, 0, 0, 0)  # squeezed whole: no crop
    assert crop_of(50, 80, 32, center_crop=True)[2:4] == (round(15 * 32 / 50), 0)  # portrait: cut top and bottom

    class NoVae:
        config = type("Config", (), {"scaling_factor": 0.13025})()

    latents = Latents(NoVae(), pixels, cached=False, crops=crops)
    plan = SamplePlan(seed=0, num_images=1, repeats=1, prompt_ids=torch.zeros(1, 77, dtype=torch.long),
                      latent_shape=(4, 4, 4), num_train_timesteps=1000, flip_p=0.5)
    batch = plan.batch(list(range(8)))
    assert batch.flip.any() and not batch.flip.all()
    ids = latents.time_ids(batch)
    for flip, row in zip(batch.flip.tolist(), ids.tolist(), strict=True):
        assert row == [64, 96, 0, 8 if not flip else mirror_left, 32, 32]


def test_rank_memory_counts_the_second_text_encoder(sdxl_model):
    """`--nproc-per-node auto` sizes a rank by its frozen weights: SDXL's include text_encoder_2, whose
    Linear layers are held in bf16 under bf16 (so it counts a little over half)."""
    from xeontune.train import families, ranks

    first, second = families.get("sdxl").encoders
    stored = {part: ranks._folder_bytes(sdxl_model / part) for part in ("unet", "text_encoder", "text_encoder_2", "vae")}
    assert stored["text_encoder_2"] > 0
    assert ranks.frozen_weight_bytes(str(sdxl_model), "fp32", family="sdxl") == sum(stored.values())
    without_2 = ranks.frozen_weight_bytes(str(sdxl_model), "bf16", family="sdxl") - ranks._text_encoder_bytes(
        stored["text_encoder_2"], "bf16", second.linear_share)
    assert abs(without_2 - (stored["unet"] // 2 + ranks._text_encoder_bytes(stored["text_encoder"], "bf16",
                                                                           first.linear_share) + stored["vae"])) <= 1


def test_ranks_per_node_count_sdxl_activations_and_checkpointing(sdxl_model, tiny_model, xeontune_home):
    """`launch --ppn auto` (job/spec.resolve_ppn) and `train --nproc-per-node auto` divide a node's memory
    by ranks.rank_memory: SDXL's weights (second text encoder included) and its measured activations (fp32
    twice bf16's); --gradient-checkpointing keeps 0.3x of them. Faked node: 16 cores, RAM for 2.5 SDXL ranks."""
    from xeontune import placement
    from xeontune.cluster.state import ClusterRecord, Node
    from xeontune.job import spec
    from xeontune.train import families, ranks

    GB = 10**9
    xl, sd = families.get("sdxl"), families.get("sd")
    assert placement.rank_memory_bytes(GB, xl.activation_bytes(1024, "fp32"), 1) - GB == pytest.approx(11 * GB)
    assert placement.rank_memory_bytes(GB, xl.activation_bytes(1024, "bf16"), 1) - GB == pytest.approx(5.5 * GB)
    assert placement.rank_memory_bytes(GB, xl.activation_bytes(512, "bf16"), 2) - GB == pytest.approx(2 * 5.5 / 4 * GB)
    assert placement.rank_memory_bytes(GB, xl.activation_bytes(1024, "fp32"), 1, checkpointing=True) - GB \
        == pytest.approx(0.3 * 11 * GB)
    assert placement.rank_memory_bytes(GB, sd.activation_bytes(1024, "fp32"), 1) - GB == pytest.approx(16 * GB)
    # a hub id that is not on this disk: SDXL-base's sizes once the family is known
    assert ranks.frozen_weight_bytes("org/xl", "fp32", family="sdxl") - ranks.frozen_weight_bytes("org/xl", "fp32") \
        == pytest.approx((2567e6 - 860e6) * 4 + 2780e6)

    common = ["--data-dir", ".", "--placeholder-token", "<t>", "--initializer-token", "toy", "--resolution", "1024",
              "--mixed-precision", "fp32", "--pack-weights", "off"]
    xl_opts = parse_args(["--model", str(sdxl_model), *common])
    weights = ranks.frozen_weight_bytes(str(sdxl_model), "fp32", family="sdxl")
    assert ranks.rank_memory(xl_opts, "fp32") == placement.rank_memory_bytes(weights, xl.activation_bytes(1024, "fp32"), 1)
    # the second text encoder is in them: every folder's weights at their stored size (fp32, not packed)
    folders = {part: ranks._folder_bytes(sdxl_model / part) for part in ("unet", "text_encoder", "text_encoder_2", "vae")}
    assert folders["text_encoder_2"] > 0 and weights == sum(folders.values())

    record = ClusterRecord(name="sky", provider="aws", key_path="/k/id", known_hosts_path="/k/kh", work_dir="/w",
                           iface="ens5", venv="/v", cores_per_node=16, nodes=[Node("node0", "head", "10.0.0.1")])
    record.memory_per_node = int(2.5 * ranks.rank_memory(xl_opts, "fp32") / (1 - placement.RESERVED_FRACTION))

    def ppn(model, *extra) -> int:
        return spec.resolve_ppn(record, spec.read_request(["--model", str(model), *common, *extra], "auto",
                                                          remote=True))

    assert ppn(sdxl_model) == 2  # memory decides
    assert ppn(tiny_model) == 1  # SD1.x's activation estimate at 1024 px (16 GB) is above SDXL's measured 11
    assert ppn(sdxl_model, "--gradient-checkpointing") == 8  # 0.3x the activations: the 16 cores decide (8 x 2)


# --- training ----------------------------------------------------------------------------------


@pytest.mark.slow
def test_sdxl_outputs_load_into_diffusers_in_both_encoders(xl_args, sdxl_model, tmp_path):
    """clip_l / clip_g, step copies, checkpoints, validation and the full pipeline; diffusers'
    StableDiffusionXLPipeline takes the file with one load_textual_inversion call per encoder."""
    from diffusers import StableDiffusionXLPipeline

    out = tmp_path / "out"
    result = train(xl_args + [
        "--max-train-steps", "4", "--num-vectors", "2", "--save-steps", "2", "--checkpointing-steps", "2",
        "--validation-prompt", "a photo of a <toy-bot>", "--num-validation-images", "1", "--validation-steps", "2",
        "--validation-inference-steps", "2", "--save-as-full-pipeline", "--mixed-precision", "fp32",
    ])
    clip_l, clip_g = split(result.vectors)
    embeds = load_file(str(out / "learned_embeds.safetensors"))
    assert sorted(embeds) == ["clip_g", "clip_l"]
    assert embeds["clip_l"].shape == (2, 32) and embeds["clip_g"].shape == (2, 64)
    assert torch.equal(embeds["clip_l"], clip_l) and torch.equal(embeds["clip_g"], clip_g)
    assert sorted(load_file(str(out / "learned_embeds-steps-2.safetensors"))) == ["clip_g", "clip_l"]
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-4"]
    assert sorted(p.name for p in (out / "validation").glob("*.png")) == ["step-000002-0.png", "step-000004-0.png"]
    token, vectors = tokens.load_learned_embeds(out / "learned_embeds.safetensors")
    assert token == "<toy-bot>" and torch.equal(vectors, result.vectors)
    initial = components.load(str(sdxl_model))
    toy = [initial.tokenizers[i].encode("toy", add_special_tokens=False)[0] for i in (0, 1)]
    for trained, encoder, toy_id in zip((clip_l, clip_g), initial.text_encoders, toy, strict=True):
        assert not torch.allclose(trained, encoder.get_input_embeddings().weight[toy_id].expand_as(trained))

    pipe = StableDiffusionXLPipeline.from_pretrained(str(sdxl_model))
    pipe.load_textual_inversion(embeds["clip_l"], token="<toy-bot>", text_encoder=pipe.text_encoder,
                                tokenizer=pipe.tokenizer)
    pipe.load_textual_inversion(embeds["clip_g"], token="<toy-bot>", text_encoder=pipe.text_encoder_2,
                                tokenizer=pipe.tokenizer_2)
    full = StableDiffusionXLPipeline.from_pretrained(str(out / "pipeline"))
    for loaded in (pipe, full):
        for tokenizer, encoder, want in ((loaded.tokenizer, loaded.text_encoder, clip_l),
                                         (loaded.tokenizer_2, loaded.text_encoder_2, clip_g)):
            ids = tokenizer.convert_tokens_to_ids(["<toy-bot>", "<toy-bot>_1"])
            assert tokenizer.unk_token_id not in ids
            assert torch.allclose(encoder.get_input_embeddings().weight[ids], want)
    image = pipe("a photo of a <toy-bot>", num_inference_steps=1, height=64, width=64).images[0]
    assert image.size == (64, 64)


@pytest.mark.slow
def test_sdxl_splice_matches_the_full_tables_in_both_encoders(xl_args, sdxl_model, tmp_path):
    common = xl_args + ["--max-train-steps", "4", "--num-vectors", "2", "--adam-weight-decay", "0.01",
                        "--mixed-precision", "fp32", "--learning-rate", "5e-3"]
    fast = train(common + ["--output-dir", str(tmp_path / "fast")])
    slow = train(common + ["--output-dir", str(tmp_path / "slow"), "--train-full-table", "--no-cache-latents"])
    moved = moved_per_encoder(sdxl_model, *split(slow.vectors))
    for name, a, b in zip(("clip_l", "clip_g"), split(fast.vectors), split(slow.vectors), strict=True):
        diff = (a - b).abs().max().item()
        print(f"{name}: splice vs full table max abs diff {diff:.3g} (moved {moved[name]:.3g} from the initializer)")
        assert diff <= ATOL, (name, diff)
        assert moved[name] > MOVED_FLOOR, (name, moved[name])


@pytest.mark.slow
def test_sdxl_resume_matches_a_straight_run(xl_args, tmp_path):
    common = xl_args + ["--max-train-steps", "6", "--checkpointing-steps", "3", "--lr-scheduler", "cosine",
                        "--num-vectors", "2", "--train-batch-size", "2", "--mixed-precision", "fp32"]
    straight = train(common + ["--output-dir", str(tmp_path / "a")])

    def interrupt(step, *_):
        if step == 4:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        train(common + ["--output-dir", str(tmp_path / "b")], on_step=interrupt)
    resumed = train(common + ["--output-dir", str(tmp_path / "b"), "--resume-from-checkpoint", "latest"])
    at_three = torch.load(tmp_path / "b" / "checkpoint-3" / "state.pt", weights_only=True)["vectors"]
    assert at_three.shape == straight.vectors.shape == (2, 96)
    assert (straight.vectors - at_three).abs().max().item() > 1e-4  # steps 4-6 moved both halves
    for a, b in zip(split(straight.vectors), split(resumed.vectors), strict=True):
        assert (a - b).abs().max().item() <= 1e-6


@pytest.mark.slow
def test_sdxl_three_ranks_match_one_process_with_three_times_the_batch_in_bf16(xl_args, tmp_path):
    """Three ranks (torch's launcher: `--nproc-per-node` allows one rank per physical core, and CI
    machines have two) x batch 1 = one process x batch 3; each rank all-reduces both halves. bf16
    (emulated where the CPU has no bf16 kernels): within the SD1.5 bounds (tests/bf16_bounds.py). (fp32, exact:
    on a real cluster in test_distributed_training.py.)"""
    precision = "bf16"
    common = xl_args + ["--max-train-steps", "3", "--checkpointing-steps", "0", "--save-steps", "0",
                        "--mixed-precision", precision, "--scale-lr", "--learning-rate", "5e-3"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "3", "-m", "xeontune.train",
         *common, "--output-dir", str(tmp_path / "ranks"), "--train-batch-size", "1"],
        capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    one = train(common + ["--output-dir", str(tmp_path / "one"), "--train-batch-size", "3"])
    got, want = (load_file(str(tmp_path / d / "learned_embeds.safetensors")) for d in ("ranks", "one"))
    metrics = {d: [json.loads(line) for line in (tmp_path / d / "metrics.jsonl").read_text().splitlines()]
               for d in ("ranks", "one")}
    assert all(json.loads((tmp_path / d / "train_config.json").read_text())["precision"] == precision
               for d in ("ranks", "one"))
    moved = moved_per_encoder(xl_args[1], want["clip_l"], want["clip_g"])
    print(f"{precision}: the single process moved clip_l {moved['clip_l']:.3g}, clip_g {moved['clip_g']:.3g} from "
          "the initializer")
    assert min(moved.values()) > MOVED_FLOOR, moved  # in bf16 too: far above what rounding alone moves
    losses = [(a["loss"], b["loss"]) for a, b in zip(metrics["ranks"], metrics["one"], strict=True)]
    assert len(losses) == 3
    loss_rel = max(abs(a - b) / abs(b) for a, b in losses)
    opts = parse_args(xl_args + ["--mixed-precision", "bf16"])
    initial = dict(zip(("clip_l", "clip_g"), split(loop.setup(opts, loop.make_accelerator(opts))[0]
                                                   .embedding.learned()), strict=True))
    for name in ("clip_l", "clip_g"):
        distance = float((want[name] - initial[name]).norm())
        vector_rel = float((got[name] - want[name]).norm()) / distance
        print(f"bf16 {name}: 3 ranks vs 1 process: loss rel diff {loss_rel:.2e}, vector diff {vector_rel:.3f} "
              "of the distance moved")
        assert vector_rel <= BF16_VECTOR_RTOL, (name, vector_rel)
    assert loss_rel <= BF16_LOSS_RTOL, losses
    assert one.vectors.shape == (1, 96)
    sent = [line["allreduce_bytes"] for line in metrics["ranks"]]
    assert sent == [(32 + 64) * 4 + 4] * 3  # one vector per encoder, plus the loss: kilobytes, not tables


def held_out_loss(run, vectors: torch.Tensor) -> float:
    """The denoising loss of placeholder prompts on (image, noise, timestep) triples never trained on,
    against the scheduler's own target (noise, or velocity for v-prediction)."""
    run.embedding.load_learned(vectors)
    return shared_held_out_loss(run)


# Held-out loss drops, measured (fp32; the tiny models' random UNets hardly listen to their text, so the
# loss moves little): sdxl 1.15177 -> 1.15095 (8.2e-4 lower) with 40 steps x 4 at lr 5e-3, while moving
# the vectors as far in random directions changed it by up to 1.7e-4; sd2 0.51675 -> 0.51569 (1.06e-3)
# with 100 x 4 at lr 0.01, random moves up to 2.8e-4. sdxl's earlier 40 x 2 at lr 0.02 lowered it by
# only 3.9e-4 against 2.1e-4 by chance. Each bound is about half the drop measured, and above twice chance.
MIN_DROP = {"sdxl": 4e-4, "sd2": 5e-4}


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["sdxl", "sd2"])
def test_it_really_learns(base_args, sdxl_model, sd2_model, tmp_path, kind):
    model = {"sdxl": sdxl_model, "sd2": sd2_model}[kind]
    # v-prediction on a random UNet: the text moves the velocity loss less than the noise loss, so SD2
    # gets more steps (40 x 2 at lr 0.02 left its held-out loss where it was)
    schedule = ["40", "0.005", "4"] if kind == "sdxl" else ["100", "0.01", "4"]
    args = [*base_args[:1], str(model), *base_args[2:]] + [
        "--max-train-steps", schedule[0], "--learning-rate", schedule[1], "--train-batch-size", schedule[2],
        "--checkpointing-steps", "0", "--save-steps", "0", "--mixed-precision", "fp32"]
    result = train(args)
    opts = parse_args(args + ["--output-dir", str(tmp_path / "eval"), "--max-train-steps", "1"])
    run, _ = loop.setup(opts, loop.make_accelerator(opts))
    assert run.components.noise_scheduler.config.prediction_type == (
        "v_prediction" if kind == "sd2" else "epsilon")
    initial = run.embedding.learned()
    before, after = held_out_loss(run, initial), held_out_loss(run, result.vectors)
    # the control: the same distance moved in random directions
    generator, step = torch.Generator().manual_seed(0), result.vectors - initial
    directions = [torch.randn(step.shape, generator=generator) for _ in range(3)]
    chance = max(abs(held_out_loss(run, initial + d * step.norm() / d.norm()) - before) for d in directions)
    print(f"{kind}: held-out loss {before:.6f} -> {after:.6f} (lower by {before - after:.3g}; a random move of "
          f"that size: {chance:.3g}; moved {step.abs().max().item():.3g})")
    assert before - after >= MIN_DROP[kind], f"learned vectors lowered the held-out loss by {before - after:.3g} " \
        f"({before:.6f} -> {after:.6f}), less than {MIN_DROP[kind]:g}"
    assert before - after > 2 * chance, f"lowered by {before - after:.3g}, and by chance up to {chance:.3g}"


@pytest.mark.slow
def test_sdxl_bf16_trains_with_both_encoders_linears_mapped_from_bf16_copies(xl_args, sdxl_model, tmp_path, monkeypatch):
    monkeypatch.setenv(components.BF16_CACHE_ENV, str(tmp_path / "cache"))
    components.ensure_bf16_copies(str(sdxl_model))  # what the rank launcher runs before the ranks
    copy = components.bf16_copy_dir(str(sdxl_model), None, None, "text_encoder_2") / components.TEXT_LINEARS_FILE
    assert copy.is_file()
    opts = parse_args(xl_args + ["--mixed-precision", "bf16", "--max-train-steps", "2", "--num-vectors", "2"])
    run, _ = loop.setup(opts, loop.make_accelerator(opts))
    assert str(copy.resolve()) in Path("/proc/self/maps").read_text()  # mapped, not converted in this process
    encoder_2 = dict(run.components.text_encoder_2.named_parameters())
    assert {p.dtype for n, p in encoder_2.items() if "_proj" in n or ".fc" in n} == {torch.bfloat16}
    assert {p.dtype for n, p in encoder_2.items() if "norm" in n} == {torch.float32}
    initial = run.embedding.learned()
    del run
    result = train(xl_args + ["--mixed-precision", "bf16", "--max-train-steps", "2", "--num-vectors", "2",
                              "--validation-prompt", "a <toy-bot>", "--num-validation-images", "1",
                              "--validation-inference-steps", "2", "--save-as-full-pipeline"])
    assert result.final_loss is not None and torch.isfinite(result.vectors).all()
    for moved in split(result.vectors - initial):
        assert moved.abs().max() > 1e-5
    assert (tmp_path / "out" / "validation" / "step-000002-0.png").is_file()
    # the saved pipeline holds the model's own second encoder (fp32, not the bf16 copy) plus the new rows
    from transformers import CLIPTextModelWithProjection

    original = CLIPTextModelWithProjection.from_pretrained(sdxl_model, subfolder="text_encoder_2").state_dict()
    saved = CLIPTextModelWithProjection.from_pretrained(tmp_path / "out" / "pipeline", subfolder="text_encoder_2")
    table = next(k for k in original if k.endswith("token_embedding.weight"))
    state = saved.state_dict()
    assert all(torch.equal(state[k], original[k]) and state[k].dtype == torch.float32 for k in original if k != table)
    assert torch.equal(state[table][-2:], split(result.vectors)[1])


@pytest.mark.slow
def test_a_half_precision_variant_trains_as_its_values_in_fp32(xl_args, sdxl_model, tmp_path, monkeypatch):
    """`--variant fp16` (SDXL's usual download) or a model saved in fp16: transformers 5 loads the text
    encoders in their files' dtype, and an fp16 encoder broke the step. The parts are upcast: a fp32 run
    gives the vectors of a model whose fp32 files hold the same fp16-rounded values, bit for bit; a bf16
    run saves a pipeline whose encoders are the files' fp16 ones plus the new rows."""
    from diffusers import StableDiffusionXLPipeline

    monkeypatch.setenv(components.BF16_CACHE_ENV, str(tmp_path / "cache"))
    half, rounded = tmp_path / "half", tmp_path / "rounded"
    StableDiffusionXLPipeline.from_pretrained(sdxl_model, torch_dtype=torch.float16).save_pretrained(half, variant="fp16")
    StableDiffusionXLPipeline.from_pretrained(half, variant="fp16", torch_dtype=torch.float32).save_pretrained(rounded)
    assert not [f for f in half.rglob("*.safetensors") if ".fp16." not in f.name]  # only the variant's files
    with pytest.raises(UserError, match="add --variant fp16"):  # forgotten: the error says what to add
        train(xl_args + ["--model", str(half), "--output-dir", str(tmp_path / "none")])

    fp32 = xl_args + ["--mixed-precision", "fp32", "--max-train-steps", "3"]
    from_half = train(fp32 + ["--model", str(half), "--variant", "fp16", "--output-dir", str(tmp_path / "a"),
                              "--save-as-full-pipeline"])
    from_rounded = train(fp32 + ["--model", str(rounded), "--output-dir", str(tmp_path / "b")])
    assert torch.equal(from_half.vectors, from_rounded.vectors)

    out = tmp_path / "bf16"
    result = train(xl_args + ["--model", str(half), "--variant", "fp16", "--mixed-precision", "bf16",
                              "--max-train-steps", "2", "--save-as-full-pipeline", "--output-dir", str(out)])
    assert torch.isfinite(result.vectors).all()
    saved = StableDiffusionXLPipeline.from_pretrained(out / "pipeline")
    for encoder, tokenizer, want in ((saved.text_encoder, saved.tokenizer, split(result.vectors)[0]),
                                     (saved.text_encoder_2, saved.tokenizer_2, split(result.vectors)[1])):
        assert encoder.dtype == torch.float16
        row = encoder.get_input_embeddings().weight[tokenizer.convert_tokens_to_ids("<toy-bot>")]
        assert torch.equal(row, want[0].half())
    # the UNet and VAE files as the model's hold them too: fp16, not upcast to fp32 (twice the size)
    for saved_by in (out, tmp_path / "a"):  # a bf16 run and an fp32 one
        stored = {f.parent.name: components.files_dtype(str(saved_by / "pipeline"), f.parent.name, None, None)
                  for f in (saved_by / "pipeline").glob("*/diffusion_pytorch_model.safetensors")}
        assert stored == {"unet": torch.float16, "vae": torch.float16}, saved_by


@pytest.mark.slow
def test_a_broken_gradient_path_in_the_second_encoder_stops_the_run(xl_args, monkeypatch):
    original = tokens.SplicedEmbedding.forward

    def cut_in_second(self, ids):
        out = original(self, ids)
        return out.detach() + 0 * self.vectors.sum() if self.embedding_dim == 64 else out

    monkeypatch.setattr(tokens.SplicedEmbedding, "forward", cut_in_second)
    with pytest.raises(TrainingError, match="vectors of text encoder 2 received no usable gradient"):
        train(xl_args + ["--mixed-precision", "fp32", "--max-train-steps", "1"])


@pytest.mark.slow
def test_the_single_node_test_takes_an_sdxl_model(sdxl_model, sample_images, tmp_path):
    """`make single-node-test MODEL=<an SDXL pipeline>` (the README's first command with its documented
    MODEL=): it trained, then loaded the file as SD1.5's and failed with a traceback."""
    script = Path(__file__).parents[2] / "scripts" / "single_node_test.py"
    proc = subprocess.run([sys.executable, str(script), "--model", str(sdxl_model), "--data", str(sample_images),
                           "--steps", "1", "--output-dir", str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=600, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "added token(s) ['<toy-bot>']" in proc.stdout
    assert json.loads((tmp_path / "out" / "train_config.json").read_text())["resolution"] == 64  # the model's size
