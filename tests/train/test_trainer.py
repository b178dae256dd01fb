"""The trainer end to end on the tiny model: it learns, resumes exactly, and writes what it promises.

Tests that compare two runs for equality pin `--mixed-precision fp32`: `auto` is bf16 on an AMX
Xeon and fp32 elsewhere, and bf16 results depend on which kernels ran. The bf16 path has tests of
its own, with tolerances derived from bf16's precision; bf16 on the tiny model runs on every CPU
(emulated without AMX/AVX512-BF16, still fast at this size).
"""

from __future__ import annotations

import json
import types

import pytest
import torch
from safetensors.torch import load_file

from tests.checks import MOVED_MIN, run_moved_from_initializer
from tests.trainlib import ThreadRanks, train
from xeontune import hardware
from xeontune.cli import main
from xeontune.errors import TrainingError
from xeontune.train import backends, loop, tokens
from xeontune.train import packed as packed_layers
from xeontune.train.options import parse_args

pytestmark = pytest.mark.slow


# The tiny model's random UNet hardly listens to its text, so the held-out loss moves little (1.1116 from
# the initializer's row). Measured, 100 steps x batch 4 at lr 5e-3: 1.8e-3 lower in fp32 and in bf16;
# the same distance moved in random directions changed it by up to 4.4e-4 (either way). 40 steps x 2 at
# lr 0.02 (this test's schedule before) lowered it by only 6.2e-4, with random moves at 4.5e-4: too
# close to chance to call learning. The bound, 1e-3, is about half the drop measured and twice chance.
MIN_DROP = 1e-3


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_it_really_learns(base_args, tmp_path, precision):
    """Denoising loss of placeholder prompts on held-out (image, noise, timestep) triples goes down by
    MIN_DROP at least, and by more than twice what moving the vectors as far in random directions does.

    Trained in `precision`; the held-out loss is measured in fp32 for both, so the two are judged alike."""
    args = base_args + ["--max-train-steps", "100", "--learning-rate", "0.005", "--train-batch-size", "4",
                        "--checkpointing-steps", "0", "--save-steps", "0", "--mixed-precision", precision]
    result = train(args)
    config = json.loads((tmp_path / "out" / "train_config.json").read_text())
    assert config["precision"] == precision

    opts = parse_args(args + ["--output-dir", str(tmp_path / "eval"), "--max-train-steps", "1",
                              "--mixed-precision", "fp32"])
    accelerator = loop.make_accelerator(opts)
    run, _ = loop.setup(opts, accelerator)
    initial = run.embedding.learned()
    fixed = list(range(10_000, 10_048))  # sample positions the run never trained on

    @torch.no_grad()
    def mean_loss(vecs):
        run.embedding.load_learned(vecs)
        losses = []
        for start in range(0, len(fixed), 8):
            batch = run.plan.batch(fixed[start:start + 8])
            latents = run.latents.sample(batch)
            noisy = run.components.noise_scheduler.add_noise(latents, batch.noise, batch.timesteps)
            hidden = run.components.text_encoder(batch.input_ids)[0]
            pred = run.components.denoiser(noisy, batch.timesteps, hidden).sample
            losses.append(torch.nn.functional.mse_loss(pred, batch.noise))
        return float(torch.stack(losses).mean())

    before, after = mean_loss(initial), mean_loss(result.vectors)
    moved = (result.vectors - initial).abs().max().item()
    # the control: the same distance moved in random directions changes the held-out loss by this much
    generator, step = torch.Generator().manual_seed(0), result.vectors - initial
    directions = [torch.randn(step.shape, generator=generator) for _ in range(3)]
    chance = max(abs(mean_loss(initial + d * step.norm() / d.norm()) - before) for d in directions)
    print(f"{precision}: held-out loss {before:.6f} -> {after:.6f} (lower by {before - after:.3g}, "
          f"{(before - after) / before:.3%}; a random move of that size: {chance:.3g}; moved {moved:.3g})")
    assert moved > MOVED_MIN
    assert before - after >= MIN_DROP, f"learned vectors lowered the held-out loss by {before - after:.3g} " \
        f"({before:.6f} -> {after:.6f}), less than {MIN_DROP:g}"
    assert before - after > 2 * chance, f"lowered by {before - after:.3g}, and by chance up to {chance:.3g}"


# bf16 resume: the resumed steps run the same kernels on the same shapes as the straight run, so the
# vectors should agree far inside bf16's own resolution. The bound is 4 bf16 rounding steps (2**-8
# each) of what steps 7-10 moved the vectors: a resume that restored another state (optimizer
# moments, data position, schedule) is off by a whole step's worth, well above it.
BF16_EPS = 2.0**-8


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_resume_matches_a_straight_run(base_args, tmp_path, precision):
    common = base_args + ["--max-train-steps", "10", "--checkpointing-steps", "3", "--lr-scheduler", "cosine",
                          "--lr-warmup-steps", "2", "--num-vectors", "2", "--train-batch-size", "2",
                          "--mixed-precision", precision]
    straight = train(common + ["--output-dir", str(tmp_path / "a")])

    def interrupt(step, *_):
        if step == 7:  # after checkpoint-6 was written, before step 7's outputs
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        train(common + ["--output-dir", str(tmp_path / "b")], on_step=interrupt)
    assert sorted(p.name for p in (tmp_path / "b").glob("checkpoint-*")) == ["checkpoint-3", "checkpoint-6"]
    resumed = train(common + ["--output-dir", str(tmp_path / "b"), "--resume-from-checkpoint", "latest"])

    at_six = torch.load(tmp_path / "b" / "checkpoint-6" / "state.pt", weights_only=False)["vectors"]
    moved = (straight.vectors - at_six).abs().max().item()  # what steps 7-10 did
    assert moved > 1e-4  # lr 5e-4 moves each element by about that much per step
    diff = (straight.vectors - resumed.vectors).abs().max().item()
    limit = 1e-6 if precision == "fp32" else 4 * BF16_EPS * moved
    print(f"{precision} resume: max abs diff {diff:.3g} (limit {limit:.3g}; steps 7-10 moved {moved:.3g})")
    assert diff <= limit, (diff, limit)
    steps = [json.loads(line)["step"] for line in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 11))


def test_outputs_and_formats(base_args, tmp_path):
    from diffusers import StableDiffusionPipeline

    out = tmp_path / "out"
    result = train(base_args + [
        "--max-train-steps", "4", "--num-vectors", "3", "--save-steps", "2", "--checkpointing-steps", "2",
        "--checkpoints-total-limit", "1", "--validation-prompt", "a photo of a <toy-bot>",
        "--num-validation-images", "2", "--validation-steps", "2", "--validation-inference-steps", "2",
        "--save-as-full-pipeline", "--report-to", "tensorboard",
    ])
    embeds = load_file(str(out / "learned_embeds.safetensors"))
    assert list(embeds) == ["<toy-bot>"] and embeds["<toy-bot>"].shape == (3, 32)
    assert torch.equal(embeds["<toy-bot>"], result.vectors)
    assert (out / "learned_embeds-steps-2.safetensors").is_file()
    assert [p.name for p in out.glob("checkpoint-*")] == ["checkpoint-4"]  # limit 1 keeps the newest
    assert sorted(p.name for p in (out / "validation").glob("*.png")) == [
        "step-000002-0.png", "step-000002-1.png", "step-000004-0.png", "step-000004-1.png"]
    assert list((out / "logs").glob("events.out.tfevents.*"))
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert {"loss", "lr", "step_time_s", "images_per_s", "allreduce_bytes"} <= set(records[0])
    assert not list(out.glob(".*tmp"))  # no temporary file left behind

    # diffusers' own loader takes the file and adds every vector's token
    pipe = StableDiffusionPipeline.from_pretrained(base_args[1], safety_checker=None)
    pipe.load_textual_inversion(str(out / "learned_embeds.safetensors"))
    assert {"<toy-bot>", "<toy-bot>_1", "<toy-bot>_2"} <= set(pipe.tokenizer.get_vocab())
    ids = pipe.tokenizer.convert_tokens_to_ids(["<toy-bot>", "<toy-bot>_1", "<toy-bot>_2"])
    assert torch.allclose(pipe.text_encoder.get_input_embeddings().weight[ids], result.vectors)

    # the full pipeline carries the token and its vectors
    full = StableDiffusionPipeline.from_pretrained(str(out / "pipeline"), safety_checker=None)
    ids = full.tokenizer.convert_tokens_to_ids(["<toy-bot>", "<toy-bot>_1", "<toy-bot>_2"])
    assert torch.allclose(full.text_encoder.get_input_embeddings().weight[ids], result.vectors)


def test_a1111_format_loads_with_a_token_name(base_args, tmp_path):
    from diffusers import StableDiffusionPipeline

    result = train(base_args + ["--save-format", "a1111", "--num-vectors", "2"])
    path = tmp_path / "out" / "learned_embeds.safetensors"
    token, vecs = tokens.load_learned_embeds(path)
    assert token == "<toy-bot>" and torch.equal(vecs, result.vectors)
    pipe = StableDiffusionPipeline.from_pretrained(base_args[1], safety_checker=None)
    pipe.load_textual_inversion(str(path), token="<toy-bot>")
    assert "<toy-bot>_1" in pipe.tokenizer.get_vocab()


def test_splice_matches_the_example_scripts_full_table(base_args, tmp_path):
    """Same math as the example script's approach (whole table trainable, rows restored, VAE every step).
    lr 5e-3 (10x the default): the vectors move about 2e-2, far above the 100x the tolerance they must."""
    common = base_args + ["--max-train-steps", "4", "--num-vectors", "2", "--adam-weight-decay", "0.01",
                          "--mixed-precision", "fp32", "--learning-rate", "5e-3"]
    fast = train(common + ["--output-dir", str(tmp_path / "fast")])
    slow = train(common + ["--output-dir", str(tmp_path / "slow"), "--train-full-table", "--no-cache-latents"])
    diff = (fast.vectors - slow.vectors).abs().max().item()
    moved = run_moved_from_initializer(tmp_path / "slow")  # two runs that learned nothing would agree too
    print(f"splice vs full table: max abs diff {diff:.3g} (moved {moved:.3g} from the initializer)")
    assert diff <= 1e-5
    assert moved >= 100 * 1e-5, f"the reference moved {moved:.3g} from its initializer: too little to compare"


def test_scale_lr_counts_batch_and_accumulation(base_args, tmp_path):
    train(base_args + ["--scale-lr", "--train-batch-size", "2", "--gradient-accumulation-steps", "3",
                       "--learning-rate", "0.001", "--max-train-steps", "1"])
    record = json.loads((tmp_path / "out" / "metrics.jsonl").read_text().splitlines()[0])
    assert record["lr"] == pytest.approx(0.006)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_broken_gradient_path_stops_the_run(base_args, tmp_path, monkeypatch, capsys, precision):
    """If a backend cuts the gradient to the vectors (IPEX prepacking did), stop at once with exit 1. The
    message names IPEX only where IPEX optimized the frozen models (this venv has no IPEX)."""
    assert hardware.ipex_version() is None
    original = tokens.SplicedEmbedding.forward
    monkeypatch.setattr(tokens.SplicedEmbedding, "forward", lambda self, ids: original(self, ids).detach() + 0 * self.vectors.sum())
    args = base_args + ["--mixed-precision", precision]
    assert main(["train", *args]) == 1
    err = capsys.readouterr().err
    assert "received no usable gradient" in err and "ipex" not in err.lower()  # IPEX did not run: not named
    monkeypatch.setattr(backends, "ipex_applied", lambda notes: True)  # as where IPEX optimized the UNet
    assert main(["train", *args, "--output-dir", str(tmp_path / "on")]) == 1
    assert "Try --ipex off" in capsys.readouterr().err
    with pytest.raises(TrainingError):
        train(args + ["--output-dir", str(tmp_path / "again")])


# Validation images against diffusers' own pipeline, measured on the tiny model (pixel levels, 0-255, on
# an AVX2-only CPU): the fp32 run's image differs from it by a mean of 0.00 and at most 1 level (8-bit
# rounding of the same float image), the bf16 run's by a mean of 1.25 and at most 9 (its bf16 UNet's
# rounding, emulated there); the image of another seed (other noise) by a mean of 56.6. The bounds leave
# bf16 4x its mean (other kernels round otherwise) and stay far below another image's.
VALIDATION_LEVELS = {"fp32": (0.5, 2), "bf16": (5.0, 48)}  # (mean, max) absolute difference


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_validation_without_the_vae_encoder(base_args, tmp_path, precision):
    """With latents cached the encoder is freed; validation still decodes its sample images (in bf16
    with the UNet loaded in bf16): PNGs of the resolution, not one colour, and the last one the image
    diffusers' own pipeline draws from the base model with the saved vectors loaded (same prompt,
    scheduler, seed and steps), not an image of other noise."""
    import numpy as np
    from diffusers import DPMSolverMultistepScheduler, StableDiffusionPipeline
    from PIL import Image

    prompt = "a <toy-bot> on a table"
    train(base_args + ["--mixed-precision", precision, "--max-train-steps", "2", "--validation-prompt", prompt,
                       "--num-validation-images", "1", "--validation-steps", "1", "--validation-inference-steps", "2"])
    out = tmp_path / "out"
    names = sorted(p.name for p in (out / "validation").glob("*.png"))
    assert names == ["step-000001-0.png", "step-000002-0.png"]
    pixels = {}
    for name in names:
        with Image.open(out / "validation" / name) as image:
            image.load()  # decodes: a whole PNG
            assert image.size == (64, 64) and image.mode == "RGB", (name, image.size, image.mode)
            assert image.text["prompt"] == prompt
            pixels[name] = np.asarray(image, dtype=np.int16)
        assert pixels[name].std() > 5, (name, pixels[name].std())  # not one colour

    pipe = StableDiffusionPipeline.from_pretrained(base_args[1], safety_checker=None)
    pipe.scheduler = DPMSolverMultistepScheduler.from_config(pipe.scheduler.config)
    pipe.load_textual_inversion(str(out / "learned_embeds.safetensors"))
    pipe.set_progress_bar_config(disable=True)

    def drawn(seed: int):
        image = pipe(prompt, num_inference_steps=2, height=64, width=64,
                     generator=torch.Generator().manual_seed(seed)).images[0]
        return np.asarray(image, dtype=np.int16)

    want, other = drawn(0), drawn(1)  # --seed 0, the trainer's default; another seed's noise
    diff, other_diff = np.abs(pixels["step-000002-0.png"] - want), np.abs(other - want)
    mean_bound, max_bound = VALIDATION_LEVELS[precision]
    print(f"{precision}: step 2's image vs diffusers' pipeline: mean {diff.mean():.2f}, max {diff.max()} levels "
          f"(another seed's image: mean {other_diff.mean():.1f})")
    assert diff.mean() <= mean_bound and diff.max() <= max_bound, (diff.mean(), diff.max())
    assert other_diff.mean() > 5 * mean_bound, other_diff.mean()  # the bounds tell images apart


def test_bf16_trains_on_bf16_frozen_weights_but_saves_the_originals(base_args, tmp_path):
    """bf16 loads the frozen UNet in bf16 once and casts the text encoder's Linear layers; a saved
    full pipeline still holds the model's own UNet and text encoder (plus the learned rows)."""
    from diffusers import UNet2DConditionModel
    from transformers import CLIPTextModel

    opts = parse_args(base_args + ["--mixed-precision", "bf16"])
    run, _ = loop.setup(opts, loop.make_accelerator(opts))
    assert {p.dtype for p in run.components.denoiser.parameters()} == {torch.bfloat16}
    text_dtypes = {name: p.dtype for name, p in run.components.text_encoder.named_parameters()}
    assert {d for n, d in text_dtypes.items() if "_proj" in n or ".fc" in n} == {torch.bfloat16}
    assert {d for n, d in text_dtypes.items() if "norm" in n or "embedding" in n} == {torch.float32}

    train(base_args + ["--mixed-precision", "bf16", "--save-as-full-pipeline", "--max-train-steps", "1"])
    original = UNet2DConditionModel.from_pretrained(base_args[1], subfolder="unet").state_dict()
    saved = UNet2DConditionModel.from_pretrained(tmp_path / "out" / "pipeline", subfolder="unet").state_dict()
    assert saved.keys() == original.keys()
    assert all(saved[k].dtype == original[k].dtype and torch.equal(saved[k], original[k]) for k in saved)
    original = CLIPTextModel.from_pretrained(base_args[1], subfolder="text_encoder").state_dict()
    saved = CLIPTextModel.from_pretrained(tmp_path / "out" / "pipeline", subfolder="text_encoder").state_dict()
    table = "embeddings.token_embedding.weight"
    assert saved.keys() == original.keys()
    assert all(saved[k].dtype == original[k].dtype == torch.float32 and torch.equal(saved[k], original[k])
               for k in saved if k != table)
    rows = original[table].shape[0]
    assert torch.equal(saved[table][:rows], original[table]) and saved[table].shape[0] == rows + 1


def test_bf16_text_encoder_linears_compute_what_autocast_did(tiny_model):
    """Casting the frozen text encoder's Linear layers to bf16 once gives, under bf16 autocast, the
    same hidden states and the same gradient to the trained rows, bit for bit, as fp32 weights that
    autocast casts at every step: the cast is only saved, not changed."""
    from xeontune.train import components

    def hidden_and_grad(cast: bool):
        loaded = components.load(str(tiny_model))
        if cast:
            components.cast_text_encoder_linears(loaded, torch.bfloat16)
        table = loaded.text_encoder.get_input_embeddings().weight
        table.requires_grad_(True)
        ids = torch.tensor([[0, 5, 17, 3, 1] + [2] * 11])
        with torch.autocast("cpu", dtype=torch.bfloat16):
            hidden = loaded.text_encoder(ids)[0]
        (hidden.float() ** 2).mean().backward()
        return hidden.detach(), table.grad[[5, 17]].clone()

    (h32, g32), (h16, g16) = hidden_and_grad(False), hidden_and_grad(True)
    assert g32.abs().sum() > 0
    assert torch.equal(h16, h32) and torch.equal(g16, g32)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_packed_weights_train_what_the_stock_layers_train(base_args, tmp_path, precision):
    """`--pack-weights on` runs the UNet's layers on reordered weights (its forward and backward as
    forward kernels). In fp32 the vectors it learns match the stock layers' up to summation order; in
    bf16 they are as close to the fp32 run's as the stock bf16 layers' are (bf16 kernels round
    differently, so bf16 runs differ from each other by about what bf16 costs)."""
    common = base_args + ["--max-train-steps", "5", "--learning-rate", "0.005", "--checkpointing-steps", "0",
                          "--save-steps", "0"]
    opts = parse_args(common + ["--mixed-precision", precision, "--pack-weights", "on"])
    if precision == "bf16" and not packed_layers.available(torch.bfloat16)[0]:
        # a CPU without oneDNN bf16 kernels (AVX2 only): forcing packing is a one-line error, checked;
        # the comparison itself cannot run here
        assert not torch.ops.mkldnn._is_mkldnn_bf16_supported()
        assert main(["train", *common, "--mixed-precision", "bf16", "--pack-weights", "on"]) == 2
        pytest.skip("no oneDNN bf16 kernels on this CPU: packed bf16 training cannot run (its one-line error did)")
    run, _ = loop.setup(opts, loop.make_accelerator(opts))
    initial = run.embedding.learned()
    kinds = {type(m).__name__ for m in run.components.denoiser.modules()}
    assert {"PackedConv2d", "PackedLinear"} <= kinds and any("packed weights" in n for n in run.backend_notes)
    del run

    def vectors(pack: str, mixed: str) -> torch.Tensor:
        out = tmp_path / f"{pack}-{mixed}"
        return train(common + ["--mixed-precision", mixed, "--pack-weights", pack, "--output-dir", str(out)]).vectors

    stock, packed = vectors("off", precision), vectors("on", precision)
    moved = (stock - initial).abs().max().item()
    assert moved > 1e-3
    if precision == "fp32":
        diff = (stock - packed).abs().max().item()
        print(f"fp32: packed vs stock max abs diff {diff:.3g} (moved {moved:.3g})")
        assert diff <= 1e-3 * moved
    else:
        exact = vectors("off", "fp32")
        stock_error, packed_error = ((v - exact).norm().item() for v in (stock, packed))
        print(f"bf16 vs fp32 run: stock {stock_error:.3g}, packed {packed_error:.3g} (moved {moved:.3g})")
        assert packed_error <= 1.5 * stock_error


def test_latents_are_cached_a_bounded_number_of_pixels_at_a_time(tiny_model):
    """Large images go through the VAE one at a time (four 1024 px images at once held gigabytes of
    fp32 activations); the cached latents do not depend on how the images were grouped."""
    from diffusers import AutoencoderKL

    from xeontune.train.latent_cache import Latents

    vae = AutoencoderKL.from_pretrained(tiny_model, subfolder="vae").eval()
    calls: list[int] = []
    encode = vae.encode
    vae.encode = lambda pixels: (calls.append(len(pixels)), encode(pixels))[1]
    pixels = torch.randn(3, 3, 64, 64, generator=torch.Generator().manual_seed(0))
    by_default = Latents(vae, pixels, cached=True)
    assert calls == [6]  # 3 images and their mirrors, 64 px: one call
    one_by_one = Latents(vae, pixels, cached=True, encode_batch=1)
    assert calls[1:] == [1] * 6
    torch.testing.assert_close(by_default.mean, one_by_one.mean, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(by_default.std, one_by_one.std, rtol=1e-5, atol=1e-6)
    assert [Latents.encode_batch(torch.empty(1, 3, side, side)) for side in (256, 512, 768, 1024)] == [4, 1, 1, 1]


def test_only_the_images_a_step_can_draw_are_encoded(tiny_model):
    """Without flips (--no-random-flip) the mirror images are never drawn, so never encoded (half the
    VAE's work before the first step); with flips always, only the mirrors. Each draws what the cache
    of both gives."""
    from diffusers import AutoencoderKL

    from xeontune.train.data import Batch
    from xeontune.train.latent_cache import Latents

    vae = AutoencoderKL.from_pretrained(tiny_model, subfolder="vae").eval()
    encoded: list[torch.Tensor] = []
    encode = vae.encode
    vae.encode = lambda pixels: (encoded.append(pixels), encode(pixels))[1]
    pixels = torch.randn(3, 3, 64, 64, generator=torch.Generator().manual_seed(0))
    both = Latents(vae, pixels, cached=True, flip_p=0.5)
    assert torch.equal(torch.cat(encoded), torch.cat([pixels, pixels.flip(-1)]))

    def drawn(latents: Latents, flip: bool) -> torch.Tensor:
        eps = torch.randn(3, *both.latent_shape(), generator=torch.Generator().manual_seed(1))
        batch = Batch(positions=[0, 1, 2], image_index=torch.tensor([2, 0, 1]), flip=torch.full((3,), flip),
                      input_ids=torch.zeros(3, 77, dtype=torch.long), latent_eps=eps,
                      noise=eps, timesteps=torch.zeros(3, dtype=torch.long), prompt_index=torch.zeros(3))
        return latents.sample(batch)

    for flip_p, flip in ((0.0, False), (1.0, True)):
        encoded.clear()
        one_side = Latents(vae, pixels, cached=True, flip_p=flip_p)
        assert torch.equal(torch.cat(encoded), pixels.flip(-1) if flip else pixels)
        torch.testing.assert_close(drawn(one_side, flip), drawn(both, flip), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(("sizes", "flip_p"), [((5, 1), 0.5), ((1,), 0.0)], ids=["two-buckets", "one-image"])
def test_ranks_share_the_latent_encoding_and_all_get_every_latent(tiny_model, sizes, flip_p):
    """3 ranks share the encoding of all buckets' latents out evenly (two buckets of 5 and 1 images with
    their mirrors: 4 each; one image: some ranks none) and every rank ends with the latents one process
    encodes; rank 0's progress counts about the whole job's."""
    from diffusers import AutoencoderKL

    from xeontune.train.latent_cache import Latents, encode_latents

    vae = AutoencoderKL.from_pretrained(tiny_model, subfolder="vae").eval()
    generator = torch.Generator().manual_seed(0)
    pixels = [torch.randn(n, 3, 64, 64 + 32 * i, generator=generator) for i, n in enumerate(sizes)]
    alone = [Latents(vae, p, cached=True, flip_p=flip_p, encode_batch=2) for p in pixels]
    rows = sum(sizes) * (2 if flip_p else 1)
    ranks, done, calls = ThreadRanks(3), [0, 0, 0], [0, 0, 0]

    def run(rank: int, spread) -> list[Latents]:
        def encode(batch: torch.Tensor):
            calls[rank] += len(batch)
            return vae.encode(batch)

        model = types.SimpleNamespace(encode=encode, dtype=vae.dtype, config=vae.config)
        parts = [Latents(model, p, cached=True, flip_p=flip_p, encode_batch=2, encode=False) for p in pixels]
        encode_latents(parts, spread, lambda n: done.__setitem__(rank, done[rank] + n))
        return parts

    results = ranks.run(run)
    assert max(calls) - min(calls) <= 1 and sum(calls) == rows
    assert done[0] >= rows
    for parts in results:
        for part, reference in zip(parts, alone, strict=True):
            torch.testing.assert_close(part.mean, reference.mean, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(part.std, reference.std, rtol=1e-5, atol=1e-6)
