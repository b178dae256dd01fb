"""Aspect-ratio buckets: photos of any shape trained near their own aspect ratio, not squeezed or cut
to a square.

``--buckets`` (auto: on when some image's nearest bucket is not the squarest) puts each image in the
bucket of nearest aspect ratio among a few sizes of about ``--resolution`` squared pixels, multiples of
``--bucket-step`` (64), from 1:2 to 2:1; the image is scaled to cover its bucket and the excess cut
evenly from both sides. Latents are cached per bucket (``BucketLatents``: one ``Latents`` each), the
sample plan draws every global micro-batch from one bucket (data.SamplePlan), and SDXL's time_ids carry
each image's original size, its crop and its bucket's size.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from xeontune.errors import UserError
from xeontune.train.data import Batch, Pixels, fit_square
from xeontune.train.images import (
    cover_box,
    crop_of,
    decode_upright,
    eight_bit,
    no_readable_image,
    open_image,
    read_image_sizes,
)
from xeontune.train.latent_cache import Latents
from xeontune.train.layout import bucket_layout, random_crop_seed


def fit_to_bucket(img: Image.Image, size: tuple[int, int]) -> tuple[torch.Tensor, tuple[int, int, int, int, int]]:
    """The image scaled to cover ``size`` and center-cropped to it, in [-1, 1], and its crop
    (``bucket_crop``)."""
    box, _ = cover_box(img.width, img.height, size)
    pixels = eight_bit(img).convert("RGB").resize(size, Image.BICUBIC, box=box)
    array = np.asarray(pixels, dtype=np.float32) / 127.5 - 1.0
    return torch.from_numpy(array).permute(2, 0, 1).contiguous(), bucket_crop(img.width, img.height, size)


def bucket_crop(width: int, height: int, size: tuple[int, int]) -> tuple[int, int, int, int, int]:
    """``fit_to_bucket``'s crop of a width x height image in SDXL's terms (as images.crop_of: original height
    and width, crop top and left in the scaled image, the mirrored image's crop left)."""
    box, scale = cover_box(width, height, size)
    top, left = round(box[1] * scale), round(box[0] * scale)
    return height, width, top, left, max(0, round(width * scale) - size[0] - left)


@dataclass
class BucketImages:
    """The images of one bucket: pixels (n, 3, H, W, decoded when read), crops (n, 5) and each one's index
    in the folder."""

    size: tuple[int, int]  # (width, height)
    pixels: Pixels
    crops: torch.Tensor
    members: list[int]


@dataclass
class TrainingImages:
    paths: list[Path]  # every readable image of --data-dir, by name
    sizes: list[tuple[int, int]]  # each one's upright (width, height)
    parts: list[BucketImages]  # one part of all the images at --resolution without buckets
    bucketed: bool

    def add(self, found: Iterable[tuple[Path, Image.Image]], opts: Any) -> int:
        """Prior preservation's class images (path and decoded image), after each part's own images,
        fitted to each part as they come (one decoded image held at a time: a user's class photos may be
        full-size), their pixels decoded again when read. How many."""
        paths: list[Path] = []
        crops: list[list[Any]] = [[] for _ in self.parts]
        for path, img in found:
            paths.append(path)
            for part, into in zip(self.parts, crops, strict=True):
                into.append(_crop(img, path.name, part.size, self.bucketed, opts))
        for part, into in zip(self.parts, crops, strict=True):
            if into:
                part.pixels.extend(paths, fitter(part.size, self.bucketed, opts))
                part.crops = torch.cat([part.crops, torch.tensor(into, dtype=torch.long)])
        return len(paths)


def load_training_images(opts: Any) -> TrainingImages:
    """--data-dir's images as ``bucket_layout`` lays them out, each decoded once here to check it and take
    its crop, one at a time (a full-size photo held at a time, not all), and decoded again when trained
    on (``Pixels``). The layout comes from the headers; an image whose pixels do not decode is skipped
    (with a warning), and one that decodes to another size than its header said is taken at that size:
    the folder is then laid out again, once."""
    found = dict(read_image_sizes(opts.data_dir))
    while True:
        paths, sizes = list(found), list(found.values())
        bucketed, layout = bucket_layout(sizes, opts)
        parts = []
        for size, members in layout:
            crops = []
            for i in members:
                upright = open_image(paths[i], decode_upright)
                if upright is None:  # its header read, its pixels did not: skipped (warned)
                    del found[paths[i]]
                elif upright.size != sizes[i]:  # its orientation was not where its header said
                    found[paths[i]] = upright.size
                else:
                    crops.append(_crop(upright, paths[i].name, size, bucketed, opts))
            parts.append((size, members, crops))
        if found == dict(zip(paths, sizes, strict=True)):
            images = TrainingImages(paths, sizes, [], bucketed)
            for size, members, crops in parts:
                pixels = Pixels(size[1], size[0])
                pixels.extend([paths[i] for i in members], fitter(size, bucketed, opts))
                images.parts.append(BucketImages(size, pixels, torch.tensor(crops, dtype=torch.long), members))
            return images
        if not found:
            raise UserError(no_readable_image(Path(opts.data_dir)))


def _crop(upright: Image.Image, name: str, size: tuple[int, int], bucketed: bool, opts: Any) -> list[int]:
    """An image's crop (images.crop_of) as ``fitter``'s pixels take it, from its size alone."""
    if bucketed:
        return list(bucket_crop(upright.width, upright.height, size))
    return list(crop_of(upright.width, upright.height, opts.resolution, opts.center_crop, random_crop_seed(opts), name))


def fitter(size: tuple[int, int], bucketed: bool, opts: Any):
    """What ``Pixels`` fits each decoded image with: ``_fit``'s pixels, without holding the options."""
    chosen = {"resolution": opts.resolution, "center_crop": opts.center_crop, "random_crop": getattr(opts, "random_crop", False),
              "seed": opts.seed}
    return functools.partial(_fitted_pixels, size=size, bucketed=bucketed, **chosen)


def _fitted_pixels(upright: Image.Image, name: str, size: tuple[int, int], bucketed: bool, resolution: int,
                   center_crop: bool, random_crop: bool, seed: int) -> torch.Tensor:
    if bucketed:
        return fit_to_bucket(upright, size)[0]
    return fit_square(upright, resolution, center_crop, seed if random_crop else None, name)[0]


class BucketLatents:
    """One ``Latents`` per bucket; a batch (all of one bucket) is served by its bucket's."""

    def __init__(self, parts: list[Latents]) -> None:
        self.parts = parts

    @property
    def vae(self) -> Any:
        return self.parts[0].vae

    @vae.setter
    def vae(self, value: Any) -> None:  # loop.release_vae_parts frees the encoder once every latent is cached
        for part in self.parts:
            part.vae = value

    def latent_shapes(self) -> list[tuple[int, int, int]]:
        return [part.latent_shape() for part in self.parts]

    def sample(self, batch: Batch) -> torch.Tensor:
        return self.parts[batch.bucket].sample(batch)

    def mask(self, batch: Batch) -> torch.Tensor | None:
        return self.parts[batch.bucket].mask(batch)

    def time_ids(self, batch: Batch) -> torch.Tensor:
        return self.parts[batch.bucket].time_ids(batch)
