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

import math
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from xeontune.errors import UserError
from xeontune.train.data import (
    Batch,
    Latents,
    cover_box,
    decode_upright,
    eight_bit,
    fit_square,
    no_readable_image,
    open_image,
    read_image_sizes,
)


def bucket_sizes(resolution: int, step: int, max_ratio: float = 2.0) -> list[tuple[int, int]]:
    """The buckets' (width, height): multiples of ``step`` of about ``resolution`` squared pixels (not
    more), from 1:``max_ratio`` to ``max_ratio``:1, each landscape shape with its portrait twin; the
    square one first, then by width."""
    area = resolution * resolution
    square = (resolution, resolution)
    sizes = {square} if resolution % step == 0 else set()
    for width in range(step, int(resolution * max_ratio) + 1, step):
        height = area // width // step * step  # the most pixels within the area
        if step <= height <= width and width / height <= max_ratio:
            sizes |= {(width, height), (height, width)}
    return sorted(sizes, key=lambda size: (size != square, size[0]))


def nearest_bucket(width: int, height: int, sizes: list[tuple[int, int]]) -> tuple[int, int]:
    """The bucket whose aspect ratio is nearest the image's (on a log scale; the larger on a tie)."""
    aspect = math.log(width / height)
    return min(sizes, key=lambda s: (abs(math.log(s[0] / s[1]) - aspect), -s[0] * s[1]))


def fit_to_bucket(img: Image.Image, size: tuple[int, int]) -> tuple[torch.Tensor, tuple[int, int, int, int, int]]:
    """The image scaled to cover ``size`` and center-cropped to it, in [-1, 1], and its crop in SDXL's
    terms (as data.crop_of: original height and width, crop top and left in the scaled image, the
    mirrored image's crop left)."""
    box, scale = cover_box(img.width, img.height, size)
    pixels = eight_bit(img).convert("RGB").resize(size, Image.BICUBIC, box=box)
    array = np.asarray(pixels, dtype=np.float32) / 127.5 - 1.0
    top, left = round(box[1] * scale), round(box[0] * scale)
    mirrored_left = max(0, round(img.width * scale) - size[0] - left)
    return torch.from_numpy(array).permute(2, 0, 1).contiguous(), (img.height, img.width, top, left, mirrored_left)


@dataclass
class BucketImages:
    """The images of one bucket: pixels (n, 3, H, W), crops (n, 5) and each one's index in the folder."""

    size: tuple[int, int]  # (width, height)
    pixels: torch.Tensor
    crops: torch.Tensor
    members: list[int]


@dataclass
class TrainingImages:
    paths: list[Path]  # every readable image of --data-dir, by name
    sizes: list[tuple[int, int]]  # each one's upright (width, height)
    parts: list[BucketImages]  # one part of all the images at --resolution without buckets
    bucketed: bool

    def add(self, upright: Iterable[Image.Image], opts: Any) -> int:
        """Prior preservation's class images, after each part's own images, fitted to each part as they
        come (one decoded image held at a time: a user's class photos may be full-size). How many."""
        fitted: list[list[tuple[torch.Tensor, Any]]] = [[] for _ in self.parts]
        for img in upright:
            for part, into in zip(self.parts, fitted, strict=True):
                into.append(_fit(img, part.size, self.bucketed, opts))
        for part, into in zip(self.parts, fitted, strict=True):
            if into:
                part.pixels = torch.cat([part.pixels, torch.stack([f[0] for f in into])])
                part.crops = torch.cat([part.crops, torch.tensor([f[1] for f in into], dtype=torch.long)])
        return len(fitted[0])


Parts = list[tuple[tuple[int, int], list[int]]]  # each part's (width, height) and its images' indices
Layout = tuple[bool, Parts]  # bucketed?, the parts


def bucket_layout(sizes: list[tuple[int, int]], opts: Any) -> Layout:
    """How images of these upright sizes train: in buckets when --buckets says so (auto: when some image's
    nearest bucket is not the square one), each bucket with the indices of its images; else one square part
    at --resolution. From the sizes alone, so the user's machine decides it as a rank does (job/run.py)."""
    every = list(range(len(sizes)))
    square = (opts.resolution, opts.resolution)
    bucket_list = bucket_sizes(opts.resolution, opts.bucket_step)
    if opts.buckets == "on" and square not in bucket_list:
        raise UserError(f"--buckets on: --resolution {opts.resolution} must be a multiple of --bucket-step "
                        f"{opts.bucket_step}")
    chosen = [nearest_bucket(w, h, bucket_list) for w, h in sizes] if bucket_list else []
    # auto: square images stay square at --resolution, even where it is no multiple of --bucket-step
    # (the buckets then hold no square one: a square image's nearest would be an oblong one, such as
    # 960x1024 at --resolution 1000)
    squarest = nearest_bucket(1, 1, bucket_list) if bucket_list else square
    if opts.buckets == "off" or not chosen or (opts.buckets == "auto" and all(c == squarest for c in chosen)):
        return False, [(square, every)]
    if square not in bucket_list:  # auto, images of several shapes: without a square bucket a square photo is cut oblong
        raise UserError(f"the images are of several shapes, so --buckets auto puts them in aspect-ratio buckets, "
                        f"whose sides are multiples of --bucket-step {opts.bucket_step}: give a --resolution "
                        f"that is one too, a smaller --bucket-step, or --buckets off (square crops)")
    return True, [(size, members) for size in bucket_list if (members := [i for i in every if chosen[i] == size])]


def load_training_images(opts: Any) -> TrainingImages:
    """--data-dir's images as ``bucket_layout`` lays them out, fitted. The layout comes from the headers;
    then each image is decoded and fitted on its own, so one full-size photo is held at a time, not all.
    An image whose pixels do not decode is skipped (with a warning), and one that decodes to another
    size than its header said is taken at that size: the folder is then laid out again, once."""
    found = dict(read_image_sizes(opts.data_dir))
    while True:
        paths, sizes = list(found), list(found.values())
        bucketed, layout = bucket_layout(sizes, opts)
        parts = []
        for size, members in layout:
            fitted = []
            for i in members:
                upright = open_image(paths[i], decode_upright)
                if upright is None:  # its header read, its pixels did not: skipped (warned)
                    del found[paths[i]]
                elif upright.size != sizes[i]:  # its orientation was not where its header said
                    found[paths[i]] = upright.size
                else:
                    fitted.append(_fit(upright, size, bucketed, opts))
            parts.append((size, members, fitted))
        if found == dict(zip(paths, sizes, strict=True)):
            return TrainingImages(paths, sizes, [
                BucketImages(size, torch.stack([f[0] for f in fitted]),
                             torch.tensor([f[1] for f in fitted], dtype=torch.long), members)
                for size, members, fitted in parts], bucketed)
        if not found:
            raise UserError(no_readable_image(Path(opts.data_dir)))


def _fit(upright: Image.Image, size: tuple[int, int], bucketed: bool, opts: Any) -> tuple[torch.Tensor, Any]:
    if bucketed:
        return fit_to_bucket(upright, size)
    pixels, crops = fit_square([upright], opts.resolution, opts.center_crop)
    return pixels[0], crops[0].tolist()


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
