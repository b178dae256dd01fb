"""The image folder as training reads it, without torch (so that `xeontune run` checks a folder on the user's
machine as a rank would, in a process that never imports torch): which files are images and masks, their
upright sizes from the headers, decoding to 8-bit, the crop each image gets, and the masks' loss weights.
train/data.py builds the training tensors from these.
"""

from __future__ import annotations

import contextlib
import logging
import struct
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
from PIL import ExifTags, Image, ImageOps, PngImagePlugin, UnidentifiedImageError

from xeontune.errors import UserError
from xeontune.train.options import require_dir

log = logging.getLogger("xeontune.train.data")  # its warnings are the data reader's, as before the split

IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg", ".webp", ".bmp", ".tif", ".tiff"}
MASK_SUFFIX = ".mask.png"  # IMAGE.mask.png beside IMAGE.jpg: white = learn, black = ignore (kohya's masked loss)


def is_image_file(path: Path) -> bool:
    """A training image of the folder: not hidden, an image suffix, not a mask (``NAME.mask.<suffix>``)."""
    return (path.is_file() and not path.name.startswith(".") and path.suffix.lower() in IMAGE_SUFFIXES
            and not _is_mask_name(path))


def _is_mask_name(path: Path) -> bool:
    return Path(path.stem).suffix.lower() == ".mask"


def mask_path(image: Path) -> Path:
    return image.with_name(image.stem + MASK_SUFFIX)


def check_mask_files(data_dir: str | Path) -> None:
    """Every mask of the folder belongs to an image and is named as one: a mask beside no image (a typo)
    or in another format would otherwise be silently unused."""
    root = Path(data_dir)
    stems = {p.stem for p in root.iterdir() if is_image_file(p)}
    for path in sorted(root.iterdir()):
        if path.name.startswith(".") or path.suffix.lower() not in IMAGE_SUFFIXES or not _is_mask_name(path):
            continue
        image_stem = Path(path.stem).stem
        if not path.name.endswith(MASK_SUFFIX):
            raise UserError(f"mask {path}: masks are named {image_stem}{MASK_SUFFIX} (a PNG; white = learn, "
                            "black = ignore)")
        if image_stem not in stems:
            raise UserError(f"mask {path} has no image beside it (an image named {image_stem}.png, .jpg, ...)")

def read_images(data_dir: str | Path, limit: int | None = None) -> Iterator[tuple[Path, Image.Image]]:
    """Each readable image of the folder, upright, by name (the first ``limit`` readable ones); unreadable
    files are skipped with a warning, and a folder with none is a one-line error."""
    yield from _each_image(data_dir, limit, decode_upright)


def read_image_sizes(data_dir: str | Path) -> Iterator[tuple[Path, tuple[int, int]]]:
    """``read_images`` without decoding: each image's upright (width, height) from its header. A file whose
    header reads but whose pixels do not passes here; the decode that trains on it skips it with a warning."""
    yield from _each_image(data_dir, None, upright_size)


def decode_upright(img: Image.Image) -> Image.Image:
    img.load()
    # Phone photos are stored sideways with an EXIF orientation tag: train on what a viewer shows.
    return eight_bit(ImageOps.exif_transpose(img), _described(img))


RESAVE = "save it as an 8- or 16-bit PNG"


def eight_bit(img: Image.Image, name: str | None = None) -> Image.Image:
    """``img`` with 8 bits a channel, scaled by its mode's range: ``convert`` clips wider pixels to 0..255,
    which turns a 16-bit image white and a 0..1 float one black. 16-bit (I;16...) and 32-bit integer (I)
    pixels are read as 0..65535, float (F) ones as 0..1; 32-bit or float pixels outside that range, and
    32-bit ones no brighter than 255 (8-bit values, or a black 16-bit image?) are a one-line error naming
    the file (``name``: "image PATH"). Other modes already have 8 bits a channel: returned as they are."""
    if img.mode not in ("I", "F") and not img.mode.startswith("I;16"):
        return img
    name = name or _described(img)
    pixels = np.asarray(img)
    if img.mode == "F":
        if not np.isfinite(pixels).all():
            raise UserError(f"{name} holds float pixels that are no numbers (NaN or infinity): {RESAVE}")
        low, high = float(pixels.min()), float(pixels.max())
        if low < 0 or high > 1:
            raise UserError(f"{name} holds float pixels from {low:g} to {high:g}: only floats from 0 to 1 are "
                            f"read; {RESAVE}")
        return Image.fromarray(np.rint(pixels * 255).astype(np.uint8))
    if img.mode == "I":
        low, high = int(pixels.min()), int(pixels.max())
        if low < 0 or high > 65535:
            raise UserError(f"{name} holds 32-bit pixels from {low} to {high}: only 0 to 65535 (16 bits) are "
                            f"read; {RESAVE}")
        if high <= 255:
            raise UserError(f"{name} holds 32-bit pixels no brighter than {high}, read as 16 bits (0 to 65535): "
                            f"8-bit values, or a black image? {RESAVE}")
    # round(v / 257) in integers: 65535 / 257 is exactly 255
    return Image.fromarray(((pixels.astype(np.int32) + 128) // 257).astype(np.uint8))


def _described(img: Image.Image) -> str:
    # Image.open sets filename; a transposed or converted copy has none
    return f"image {getattr(img, 'filename', '') or '(unnamed)'}"


def upright_size(img: Image.Image) -> tuple[int, int]:
    """(width, height) as ``decode_upright`` gives the image, from its metadata alone, decoding no pixel: the
    header's, and a PNG's chunks after its pixels too (``png_exif``), so `run`'s check and a rank agree. A
    rank that still decodes an image of another size lays its folder out again (buckets.load_training_images)."""
    if img.format == "TIFF":  # Pillow gives a TIFF's size upright on open and turns its pixels on load
        return img.size
    exif = png_exif(img) if img.format == "PNG" else img.getexif()
    return (img.height, img.width) if exif.get(ExifTags.Base.Orientation, 1) in (5, 6, 7, 8) else img.size


PNG_EXIF_CHUNKS = (b"eXIf", b"tEXt", b"zTXt", b"iTXt")  # where Pillow finds an orientation (ImageMagick's raw
# profile and XMP are text chunks)


def png_exif(img: Image.Image) -> Image.Exif:
    """The EXIF a decode of the PNG ``img`` (just opened) transposes by: that of its chunks before the pixels
    and after them (an eXIf may follow IDAT; Pillow reads those chunks when it decodes), read with Pillow's
    own chunk readers while every pixel chunk is skipped, not inflated. PNG's own getexif() would decode
    the whole image for it."""
    info = dict(img.info)
    filename = getattr(img, "filename", "")
    if filename:
        # a chunk past the pixels that does not read: the decode fails there too (and skips the file)
        with contextlib.suppress(OSError, ValueError, SyntaxError, struct.error):
            info.update(_png_info_after_pixels(Path(filename), bool(getattr(img, "is_animated", False))))
    probe = Image.new("1", (1, 1))  # Image.getexif's rule (eXIf, else the raw profile; XMP) on that info
    probe.info = info
    return probe.getexif()


def _png_info_after_pixels(path: Path, animated: bool) -> dict[str | tuple[int, int], Any]:
    """The image info that the PNG's metadata chunks after its first pixel chunk give, as Pillow's
    ``load_end`` reads them: up to IEND, or an animation's next frame."""
    with path.open("rb") as fp:
        if fp.read(8) != b"\x89PNG\r\n\x1a\n":
            return {}
        png = PngImagePlugin.PngStream(fp)
        after = False
        while True:
            try:
                cid, pos, length = png.read()
            except (struct.error, SyntaxError):  # the file's end (or a damaged chunk: the decode stops there too)
                break
            if cid == b"IEND" or (after and animated and cid == b"fcTL"):
                break
            after = after or cid == b"IDAT"
            if after and cid in PNG_EXIF_CHUNKS:
                try:
                    png.call(cid, pos, length)
                except UnicodeDecodeError:  # where Pillow's load_end stops reading too
                    break
            fp.seek(pos + length + 4)  # past the data (unread, or read) and the CRC
        return png.im_info


def _each_image(data_dir: str | Path, limit: int | None, take: Callable[[Image.Image], Any]) -> Iterator[tuple[Path, Any]]:
    """``take`` of each readable image of the folder, by name: read_images' rules, one image open at a time."""
    root = Path(data_dir)
    require_dir(root, "data dir")
    for link in sorted(p for p in root.iterdir() if p.is_symlink() and not p.is_file()):
        # a link to a file is read as the file, here and on a cluster's nodes (ssh.tree_plan sends its bytes)
        log.warning("skipping %s: a symlink to %s: files and links to files are read, no folder", link,
                    "a folder" if link.is_dir() else "nothing")
    if not any(p for p in root.iterdir() if p.is_file() and not p.name.startswith(".")):
        folders = sorted(p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
        if folders:
            raise UserError(f"data dir {root} holds no files, only folders ({', '.join(folders[:3])}): the images "
                            "must be in it, not in folders below it")
        raise UserError(f"data dir {root} is empty")
    found = 0
    for path in sorted(p for p in root.iterdir() if is_image_file(p)):
        if limit is not None and found >= limit:
            break
        taken = open_image(path, take)
        if taken is None:
            continue
        found += 1
        yield path, taken
    if not found:
        raise UserError(no_readable_image(root))


def no_readable_image(root: Path) -> str:
    return f"no readable image in {root} (looked for {', '.join(sorted(IMAGE_SUFFIXES))})"


def open_image(path: Path, take: Callable[[Image.Image], Any]) -> Any | None:
    """``take`` of the open image, or None with a warning where the file is no readable image."""
    try:
        with Image.open(path) as img:
            return take(img)
    except (UnidentifiedImageError, OSError, ValueError) as exc:
        log.warning("skipping %s: not a readable image (%s)", path, exc.__class__.__name__)
    except Image.DecompressionBombError:
        # A declared size beyond PIL's limit (Image.MAX_IMAGE_PIXELS x 2): possibly a bomb, never decoded.
        log.warning("skipping %s: its declared size is too large to decode safely (DecompressionBombError)", path)
    return None


def cover_box(width: int, height: int, size: tuple[int, int]) -> tuple[tuple[float, float, float, float], float]:
    """The centered part of a width x height image that, scaled by the returned factor, exactly covers
    ``size`` (width, height): the image is scaled to cover an aspect-ratio bucket and the excess cut on
    both sides (train/buckets.py)."""
    scale = max(size[0] / width, size[1] / height)
    crop_w, crop_h = size[0] / scale, size[1] / scale
    left, top = (width - crop_w) / 2, (height - crop_h) / 2
    return (left, top, left + crop_w, top + crop_h), scale


def square_box(width: int, height: int, center_crop: bool, random_crop: int | None = None,
               name: str = "") -> tuple[int, int, int] | None:
    """The square (left, top, side) that ``preprocess`` cuts from a width x height image before resizing it,
    or None: the whole image squeezed to a square. ``random_crop``: the seed of a place drawn once per image
    (from the seed and the file's ``name``, so the same on every rank and every run; train_text_to_image.py's
    RandomCrop, drawn once as its SDXL twin does where it caches latents); else ``center_crop``'s centred one."""
    side = min(width, height)
    if random_crop is not None:
        import torch  # only --random-crop draws (the check on the user's machine needs no torch otherwise)

        draw = torch.Generator().manual_seed(mixed_seed(random_crop, zlib.crc32(name.encode())))
        left, top = (int(torch.randint(0, extra + 1, (1,), generator=draw)) for extra in (width - side, height - side))
        return left, top, side
    if center_crop:
        return (width - side) // 2, (height - side) // 2, side
    return None


def crop_of(width: int, height: int, resolution: int, center_crop: bool, random_crop: int | None = None,
            name: str = "") -> tuple[int, int, int, int, int]:
    """What ``preprocess`` takes from a width x height image, in SDXL's terms: (original height, original
    width, crop top, crop left, crop left of the mirrored image). SDXL counts the corner in the image
    resized so that its shorter side is the resolution: preprocess crops first and resizes the square
    after, which is the same crop, scaled. Without a crop the whole image is squeezed: (0, 0)."""
    box = square_box(width, height, center_crop, random_crop, name)
    if box is None:
        return height, width, 0, 0, 0
    left, top, side = box
    scale = resolution / side
    top, left = round(top * scale), round(left * scale)
    return height, width, top, left, max(0, round(width * scale) - resolution - left)


def mask_weights(paths: list[Path], sizes: list[tuple[int, int]], resolution: int, center_crop: bool,
                 bucket: tuple[int, int] | None = None, random_crop: int | None = None) -> list[np.ndarray] | None:
    """Each image's loss weights at latent resolution, (1, R/8, R/8) float32 in [0, 1], from ``IMAGE.mask.png``
    (cropped as its image is, then area-averaged, so a mask's edge weighs in between); an image without
    a mask weighs 1 everywhere. None when no image has a mask: the loss is then computed as always.
    ``sizes``: the images' upright (width, height), which a mask must match (``upright_size``).
    ``bucket``: the images' bucket (width, height), which they were fitted to (``fit_to_bucket``);
    ``random_crop``: the seed of --random-crop's places (``square_box``)."""
    if not any(mask_path(p).is_file() for p in paths):
        return None
    width, height = bucket or (resolution, resolution)
    masks: list[np.ndarray] = []
    for path, shown in zip(paths, sizes, strict=True):
        mask = mask_path(path)
        if not mask.is_file():
            masks.append(np.ones((1, height // 8, width // 8), dtype=np.float32))
            continue
        try:
            with Image.open(mask) as img:
                upright = eight_bit(ImageOps.exif_transpose(img), f"mask {mask}").convert("L")
                if upright.size != shown:
                    raise UserError(f"mask {mask} is {upright.width}x{upright.height}, its image (upright) "
                                    f"{shown[0]}x{shown[1]}: a mask must match its image's size")
                if bucket:
                    box, _ = cover_box(upright.width, upright.height, bucket)
                    small = upright.resize((width // 8, height // 8), Image.BOX, box=box)
                else:
                    box = square_box(upright.width, upright.height, center_crop, random_crop, path.name)
                    if box is not None:
                        left, top, edge = box
                        upright = upright.crop((left, top, left + edge, top + edge))
                    small = upright.resize((width // 8, height // 8), Image.BOX)
        except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as exc:
            raise UserError(f"mask {mask} is not a readable image ({exc.__class__.__name__})") from None
        weights = (np.asarray(small, dtype=np.float32) / 255.0)[None]
        if not weights.any():
            log.warning("mask %s is black all over: its image teaches nothing (white marks what trains)", mask)
        masks.append(weights)
    return masks


def mixed_seed(seed: int, position: int) -> int:
    # splitmix-style mixing so nearby (seed, position) pairs give unrelated streams
    return (seed * 0x9E3779B97F4A7C15 + position * 0xBF58476D1CE4E5B9 + 0x94D049BB133111EB) & (2**63 - 1)
