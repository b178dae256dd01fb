"""The image folder's checks that need no decode and no torch: the images' sizes from their headers, the
layout, the masks and the prompts. A rank runs them on the folder it trains on (``masks_and_prompts``, from
loop.read_training_data); `xeontune run` runs them all on the user's machine before a cluster exists
(``check_training_data``), in a process that never imports torch."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from xeontune.errors import UserError
from xeontune.train import prior
from xeontune.train.images import check_mask_files, mask_weights, read_image_sizes
from xeontune.train.layout import Parts, bucket_layout, random_crop_seed
from xeontune.train.methods.declaration import get as declared
from xeontune.train.prompts import ImagePrompts, image_prompts


def check_training_data(opts: Any) -> None:
    """``loop.read_training_data``'s checks from the images' headers, decoding none (the masks alone are
    read): `xeontune run` calls this on the user's machine before it creates a cluster, so a mistake in the
    folder costs no machine, and 200 photos cost neither gigabytes of memory nor minutes of decoding here.
    What only a decode finds (pixels damaged past a sound header) is left to the rank, which skips the file."""
    if opts.with_prior_preservation:
        prior.check_class_dir(opts)
    found = list(read_image_sizes(opts.data_dir))
    paths, sizes = [p for p, _ in found], [s for _, s in found]
    bucketed, layout = bucket_layout(sizes, opts)
    masks_and_prompts(opts, paths, sizes, layout, bucketed)


def masks_and_prompts(opts: Any, paths: list[Path], sizes: list[tuple[int, int]], layout: Parts,
                      bucketed: bool) -> tuple[list[list[np.ndarray] | None], ImagePrompts | None]:
    """Each part's masks (``images.mask_weights``) and the images' prompts, checked: masks named and sized
    as their images, not all black, and prompts that suit the method (its declared ``check_prompts``)."""
    check_mask_files(opts.data_dir)
    masks = [mask_weights([paths[i] for i in members], [sizes[i] for i in members], opts.resolution,
                          opts.center_crop, size if bucketed else None, random_crop_seed(opts))
             for size, members in layout]
    if all(part is not None and not any(m.any() for m in part) for part in masks):
        raise UserError(f"every image's mask in {opts.data_dir} is black all over, so nothing would train: "
                        "white marks what the loss counts (IMAGE.mask.png)")
    given = image_prompts(opts.data_dir, paths, instance_prompt=opts.instance_prompt,
                          caption_column=opts.caption_column)
    declared(opts.method).check_prompts(opts, given)
    return masks, given
