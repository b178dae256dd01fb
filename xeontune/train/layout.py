"""How a folder's images train, from their sizes alone: in aspect-ratio buckets (train/buckets.py) where
--buckets says so, else as one square part at --resolution. Torch-free, so that the user's machine lays the
folder out as a rank does (train/data_check.py, for `xeontune run`).
"""

from __future__ import annotations

import math
from typing import Any

from xeontune.errors import UserError


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


def random_crop_seed(opts: Any) -> int | None:
    """The seed of --random-crop's places (images.square_box), None without it."""
    return opts.seed if getattr(opts, "random_crop", False) else None
