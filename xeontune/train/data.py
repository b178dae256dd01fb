"""Training data: the tensors made of the image folder (train/images.py reads it), prompt templates and the per-sample plan.

Every random choice of a sample (which image, flip, template, VAE latent draw, noise, timestep) is
a function of (seed, global sample position) alone. So one process with batch 3b and three ranks
with batch b train on exactly the same samples, and a resumed run needs no RNG state to continue.

Each image's crop is taken once, at load (a centered square with --center-crop, else the whole
image squeezed to a square), and recorded: SDXL's UNet takes the original size and the crop's
top-left corner among its ``time_ids``, and the latent cache keeps them beside each image's latents.
"""

from __future__ import annotations

import functools
import hashlib
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from xeontune.errors import UserError
from xeontune.train.images import (
    crop_of,
    decode_upright,
    eight_bit,
    mixed_seed,
    open_image,
    read_images,
    square_box,
)

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


def mask_tensor(weights: list[np.ndarray] | None) -> torch.Tensor | None:
    """``images.mask_weights`` as one (N, 1, R/8, R/8) tensor, None when no image has a mask."""
    return None if weights is None else torch.stack([torch.from_numpy(w) for w in weights])


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


def sample_generator(seed: int, position: int) -> torch.Generator:
    return torch.Generator().manual_seed(mixed_seed(seed, position))


STEP_STREAM = 0xD209_0D7  # what a micro-batch draws from torch's global RNG (LoRA's dropout)


def seed_global_rng(seed: int, position: int) -> None:
    """Seed torch's global RNG for the micro-batch whose first sample is ``position``: what the step draws
    from it (LoRA's dropout masks) is then the same in a resumed run as in a straight one and in a rerun,
    and differs between ranks (a checkpoint holds rank 0's RNG state only)."""
    torch.manual_seed(mixed_seed(seed ^ STEP_STREAM, position))


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
