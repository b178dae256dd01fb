"""The latent cache: each training image's VAE latent distribution, and its mirror image's where a step
can draw it, encoded once for the whole job, each rank its share, then read by every rank.

A run's rows are every bucket's images, then their mirror images (``Latents``, one per bucket). Rows are encoded in
blocks of at most ``BLOCK_ROWS``. With a cache folder (``--latent-cache-dir``, by default
``$XEONTUNE_CACHE/latents``), each block is a file written whole (a temporary file, then a rename) in a
folder named by a digest of everything that decides its latents: the images' bytes and crops, the
buckets, the sides, the VAE (its files and its dtype) and how it ran. So:

- a run that crashed while encoding, or a later run on the same images, encodes only the rows that no
  file holds yet;
- the ranks encode the missing rows in equal shares; a block that some rank's node lacks (no shared
  disk) is sent to it once, and every rank then maps the files (``torch.load(mmap=True)``): the
  latents of thousands of images are pages of files, not the ranks' memory;
- the decoded images are read one VAE call's worth at a time (data.Pixels), never all at once.

Without a folder (``encode_latents(..., root=None)``, the tests' and the bench's baseline), the blocks
stay in memory and one gather gives every rank every row.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from xeontune.errors import UserError
from xeontune.io import atomic_path
from xeontune.train.data import Batch, Pixels, file_digest

log = logging.getLogger(__name__)

FORMAT = 1  # in every key: a change of what a row holds, or of how images are fitted, makes new folders
BLOCK_ROWS = 64  # rows a rank writes at a time: the most a crash loses of its work
SEND_BYTES = 64 * 2**20  # what one exchange of missing blocks between nodes carries at most
_BLOCK_RE = re.compile(r"^p(\d+)-(\d+)-(\d+)\.pt$")


@dataclass(frozen=True, order=True)
class Block:
    """Rows ``first`` to ``first + count`` of part (bucket) ``part``."""

    part: int
    first: int
    count: int

    @property
    def name(self) -> str:
        return f"p{self.part}-{self.first:08d}-{self.count}.pt"

    @classmethod
    def parse(cls, name: str) -> Block | None:
        found = _BLOCK_RE.match(name)
        return cls(*map(int, found.groups())) if found else None


class Rows:
    """One part's rows, indexed as one (rows, C, h, w) tensor would be, held in blocks (mapped files, or
    tensors in memory)."""

    def __init__(self, blocks: list[tuple[Block, torch.Tensor]], count: int) -> None:
        self.blocks = [tensor for _, tensor in blocks]
        self.where = torch.full((count, 2), -1, dtype=torch.long)  # each row's block and its place in it
        for b, (block, _) in enumerate(blocks):
            rows = torch.arange(block.first, block.first + block.count)
            self.where[rows, 0], self.where[rows, 1] = b, torch.arange(block.count)
        assert bool((self.where[:, 0] >= 0).all()), "a latent row no block holds"
        self.shape = torch.Size((count, *self.blocks[0].shape[1:]))

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, index: torch.Tensor | list[int] | int) -> torch.Tensor:
        picked = self.where[torch.as_tensor(index)]
        if picked.dim() == 1:
            return self.blocks[int(picked[0])][int(picked[1])].clone()
        return torch.stack([self.blocks[b][o] for b, o in picked.tolist()])


class Spread(Protocol):
    """The ranks of a job, to share work out (``loop.Sync``): this rank, how many, and every rank's value."""

    @property
    def rank(self) -> int: ...

    @property
    def world(self) -> int: ...

    def gather(self, value: Any) -> list[Any]: ...


def drawn_sides(flip_p: float) -> list[bool]:
    """Which sides of an image a step can draw (False: as it is, True: mirrored): only those are encoded,
    so --no-random-flip (flip_p 0) halves the VAE's work."""
    return [mirrored for mirrored, drawn in ((False, flip_p < 1), (True, flip_p > 0)) if drawn]


class Latents:
    """VAE latents of the training images.

    With ``cached=True`` each image's latent distribution (and its mirror image's, where ``flip_p``
    lets a step draw it) is encoded once; a step draws ``mean + std * eps`` from it, which is exactly
    what encoding every step computes. With ``cached=False`` the VAE encodes every step (what the common example
    script does). ``crops`` (from ``load_images_with_crops``) are kept per image and per mirror image,
    for SDXL's time_ids. ``encode=False`` leaves the cache to the caller's ``encode_latents`` (the
    buckets of a run encoded together).
    """

    def __init__(self, vae: torch.nn.Module, images: torch.Tensor | Pixels, cached: bool, encode_batch: int | None = None,
                 crops: torch.Tensor | None = None, masks: torch.Tensor | None = None, flip_p: float = 0.5,
                 encode: bool = True) -> None:
        self.vae: torch.nn.Module | None = vae  # None once the caller frees it (cached mode)
        self.images = images
        self.cached = cached
        # loss weights of [originals, mirrored] (data.mask_tensor), as the square roots masked_mse takes
        self.masks = None if masks is None else torch.cat([masks, masks.flip(-1)]).sqrt()
        if crops is None:
            n, _, h, w = images.shape
            crops = torch.tensor([[h, w, 0, 0, 0]] * n)
        # (original h, original w, crop top, crop left) of [originals, mirrored], indexed as the cache
        self.crops = torch.cat([crops[:, :4], torch.cat([crops[:, :3], crops[:, 4:]], dim=1)])
        self.scaling = float(getattr(vae.config, "scaling_factor", 0.18215))
        self.shift = float(getattr(vae.config, "shift_factor", None) or 0.0)  # SD3's VAE centres its latents
        self.sides = drawn_sides(flip_p)
        self.per_call = encode_batch or self.encode_batch(images)
        # the cache: one row per image and drawn side, sides in order (tensors, or latent_cache's mapped rows)
        self.mean: Any = None
        self.std: Any = None
        if cached and encode:
            encode_latents([self])

    def image_paths(self) -> list[Path]:
        """The image files of a folder's images (``Pixels``), in order; none for pixels given as a tensor."""
        return [path for path, _ in getattr(self.images, "sources", [])]

    def side_pixels(self, rows: list[int]) -> torch.Tensor:
        """The pixels of cache rows ``rows`` (row k: image k % n, on side k // n)."""
        n = len(self.images)
        return torch.stack([self.images[k % n].flip(-1) if self.sides[k // n] else self.images[k % n] for k in rows])

    @staticmethod
    def encode_batch(images: torch.Tensor) -> int:
        """Images per VAE call when caching: up to 512 x 512 pixels' worth. The fp32 encoder's
        full-resolution activations are 0.5 GB per 1024 px image and several are alive at once: four
        1024 px images at a time raised an SDXL bf16 run's peak RSS from 12.4 to 21.8 GB. One at a
        time computes the same latents."""
        return max(1, (512 * 512) // (images.shape[-1] * images.shape[-2]))

    @torch.no_grad()
    def _encode(self, pixels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        dist = self.vae.encode(pixels.to(self.vae.dtype)).latent_dist  # the bench's baseline VAE is bf16
        return dist.mean.float(), dist.std.float()

    def latent_shape(self) -> tuple[int, int, int]:
        if self.mean is not None:
            return tuple(self.mean.shape[1:])  # type: ignore[return-value]
        mean, _ = self._encode(self.images[:1])
        return tuple(mean.shape[1:])  # type: ignore[return-value]

    def time_ids(self, batch: Batch) -> torch.Tensor:
        """SDXL's six size conditions per sample: original size, crop top-left, target size (B, 6): the
        images' own (height, width), the resolution or their bucket's."""
        crops = self.crops[batch.image_index + batch.flip.long() * len(self.images)]
        target = torch.tensor(list(self.images.shape[-2:])).expand(len(crops), 2)
        return torch.cat([crops, target], dim=1).float()

    def mask(self, batch: Batch) -> torch.Tensor | None:
        """The batch's loss weights' square roots (B, 1, h, w), or None when no image has a mask."""
        if self.masks is None:
            return None
        return self.masks[batch.image_index + batch.flip.long() * len(self.images)]

    def sample(self, batch: Batch) -> torch.Tensor:
        if self.cached:
            assert self.mean is not None and self.std is not None
            if len(self.sides) == 2:
                index = batch.image_index + batch.flip.long() * len(self.images)
            else:  # one side encoded: the plan, drawing flips with the same flip_p, draws only that one
                assert bool((batch.flip == self.sides[0]).all()), "a flip drawn that flip_p rules out"
                index = batch.image_index
            mean, std = self.mean[index], self.std[index]
        else:
            pixels = self.images[batch.image_index]
            pixels = torch.where(batch.flip[:, None, None, None], pixels.flip(-1), pixels)
            mean, std = self._encode(pixels)
        drawn = mean + std * batch.latent_eps
        return (drawn - self.shift if self.shift else drawn) * self.scaling


def cache_key(parts: list[Latents], identity: dict[str, Any]) -> str:
    """The folder name of these parts' latents: a digest of what decides them. ``identity``: the VAE and how
    it runs (the loop's: model, VAE files, dtype, precision); the parts add their images' bytes, crops,
    sizes and sides."""
    digest = hashlib.sha256(json.dumps({"format": FORMAT, **identity}, sort_keys=True, default=str).encode())
    for part in parts:
        digest.update(json.dumps([list(part.images.shape), part.sides, part.crops.tolist()]).encode())
        for path in part.image_paths():
            digest.update(file_digest(path))
    return digest.hexdigest()[:24]


def encode_latents(parts: list[Latents], spread: Spread | None = None, progress: Callable[[int], object] | None = None,
                   root: Path | None = None) -> int:
    """Fill the caches of ``parts`` (a run's buckets), reading the blocks ``root`` holds and encoding the
    rest: the missing rows in one list, rank r's a contiguous r-th of it, so that N ranks each encode
    about 1/N of them whatever the buckets. ``progress`` (rank 0's bar) counts what all ranks encoded,
    taking the others to keep pace. Returns how many rows were read, not encoded."""
    rank, world = (spread.rank, spread.world) if spread else (0, 1)
    counts = [len(part.images) * len(part.sides) for part in parts]
    stored = _listing(root, counts)
    seen = _gather(spread, stored)
    covered = [torch.zeros(n, dtype=torch.bool) for n in counts]
    for names in seen:
        for name in names:
            block = Block.parse(name)
            covered[block.part][block.first:block.first + block.count] = True
    missing = [(p, k) for p, done in enumerate(covered) for k in (~done).nonzero().flatten().tolist()]
    mine = missing[-(-rank * len(missing) // world):-(-(rank + 1) * len(missing) // world)]  # rank 0's the first
    made: dict[Block, torch.Tensor] = {}
    for block in _blocks(mine):
        part = parts[block.part]
        rows = list(range(block.first, block.first + block.count))
        encoded = []
        for first in range(0, len(rows), part.per_call):
            chunk = rows[first:first + part.per_call]
            encoded.append(torch.stack(part._encode(part.side_pixels(chunk)), dim=1))  # (rows, 2: mean/std, C, h, w)
            if progress:
                progress(len(chunk) * world)
        made[block] = torch.cat(encoded)
        if root is not None:
            with atomic_path(root / block.name) as tmp, tmp.open("wb") as file:
                torch.save(made.pop(block), file)
    blocks = _share_files(root, counts, spread) if root is not None else _share_memory(made, spread)
    for p, part in enumerate(parts):
        own = sorted((b, t) for b, t in blocks.items() if b.part == p)
        chosen, upto = [], 0  # the fewest blocks that hold every row, in order (a crash may leave overlaps)
        for block, tensor in own:
            if block.first + block.count > upto:
                chosen.append((block, tensor))
                upto = block.first + block.count
        rows = Rows(chosen, counts[p])
        if root is None:  # in memory: one tensor each, as one process's encoding gives them
            both = rows[torch.arange(counts[p])]
            part.mean, part.std = both[:, 0].contiguous(), both[:, 1].contiguous()
        else:
            part.mean, part.std = _Half(rows, 0), _Half(rows, 1)
    return sum(counts) - len(missing)


class _Half:
    """The mean or the std of ``Rows`` holding both (each row: (2, C, h, w))."""

    def __init__(self, rows: Rows, which: int) -> None:
        self.rows, self.which = rows, which
        self.shape = torch.Size((rows.shape[0], *rows.shape[2:]))

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, index: torch.Tensor | list[int] | int) -> torch.Tensor:
        return self.rows[index].select(-4, self.which)


def _blocks(rows: list[tuple[int, int]]) -> list[Block]:
    """``rows`` (part, row) cut into blocks: runs of consecutive rows of one part, of at most BLOCK_ROWS."""
    blocks: list[Block] = []
    for p, k in rows:
        last = blocks[-1] if blocks else None
        if last and last.part == p and last.first + last.count == k and last.count < BLOCK_ROWS:
            blocks[-1] = Block(p, last.first, last.count + 1)
        else:
            blocks.append(Block(p, k, 1))
    return blocks


def _listing(root: Path | None, counts: list[int]) -> dict[str, int]:
    """The whole blocks in ``root`` that fit these parts: name -> size in bytes."""
    if root is None or not root.is_dir():
        return {}
    found = {}
    for path in root.iterdir():
        block = Block.parse(path.name)
        if block and block.part < len(counts) and block.count > 0 and block.first + block.count <= counts[block.part]:
            with contextlib.suppress(FileNotFoundError):
                found[path.name] = path.stat().st_size
    return found


def _gather(spread: Spread | None, value: Any) -> list[Any]:
    return spread.gather(value) if spread and spread.world > 1 else [value]


def _share_memory(made: dict[Block, torch.Tensor], spread: Spread | None) -> dict[Block, torch.Tensor]:
    """Every rank's blocks on every rank (one gather: each rank holds them all after it)."""
    everything: dict[Block, torch.Tensor] = {}
    for share in _gather(spread, made):
        everything.update(share)
    return everything


def _share_files(root: Path, counts: list[int], spread: Spread | None) -> dict[Block, torch.Tensor]:
    """Every block in ``root`` on every rank's disk, then mapped. Ranks that share a disk see each other's
    files; a block no rank of a node wrote is sent there by the first rank that has it."""
    rank = spread.rank if spread else 0
    seen = _gather(spread, _listing(root, counts))  # after every rank wrote its blocks; the same list on all
    wanted = sorted(set().union(*seen))
    lacking = [name for name in wanted if not all(name in names for names in seen)]
    while lacking:  # in batches of about SEND_BYTES, cut alike on every rank (from the gathered sizes)
        batch, size = [], 0
        while lacking and (not batch or size < SEND_BYTES):
            name = lacking.pop(0)
            sender = next(r for r, names in enumerate(seen) if name in names)
            batch.append((name, sender))
            size += seen[sender][name]
        payload = {name: (root / name).read_bytes() for name, sender in batch if sender == rank}
        received = _gather(spread, payload)
        for name, sender in batch:
            if name not in seen[rank] and not (root / name).is_file():  # another rank of this node may have
                with atomic_path(root / name) as tmp:
                    tmp.write_bytes(received[sender][name])
    blocks = {}
    for name in wanted:
        try:
            blocks[Block.parse(name)] = torch.load(root / name, mmap=True, weights_only=True)
        except (OSError, RuntimeError, EOFError) as exc:
            raise RuntimeError(f"latent cache file {root / name} does not read ({exc}): delete {root} and "
                               "train again") from None
    return blocks


def check_dir(path: Path) -> None:
    """A one-line error unless the latents can be kept under ``path``: before any model loads, not after
    minutes of loading. Nothing is made here (the first block makes the folders)."""
    existing = next(p for p in (path, *path.parents) if p.exists())
    if not existing.is_dir():
        why = f"{existing} is a file"
    elif not os.access(existing, os.W_OK | os.X_OK):
        why = f"{existing} is not writable"
    else:
        return
    raise UserError(f"--latent-cache-dir {path} cannot be written ({why}): give another folder, or none to keep "
                    "the latents in memory")


def describe(root: Path) -> str:
    """The cache folder and its size on disk, for the log."""
    size = sum(p.stat().st_size for p in root.iterdir() if Block.parse(p.name)) if root.is_dir() else 0
    return f"{root} ({size / 2**20:.1f} MB)"
