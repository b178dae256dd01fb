"""Where each image's prompt comes from (captions, the instance prompt, the method's templates), the
folders that are one-line errors, and masked loss (IMAGE.mask.png)."""

from __future__ import annotations

import json
import shutil
from types import SimpleNamespace

import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

from tests.one_line import one_line_error
from xeontune.cli import main
from xeontune.errors import UserError
from xeontune.train import loop
from xeontune.train.data import Batch, SamplePlan, load_images_with_crops, mask_tensor, masked_mse
from xeontune.train.images import mask_weights
from xeontune.train.latent_cache import Latents
from xeontune.train.prompts import image_prompts


@pytest.fixture
def folder(sample_images, tmp_path):
    """A copy of the 6 sample images (toy_00.png ... toy_05.png) to caption."""
    return shutil.copytree(sample_images, tmp_path / "data")


def prompts_of(folder, **kwargs):
    _, paths, _ = load_images_with_crops(folder, 64, False)
    return image_prompts(folder, paths, **{"instance_prompt": None, **kwargs})


def each_image(given) -> list[str]:
    return [given.texts[row] for row in given.of_image]


def test_captions_from_txt_files_and_metadata_jsonl(folder):
    for i in range(3):
        (folder / f"toy_0{i}.txt").write_text(f"  a photo of sks toy\nnumber {i} \n")
    with open(folder / "metadata.jsonl", "w") as f:
        for i in range(3, 6):
            f.write(json.dumps({"file_name": f"toy_0{i}.png", "text": "unused", "caption": f"toy {i}"}) + "\n")
    given = prompts_of(folder, caption_column="caption")
    assert each_image(given) == [f"a photo of sks toy number {i}" for i in range(3)] + [f"toy {i}" for i in range(3, 6)]
    assert given.source == "captions"
    assert prompts_of(folder, instance_prompt="ignored", caption_column="caption").texts == given.texts


def test_the_instance_prompt_fills_in_for_uncaptioned_images_and_nothing_gives_none(folder):
    assert prompts_of(folder) is None  # the method's own prompts (textual inversion's templates)
    given = prompts_of(folder, instance_prompt="a photo of sks toy")
    assert each_image(given) == ["a photo of sks toy"] * 6 and given.source == "the instance prompt"
    (folder / "toy_02.txt").write_text("a red toy")
    given = prompts_of(folder, instance_prompt="a photo of sks toy")
    assert each_image(given) == ["a photo of sks toy"] * 2 + ["a red toy"] + ["a photo of sks toy"] * 3
    assert given.texts == ["a photo of sks toy", "a red toy"]  # each distinct prompt once


@pytest.mark.parametrize("mistake, message", [
    ("uncaptioned", "toy_00.png has no caption"),
    ("orphan caption", "caption {folder}/dog.txt has no image"),
    ("orphan metadata", "file_name 'dog.png' is not an image"),
    ("two captions", "toy_01.png has two different captions"),
    ("no column", "has no text field 'text' (--caption-column; its fields: caption)"),
    ("not json", "line 1 is not JSON"),
    ("empty caption", "caption {folder}/toy_03.txt is empty"),
    ("empty metadata caption", "the caption of 'toy_01.png' is empty"),
    ("column without metadata", "--caption-column caption: names a field of metadata.jsonl"),
])
def test_bad_caption_folders_are_one_line_errors(folder, mistake, message):
    if mistake == "uncaptioned":
        for i in range(1, 6):
            (folder / f"toy_0{i}.txt").write_text("a toy")
    elif mistake == "orphan caption":
        (folder / "dog.txt").write_text("a dog")
    elif mistake == "orphan metadata":
        (folder / "metadata.jsonl").write_text(json.dumps({"file_name": "dog.png", "text": "a dog"}) + "\n")
    elif mistake == "two captions":
        (folder / "toy_01.txt").write_text("a toy")
        (folder / "metadata.jsonl").write_text(json.dumps({"file_name": "toy_01.png", "text": "a cat"}) + "\n")
    elif mistake == "no column":
        (folder / "metadata.jsonl").write_text(json.dumps({"file_name": "toy_01.png", "caption": "x"}) + "\n")
    elif mistake == "empty caption":
        (folder / "toy_03.txt").write_text(" \n")
    elif mistake == "empty metadata caption":
        (folder / "metadata.jsonl").write_text(json.dumps({"file_name": "toy_01.png", "text": " "}) + "\n")
    elif mistake == "column without metadata":
        (folder / "toy_01.txt").write_text("a toy")
    else:
        (folder / "metadata.jsonl").write_text("{file_name: toy_01.png}\n")
    with pytest.raises(UserError) as err:
        prompts_of(folder, **({"caption_column": "caption"} if mistake == "column without metadata" else {}))
    assert message.format(folder=folder) in str(err.value) and "\n" not in str(err.value)


def test_each_sample_takes_its_images_prompt_and_the_random_streams_stay_as_without():
    common = dict(seed=3, num_images=3, repeats=4, prompt_ids=torch.arange(3)[:, None].expand(3, 77),
                  latent_shape=(4, 8, 8), num_train_timesteps=1000, flip_p=0.5)
    own = SamplePlan(prompt_of_image=[2, 0, 1], **common).batch(list(range(12)))
    drawn = SamplePlan(**common).batch(list(range(12)))
    assert own.prompt_index.tolist() == [[2, 0, 1][i] for i in own.image_index.tolist()]
    assert (own.input_ids[:, 0] == own.prompt_index).all()
    assert drawn.prompt_index.tolist() != own.prompt_index.tolist()  # templates are drawn at random
    for name in ("image_index", "flip", "noise", "latent_eps", "timesteps"):
        assert torch.equal(getattr(own, name), getattr(drawn, name)), name


# --- through the trainer ------------------------------------------------------------------------------


def train_args(model, data, out, *more):
    return ["train", "--model", str(model), "--data-dir", str(data), "--resolution", "64", "--max-train-steps",
            "2", "--checkpointing-steps", "0", "--save-steps", "0", "--mixed-precision", "fp32",
            "--output-dir", str(out), *more]


LORA = ("--method", "lora", "--learning-rate", "1e-3")
TI = ("--placeholder-token", "<sks>", "--initializer-token", "toy", "--num-vectors", "2")


@pytest.fixture
def seen(monkeypatch) -> list[str]:
    """The prompts the text encoder reads (as the first tokenizer decodes them), in order: at each step
    (``Run.encode_prompts``), or once for the text cache (``TextCache``, which may load the encoders itself)."""
    read: list[str] = []
    encode, cache = loop.Run.encode_prompts, loop.TextCache.__init__

    def recording(run, input_ids):
        read.extend(run.components.tokenizer.batch_decode(input_ids[0], skip_special_tokens=True))
        return encode(run, input_ids)

    def caching(self, components, all_prompt_ids, *args, **kwargs):
        read.extend(components.tokenizer.batch_decode(all_prompt_ids[0], skip_special_tokens=True))
        return cache(self, components, all_prompt_ids, *args, **kwargs)

    monkeypatch.setattr(loop.Run, "encode_prompts", recording)
    monkeypatch.setattr(loop.TextCache, "__init__", caching)
    return read


@pytest.mark.slow
def test_lora_trains_on_captions_alone_and_its_text_encoder_reads_each_caption(tiny_model, folder, tmp_path, seen):
    for i in range(6):
        (folder / f"toy_0{i}.txt").write_text(f"a photo of sks toy {['red', 'blue'][i % 2]}")
    assert main(train_args(tiny_model, folder, tmp_path / "out", *LORA)) == 0
    assert sorted(seen) == ["a photo of sks toy blue", "a photo of sks toy red"]  # cached once per caption
    weights = load_file(tmp_path / "out" / "pytorch_lora_weights.safetensors")
    assert max(float(v.abs().max()) for k, v in weights.items() if "lora.up" in k) > 1e-4  # up weights start at 0


@pytest.mark.slow
def test_textual_inversion_reads_captions_with_every_vector_of_its_token(tiny_model, folder, tmp_path, seen):
    for i in range(6):
        (folder / f"toy_0{i}.txt").write_text("a photo of a <sks> on a table")
    assert main(train_args(tiny_model, folder, tmp_path / "out", *TI)) == 0
    # (added tokens decode without the spaces around them)
    assert {text.replace(" ", "") for text in seen} == {"aphotoofa<sks><sks>_1onatable"}


def test_prompts_that_do_not_suit_the_method_are_one_line_errors(tiny_model, folder, tmp_path, capsys):
    line = one_line_error(capsys, train_args(tiny_model, folder, tmp_path / "a", *LORA))
    assert "--method lora needs --instance-prompt, or a caption per image" in line
    (folder / "toy_03.txt").write_text("a photo of a toy")
    line = one_line_error(capsys, train_args(tiny_model, folder, tmp_path / "b", *TI, "--instance-prompt", "a <sks>"))
    assert "'a photo of a toy'" in line and "toy_03.txt" in line and "--placeholder-token <sks>" in line
    line = one_line_error(capsys, train_args(tiny_model, folder, tmp_path / "c", *LORA))
    assert "toy_00.png has no caption" in line


# --- masked loss --------------------------------------------------------------------------------------


def test_a_mask_weighs_the_loss_per_latent_pixel():
    pred, target = torch.randn(2, 4, 8, 8, requires_grad=True), torch.randn(2, 4, 8, 8)
    white = torch.ones(2, 1, 8, 8)
    assert torch.equal(masked_mse(pred, target, white), masked_mse(pred, target, None))  # exactly
    half = white.clone()
    half[..., :4] = 0
    masked_mse(pred, target, half).backward()
    assert float(pred.grad[..., :4].abs().max()) == 0.0 and float(pred.grad[..., 4:].abs().min()) > 0
    # a grey pixel (w = 0.25, given as its root 0.5) counts a quarter
    grey = torch.full((2, 1, 8, 8), 0.5)
    assert torch.allclose(masked_mse(pred, target, grey), 0.25 * masked_mse(pred, target, None))


def sizes_of(paths):
    return [Image.open(p).size for p in paths]


def test_masks_are_cropped_and_scaled_as_their_images_and_mirrored_with_them(folder):
    left_black = Image.new("L", (64, 64), 255)
    left_black.paste(0, (0, 0, 32, 64))
    left_black.save(folder / "toy_01.mask.png")
    _, paths, _ = load_images_with_crops(folder, 64, False)
    assert [p.name for p in paths] == [f"toy_0{i}.png" for i in range(6)]  # a mask is not a training image
    masks = mask_tensor(mask_weights(paths, sizes_of(paths), 64, False))
    assert masks.shape == (6, 1, 8, 8)
    assert torch.equal(masks[1, 0, :, :4], torch.zeros(8, 4)) and torch.equal(masks[1, 0, :, 4:], torch.ones(8, 4))
    assert torch.equal(masks[[0, 2, 3, 4, 5]], torch.ones(5, 1, 8, 8))  # no mask: all of it counts
    # a mirrored sample takes its mask mirrored: the black half is then on the right
    latents = Latents(SimpleNamespace(config=SimpleNamespace()), torch.zeros(6, 3, 64, 64), cached=False,
                      masks=masks, flip_p=0.5)
    batch = Batch(positions=[0, 1], image_index=torch.tensor([1, 1]), flip=torch.tensor([False, True]),
                  input_ids=torch.zeros(2, 77, dtype=torch.long), latent_eps=torch.zeros(2, 4, 8, 8),
                  noise=torch.zeros(2, 4, 8, 8), timesteps=torch.zeros(2))
    weights = latents.mask(batch)
    assert torch.equal(weights[0], masks[1]) and torch.equal(weights[1], masks[1].flip(-1))
    assert torch.equal(weights[1, 0, :, 4:], torch.zeros(8, 4))
    rest = [p for p in paths if p.name != "toy_01.png"]
    assert mask_tensor(mask_weights(rest, sizes_of(rest), 64, False)) is None
    Image.new("L", (32, 32), 255).save(folder / "toy_02.mask.png")
    with pytest.raises(UserError, match="a mask must match its image's size"):
        mask_tensor(mask_weights(paths, sizes_of(paths), 64, False))


def test_mask_mistakes_are_one_line_errors_before_the_model_loads(tiny_model, folder, tmp_path, capsys, caplog):
    """A mask beside no image (a typo), one not named NAME.mask.png (it was trained as a picture), and
    masks that leave nothing to learn: one line each; a single black mask: a warning naming it."""
    args = train_args(tiny_model, folder, tmp_path / "out", *LORA, "--instance-prompt", "a photo of sks toy")
    Image.new("L", (64, 64), 255).save(folder / "toy_9.mask.png")
    assert "toy_9.mask.png has no image beside it" in one_line_error(capsys, args)
    (folder / "toy_9.mask.png").rename(folder / "toy_01.mask.jpg")
    _, paths, _ = load_images_with_crops(folder, 64, False)
    assert len(paths) == 6  # not a seventh training image
    assert "masks are named toy_01.mask.png" in one_line_error(capsys, args)
    (folder / "toy_01.mask.jpg").unlink()
    for i in range(6):
        Image.new("L", (64, 64), 0).save(folder / f"toy_0{i}.mask.png")
    assert "every image's mask" in one_line_error(capsys, args) and not (tmp_path / "out").exists()
    for i in range(1, 6):
        (folder / f"toy_0{i}.mask.png").unlink()
    caplog.clear()
    caplog.set_level("WARNING", logger="xeontune.train.data")  # bench, run earlier in this process, quiets xeontune.train
    assert mask_tensor(mask_weights(paths, sizes_of(paths), 64, False)) is not None and "toy_00.mask.png is black all over" in caplog.text


@pytest.mark.slow
def test_all_white_masks_train_exactly_as_no_masks(tiny_model, folder, tmp_path):
    args = (*LORA, "--instance-prompt", "a photo of sks toy")
    assert main(train_args(tiny_model, folder, tmp_path / "plain", *args)) == 0
    for i in range(6):
        Image.new("L", (64, 64), 255).save(folder / f"toy_0{i}.mask.png")
    assert main(train_args(tiny_model, folder, tmp_path / "white", *args)) == 0
    plain = load_file(tmp_path / "plain" / "pytorch_lora_weights.safetensors")
    white = load_file(tmp_path / "white" / "pytorch_lora_weights.safetensors")
    assert plain.keys() == white.keys() and all(torch.equal(plain[k], white[k]) for k in plain)
    assert max(float(v.abs().max()) for k, v in plain.items() if "lora.up" in k) > 1e-4  # and they trained


# A mask's black cells must not count, and that can be asserted exactly only where it is exact: the loss
# weighs the UNet's prediction per latent cell, but the VAE encoder and the UNet see the whole image, so
# the pixels under a black half still shape the prediction in the white half (measured, textual inversion
# as below: noise in the black half of every image moved the vectors 1.0e-2, as much as noise in the white
# half did: no tolerance tells the two apart). What is exact, and asserted: (1) an image whose mask is
# black all over teaches nothing, whatever its pixels (bit for bit: 0.0 measured); (2) the prediction in
# the black cells does not count: an offset added to it there changes nothing, bit for bit, while the same
# offset in the white cells does. The masks' black half is the top one, 32 px: latent rows 0-3 exactly
# (8 px a latent cell), and the same half on a mirrored sample, so random flips stay on.
BLACK_ROWS, WHITE_ROWS = slice(0, 4), slice(4, 8)


def masked_folder(sample_images, folder, masks: str, noise_in: str | None = None):
    """The 6 sample images with masks: "white" all over, or "top" (top half black, and toy_01's mask black
    all over). ``noise_in`` "toy_01": that image's pixels replaced by noise."""
    import numpy as np

    shutil.copytree(sample_images, folder)
    for i in range(6):
        mask = Image.new("L", (64, 64), 255)
        if masks == "top":
            mask.paste(0, (0, 0, 64, 64 if i == 1 else 32))
        mask.save(folder / f"toy_0{i}.mask.png")
    if noise_in:
        noise = np.random.default_rng(9).integers(0, 256, (64, 64, 3), dtype=np.uint8)
        Image.fromarray(noise).save(folder / f"{noise_in}.png")
    return folder


def offset_prediction(monkeypatch, rows: slice, samples: slice = slice(None)) -> None:
    """The UNet's prediction plus 1 in latent ``rows`` of the batch's ``samples`` (a constant: it adds
    nothing to the gradient but what the loss makes of it)."""
    from diffusers import UNet2DConditionModel
    from diffusers.models.unets.unet_2d_condition import UNet2DConditionOutput

    forward = UNet2DConditionModel.forward

    def shifted(self, *args, **kwargs):
        out = forward(self, *args, **kwargs)
        sample = out.sample if isinstance(out, UNet2DConditionOutput) else out[0]
        assert sample.shape[-2:] == (8, 8), sample.shape  # 64 px: 8 x 8 latent cells
        offset = torch.zeros_like(sample)
        offset[samples, :, rows, :] = 1.0
        return UNet2DConditionOutput(sample=sample + offset)

    monkeypatch.setattr(UNet2DConditionModel, "forward", shifted)


def max_apart(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


@pytest.mark.slow
def test_textual_inversion_learns_from_the_white_half_of_a_mask_alone(tiny_model, sample_images, tmp_path,
                                                                       monkeypatch):
    """fp32, 4 steps at lr 5e-3 (the vectors move about 2e-2). Half-black masks train other vectors than
    white ones, far beyond rounding; an all-black image's pixels and the prediction in black cells change
    nothing, bit for bit (see BLACK_ROWS above for why not the black half's pixels)."""
    from tests.checks import initializer_row

    def vectors(name: str, masks: str, noise_in: str | None = None) -> dict:
        data = masked_folder(sample_images, tmp_path / f"data-{name}", masks, noise_in)
        assert main(train_args(tiny_model, data, tmp_path / name, *TI, "--max-train-steps", "4",
                               "--learning-rate", "5e-3", "--train-batch-size", "2")) == 0
        return load_file(tmp_path / name / "learned_embeds.safetensors")

    white, half = vectors("white", "white"), vectors("half", "top")
    noisy = vectors("noisy", "top", noise_in="toy_01")  # toy_01's mask is black all over
    with monkeypatch.context() as patched:
        offset_prediction(patched, BLACK_ROWS)
        black_offset = vectors("black-offset", "top")
    with monkeypatch.context() as patched:
        offset_prediction(patched, WHITE_ROWS)
        white_offset = vectors("white-offset", "top")
    moved = float((half["<sks>"] - initializer_row(tiny_model)).abs().max())
    found = {"half vs white": max_apart(half, white), "all-black image's pixels": max_apart(noisy, half),
             "offset in black cells": max_apart(black_offset, half), "offset in white cells": max_apart(white_offset, half)}
    print(f"masked textual inversion (moved {moved:.3g}): " + ", ".join(f"{k} {v:.3g}" for k, v in found.items()))
    assert moved >= 1e-3, moved
    assert found["half vs white"] >= 1e-3  # fp32 rounding of these runs is below 1e-6
    assert found["all-black image's pixels"] <= 1e-6 and found["offset in black cells"] <= 1e-6, found
    assert found["offset in white cells"] >= 1e-3, found  # the offset is felt where the mask is white


@pytest.mark.slow
def test_prior_preservation_masks_the_instance_samples_and_not_the_class_samples(tiny_model, sample_images,
                                                                                 tmp_path, monkeypatch):
    """LoRA with prior preservation, batch 1 (the UNet's batch: the instance sample, then a class
    sample): instance masks act as without prior preservation (above); the class sample has no mask,
    so the same offset in its top rows changes the adapters."""
    class_dir = tmp_path / "class"

    def adapters(name: str, masks: str, noise_in: str | None = None) -> dict:
        data = masked_folder(sample_images, tmp_path / f"data-{name}", masks, noise_in)
        assert main(train_args(tiny_model, data, tmp_path / name, *LORA, "--instance-prompt", "a photo of sks toy",
                               "--with-prior-preservation", "--class-data-dir", str(class_dir), "--class-prompt",
                               "a photo of a toy", "--num-class-images", "2", "--class-inference-steps", "2",
                               "--max-train-steps", "3", "--train-batch-size", "1", "--adam-epsilon", "1e-5")) == 0
        return load_file(tmp_path / name / "pytorch_lora_weights.safetensors")

    white = adapters("white", "white")  # generates the class images, unshifted; the later runs read them
    half = adapters("half", "top")
    noisy = adapters("noisy", "top", noise_in="toy_01")
    with monkeypatch.context() as patched:
        offset_prediction(patched, BLACK_ROWS, samples=slice(0, 1))  # the instance sample's black cells
        instance_offset = adapters("instance-offset", "top")
    with monkeypatch.context() as patched:
        offset_prediction(patched, BLACK_ROWS, samples=slice(1, 2))  # the class sample's same cells
        class_offset = adapters("class-offset", "top")
    moved = max(float(v.abs().max()) for k, v in half.items() if "lora.up" in k)  # up weights start at 0
    found = {"half vs white": max_apart(half, white), "all-black image's pixels": max_apart(noisy, half),
             "offset in the instance's black cells": max_apart(instance_offset, half),
             "offset in the class sample's": max_apart(class_offset, half)}
    print(f"masked prior preservation (up weights moved {moved:.3g}): "
          + ", ".join(f"{k} {v:.3g}" for k, v in found.items()))
    assert moved >= 1e-3, moved
    assert found["half vs white"] >= 1e-3
    assert found["all-black image's pixels"] <= 1e-6 and found["offset in the instance's black cells"] <= 1e-6, found
    assert found["offset in the class sample's"] >= 1e-3, found


# --- sample images ------------------------------------------------------------------------------------


@pytest.mark.slow
def test_several_validation_prompts_and_a_first_set_before_training(tiny_model, sample_images, tmp_path):
    import numpy as np

    out = tmp_path / "out"
    assert main(train_args(tiny_model, sample_images, out, *LORA, "--instance-prompt", "a photo of sks toy",
                           "--learning-rate", "5e-2", "--validation-prompt", "a photo of sks toy",
                           "--validation-prompt", "sks toy on a beach", "--num-validation-images", "1",
                           "--validation-steps", "0", "--validate-at-start", "--validation-inference-steps", "2")) == 0
    names = sorted(p.name for p in (out / "validation").glob("*.png"))
    assert names == ["step-000000-0.png", "step-000000-1.png", "step-000002-0.png", "step-000002-1.png"]
    images = {name: Image.open(out / "validation" / name) for name in names}
    assert [images[n].text["prompt"] for n in names] == ["a photo of sks toy", "sks toy on a beach"] * 2
    assert [images[n].text["step"] for n in names] == ["0", "0", "2", "2"]
    before, after = (np.asarray(images[f"step-00000{s}-0.png"], dtype=np.int16) for s in (0, 2))
    assert int(np.abs(after - before).max()) > 0  # the adapters changed what the model draws
