"""Weights files read and written one tensor at a time: what makes the bf16 copies without the model.

A safetensors file is an 8-byte little-endian header length, a JSON header (each tensor's dtype,
shape and byte range in the data that follows, plus an optional ``__metadata__``), then the data.
``read_tensors`` reads each tensor on its own with plain reads (safetensors' ``safe_open`` maps the
whole file, and every page read through that mapping stays in this process's resident memory until
the mapping goes: a 10 GB fp32 UNet shard counted 10 GB), and a ``.bin`` (torch's zip format)
through a memory map whose pages are handed back after each tensor. ``write_safetensors`` writes the
header first, then each tensor where it goes, as it comes, in the layout `safetensors.torch.save_file`
writes (same order, offsets and padding), so the file is the one that writing a state dict would give.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable, Iterable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import torch

DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
          "BOOL": torch.bool}
NAMES = {dtype: name for name, dtype in DTYPES.items()}


class Unreadable(ValueError):
    """A weights file this module does not read tensor by tensor (loading converts it instead)."""


@dataclass(frozen=True)
class Stored:
    """One tensor in a weights file: ``read()`` gives it (its own memory, or pages of a mapping that
    ``done(tensor)`` hands back); ``where`` orders the reads as the tensors lie in the files."""
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    read: Callable[[], torch.Tensor]
    where: tuple[int, int]
    done: Callable[[torch.Tensor], object] = lambda tensor: None


@dataclass(frozen=True)
class Entry:
    """One tensor to write: ``make()`` gives it, in ``dtype`` and ``shape``; ``where``: when to make it
    (ascending; the reads of its source, so that they run through the source files in order)."""
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    make: Callable[[], torch.Tensor]
    where: tuple[int, int] = (0, 0)


def _nbytes(dtype: torch.dtype, shape: Iterable[int]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count * dtype.itemsize


def safetensors_header(path: Path) -> tuple[dict, int]:
    """A safetensors file's header (tensor name to {dtype, shape, data_offsets}, and ``__metadata__``)
    and where its data starts."""
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise Unreadable(f"{path} is not a safetensors file")
        (length,) = struct.unpack("<Q", head)
        if length > 100_000_000:
            raise Unreadable(f"{path} is not a safetensors file (header of {length} bytes)")
        try:
            header = json.loads(f.read(length))
        except (UnicodeDecodeError, json.JSONDecodeError):
            raise Unreadable(f"{path} is not a safetensors file") from None
    if not isinstance(header, dict):
        raise Unreadable(f"{path} is not a safetensors file")
    return header, 8 + length


def _pread_into(fd: int, buffer: memoryview, offset: int) -> None:
    done = 0
    while done < len(buffer):
        got = os.preadv(fd, [buffer[done:]], offset + done)
        if got <= 0:
            raise OSError(f"weights file ended {len(buffer) - done} bytes early")
        done += got


def _safetensors_tensors(path: Path, index: int, stack: ExitStack) -> Iterator[Stored]:
    header, start = safetensors_header(path)
    size = path.stat().st_size
    fd = os.open(path, os.O_RDONLY)
    stack.callback(os.close, fd)
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape = DTYPES[info["dtype"]], tuple(int(s) for s in info["shape"])
            low, high = (int(o) for o in info["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise Unreadable(f"{path}: tensor {name} of dtype {info.get('dtype')!r} is not read here") from None
        if high - low != _nbytes(dtype, shape) or not start + low <= start + high <= size:
            raise Unreadable(f"{path}: tensor {name}'s bytes do not match its shape")

        def read(dtype: torch.dtype = dtype, shape: tuple[int, ...] = shape, offset: int = start + low,
                 nbytes: int = high - low) -> torch.Tensor:
            raw = torch.empty(nbytes, dtype=torch.uint8)
            if nbytes:
                _pread_into(fd, memoryview(raw.numpy()), offset)
            return raw.view(dtype).reshape(shape)

        yield Stored(name, dtype, shape, read, (index, low))


def _bin_tensors(path: Path, index: int) -> Iterator[Stored]:
    from xeontune.train.packed import release_file_pages

    try:
        state = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except (RuntimeError, OSError, ValueError, EOFError) as exc:  # an old, non-zip .bin cannot be mapped
        raise Unreadable(f"{path}: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}") from None
    if not isinstance(state, dict) or not all(isinstance(t, torch.Tensor) for t in state.values()):
        raise Unreadable(f"{path} does not hold a state dict")
    for name, tensor in state.items():
        yield Stored(name, tensor.dtype, tuple(tensor.shape), lambda tensor=tensor: tensor,
                     (index, tensor.data_ptr()), release_file_pages)


def read_tensors(files: Iterable[Path], stack: ExitStack) -> dict[str, Stored]:
    """Every tensor of ``files`` (safetensors or .bin; an index .json is skipped: its shards are among
    the files), unread. The files stay open until ``stack`` closes."""
    found: dict[str, Stored] = {}
    for index, path in enumerate(p for p in files if p.suffix != ".json"):
        tensors = _safetensors_tensors(path, index, stack) if path.suffix == ".safetensors" else _bin_tensors(path, index)
        for stored in tensors:
            if stored.name in found:
                raise Unreadable(f"tensor {stored.name} is in more than one weights file")
            found[stored.name] = stored
    return found


def write_safetensors(path: Path, entries: list[Entry], metadata: dict[str, str] | None = None) -> None:
    """Write ``entries`` as a safetensors file, making one tensor at a time (in ``where`` order), each
    written to its place and let go. The layout is `safetensors.torch.save_file`'s: tensors ordered by
    element size (largest first: every tensor stays aligned) then name, the header padded with spaces
    to 8 bytes, ``__metadata__`` first when given."""
    layout = sorted(entries, key=lambda e: (-e.dtype.itemsize, e.name))
    header: dict[str, object] = {"__metadata__": metadata} if metadata else {}
    offsets: dict[str, int] = {}
    end = 0
    for entry in layout:
        nbytes = _nbytes(entry.dtype, entry.shape)
        header[entry.name] = {"dtype": NAMES[entry.dtype], "shape": list(entry.shape), "data_offsets": [end, end + nbytes]}
        offsets[entry.name] = end
        end += nbytes
    raw = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    raw += b" " * (-len(raw) % 8)
    start = 8 + len(raw)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
    try:
        _pwrite(fd, struct.pack("<Q", len(raw)) + raw, 0)
        for entry in sorted(entries, key=lambda e: e.where):
            tensor = entry.make()
            if tensor.dtype != entry.dtype or tuple(tensor.shape) != entry.shape:
                raise ValueError(f"{entry.name}: made {tensor.dtype} {tuple(tensor.shape)}, "
                                 f"not {entry.dtype} {entry.shape}")
            if tensor.numel():
                data = tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
                _pwrite(fd, memoryview(data), start + offsets[entry.name])
            del tensor
        os.ftruncate(fd, start + end)  # a last tensor with no elements still ends the file where the header says
    finally:
        os.close(fd)


def _pwrite(fd: int, data: bytes | memoryview, offset: int) -> None:
    view = memoryview(data).cast("B")
    done = 0
    while done < len(view):
        done += os.pwrite(fd, view[done:], offset + done)
