"""xeontune's CPU attention (train/kernels/attention.cpp), beside torch's SDPA, and the rule that picks one.

The kernel is compiled on first use into $XEONTUNE_CACHE/kernels/ by torch's own extension builder
(``torch.utils.cpp_extension.load``, with ninja), for this CPU (``-march=native``, a folder per CPU kind,
so nodes of several kinds sharing a home each build their own), not with the package: the package stays
one pure-Python wheel that installs on machines without a compiler, and the kernel gets the instructions
of the CPU that runs it. Where it cannot be built (no compiler, no ninja, a failed build) torch's SDPA is
used and one log line says why; nothing else changes.

``Processor`` is a diffusers attention processor that runs the UNet's attention through ``attention``:
the kernel where the call is one it handles (no mask, no dropout, not causal, fp32 or bf16, the last
dimension contiguous), torch's SDPA otherwise, silently. ``--attention auto`` narrows that to the calls
``prefers_kernel`` picks on this CPU (fp32 over 1024 keys and more; bf16 over 256 and more where the CPU has
AVX512-BF16 without AMX).
"""

from __future__ import annotations

import functools
import hashlib
import logging
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from xeontune import hardware
from xeontune.io import cache_root, flocked

log = logging.getLogger("xeontune.train")

SOURCE = Path(__file__).parent / "kernels" / "attention.cpp"
CHOICES = ("auto", "torch", "xeontune")
DTYPES = (torch.float32, torch.bfloat16)


def _capability() -> tuple[str, list[str]]:
    """ATen's vector width the kernel is compiled for (its ``Vectorized`` and exp), from this CPU's flags."""
    flags = hardware.cpu_flags()
    if {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= flags:
        return "AVX512", ["-DCPU_CAPABILITY=AVX512", "-DCPU_CAPABILITY_AVX512"]
    if {"avx2", "fma"} <= flags:
        return "AVX2", ["-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2"]
    return "DEFAULT", ["-DCPU_CAPABILITY=DEFAULT"]


def build_directory() -> Path:
    """One folder per torch version, source and CPU kind (its flags: -march=native is this CPU's)."""
    kind = hashlib.sha256(" ".join(sorted(hardware.cpu_flags())).encode()).hexdigest()[:10]
    source = hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:10]
    return cache_root() / "kernels" / f"attention-{torch.__version__}-{source}-{_capability()[0].lower()}-{kind}"


@functools.cache
def kernel() -> str | None:
    """Build (once per CPU kind, then load) the kernel; None when it is ready, else why it is not."""
    if hasattr(torch.ops.xeontune, "attention_forward"):
        return None
    try:
        from torch.utils import cpp_extension

        folder = build_directory()
        folder.mkdir(parents=True, exist_ok=True)
        _, defines = _capability()
        # torch's own lock is a file that a build killed hard (the OOM killer, SIGKILL) leaves behind, and
        # every later load then waits on it for ever: builds take turns on a flock instead, which dies with
        # its holder, and whoever holds it may clear such a leftover
        with flocked(folder / "xeontune-build.lock", "another process building the attention kernel"):
            (folder / "lock").unlink(missing_ok=True)
            cpp_extension.load(name="xeontune_attention", sources=[str(SOURCE)], build_directory=str(folder),
                               extra_cflags=["-O3", "-march=native", "-fopenmp", *defines], is_python_module=False,
                               verbose=False)
    except Exception as exc:  # no compiler, no ninja, a failed build: torch's SDPA, said once
        reason = " ".join(str(exc).split())[:200] or exc.__class__.__name__
        log.warning("xeontune's attention kernel could not be built (%s): torch's SDPA is used", reason)
        return reason
    _register_autograd()
    return None


def _register_autograd() -> None:
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[torch.Tensor, torch.Tensor]) -> None:
        q, k, v, scale = inputs
        out, lse = output
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.scale = scale
        ctx.mark_non_differentiable(lse)

    def backward(ctx: Any, grad_out: torch.Tensor, _grad_lse: Any) -> tuple[Any, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = torch.ops.xeontune.attention_backward(grad_out, q, k, v, out, lse, ctx.scale)
        return dq, dk, dv, None

    torch.library.register_autograd("xeontune::attention_forward", backward, setup_context=setup_context)

    @torch.library.register_fake("xeontune::attention_forward")
    def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        return _heads_last(q), q.new_empty(q.shape[:3], dtype=torch.float32)

    @torch.library.register_fake("xeontune::attention_backward")
    def _(grad_out, q, k, v, out, lse, scale):  # noqa: ANN001, ANN202 (the op's own schema)
        return _heads_last(q), _heads_last(k), _heads_last(v)


def _heads_last(like: torch.Tensor) -> torch.Tensor:
    """An empty tensor shaped as ``like`` whose memory is (batch, tokens, heads, head), as the kernel's outputs
    are (its ``like_heads_last``): a compiler plans its buffers by these strides."""
    batch, heads, tokens, head = like.shape
    return like.new_empty(batch, tokens, heads, head).transpose(1, 2)


def bf16_products() -> bool:
    """Whether the built kernel runs a bf16 head's products in bf16 on this CPU (its brgemm on VNNI pairs: an
    AVX-512 CPU), rather than widening them to fp32."""
    return kernel() is None and bool(torch.ops.xeontune.bf16_products())


def handles(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: Any = None, dropout_p: float = 0.0,
            is_causal: bool = False) -> bool:
    """Whether the kernel computes this call (else torch's SDPA does)."""
    return (attn_mask is None and dropout_p == 0.0 and not is_causal and q.dim() == k.dim() == v.dim() == 4
            and q.dtype in DTYPES and q.dtype == k.dtype == v.dtype and q.device.type == "cpu"
            and q.shape[:2] == k.shape[:2] == v.shape[:2] and q.shape[3] == k.shape[3] and k.shape == v.shape
            and q.stride(3) == k.stride(3) == v.stride(3) == 1 and q.shape[2] > 0 and k.shape[2] > 0)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """softmax(q k^T * scale) v by the kernel (built already: ``kernel()`` is None), autograd included.
    q, k, v: (batch, heads, tokens, head); the result's memory is (batch, tokens, heads, head)."""
    return torch.ops.xeontune.attention_forward(q, k, v, scale if scale is not None else q.shape[-1] ** -0.5)[0]


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: Any = None, dropout_p: float = 0.0,
         is_causal: bool = False, scale: float | None = None, always: bool = True) -> torch.Tensor:
    """F.scaled_dot_product_attention's call, computed by the kernel where it handles the call and is built
    and, unless ``always``, where ``prefers_kernel`` says it wins on this CPU (--attention auto)."""
    if (handles(q, k, v, attn_mask, dropout_p, is_causal) and (always or prefers_kernel(q.dtype, k.shape[2]))
            and kernel() is None):
        return attention(q, k, v, scale)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                                          scale=scale)


# --attention auto's rule, from `xeontune bench --attention` (docs/performance.md, "Attention kernel"):
# - fp32, on an AVX2 EPYC and on a Zen 4: the kernel wins over 1024 keys and more (self-attention, 1.1-1.3x)
#   and loses or ties over fewer (cross-attention's 77, 256-token levels);
# - bf16 on AVX512-BF16 (Zen 4: its products on vdpbf16ps): 1.4x at 256 keys, 1.5-1.6x at 1024 and 4096, a tie
#   over 77;
# - bf16 without bf16 instructions: 3.7-10.6x faster than torch's emulated bf16, but
#   test_three_ranks_match_one_process_in_bf16 then drifted past its bound by one flipped Adam step of one
#   element of the tiny model's 32-wide vector (the kernel is batch- and thread-invariant, and as close to fp32
#   as torch's): torch's there until that test tells a flip from a wrong sample plan;
# - AMX: not measured (torch's SDPA packs its bf16 products for the tiles there): torch's.
AUTO_MIN_FP32_KEYS = 1024
AUTO_MIN_BF16_KEYS = 256


def native_bf16(flags: frozenset[str] | None = None) -> bool:
    flags = hardware.cpu_flags() if flags is None else flags
    return "avx512_bf16" in flags or "amx_bf16" in flags


def auto_min_keys(precision: str, flags: frozenset[str] | None = None) -> int | None:
    """--attention auto: the fewest keys from which the kernel computes a call in ``precision`` ("fp32",
    "bf16") on this CPU; None: never (the rule above)."""
    flags = hardware.cpu_flags() if flags is None else flags
    if "amx_bf16" in flags:
        return None
    if precision == "fp32":
        return AUTO_MIN_FP32_KEYS
    return AUTO_MIN_BF16_KEYS if "avx512_bf16" in flags else None


def prefers_kernel(dtype: torch.dtype, keys: int, flags: frozenset[str] | None = None) -> bool:
    """--attention auto: whether the kernel computes a call of ``dtype`` over ``keys`` keys on this CPU."""
    least = auto_min_keys("fp32" if dtype == torch.float32 else "bf16", flags)
    return least is not None and keys >= least


class Processor:
    """diffusers' ``AttnProcessor2_0`` for the UNet's attention blocks with ``sdpa`` in place of torch's.
    A block with anything else to do (a mask, norms, 4-D input, a spatial norm) goes to the stock processor."""

    def __init__(self, always: bool = True) -> None:
        from diffusers.models.attention_processor import AttnProcessor2_0

        self.stock = AttnProcessor2_0()
        self.always = always  # False: --attention auto, the kernel where ``prefers_kernel`` says

    def __call__(self, attn: Any, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor | None = None,
                 attention_mask: torch.Tensor | None = None, temb: torch.Tensor | None = None, *args: Any,
                 **kwargs: Any) -> torch.Tensor:
        if (attention_mask is not None or hidden_states.ndim != 3 or attn.spatial_norm is not None
                or attn.group_norm is not None or attn.norm_cross or attn.norm_q is not None
                or attn.norm_k is not None):
            return self.stock(attn, hidden_states, encoder_hidden_states, attention_mask, temb, *args, **kwargs)
        context = hidden_states if encoder_hidden_states is None else encoder_hidden_states
        query, key, value = attn.to_q(hidden_states), attn.to_k(context), attn.to_v(context)
        batch, tokens, inner = query.shape
        head = inner // attn.heads
        query, key, value = (t.view(batch, -1, attn.heads, head).transpose(1, 2) for t in (query, key, value))
        out = sdpa(query, key, value, always=self.always).transpose(1, 2).reshape(batch, tokens, inner)
        out = attn.to_out[1](attn.to_out[0](out))  # the projection, then its dropout
        if attn.residual_connection:
            out = out + hidden_states
        return out / attn.rescale_output_factor


def use_kernel(choice: str, precision: str, flags: frozenset[str] | None = None,
               tokens: int | None = None) -> tuple[str | None, str]:
    """What --attention CHOICE runs on this CPU in ``precision``: "always" (the kernel for every call it
    handles), "auto" (where ``prefers_kernel`` says) or None (torch's SDPA), and the note that says so. The
    kernel is built here when it will be used (15-60 s, once per CPU kind). ``tokens``: the most any attention
    of the run sees (the latent's pixels at --resolution), where known: auto builds nothing for a run whose
    every call stays below the rule's keys."""
    if choice not in CHOICES:
        raise ValueError(f"--attention must be one of {', '.join(CHOICES)}, got {choice!r}")
    if choice == "torch":
        return None, "torch's SDPA (--attention torch)"
    flags = hardware.cpu_flags() if flags is None else flags
    least = auto_min_keys(precision, flags)
    if choice == "auto" and least is None and "amx_bf16" in flags:
        return None, ("torch's SDPA (--attention auto: the kernel is not measured yet on an AMX CPU; "
                      "--attention xeontune forces it)")
    if choice == "auto" and least is None:
        return None, ("torch's SDPA (--attention auto: in bf16 without bf16 instructions the kernel is not chosen "
                      "yet, docs/performance.md; --attention xeontune forces it)")
    if choice == "auto" and tokens is not None and tokens < least:
        return None, f"torch's SDPA (--attention auto: {tokens} tokens at most, the kernel wins from {least})"
    if choice == "auto":
        said = f"for self-attention over {least}+ keys, torch's SDPA for the rest (--attention auto)"
    else:
        said = "for every call it handles (--attention xeontune)"
    why = kernel()
    if why is not None:
        return None, f"torch's SDPA (the kernel could not be built: {why})"
    return ("always" if choice == "xeontune" else "auto"), f"xeontune's kernel {said}"


def stock_blocks(denoiser: torch.nn.Module) -> list[Any]:
    """The attention blocks of a diffusers model that run the stock ``AttnProcessor2_0`` (a UNet's; a
    transformer's joint attention has processors of its own)."""
    from diffusers.models.attention_processor import Attention, AttnProcessor2_0

    return [m for m in denoiser.modules() if isinstance(m, Attention) and type(m.processor) is AttnProcessor2_0]


def install(denoiser: torch.nn.Module, mode: str = "always") -> int:
    """Put ``Processor`` in place of every stock ``AttnProcessor2_0`` of a diffusers model (``stock_blocks``);
    how many. ``mode``: ``use_kernel``'s."""
    blocks = stock_blocks(denoiser)
    for block in blocks:
        block.set_processor(Processor(always=mode == "always"))
    return len(blocks)

