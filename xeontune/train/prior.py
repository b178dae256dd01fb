"""Prior preservation (DreamBooth): class images, and the base model generating the missing ones.

``--with-prior-preservation --class-data-dir DIR --class-prompt "a photo of a dog"`` trains each
step on class images too (``data.sample_loss`` adds ``--prior-loss-weight`` times their loss), so the
model keeps drawing the class as it did. The class images are the first ``--num-class-images`` images
of DIR by name. When DIR holds fewer, the missing ones are generated before training by the frozen base
pipeline on the CPU, spread over the ranks, each written as it is done (``class-NNNNN.png``): a run
stopped half-way generates only what is still missing. Each rank draws ``--sample-batch-size`` images a
pipeline call, as the example does; image i starts from its own seed, so which rank draws it (and beside
which others) changes nothing but rounding, and every node ends with the whole set (the ranks exchange
what they drew, for nodes without a shared filesystem).
"""

from __future__ import annotations

import io
import logging
import time
from pathlib import Path
from typing import Any

from PIL import Image

from xeontune.errors import UserError
from xeontune.io import atomic_path
from xeontune.train.images import IMAGE_SUFFIXES, is_image_file

log = logging.getLogger("xeontune.train")

GENERATED = "class-{:05d}.png"
CLASS_IMAGE_SEED = 0xC1A55_1A6E  # the class images' seeds, apart from every training stream


def check_class_dir(opts: Any) -> None:
    """Before anything loads: DIR must be a folder (or not exist yet), not the --data-dir, and hold no
    folder named like an image."""
    class_dir, data_dir = Path(opts.class_data_dir), Path(opts.data_dir)
    if class_dir.exists() and not class_dir.is_dir():
        raise UserError(f"--class-data-dir {class_dir} is a file, not a folder")
    if class_dir.resolve() == data_dir.resolve():
        raise UserError(f"--class-data-dir {class_dir} is the --data-dir: generated class images would become "
                        "training images of the subject; give the class images a folder of their own")
    # a folder named like an image is no class image: one named as a generated one (class-00000.png) would
    # stop the run when that image is written, after the base model loaded and drew the others
    listed = sorted(class_dir.iterdir()) if class_dir.is_dir() else []
    folders = [p for p in listed if p.suffix.lower() in IMAGE_SUFFIXES and p.is_dir()]
    if folders:
        raise UserError(f"--class-data-dir {class_dir} holds a folder named like an image, {folders[0]}: class "
                        f"images are files there (generated ones are named {GENERATED.format(0)}, ...); "
                        "rename or move the folder")


def class_image_names(class_dir: Path) -> list[str]:
    """The readable images of DIR: a damaged one counts as missing (a generated one is drawn again)."""
    return sorted(p.name for p in class_dir.iterdir() if is_image_file(p) and _readable(p)) if class_dir.is_dir() else []


def _readable(path: Path) -> bool:
    try:
        with Image.open(path) as img:
            img.verify()  # the whole file's structure (PNG: every chunk's CRC), without decoding pixels
        return True
    except Exception:  # PIL raises many kinds for damaged files; any of them means unusable
        return False


def missing_names(have: list[str], wanted: int) -> list[str]:
    """The generated names that would bring ``have`` up to ``wanted`` images."""
    others = [n for n in have if _generated_index(n) is None]
    names = [GENERATED.format(i) for i in range(max(0, wanted - len(others)))]
    return [n for n in names if n not in have]


def _generated_index(name: str) -> int | None:
    stem = name.removeprefix("class-").removesuffix(".png")
    return int(stem) if name.startswith("class-") and name.endswith(".png") and stem.isdigit() else None


def ensure_class_images(components: Any, method: Any, opts: Any, sync: Any, autocast: Any) -> None:
    """Generate what DIR lacks (on any node) of ``--num-class-images``, each rank its share, then give
    every node every image."""
    import torch  # here: the folder's checks above are `run`'s too, in a process without torch (data_check.py)
    from tqdm.auto import tqdm

    from xeontune.train.data import sample_generator

    class_dir = Path(opts.class_data_dir)
    rank, world = sync.rank, sync.world
    class_dir.mkdir(parents=True, exist_ok=True)
    missing = missing_names(class_image_names(class_dir), opts.num_class_images)
    if sync.group is not None:  # what any node lacks is generated (every node computes the same list)
        missing = sorted(set().union(*sync.gather(missing)))
    if not missing:
        return
    mine = missing[rank::world]
    if rank == 0:
        log.info("generating %d class images for %r with the base model, over %d rank(s), into %s",
                 len(missing), opts.class_prompt, world, class_dir)
    drawn: dict[str, bytes] = {}
    from xeontune.train.validation import make_pipeline

    with method.inference(components):
        pipe = make_pipeline(components)
        started = time.perf_counter()
        with tqdm(total=len(mine), desc="class images", unit="image", disable=rank != 0) as bar:
            for first in range(0, len(mine), opts.sample_batch_size):  # batches fill many threads better
                names = mine[first:first + opts.sample_batch_size]
                with torch.no_grad(), autocast():
                    images = pipe([opts.class_prompt] * len(names), num_inference_steps=opts.class_inference_steps,
                                  generator=[sample_generator(opts.seed ^ CLASS_IMAGE_SEED, _generated_index(name))
                                             for name in names],
                                  height=opts.resolution, width=opts.resolution).images
                for name, image in zip(names, images, strict=True):
                    buffer = io.BytesIO()
                    image.save(buffer, format="PNG")
                    drawn[name] = buffer.getvalue()
                    write(class_dir / name, drawn[name])
                bar.update(len(names))
    if sync.group is not None:
        for share in sync.gather(drawn):
            for name, data in share.items():
                if not (class_dir / name).exists():  # a node without a shared filesystem
                    write(class_dir / name, data)
    if rank == 0:  # after the gather: the slowest rank's time, what the job waited
        elapsed = time.perf_counter() - started
        log.info("generated %d class images in %.1f s: %.3f images/s over %d rank(s)",
                 len(missing), elapsed, len(missing) / elapsed, world)


def write(path: Path, data: bytes) -> None:
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)


