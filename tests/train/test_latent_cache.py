"""The latent cache on disk (train/latent_cache.py): encoded once for the whole job, each rank its share,
kept in block files that a later or restarted run reads instead of encoding, mapped rather than loaded;
and the images behind it decoded when read (data.Pixels), with --random-crop's places drawn once."""

from __future__ import annotations

import os
import types
from pathlib import Path

import pytest
import torch
from PIL import Image

from tests.trainlib import ThreadRanks
from xeontune.errors import UserError
from xeontune.train import latent_cache
from xeontune.train.data import Pixels, fit_square, preprocess
from xeontune.train.images import crop_of, mask_weights, square_box
from xeontune.train.latent_cache import Latents, encode_latents


@pytest.fixture(scope="module")
def vae(tiny_model):
    from diffusers import AutoencoderKL

    return AutoencoderKL.from_pretrained(tiny_model, subfolder="vae").eval()


@pytest.fixture
def photos(tmp_path) -> list[Path]:
    """Seven photos of three shapes, noise so that every crop differs."""
    folder = tmp_path / "photos"
    folder.mkdir()
    generator = torch.Generator().manual_seed(3)
    paths = []
    for i, (w, h) in enumerate([(64, 64), (96, 64), (64, 112)] * 2 + [(80, 72)]):
        noise = torch.randint(0, 256, (h, w, 3), generator=generator, dtype=torch.uint8).numpy()
        paths.append(folder / f"p{i}.png")
        Image.fromarray(noise).save(paths[-1])
    return paths


def _pixels(paths: list[Path], resolution: int = 64) -> Pixels:
    pixels = Pixels(resolution, resolution)
    pixels.extend(paths, lambda img, name: fit_square(img, resolution, center_crop=True)[0])
    return pixels


class Counting:
    """The VAE, counting the images it encodes; ``fail_after``: it raises once it has encoded that many."""

    def __init__(self, vae, fail_after: int | None = None) -> None:
        self.vae, self.encoded, self.fail_after = vae, 0, fail_after
        self.dtype, self.config = vae.dtype, vae.config

    def encode(self, batch: torch.Tensor):
        if self.fail_after is not None and self.encoded + len(batch) > self.fail_after:
            raise RuntimeError("killed mid-cache")
        self.encoded += len(batch)
        return self.vae.encode(batch)


def _mapped_from(tensor: torch.Tensor, folder: Path) -> bool:
    """Whether ``tensor``'s memory is a mapping of a file in ``folder`` (/proc/self/maps)."""
    address = tensor.data_ptr()
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5].startswith(str(folder)):
            low, high = (int(x, 16) for x in fields[0].split("-"))
            if low <= address < high:
                return True
    return False


def test_a_second_run_reads_every_latent_from_mapped_files_and_a_crashed_one_encodes_only_the_rest(vae, photos,
                                                                                                 tmp_path):
    """One process in memory is the reference. A run killed after 5 images leaves the blocks it wrote
    whole; the next encodes only the rows no file holds (with latent_cache.BLOCK_ROWS 2 here); a third
    encodes nothing; all three give the reference's latents, the disk's mapped from the files."""
    reference = Latents(vae, _pixels(photos), cached=True, flip_p=0.5, encode_batch=1)
    rows = 2 * len(photos)
    root = tmp_path / "cache"
    block_rows = latent_cache.BLOCK_ROWS
    latent_cache.BLOCK_ROWS = 2
    try:
        crashing = Latents(Counting(vae, fail_after=5), _pixels(photos), cached=True, flip_p=0.5, encode_batch=1,
                           encode=False)
        with pytest.raises(RuntimeError, match="killed mid-cache"):
            encode_latents([crashing], root=root)
        written = sorted(p.name for p in root.iterdir())
        assert written == ["p0-00000000-2.pt", "p0-00000002-2.pt"]  # whole blocks only: no temporary left
        restarted = Latents(Counting(vae), _pixels(photos), cached=True, flip_p=0.5, encode_batch=1, encode=False)
        assert encode_latents([restarted], root=root) == 4
        assert restarted.vae.encoded == rows - 4
        again = Latents(Counting(vae), _pixels(photos), cached=True, flip_p=0.5, encode_batch=1, encode=False)
        assert encode_latents([again], root=root) == rows and again.vae.encoded == 0
    finally:
        latent_cache.BLOCK_ROWS = block_rows
    every = torch.arange(rows)
    for run in (restarted, again):
        torch.testing.assert_close(run.mean[every], reference.mean, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(run.std[every], reference.std, rtol=1e-5, atol=1e-6)
        assert run.mean.shape == reference.mean.shape and run.latent_shape() == reference.latent_shape()
    assert all(_mapped_from(block, root) for block in again.mean.rows.blocks)


def test_ranks_without_a_shared_disk_encode_a_share_each_and_each_node_ends_with_every_file(vae, photos, tmp_path):
    """3 ranks, ranks 0 and 1 on one node's disk, rank 2 on another's: each encodes a third of the rows
    (two buckets' worth), every block reaches both disks, and each rank samples what one process does."""
    generator = torch.Generator().manual_seed(0)
    square, oblong = _pixels(photos[:5]), _pixels(photos[5:], resolution=32)
    alone = [Latents(vae, p, cached=True, flip_p=0.5, encode_batch=2) for p in (square, oblong)]
    rows = 2 * len(photos)
    disks = [tmp_path / "node0", tmp_path / "node0", tmp_path / "node1"]
    calls = [Counting(vae) for _ in range(3)]

    def run(rank: int, spread) -> list[Latents]:
        parts = [Latents(calls[rank], p, cached=True, flip_p=0.5, encode_batch=2, encode=False)
                 for p in (_pixels(photos[:5]), _pixels(photos[5:], resolution=32))]
        encode_latents(parts, spread, root=disks[rank])
        return parts

    results = ThreadRanks(3).run(run)
    encoded = [c.encoded for c in calls]
    assert sum(encoded) == rows and max(encoded) - min(encoded) <= 1
    assert sorted(os.listdir(disks[0])) == sorted(os.listdir(disks[2])) and len(os.listdir(disks[0])) >= 3
    eps = torch.randn(3, 4, 8, 8, generator=generator)
    for rank, parts in enumerate(results):
        for part, reference in zip(parts, alone, strict=True):
            index = torch.tensor([0, 1, len(part.mean) - 1])
            assert _mapped_from(part.mean.rows.blocks[0], disks[rank])
            torch.testing.assert_close(part.mean[index], reference.mean[index], rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(part.std[index], reference.std[index], rtol=1e-5, atol=1e-6)
            batch = types.SimpleNamespace(image_index=torch.tensor([0, 1]), flip=torch.tensor([False, True]),
                                          latent_eps=eps[:2, :, : part.latent_shape()[1], : part.latent_shape()[2]])
            torch.testing.assert_close(part.sample(batch), reference.sample(batch), rtol=1e-5, atol=1e-6)


def test_the_key_changes_with_any_image_byte_crop_or_vae_setting(vae, photos):
    base = Latents(vae, _pixels(photos), cached=False, flip_p=0.5)
    key = latent_cache.cache_key([base], {"vae_dtype": "torch.float32"})
    assert key == latent_cache.cache_key([Latents(vae, _pixels(photos), cached=False, flip_p=0.5)],
                                         {"vae_dtype": "torch.float32"})
    assert key != latent_cache.cache_key([base], {"vae_dtype": "torch.bfloat16"})
    assert key != latent_cache.cache_key([Latents(vae, _pixels(photos), cached=False, flip_p=0.0)],
                                         {"vae_dtype": "torch.float32"})
    assert key != latent_cache.cache_key([Latents(vae, _pixels(photos, 32), cached=False, flip_p=0.5)],
                                         {"vae_dtype": "torch.float32"})
    photos[3].write_bytes(photos[3].read_bytes() + b"\0")  # one byte more in one file
    assert key != latent_cache.cache_key([base], {"vae_dtype": "torch.float32"})


def test_pixels_decode_each_image_when_read_and_an_image_gone_mid_run_is_one_line(photos):
    pixels = _pixels(photos)
    assert pixels.shape == (len(photos), 3, 64, 64) and len(pixels) == len(photos)
    with Image.open(photos[1]) as img:
        expected = preprocess(img, 64, center_crop=True)
    assert torch.equal(pixels[1], expected) and torch.equal(pixels[torch.tensor([1])][0], expected)
    assert pixels[2:4].shape == (2, 3, 64, 64) and pixels[[]].shape == (0, 3, 64, 64)
    photos[1].write_bytes(b"not an image any more")
    with pytest.raises(UserError, match=r"p1.png no longer reads as the image it was when training started"):
        pixels[1]


def test_random_crop_draws_one_place_per_image_from_the_seed_and_crops_its_mask_there():
    boxes = {square_box(100, 60, False, 7, f"im{i}.png") for i in range(20)}
    assert len(boxes) > 5 and all(box[1] == 0 and box[2] == 60 and 0 <= box[0] <= 40 for box in boxes)
    assert square_box(100, 60, False, 7, "a.png") == square_box(100, 60, True, 7, "a.png")  # the seed decides
    assert square_box(100, 60, False, 7, "a.png") != square_box(100, 60, False, 8, "a.png") or \
        square_box(100, 60, False, 7, "b.png") != square_box(100, 60, False, 8, "b.png")
    left, top, side = square_box(100, 60, False, 7, "a.png")
    height, width, crop_top, crop_left, mirrored = crop_of(100, 60, 30, False, 7, "a.png")
    assert (height, width, crop_top, crop_left) == (60, 100, 0, round(left / 2))
    assert mirrored == 50 - 30 - round(left / 2)


def test_random_crop_trains_the_drawn_square_and_its_mask(tmp_path):
    from xeontune.train.buckets import load_training_images
    from xeontune.train.data import mask_tensor
    from xeontune.train.options import TrainOptions, validate

    data = tmp_path / "data"
    data.mkdir()
    ramp = torch.arange(96, dtype=torch.uint8).expand(48, 96)  # brightness = column: the crop's place shows
    Image.fromarray(torch.stack([ramp] * 3, -1).numpy()).save(data / "wide.png")
    mask = torch.zeros(48, 96, dtype=torch.uint8)
    mask[:, :48] = 255
    Image.fromarray(mask.numpy()).save(data / "wide.mask.png")
    opts = validate(TrainOptions(model="m", data_dir=str(data), placeholder_token="<t>", initializer_token="t",
                                 resolution=48, random_crop=True, seed=11, buckets="off"))
    images = load_training_images(opts)
    left, _, _ = square_box(96, 48, False, 11, "wide.png")
    pixels = images.parts[0].pixels[0]
    assert abs(float((pixels[0, 0, 0] + 1) * 127.5) - left) <= 1  # the first column is the crop's
    masks = mask_tensor(mask_weights(images.paths, images.sizes, 48, False, random_crop=11))
    white = torch.tensor([sum(c < 48 for c in range(left + 8 * j, left + 8 * j + 8)) / 8 for j in range(6)])
    assert masks is not None and torch.allclose(masks[0, 0, 0], white, atol=0.02)
    with pytest.raises(UserError, match="--center-crop and --random-crop each choose the square"):
        validate(TrainOptions(model="m", data_dir=str(data), placeholder_token="<t>", initializer_token="t",
                              center_crop=True, random_crop=True))


@pytest.mark.slow
def test_a_second_run_on_the_same_images_reads_the_latents_and_trains_the_same_vectors(tiny_model, sample_images,
                                                                                      tmp_path, caplog):
    """--latent-cache-dir: the first run encodes and keeps; the second reads every latent and learns
    the same vectors bit for bit (fp32); with 'none' nothing is written and the vectors are the same."""
    from tests.checks import assert_same_vectors
    from tests.trainlib import train

    cache = tmp_path / "latents"

    def run(out: str, where: str) -> str:
        caplog.clear()
        with caplog.at_level("INFO", logger="xeontune.train"):  # a bench run in this process may have quieted it
            train(["--model", str(tiny_model), "--data-dir", str(sample_images), "--placeholder-token", "<t>",
                   "--initializer-token", "toy", "--resolution", "32", "--max-train-steps", "3",
                   "--mixed-precision", "fp32", "--learning-rate", "5e-2", "--save-steps", "0",
                   "--latent-cache-dir", where, "--output-dir", str(tmp_path / out)])
        return next(r.getMessage() for r in caplog.records if r.getMessage().startswith("cached "))

    first = run("first", str(cache))
    (key,) = cache.iterdir()
    assert "; kept in " + str(key) in first and any(key.iterdir())
    second = run("second", str(cache))
    rows = int(second.split()[1])
    assert f"; {rows} read from {key}" in second
    assert_same_vectors(tmp_path / "second", tmp_path / "first", atol=0)
    none = run("none", "none")
    assert " kept in" not in none and " read from" not in none and list(cache.iterdir()) == [key]
    assert_same_vectors(tmp_path / "none", tmp_path / "first", atol=0)


def test_a_latent_cache_dir_that_cannot_be_written_is_one_line_before_any_model_loads(tiny_model, sample_images,
                                                                                     tmp_path, capsys):
    from tests.one_line import one_line_error

    (tmp_path / "afile").write_text("")
    args = ["train", "--model", str(tiny_model), "--data-dir", str(sample_images), "--placeholder-token", "<t>",
            "--initializer-token", "toy", "--resolution", "32", "--output-dir", str(tmp_path / "out"),
            "--latent-cache-dir", str(tmp_path / "afile" / "latents")]
    message = one_line_error(capsys, args)
    assert message.startswith(f"error: --latent-cache-dir {tmp_path / 'afile' / 'latents'} cannot be written "
                              f"({tmp_path / 'afile'} is a file)")
    assert "give another folder, or none to keep the latents in memory" in message
