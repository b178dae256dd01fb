"""Training data: the image folder, prompt templates, the latent cache and the per-sample plan.

Every random choice of a sample (which image, flip, template, VAE latent draw, noise, timestep) is
a function of (seed, global sample position) alone. So one process with batch 3b and three ranks
with batch b train on exactly the same samples, and a resumed run needs no RNG state to continue.

Each image's crop is taken once, at load (a centered square with --center-crop, else the whole
image squeezed to a square), and recorded: SDXL's UNet takes the original size and the crop's
top-left corner among its ``time_ids``, and the latent cache keeps them beside each image's latents.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import math
import struct
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import ExifTags, Image, ImageOps, PngImagePlugin, UnidentifiedImageError

from xeontune.errors import UserError
from xeontune.train.options import require_dir

log = logging.getLogger(__name__)

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

OBJECT_TEMPLATES = (
    "a photo of a {}",
    "a photo of the {}",
    "a close-up photo of a {}",
    "a cropped photo of the {}",
    "a bright photo of a {}",
    "a dark photo of the {}",
    "a good photo of a {}",
    "a photo of my {}",
    "a photo of a small {}",
    "a photo of the big {}",
    "a rendering of a {}",
    "a picture of one {}",
)
STYLE_TEMPLATES = (
    "a painting in the style of {}",
    "a picture in the style of {}",
    "an image in the style of {}",
    "a drawing in the style of {}",
    "a small painting in the style of {}",
    "a big picture in the style of {}",
    "a dark painting in the style of {}",
    "a bright drawing in the style of {}",
    "art in the style of {}",
    "a photo in the style of {}",
)


def templates_for(learnable_property: str) -> tuple[str, ...]:
    return STYLE_TEMPLATES if learnable_property == "style" else OBJECT_TEMPLATES


def load_images(data_dir: str | Path, resolution: int, center_crop: bool) -> tuple[torch.Tensor, list[Path]]:
    """Load every readable image as a (N, 3, R, R) tensor in [-1, 1]; skip unreadable files with a warning."""
    images, paths, _ = load_images_with_crops(data_dir, resolution, center_crop)
    return images, paths


def load_images_with_crops(
    data_dir: str | Path, resolution: int, center_crop: bool, limit: int | None = None
) -> tuple[torch.Tensor, list[Path], torch.Tensor]:
    """``load_images`` plus each image's crop, (N, 5) long: see ``crop_of``. ``limit``: the first so
    many images by name."""
    paths, upright = zip(*read_images(data_dir, limit), strict=True)
    fitted = [fit_square(img, resolution, center_crop) for img in upright]
    return torch.stack([f[0] for f in fitted]), list(paths), torch.tensor([f[1] for f in fitted], dtype=torch.long)


def fit_square(upright: Image.Image, resolution: int, center_crop: bool, random_crop: int | None = None,
               name: str = "") -> tuple[torch.Tensor, tuple[int, int, int, int, int]]:
    """An image as training takes it without buckets, (3, R, R), and its crop (``crop_of``)."""
    return (preprocess(upright, resolution, center_crop, random_crop, name),
            crop_of(upright.width, upright.height, resolution, center_crop, random_crop, name))


class Pixels:
    """Training images as one bucket's (n, 3, H, W) tensor in [-1, 1] would hold them, each decoded from its
    file and fitted (``fit``: upright image -> pixels) when asked: a thousand 512 px images are 3 GB in fp32,
    and the latent cache needs each one once. A file that no longer decodes is a one-line error."""

    def __init__(self, height: int, width: int) -> None:
        self.height, self.width = height, width
        self.sources: list[tuple[Path, Callable[[Image.Image, str], torch.Tensor]]] = []

    def extend(self, paths: list[Path], fit: Callable[[Image.Image, str], torch.Tensor]) -> None:
        self.sources += [(path, fit) for path in paths]

    def __len__(self) -> int:
        return len(self.sources)

    @property
    def shape(self) -> torch.Size:
        return torch.Size((len(self), 3, self.height, self.width))

    def _one(self, i: int) -> torch.Tensor:
        path, fit = self.sources[i]
        pixels = open_image(path, lambda img: fit(decode_upright(img), path.name))
        if pixels is None:
            raise UserError(f"{path} no longer reads as the image it was when training started: keep the training "
                            "images as they are while a run trains on them")
        return pixels

    def __getitem__(self, index: int | slice | list[int] | torch.Tensor) -> torch.Tensor:
        if isinstance(index, int):
            return self._one(index)
        rows = range(len(self))[index] if isinstance(index, slice) else torch.as_tensor(index).reshape(-1).tolist()
        return torch.stack([self._one(i) for i in rows]) if len(rows) else torch.empty(0, 3, self.height, self.width)


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
        draw = sample_generator(random_crop, zlib.crc32(name.encode()))
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


def load_masks(paths: list[Path], sizes: list[tuple[int, int]], resolution: int, center_crop: bool,
               bucket: tuple[int, int] | None = None, random_crop: int | None = None) -> torch.Tensor | None:
    """Each image's loss weights at latent resolution, (N, 1, R/8, R/8) in [0, 1], from ``IMAGE.mask.png``
    (cropped as its image is, then area-averaged, so a mask's edge weighs in between); an image without
    a mask weighs 1 everywhere. None when no image has a mask: the loss is then computed as always.
    ``sizes``: the images' upright (width, height), which a mask must match (``upright_size``).
    ``bucket``: the images' bucket (width, height), which they were fitted to (``fit_to_bucket``);
    ``random_crop``: the seed of --random-crop's places (``square_box``)."""
    if not any(mask_path(p).is_file() for p in paths):
        return None
    width, height = bucket or (resolution, resolution)
    masks = []
    for path, shown in zip(paths, sizes, strict=True):
        mask = mask_path(path)
        if not mask.is_file():
            masks.append(torch.ones(1, height // 8, width // 8))
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
        weights = torch.from_numpy(np.asarray(small, dtype=np.float32) / 255.0)[None]
        if not weights.any():
            log.warning("mask %s is black all over: its image teaches nothing (white marks what trains)", mask)
        masks.append(weights)
    return torch.stack(masks)


def image_set_digest(paths: list[Path]) -> str:
    """``N images, <digest>`` of the images' names and bytes: equal on two nodes only for the same set."""
    digest = hashlib.sha256()
    for path in sorted(paths, key=lambda p: p.name):
        digest.update(path.name.encode() + b"\0" + file_digest(path))
    return f"{len(paths)} images, {digest.hexdigest()[:12]}"


def file_digest(path: Path) -> bytes:
    """The sha256 of a file's bytes, read once per run for as long as its size and time stay (the ranks'
    image check and the latent cache's key both need every image's)."""
    stat = Path(path).stat()
    return _file_digest(str(path), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=65536)
def _file_digest(path: str, size: int, mtime_ns: int) -> bytes:
    return hashlib.sha256(Path(path).read_bytes()).digest()


def preprocess(img: Image.Image, resolution: int, center_crop: bool, random_crop: int | None = None,
               name: str = "") -> torch.Tensor:
    img = eight_bit(img).convert("RGB")
    box = square_box(img.width, img.height, center_crop, random_crop, name)
    if box is not None:
        left, top, side = box
        img = img.crop((left, top, left + side, top + side))
    img = img.resize((resolution, resolution), Image.BICUBIC)
    array = np.asarray(img, dtype=np.float32) / 127.5 - 1.0
    return torch.from_numpy(array).permute(2, 0, 1).contiguous()


def _mixed(seed: int, position: int) -> int:
    # splitmix-style mixing so nearby (seed, position) pairs give unrelated streams
    return (seed * 0x9E3779B97F4A7C15 + position * 0xBF58476D1CE4E5B9 + 0x94D049BB133111EB) & (2**63 - 1)


def sample_generator(seed: int, position: int) -> torch.Generator:
    return torch.Generator().manual_seed(_mixed(seed, position))


STEP_STREAM = 0xD209_0D7  # what a micro-batch draws from torch's global RNG (LoRA's dropout)


def seed_global_rng(seed: int, position: int) -> None:
    """Seed torch's global RNG for the micro-batch whose first sample is ``position``: what the step draws
    from it (LoRA's dropout masks) is then the same in a resumed run as in a straight one and in a rerun,
    and differs between ranks (a checkpoint holds rank 0's RNG state only)."""
    torch.manual_seed(_mixed(seed ^ STEP_STREAM, position))


@dataclass
class Batch:
    positions: list[int]
    image_index: torch.Tensor  # (B,)
    flip: torch.Tensor  # (B,) bool
    input_ids: torch.Tensor  # (B, 77)
    latent_eps: torch.Tensor  # (B, 4, h, w): draw from the VAE latent distribution
    noise: torch.Tensor  # (B, 4, h, w)
    timesteps: torch.Tensor  # (B,) training timestep indices
    prompt_index: torch.Tensor | None = None  # (B,): each sample's row of the plan's prompts
    instance_count: int | None = None  # prior preservation: the first this many are instance samples, the rest class
    bucket: int = 0  # the aspect-ratio bucket of every sample (image_index counts within it)
    more_input_ids: tuple[torch.Tensor, ...] = ()  # the same prompts by a family's further tokenizers (SDXL's second)

    @property
    def all_input_ids(self) -> list[torch.Tensor]:
        """One id tensor per text encoder of the family, in its order."""
        return [self.input_ids, *self.more_input_ids]


CLASS_STREAM = 0x5EED_C1A55  # prior preservation's class samples draw from streams of their own
OFFSET_STREAM = 0x0FF5_E7  # --noise-offset's per-channel offsets: a stream of their own, the others unchanged


def offset_noise(batch: Batch, channels: int, seed: int) -> torch.Tensor:
    """--noise-offset's Gaussian offsets, one per sample and channel (shape (samples, channels, 1, 1)), as
    the examples draw them; each from its sample position's own stream, so ranks and accumulation agree."""
    k = len(batch.positions)
    samples = [(pos, False) for pos in batch.positions] + [(pos, True) for pos in batch.positions][
        : len(batch.noise) - k]
    return torch.stack([torch.randn((channels, 1, 1), generator=sample_generator(
        (seed ^ OFFSET_STREAM) ^ (CLASS_STREAM if is_class else 0), pos)) for pos, is_class in samples])


class SamplePlan:
    """Maps global sample positions to samples; epochs are shuffled by a seeded permutation.

    With prior preservation (``num_class_images``) each position also gets a class sample: a class
    image (images ``num_images`` on, in their own seeded order), the class prompt (the last prompt row)
    and draws of its own; a batch holds the instance samples, then the class samples.

    With aspect-ratio buckets (``buckets``: each bucket's images, by their index in the folder) an
    epoch is a seeded order of chunks of ``group`` positions (the global micro-batch: per-rank batch x
    ranks), each chunk from one bucket: a bucket's images x repeats in a seeded order, its last chunk
    filled from its start. ``image_index`` then counts within the batch's ``bucket`` (instance images,
    then class images)."""

    def __init__(
        self,
        *,
        seed: int,
        num_images: int,
        repeats: int,
        prompt_ids: torch.Tensor,  # (num_templates, 77): tokenized templates with the placeholder
        more_prompt_ids: tuple[torch.Tensor, ...] = (),  # the same templates by a family's further tokenizers
        prompt_of_image: list[int] | None = None,  # each image's own prompt row (captions); None: drawn per sample
        latent_shape: tuple[int, int, int],
        num_train_timesteps: int,
        flip_p: float,
        timestep_density: Callable[[torch.Generator], float] | None = None,  # the family's (None: uniform)
        num_class_images: int = 0,
        buckets: list[list[int]] | None = None,
        bucket_latent_shapes: list[tuple[int, int, int]] | None = None,
        group: int = 1,
    ) -> None:
        self.seed = seed
        self.repeats = repeats
        self.buckets = buckets if buckets and len(buckets) > 1 else None
        self.bucket_latent_shapes = bucket_latent_shapes
        self.group = group
        self._layout_epoch = -1
        self._layout: list[tuple[int, int]] = []
        self.num_class_images = num_class_images
        # the rows instance samples draw templates from: all but a class prompt's
        self.instance_rows = len(prompt_ids) - (1 if num_class_images else 0)
        self.num_images = num_images
        self.epoch_len = num_images * repeats
        if self.buckets:
            self.epoch_len = sum(math.ceil(len(b) * repeats / group) * group for b in self.buckets)
        self.prompt_ids = prompt_ids
        self.more_prompt_ids = more_prompt_ids
        self.prompt_of_image = prompt_of_image
        self.latent_shape = latent_shape
        self.num_train_timesteps = num_train_timesteps
        self.timestep_density = timestep_density
        self.flip_p = flip_p
        self._perm_epoch = -1
        self._class_epoch = -1
        self._class_order = torch.empty(0, dtype=torch.long)
        self._perm = torch.empty(0, dtype=torch.long)

    def _permutation(self, epoch: int) -> torch.Tensor:
        if epoch != self._perm_epoch:
            gen = torch.Generator().manual_seed(self.seed * 7919 + epoch)
            self._perm = torch.randperm(self.epoch_len, generator=gen)
            self._perm_epoch = epoch
        return self._perm

    def _class_image(self, position: int) -> int:
        epoch, offset = divmod(position, self.num_class_images)
        if epoch != self._class_epoch:  # one seeded order per epoch of the class images
            self._class_order = torch.randperm(self.num_class_images, generator=torch.Generator().manual_seed(
                (self.seed ^ CLASS_STREAM) * 7919 + epoch))
            self._class_epoch = epoch
        return int(self._class_order[offset])

    def _bucket_layout(self, epoch: int) -> list[tuple[int, int]]:
        """(bucket, image within it) of each position of the epoch."""
        assert self.buckets is not None
        if epoch != self._layout_epoch:
            gen = torch.Generator().manual_seed(self.seed * 7919 + epoch)
            chunks = []
            for bucket, members in enumerate(self.buckets):
                order = [int(i) % len(members) for i in torch.randperm(len(members) * self.repeats, generator=gen)]
                order += [order[k % len(order)] for k in range(-len(order) % self.group)]
                chunks += [(bucket, order[k:k + self.group]) for k in range(0, len(order), self.group)]
            self._layout = [(bucket, i) for c in torch.randperm(len(chunks), generator=gen).tolist()
                            for bucket, items in [chunks[c]] for i in items]
            self._layout_epoch = epoch
        return self._layout

    def batch(self, positions: list[int]) -> Batch:
        image_index, flips, ids, template, eps, noise, timesteps = [], [], [], [], [], [], []
        samples = [(pos, False) for pos in positions] + [(pos, True) for pos in positions if self.num_class_images]
        bucket, shape, instances = 0, self.latent_shape, self.num_images
        if self.buckets:
            epoch, offset = divmod(positions[0], self.epoch_len)
            bucket = self._bucket_layout(epoch)[offset][0]
            shape, instances = self.bucket_latent_shapes[bucket], len(self.buckets[bucket])
        for pos, is_class in samples:
            image = None  # the instance image's index in the folder
            if is_class:
                image_index.append(instances + self._class_image(pos))
                gen = sample_generator(self.seed ^ CLASS_STREAM, pos)
            elif self.buckets:
                epoch, offset = divmod(pos, self.epoch_len)
                in_bucket, local = self._bucket_layout(epoch)[offset]
                if in_bucket != bucket:
                    raise ValueError(f"positions {positions[0]}..{positions[-1]} span two buckets: a batch must lie "
                                     f"within one global micro-batch of {self.group}")
                image_index.append(local)
                image = self.buckets[bucket][local]
                gen = sample_generator(self.seed, pos)
            else:
                epoch, offset = divmod(pos, self.epoch_len)
                image = int(self._permutation(epoch)[offset]) % self.num_images
                image_index.append(image)
                gen = sample_generator(self.seed, pos)
            flips.append(bool(torch.rand((), generator=gen) < self.flip_p))
            drawn = int(torch.randint(self.instance_rows, (), generator=gen))  # drawn always: the same streams
            if is_class:
                drawn = len(self.prompt_ids) - 1
            elif self.prompt_of_image is not None:
                drawn = self.prompt_of_image[image]
            template.append(drawn)
            ids.append(self.prompt_ids[drawn])
            eps.append(torch.randn(shape, generator=gen))
            noise.append(torch.randn(shape, generator=gen))
            timesteps.append(self._timestep(gen))
        return Batch(
            positions=list(positions),
            image_index=torch.tensor(image_index),
            flip=torch.tensor(flips),
            input_ids=torch.stack(ids),
            latent_eps=torch.stack(eps),
            noise=torch.stack(noise),
            timesteps=torch.tensor(timesteps, dtype=torch.long),
            prompt_index=torch.tensor(template, dtype=torch.long),
            instance_count=len(positions) if self.num_class_images else None,
            bucket=bucket,
            more_input_ids=tuple(ids[template] for ids in self.more_prompt_ids),
        )

    @property
    def all_prompt_ids(self) -> list[torch.Tensor]:
        return [self.prompt_ids, *self.more_prompt_ids]

    def _timestep(self, gen: torch.Generator) -> int:
        """A training timestep's index: uniform, or at u of the family's density (as the flow-matching
        examples index their scheduler's timesteps)."""
        n = self.num_train_timesteps
        if self.timestep_density is None:
            return int(torch.randint(n, (), generator=gen))
        return min(int(self.timestep_density(gen) * n), n - 1)


def sample_loss(pred: torch.Tensor, target: torch.Tensor, root_weight: torch.Tensor | None, batch: Batch,
                prior_loss_weight: float, sample_weights: torch.Tensor | None = None) -> torch.Tensor:
    """The step's loss: ``masked_mse`` over the batch; with prior preservation, the instance samples'
    plus ``prior_loss_weight`` times the class samples' mean squared error (as diffusers' DreamBooth
    example computes it; class images have no masks). ``sample_weights``: each sample's (min-SNR)."""
    k = batch.instance_count
    if k is None:
        return masked_mse(pred, target, root_weight, sample_weights)
    w = (None, None) if sample_weights is None else (sample_weights[:k], sample_weights[k:])
    prior = masked_mse(pred[k:], target[k:], None, w[1])
    return (masked_mse(pred[:k], target[:k], None if root_weight is None else root_weight[:k], w[0])
            + prior_loss_weight * prior)


def masked_mse(pred: torch.Tensor, target: torch.Tensor, root_weight: torch.Tensor | None,
               sample_weights: torch.Tensor | None = None) -> torch.Tensor:
    """The mean squared error, each latent pixel's term weighted by its mask's value w: both sides are
    scaled by sqrt(w) (``root_weight``), so an all-white mask gives exactly the unmasked loss and a black
    pixel contributes nothing, not even a gradient. ``sample_weights``: each sample's mean error weighted
    by it before the batch's mean (the examples' min-SNR loss)."""
    pred, target = pred.float(), target.float()
    if root_weight is not None:
        pred, target = pred * root_weight, target * root_weight
    if sample_weights is None:
        return torch.nn.functional.mse_loss(pred, target)
    per_sample = torch.nn.functional.mse_loss(pred, target, reduction="none").mean(dim=list(range(1, pred.dim())))
    return (per_sample * sample_weights).mean()


def min_snr_weights(noise_scheduler: Any, timesteps: torch.Tensor, gamma: float) -> torch.Tensor:
    """Each sample's min-SNR weight: min(SNR, gamma) / SNR for epsilon, / (SNR + 1) for v-prediction."""
    from diffusers.training_utils import compute_snr

    snr = compute_snr(noise_scheduler, timesteps)
    clipped = torch.clamp(snr, max=gamma)
    return clipped / (snr + 1) if noise_scheduler.config.prediction_type == "v_prediction" else clipped / snr
