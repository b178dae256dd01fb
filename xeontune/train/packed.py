"""The frozen UNet's convolutions and Linear layers with their weights reordered for oneDNN once.

Why: stock torch hands oneDNN a plain-layout weight at every call, and oneDNN reorders it into its
blocked (on AMX: VNNI-tiled) layout every time: a 1280-channel 3x3 convolution at 4x4 took 5.7 ms
so, and 0.65 ms on a weight reordered once. The UNet's weights never change here, so they are reordered
once, with the kernels torch ships for inductor's frozen graphs (``torch.ops.mkldnn``). This is what
IPEX's weight prepacking does, with stock torch.

Textual inversion needs the gradient of the loss with respect to each layer's input only (the
weights are frozen), and that gradient is itself a forward layer with a second reordered weight:
- Linear: dL/dx = g @ W, a Linear with weight W^T;
- Conv2d, stride 1: dL/dx = conv(g, W^T with its kernel flipped, padding k-1-p).
So a packed layer holds two reordered weights (the second made on the first backward that needs it)
and runs forward and backward as forward kernels. The module keeps its class's parameters and
state_dict: only its forward changes (``pack`` swaps the class for a subclass of it; ``unpack``
swaps it back). Measured in docs/performance.md ("Packed weights").
"""

from __future__ import annotations

import bisect
import contextlib
import ctypes
import functools
import os
import struct
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from xeontune import hardware
from xeontune.train import families

PACK_CHOICES = ("auto", "on", "off")


# bf16 on AMX: packing won at 2 threads a rank (1.6x, a 2-vCPU AMX Xeon at 256 px) and lost at 16 (a 16-core
# AMX Xeon, a LoRA step at 512 px, `--pack-weights on` / `off` alternated: 1.955 / 1.263 and 1.707 / 1.599
# s/step, the forward 0.82 / 0.42 and 0.75 / 0.53 s; docs/performance.md). Between 2 and 16 it is not
# measured: 4 is the geometric middle of a 1.6x win and a 0.78x loss, rounded down to stock torch's side.
AMX_BF16_MAX_PACKED_THREADS = 4


def auto_choice(precision: str, family: str = "sd", threads: int | None = None) -> tuple[bool, str]:
    """Whether `--pack-weights auto` packs on this CPU, and why not when it does not (one phrase, for
    notes and `doctor`). The rule: pack in both precisions wherever oneDNN runs the packed kernels in
    the precision's dtype, since it won wherever it was measured with few threads a rank
    (docs/performance.md, "Packed weights"): bf16 1.6x on an AMX Xeon and 1.29x on an AVX512-BF16 EPYC,
    fp32 1.18x on the same Xeon and 1.21x on an AVX2-only EPYC; except where the model's family
    measured it no faster (``Family.packing_refusal``: SDXL in bf16 without AMX), and bf16 on AMX with more than AMX_BF16_MAX_PACKED_THREADS threads a rank, where
    stock torch's forward was faster. ``threads``: the rank's (default: this process's torch threads).
    Its price is memory: each rank holds the reordered copies (``frozen_weight_bytes`` counts them)."""
    ok, why = available(torch.bfloat16 if precision == "bf16" else torch.float32)
    if not ok:
        return False, f"not used ({why})"
    amx = "amx_bf16" in hardware.cpu_flags()
    refused = families.get(family).packing_refusal(precision, amx)
    if refused:
        return False, f"not used ({refused}; --pack-weights on forces it)"
    threads = torch.get_num_threads() if threads is None else threads
    if precision == "bf16" and amx and threads > AMX_BF16_MAX_PACKED_THREADS:
        return False, (f"not used ({threads} threads a rank: in bf16 on AMX stock torch was faster above "
                       f"{AMX_BF16_MAX_PACKED_THREADS}, 1.43 against 1.83 s/step with 16 at 512 px; "
                       "--pack-weights on forces it)")
    return True, ""


@functools.cache
def available(dtype: torch.dtype) -> tuple[bool, str]:
    """Whether this torch and CPU run the packed kernels in ``dtype``, checked once by running a small
    packed convolution and Linear, forward and backward, against the stock layers."""
    if not torch.backends.mkldnn.is_available():
        return False, "this torch build has no oneDNN (mkldnn)"
    for name in ("_convolution_pointwise", "_linear_pointwise", "_reorder_linear_weight"):
        if not hasattr(torch.ops.mkldnn, name):
            return False, f"this torch has no torch.ops.mkldnn.{name}"
    if not hasattr(torch._C._nn, "mkldnn_reorder_conv2d_weight"):
        return False, "this torch has no mkldnn_reorder_conv2d_weight"
    generator = torch.Generator().manual_seed(0)
    model = nn.Sequential(nn.Conv2d(8, 16, 3, padding=1), nn.Flatten(2), nn.Linear(16, 8)).to(dtype)
    model.requires_grad_(False)
    x = torch.randn(1, 8, 4, 4, generator=generator, dtype=dtype)

    def run() -> tuple[torch.Tensor, torch.Tensor]:
        x_ = x.clone().requires_grad_(True)
        out = model(x_)
        out.float().square().sum().backward()
        return out.detach().float(), x_.grad.float()

    expected = run()
    try:
        pack(model)
        got = run()
    except RuntimeError as exc:  # oneDNN has no kernel for this dtype on this CPU
        return False, f"oneDNN cannot run packed {dtype} layers here ({str(exc).splitlines()[0][:120]})"
    finally:
        unpack(model)
    tolerance = 1e-4 if dtype == torch.float32 else 3e-2
    for want, have in zip(expected, got, strict=True):
        if not torch.allclose(have, want, rtol=tolerance, atol=tolerance * want.abs().max().item()):
            return False, f"packed {dtype} layers disagree with stock torch here"
    return True, "oneDNN kernels run and agree with stock torch"


def _fast_path(weight: torch.Tensor, x: torch.Tensor) -> bool:
    """The packed kernels take one dtype for input and weight; under CPU autocast to another dtype
    (fp32 weights with bf16 autocast), or off the CPU, the stock layer runs instead."""
    if x.device.type != "cpu" or weight.dtype not in (torch.float32, torch.bfloat16):
        return False
    if torch.is_autocast_enabled("cpu"):
        return torch.get_autocast_dtype("cpu") == weight.dtype
    return x.dtype == weight.dtype


class _ConvFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, conv: PackedConv2d) -> torch.Tensor:
        ctx.conv = conv
        return torch.ops.mkldnn._convolution_pointwise(
            x, conv.packed_weight(x.shape), conv.bias, conv.padding, [1, 1], [1, 1], 1, "none", [], "")

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        if not ctx.needs_input_grad[0]:
            return None, None
        conv = ctx.conv
        grad = grad.to(conv.weight.dtype)
        if not (grad.is_contiguous() or grad.is_contiguous(memory_format=torch.channels_last)):
            grad = grad.contiguous()
        back_padding = [conv.kernel_size[0] - 1 - conv.padding[0]] * 2
        return torch.ops.mkldnn._convolution_pointwise(
            grad, conv.packed_input_grad_weight(grad.shape), None, back_padding, [1, 1], [1, 1], 1, "none", [], "",
        ), None


class PackedConv2d(nn.Conv2d):
    """A frozen stride-1 Conv2d whose forward and input gradient run on once-reordered weights."""

    _packed: torch.Tensor | None
    _packed_back: torch.Tensor | None

    @staticmethod
    def eligible(conv: nn.Module) -> bool:
        if type(conv) is not nn.Conv2d or conv.weight.requires_grad:
            return False
        k, p = conv.kernel_size, conv.padding
        return (conv.stride == (1, 1) and conv.dilation == (1, 1) and conv.groups == 1
                and conv.padding_mode == "zeros" and isinstance(p, tuple) and k[0] == k[1] and p[0] == p[1]
                and p[0] <= k[0] - 1)

    def packed_weight(self, input_shape: torch.Size) -> torch.Tensor:
        if self._packed is None:
            self._packed = _reorder_conv(self.weight.detach(), self.padding, input_shape)
            release_file_pages(self.weight)
        return self._packed

    def packed_input_grad_weight(self, grad_shape: torch.Size) -> torch.Tensor:
        if self._packed_back is None:
            flipped = self.weight.detach().transpose(0, 1).flip(2, 3).contiguous()
            back_padding = (self.kernel_size[0] - 1 - self.padding[0],) * 2
            self._packed_back = _reorder_conv(flipped, back_padding, grad_shape)
            release_file_pages(self.weight)
        return self._packed_back

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not _fast_path(self.weight, x):
            return super().forward(x)
        return _ConvFunction.apply(x.to(self.weight.dtype), self)


def release_file_pages(tensor: torch.Tensor) -> bool:
    """Drop ``tensor``'s pages from this process's resident memory when they are pages of a file
    mapping (the bf16 weight copies are memory-mapped safetensors): once a layer's weights are
    reordered, its plain weights are read again only if a stock path needs them, and then the kernel
    maps them back in from the page cache or the file. Without this, every rank would keep 1.7 GB
    of plain UNet weights resident beside the reordered ones. Anonymous memory is never touched
    (MADV_DONTNEED would zero it), so this is a no-op for weights that were converted in memory.
    True if pages were released."""
    if sys.platform != "linux" or not tensor.is_contiguous():
        return False
    start = tensor.data_ptr()
    end = start + tensor.numel() * tensor.element_size()
    first, last = -(-start // _PAGE) * _PAGE, end // _PAGE * _PAGE  # whole pages inside the tensor
    if last <= first or not _in_file_mapping(first, last):
        return False
    return _libc().madvise(ctypes.c_void_p(first), ctypes.c_size_t(last - first), _MADV_DONTNEED) == 0


_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
_MADV_DONTNEED = 4


@functools.cache
def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc


def _mappings() -> Iterator[tuple[int, int, str, bool]]:
    """/proc/self/maps as (low, high, permissions, of a file): True for a mapping of a regular file
    that still exists."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            low, high = (int(a, 16) for a in fields[0].split("-"))
            path = fields[5].strip() if len(fields) > 5 else ""
            yield low, high, fields[1], fields[4] != "0" and path.startswith("/") and not path.endswith("(deleted)")


def file_mapped_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """How many of ``tensors``' bytes lie in mappings of regular files (/proc/self/maps, read once):
    page cache, which MemAvailable counts as free, rather than this process's anonymous memory."""
    if sys.platform != "linux":
        return 0
    spans = sorted((low, high) for low, high, _, of_file in _mappings() if of_file)
    total = 0
    for tensor in tensors:
        start = tensor.data_ptr()
        end = start + tensor.numel() * tensor.element_size()
        i = bisect.bisect_right(spans, (start, sys.maxsize)) - 1  # the last mapping starting at or before start
        if i >= 0 and spans[i][0] <= start and end <= spans[i][1]:
            total += end - start
    return total


def _in_file_mapping(first: int, last: int) -> bool:
    """Whether [first, last) lies inside one mapping of a regular file (per /proc/self/maps) and holds
    no anonymous page: in a private writable mapping a page that was written to is a copy-on-write
    copy, which MADV_DONTNEED would silently revert to the file's contents."""
    for low, high, perms, of_file in _mappings():
        if low <= first < high:
            if not (last <= high and of_file):
                return False
            return not (perms[1] == "w" and perms[3] == "p") or not _has_anonymous_pages(first, last)
    return False


_PAGEMAP_PRESENT, _PAGEMAP_SWAPPED, _PAGEMAP_FILE = 1 << 63, 1 << 62, 1 << 61


def _has_anonymous_pages(first: int, last: int) -> bool:
    """Whether any page of [first, last) is resident or swapped but not a file page (/proc/self/pagemap:
    8 bytes a page, whose flags a process may read for itself). Unreadable counts as yes."""
    try:
        with open("/proc/self/pagemap", "rb") as pagemap:
            pagemap.seek(first // _PAGE * 8)
            entries = pagemap.read((last - first) // _PAGE * 8)
    except OSError:
        return True
    for (entry,) in struct.iter_unpack("<Q", entries):
        if entry & (_PAGEMAP_PRESENT | _PAGEMAP_SWAPPED) and not entry & _PAGEMAP_FILE:
            return True
    return len(entries) != (last - first) // _PAGE * 8


def _reorder_conv(weight: torch.Tensor, padding: tuple[int, ...], input_shape: torch.Size) -> torch.Tensor:
    return torch._C._nn.mkldnn_reorder_conv2d_weight(
        weight.to_mkldnn(), list(padding), [1, 1], [1, 1], 1, list(input_shape))


class _LinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, linear: PackedLinear) -> torch.Tensor:
        ctx.linear = linear
        return torch.ops.mkldnn._linear_pointwise(x, linear.packed_weight(x), linear.bias, "none", [], "")

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        if not ctx.needs_input_grad[0]:
            return None, None
        linear = ctx.linear
        grad = grad.to(linear.weight.dtype).contiguous()
        return torch.ops.mkldnn._linear_pointwise(
            grad, linear.packed_input_grad_weight(grad), None, "none", [], ""), None


class PackedLinear(nn.Linear):
    """A frozen Linear whose forward and input gradient run on once-reordered weights."""

    _packed: torch.Tensor | None
    _packed_back: torch.Tensor | None

    @staticmethod
    def eligible(linear: nn.Module) -> bool:
        return type(linear) is nn.Linear and not linear.weight.requires_grad

    def packed_weight(self, x: torch.Tensor) -> torch.Tensor:
        if self._packed is None:
            self._packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), x.numel() // x.shape[-1])
            release_file_pages(self.weight)
        return self._packed

    def packed_input_grad_weight(self, grad: torch.Tensor) -> torch.Tensor:
        if self._packed_back is None:
            transposed = self.weight.detach().t().contiguous()
            self._packed_back = torch.ops.mkldnn._reorder_linear_weight(transposed, grad.numel() // grad.shape[-1])
            release_file_pages(self.weight)
        return self._packed_back

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not _fast_path(self.weight, x):
            return F.linear(x, self.weight, self.bias)
        return _LinearFunction.apply(x.to(self.weight.dtype).contiguous(), self)


@dataclass(frozen=True)
class PackReport:
    convolutions: int
    linears: int
    parameters: int  # weights packed (each is held again, reordered, once or twice: see module doc)

    def describe(self, title: str = "UNet") -> str:
        """``title``: what the family calls its denoiser (Family.denoiser_title)."""
        convolutions = f"{self.convolutions} convolution{'s' if self.convolutions != 1 else ''}"
        linears = f"{self.linears} Linear layer{'s' if self.linears != 1 else ''}"
        return (f"packed weights: the {title}'s {convolutions} and {linears} ({self.parameters / 1e6:.1f} M weights) "
                "reordered for oneDNN once")


_PACKED = {nn.Conv2d: PackedConv2d, nn.Linear: PackedLinear}


def pack(model: nn.Module) -> PackReport:
    """Make every eligible frozen Conv2d and Linear in ``model`` a packed one, in place. The reorders
    happen on first use, with that call's real input shape."""
    counts = {nn.Conv2d: 0, nn.Linear: 0}
    parameters = 0
    for module in model.modules():
        kind = type(module)
        if kind in _PACKED and _PACKED[kind].eligible(module):
            module.__class__ = _PACKED[kind]
            module._packed = module._packed_back = None
            counts[kind] += 1
            parameters += module.weight.numel()
    return PackReport(counts[nn.Conv2d], counts[nn.Linear], parameters)


def unpack(model: nn.Module) -> None:
    """Undo ``pack``: the stock layers again, the reordered copies freed."""
    for module in model.modules():
        for stock, packed in _PACKED.items():
            if type(module) is packed:
                module.__class__ = stock
                del module._packed, module._packed_back


@contextlib.contextmanager
def stock_layers(model: nn.Module) -> Iterator[None]:
    """Run ``model``'s packed layers as stock ones for a while (FLOP counting sees aten ops only),
    keeping their reordered weights for afterwards."""
    swapped = [(m, type(m)) for m in model.modules() if type(m) in _PACKED.values()]
    stock = {packed: plain for plain, packed in _PACKED.items()}
    for module, kind in swapped:
        module.__class__ = stock[kind]
    try:
        yield
    finally:
        for module, kind in swapped:
            module.__class__ = kind
