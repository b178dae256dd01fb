"""Aspect-ratio buckets: the sizes, which image goes where, batches that each hold one bucket (every
image once an epoch, ranks agreeing), SDXL's time_ids from the real size and crop, and training: ranks
equal one process with their batches together, and resume is exact across bucket changes (fp32)."""

from __future__ import annotations

import io
import logging
import os
import shutil
import struct
import subprocess
import sys
import zlib
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from PIL import ExifTags, Image, ImageFile
from safetensors.torch import load_file

from tests.trainlib import lora_args
from xeontune.cli import main
from xeontune.errors import UserError
from xeontune.train.buckets import fit_to_bucket, load_training_images
from xeontune.train.data import SamplePlan
from xeontune.train.data_check import check_training_data
from xeontune.train.images import read_image_sizes
from xeontune.train.latent_cache import Latents
from xeontune.train.layout import bucket_sizes, nearest_bucket
from xeontune.train.loop import read_training_data
from xeontune.train.options import parse_args

LORA_FILE = "pytorch_lora_weights.safetensors"


def test_bucket_sizes_keep_about_the_pixels_in_multiples_of_the_step():
    sizes = bucket_sizes(512, 64)
    assert sizes[0] == (512, 512)
    assert {(576, 448), (448, 576), (640, 384), (384, 640)} <= set(sizes)
    for w, h in sizes:
        assert w % 64 == 0 and h % 64 == 0 and 0.75 * 512**2 <= w * h <= 512**2 and max(w / h, h / w) <= 2
    assert nearest_bucket(4032, 3024, sizes) == (576, 448)  # a 4:3 phone photo
    assert nearest_bucket(3024, 4032, sizes) == (448, 576)
    assert nearest_bucket(1000, 1000, sizes) == (512, 512)
    assert nearest_bucket(1920, 1080, sizes) == (640, 384)  # 16:9 -> 5:3
    assert bucket_sizes(64, 16) == [(64, 64), (48, 80), (80, 48)]  # the tiny models' (--bucket-step 16)
    for resolution in (256, 512, 768, 1024):  # a portrait photo is cut as its landscape twin is
        sizes = bucket_sizes(resolution, 64)
        assert {(h, w) for w, h in sizes} == set(sizes), resolution
        assert nearest_bucket(2000, 1000, sizes) == nearest_bucket(1000, 2000, sizes)[::-1], resolution
    assert nearest_bucket(2000, 1000, bucket_sizes(1024, 64)) == (1408, 704)  # SDXL: 2:1 both ways


def test_an_image_covers_its_bucket_and_sdxl_gets_its_real_size_and_crop():
    img = Image.new("RGB", (200, 100), (255, 0, 0))
    img.paste((0, 0, 255), (0, 0, 20, 100))  # a blue band on the left, cut by the crop
    pixels, crop = fit_to_bucket(img, (80, 48))
    assert pixels.shape == (3, 48, 80)
    # scaled by 0.48 to 96 x 48, 8 px cut from each side: the crop's corner at (top 0, left 8)
    assert crop == (100, 200, 0, 8, 8)
    latents = Latents(NoVae(), pixels[None], cached=False, crops=torch.tensor([crop]))
    plan = SamplePlan(seed=0, num_images=1, repeats=1, prompt_ids=torch.zeros(1, 77, dtype=torch.long),
                      latent_shape=(4, 6, 10), num_train_timesteps=10, flip_p=0.0)
    assert latents.time_ids(plan.batch([0])).tolist() == [[100.0, 200.0, 0.0, 8.0, 48.0, 80.0]]


class NoVae(torch.nn.Module):
    class config:
        scaling_factor = 1.0

    dtype = torch.float32


def shaped_folder(sample_images, tmp_path, sizes):
    """The sample images resized to ``sizes`` (width, height), one each."""
    folder = tmp_path / "shaped"
    folder.mkdir()
    for i, (src, size) in enumerate(zip(sorted(sample_images.glob("*.png")), sizes, strict=False)):
        Image.open(src).resize(size).save(folder / f"img_{i}.png")
    return folder


MIXED = [(96, 48), (64, 64), (40, 80), (90, 50), (64, 60), (50, 100)]  # 2:1, square, 1:2, ...


def test_auto_buckets_only_where_some_image_is_not_nearest_the_square(sample_images, tmp_path):
    def load(folder, *flags):
        return load_training_images(parse_args(["--model", "m", "--data-dir", str(folder), "--placeholder-token",
                                                "<t>", "--initializer-token", "t", "--resolution", "64",
                                                "--bucket-step", "16", *flags]))

    square = load(sample_images)
    assert not square.bucketed and len(square.parts) == 1 and square.parts[0].pixels.shape == (6, 3, 64, 64)
    mixed = load(shaped_folder(sample_images, tmp_path, MIXED))
    assert mixed.bucketed
    assert {p.size: p.members for p in mixed.parts} == {(64, 64): [1, 4], (48, 80): [2, 5], (80, 48): [0, 3]}
    assert all(p.pixels.shape == (len(p.members), 3, p.size[1], p.size[0]) for p in mixed.parts)
    assert not load(tmp_path / "shaped", "--buckets", "off").bucketed
    assert load(sample_images, "--buckets", "on").bucketed
    # --resolution 72 is no multiple of the step (16): the buckets hold no square one, yet square
    # images stay square at 72, not cut to the squarest bucket (80x64)
    odd = load(sample_images, "--resolution", "72")
    assert not odd.bucketed and odd.parts[0].pixels.shape == (6, 3, 72, 72)
    # ... and images of several shapes are refused there, not a square photo cut to 1:2
    with pytest.raises(UserError, match="give a --resolution that is one too"):
        load(tmp_path / "shaped", "--resolution", "72")


def test_class_images_join_every_bucket_fitted_to_it_as_they_come(sample_images, tmp_path):
    """Prior preservation's class images go after each bucket's own images, fitted to that bucket, from an
    iterator (a user's full-size class photos are decoded and fitted one at a time, not held together),
    and decoded again from their files when read."""
    opts = parse_args(["--method", "lora", "--model", "m", "--data-dir", str(shaped_folder(sample_images, tmp_path,
                       MIXED)), "--instance-prompt", "a photo of sks toy", "--resolution", "64", "--bucket-step", "16"])
    images = load_training_images(opts)
    before = {part.size: len(part.members) for part in images.parts}
    wide = Image.open(sorted(sample_images.glob("*.png"))[0]).convert("RGB").resize((120, 60))
    tall = wide.transpose(Image.Transpose.ROTATE_90)
    (tmp_path / "class").mkdir()
    for name, img in (("wide", wide), ("tall", tall)):
        img.save(tmp_path / "class" / f"{name}.png")
    drawn = []
    assert images.add(((drawn.append(img) or tmp_path / "class" / f"{name}.png", img)
                       for name, img in (("wide", wide), ("tall", tall))), opts) == 2
    for part in images.parts:
        assert part.pixels.shape[0] == part.crops.shape[0] == before[part.size] + 2 and part.crops.dtype == torch.long
        for row, img in zip(range(before[part.size], before[part.size] + 2), drawn, strict=True):
            pixels, crop = fit_to_bucket(img, part.size)
            assert torch.equal(part.pixels[row], pixels) and part.crops[row].tolist() == list(crop)


def test_runs_folder_check_imports_no_torch(sample_images, tmp_path):
    """`xeontune run` checks the folder in its own process (job/run.read_data_here) without importing torch
    (2-3 s of a core for each call): the sizes, buckets, masks and the method's declared prompt check. Its
    one-line errors still come: a folder whose every mask is black, a caption without the token."""
    folder = shaped_folder(sample_images, tmp_path, MIXED)
    for image in sorted(folder.glob("*.png")):
        Image.new("L", Image.open(image).size, 0).save(folder / f"{image.stem}.mask.png")
    black, untokened = tmp_path / "black", tmp_path / "captions"
    shutil.copytree(folder, black)
    for mask in folder.glob("*.mask.png"):
        mask.unlink()
    shutil.copytree(folder, untokened)
    for i, image in enumerate(sorted(untokened.glob("*.png"))):
        image.with_suffix(".txt").write_text("a photo of a toy" if i == 0 else "a photo of <t>")
    code = (
        "import sys\n"
        "from xeontune.errors import UserError\n"
        "from xeontune.job.run import read_data_here\n"
        "from xeontune.train.options import parse_args\n"
        "for folder in sys.argv[1:]:\n"
        "    opts = parse_args(['--model', 'm', '--data-dir', folder, '--placeholder-token', '<t>',\n"
        "                       '--initializer-token', 'toy', '--resolution', '64', '--bucket-step', '16'])\n"
        "    try:\n"
        "        read_data_here(opts)\n"
        "        print('ok')\n"
        "    except UserError as exc:\n"
        "        print(str(exc).replace(chr(10), ' '))\n"
        "print('torch imported' if 'torch' in sys.modules else 'no torch')\n")
    done = subprocess.run([sys.executable, "-c", code, str(folder), str(black), str(untokened)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    said = done.stdout.splitlines()
    assert said[0] == "ok" and said[-1] == "no torch", said
    assert said[1].startswith(f"every image's mask in {black} is black all over"), said
    assert "does not contain --placeholder-token <t>" in said[2], said


def test_runs_folder_check_decodes_no_image_and_lays_it_out_as_the_ranks_read_does(sample_images, tmp_path,
                                                                                   monkeypatch, caplog):
    """`run`'s check on the user's machine (check_training_data) takes each image's size from its header,
    upright (a photo stored sideways with EXIF orientation 6 counts 50x100: JPEG, PNG, TIFF), and decodes
    none; a rank's read (read_training_data) puts the same images in the same buckets, skipping with a
    warning a file whose header reads but whose pixels do not; a PNG whose orientation comes after its
    pixels counts upright in both (its chunks are read, its pixels not); the two refuse the same mistakes alike."""
    folder = shaped_folder(sample_images, tmp_path, MIXED)
    sideways = Image.Exif()
    sideways[ExifTags.Base.Orientation] = 6
    photo = Image.open(sorted(sample_images.glob("*.png"))[0]).convert("RGB").resize((100, 50))
    for name in ("phone.jpg", "phone.png", "phone.tif"):
        photo.save(folder / name, exif=sideways)
    whole = io.BytesIO()
    Image.effect_noise((100, 50), 64).convert("RGB").save(whole, "JPEG")  # noise: the pixels outweigh the header
    (folder / "a_cut.jpg").write_bytes(whole.getvalue()[: len(whole.getvalue()) * 2 // 3])  # first: the rest shift
    (folder / "late.png").write_bytes(png_with_exif_after_the_pixels(photo, sideways))
    opts = parse_args(["--method", "lora", "--model", "m", "--data-dir", str(folder), "--instance-prompt",
                       "a photo of sks toy", "--resolution", "64", "--bucket-step", "16"])
    decoded = []
    load = ImageFile.ImageFile.load
    monkeypatch.setattr(ImageFile.ImageFile, "load", lambda img: decoded.append(Path(img.filename).name) or load(img))
    caplog.set_level(logging.WARNING, logger="xeontune.train.data")
    check_training_data(opts)
    heads = {path.name: size for path, size in read_image_sizes(folder)}
    assert decoded == [] and "a_cut" not in caplog.text
    assert {heads[n] for n in ("phone.jpg", "phone.png", "phone.tif", "late.png")} == {(50, 100)}
    images, *_ = read_training_data(opts)
    assert caplog.text.count("a_cut.jpg: not a readable image") == 1
    names = [p.name for p in images.paths]
    assert "a_cut.jpg" not in names and {"phone.jpg", "phone.png", "phone.tif", "late.png"} <= set(decoded)
    assert {images.sizes[names.index(n)] for n in ("phone.jpg", "phone.png", "phone.tif", "late.png")} == {(50, 100)}
    by_bucket = {part.size: sorted(names[i] for i in part.members) for part in images.parts}
    assert by_bucket == {(64, 64): ["img_1.png", "img_4.png"], (80, 48): ["img_0.png", "img_3.png"],
                         (48, 80): ["img_2.png", "img_5.png", "late.png", "phone.jpg", "phone.png", "phone.tif"]}
    assert all(part.pixels.shape == (len(part.members), 3, part.size[1], part.size[0]) for part in images.parts)
    # the same mistakes, the same one line: a mask of the photo as stored (sideways), not as it trains
    (folder / "a_cut.jpg").unlink()
    (folder / "late.png").unlink()
    Image.new("L", (100, 50), 255).save(folder / "phone.mask.png")
    for read in (check_training_data, read_training_data):
        with pytest.raises(UserError, match="phone.mask.png is 100x50, its image .upright. 50x100"):
            read(opts)
    Image.new("L", (50, 100), 255).save(folder / "phone.mask.png")
    check_training_data(opts)
    assert read_training_data(opts)[1][1] is not None  # the 1:2 bucket's masks
    for read in (check_training_data, read_training_data):
        with pytest.raises(UserError, match="give a --resolution that is one too"):
            read(replace(opts, resolution=72))


def png_with_exif_after_the_pixels(img, exif):
    """A PNG whose eXIf chunk follows its pixels: its header alone reads 100x50; it decodes upright."""
    whole = io.BytesIO()
    img.save(whole, "PNG")
    data, body = whole.getvalue(), exif.tobytes().removeprefix(b"Exif\x00\x00")
    chunk = struct.pack(">I", len(body)) + b"eXIf" + body + struct.pack(">I", zlib.crc32(b"eXIf" + body))
    end = data.rindex(b"IEND") - 4
    return data[:end] + chunk + data[end:]


def test_each_global_micro_batch_is_one_bucket_and_every_image_comes_once_an_epoch():
    buckets = [[1, 4], [2, 5, 6], [0, 3, 7]]
    plan = SamplePlan(seed=3, num_images=8, repeats=1, prompt_ids=torch.zeros(1, 77, dtype=torch.long),
                      latent_shape=(4, 8, 8), bucket_latent_shapes=[(4, 8, 8), (4, 10, 6), (4, 6, 10)],
                      num_train_timesteps=10, flip_p=0.5, buckets=buckets, group=2)
    assert plan.epoch_len == 2 + 4 + 4  # each bucket's images, its last chunk of 2 filled
    seen, order = [], []
    for start in range(0, plan.epoch_len, 2):
        ranks = [plan.batch([p]) for p in (start, start + 1)]  # 2 ranks of batch 1: the same bucket
        assert ranks[0].bucket == ranks[1].bucket
        together = plan.batch([start, start + 1])  # = 1 process with batch 2
        assert together.bucket == ranks[0].bucket
        assert together.noise.shape[-2:] == torch.Size(plan.bucket_latent_shapes[together.bucket][1:])
        assert torch.equal(together.noise, torch.cat([r.noise for r in ranks]))
        seen += [buckets[together.bucket][i] for i in together.image_index.tolist()]
        order.append(together.bucket)
    assert set(seen) == set(range(8)) and len(seen) == 10  # all of them, two twice (the filled chunks)
    assert len(set(order)) == 3
    with pytest.raises(ValueError, match="span two buckets"):
        plan.batch([1, 2])


def bucketed(model, data, out, *more):
    """`xeontune train` and trainlib.lora_args, with buckets 16 px apart; ``more`` last (the last flag wins)."""
    return ["train", *lora_args(model, data, out, "--bucket-step", "16", *more)]


def max_diff(a, b):
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


@pytest.mark.slow
def test_bucketed_training_resumes_exactly_across_bucket_changes(sdxl_model, sample_images, tmp_path,
                                                                monkeypatch):
    """SDXL: its time_ids change with the bucket too (SD1.x's bucketed runs: the rank tests)."""
    model = sdxl_model
    data = shaped_folder(sample_images, tmp_path, MIXED)
    common = ["--max-train-steps", "4", "--checkpointing-steps", "2"]
    buckets = []  # each step's bucket in the straight run
    draw = SamplePlan.batch

    def noted(plan, positions):
        batch = draw(plan, positions)
        buckets.append(batch.bucket)
        return batch

    monkeypatch.setattr(SamplePlan, "batch", noted)
    assert main(bucketed(model, data, tmp_path / "straight", *common)) == 0
    monkeypatch.undo()
    assert len(buckets) == 4 and buckets[1] != buckets[2]  # the resume at step 2 lands on a bucket change
    assert main(bucketed(model, data, tmp_path / "resumed", "--max-train-steps", "2", "--checkpointing-steps",
                         "2")) == 0
    assert main(bucketed(model, data, tmp_path / "resumed", *common, "--resume-from-checkpoint", "latest")) == 0
    straight, resumed = (load_file(tmp_path / d / LORA_FILE) for d in ("straight", "resumed"))
    assert max(float(v.abs().max()) for k, v in straight.items() if "lora.up" in k) > 1e-4
    assert max_diff(straight, resumed) == 0


@pytest.mark.slow
def test_two_ranks_train_what_one_process_does_with_both_batches(tiny_model, sample_images, tmp_path):
    """(3 ranks on the namespace cluster: tests/cluster/test_lora_cluster.py.)"""
    data = shaped_folder(sample_images, tmp_path, MIXED)
    common = ["--max-train-steps", "3", "--checkpointing-steps", "0", "--no-random-flip", "--scale-lr"]
    proc = subprocess.run([sys.executable, "-m", "xeontune.cli", *bucketed(tiny_model, data, tmp_path / "ranks", *common,
                                                                            "--nproc-per-node", "2")],
                          capture_output=True, text=True, timeout=600, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert main(bucketed(tiny_model, data, tmp_path / "one", *common, "--train-batch-size", "2")) == 0
    got, want = (load_file(tmp_path / d / LORA_FILE) for d in ("ranks", "one"))
    diff = max_diff(got, want)
    # the up weights start at 0: what they hold is how far the adapters moved (two runs that learned
    # nothing would agree too), 100x the tolerance at least
    moved = max(float(v.abs().max()) for k, v in want.items() if "lora.up" in k)
    print(f"buckets, 2 ranks vs 1 process x2: max abs diff {diff:.3g} (up weights moved {moved:.3g} from 0)")
    assert diff <= 1e-5
    assert moved >= 100 * 1e-5, moved
    shutil.rmtree(data)
