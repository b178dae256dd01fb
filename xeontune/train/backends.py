"""Packed weights, IPEX and torch.compile applied to the frozen models, once, after they are loaded.

Packed weights (`--pack-weights`, xeontune/train/packed.py): with stock torch, the frozen UNet's
convolutions and Linear layers run on weights reordered for oneDNN once, instead of at every call.
`auto` packs wherever oneDNN runs the packed kernels in the training dtype (the rule and its
measurements: ``packed.auto_choice``; bf16 1.6x on an AMX Xeon, fp32 1.18-1.21x on AVX-512 and
AVX2-only CPUs), except SDXL in bf16 without AMX, and not when the UNet is compiled. Where packing
runs, `--ipex auto` leaves IPEX out: packed stock torch beat IPEX 2.8 side by side in bf16 and fp32.

Precision: with bf16 the frozen UNet arrives here already in bf16 (`components.load` loads it so,
once: no per-step weight cast under autocast, half the memory), and the step runs under bf16
autocast; `ipex.optimize(dtype=bfloat16)` keeps it so. That is safe because the trainer calls the
UNet only under autocast when precision is bf16 (the step and validation). The text encoders keep
their token tables and norms in fp32 (the tables hold the trainable rows); in bf16 their Linear
layers come from a bf16 copy (``components.cast_text_encoder_linears``). The VAE is never cast: it
encodes the latent cache outside autocast.

IPEX is optional and used with care:
- only when it imports and matches the installed torch (its last release, 2.8, needs torch 2.8);
- `--ipex auto` uses it only on CPUs with AVX-512 (bw/vl/dq). On this project's AVX2-only EPYC its
  prepacked fp32 convolutions made the SD1.5 UNet forward 12x slower than stock torch, and without
  prepacking it ran exactly as fast as stock torch, so there it is skipped. `--ipex on` applies it
  anyway, prepacking only where the CPU has AVX-512; XEONTUNE_IPEX_PREPACK=on|off overrides that
  choice (for testing the prepack path, or for CPUs this rule misjudges);
- `nn.Linear` layers are never prepacked: IPEX 2.8's prepacked Linear returns no gradient for its
  input when its weight is frozen, and textual inversion's only path from the loss to the token
  vectors runs through the UNet's cross-attention to_k / to_v Linears.
"""

from __future__ import annotations

import logging
import os
import time
import warnings
from collections.abc import Callable

import torch
from torch import nn

from xeontune import hardware
from xeontune.errors import UserError
from xeontune.train import families, packed

log = logging.getLogger(__name__)

IPEX_CHOICES = ("auto", "on", "off")
PACK_CHOICES = packed.PACK_CHOICES
PREPACK_ENV = "XEONTUNE_IPEX_PREPACK"


def prepare_frozen_models(
    unet: nn.Module, vae: nn.Module, *, precision: str, ipex: str = "auto", compile: bool = False,
    pack: str = "auto", checkpointing: bool = False, step_bytes: int | None = None, family: str = "sd",
    agree: Callable[[bool], bool] | None = None, ipex_off_because: str = "--ipex off",
) -> tuple[nn.Module, nn.Module, list[str]]:
    """Return (unet, vae, notes): the models to train with and one line per decision taken.

    ``step_bytes``: what the run holds beside the UNet (the other models' weights and a step's activations);
    given, `--pack-weights auto` packs only where the packed UNet and those fit in this process's memory,
    and a run that may not fit as prepared is warned. ``agree``: in a multi-rank run, True only where every
    rank's answer is True, so that all ranks pack or none does (one rank short of memory slows them all)."""
    if ipex not in IPEX_CHOICES:
        raise UserError(f"--ipex must be one of {', '.join(IPEX_CHOICES)}, got {ipex!r}")
    if pack not in PACK_CHOICES:
        raise UserError(f"--pack-weights must be one of {', '.join(PACK_CHOICES)}, got {pack!r}")
    if pack == "on" and compile:
        raise UserError("--pack-weights on and --compile cannot be combined: inductor packs weights itself")
    if precision not in ("fp32", "bf16"):
        raise ValueError(f"precision must be fp32 or bf16, got {precision!r}")
    notes: list[str] = []
    title = families.get(family).denoiser_title  # what the messages call the denoiser
    if checkpointing:  # first: IPEX's copy, the packed layers and a compiled graph all keep the blocks' flag
        notes.append(enable_checkpointing(unet, title))
    # decided once, up front: where auto packs, `--ipex auto` leaves IPEX out (see _auto_packing)
    auto_pack = _auto_packing(precision, compile, family) if pack == "auto" else (False, "")
    memory = _process_memory() if step_bytes is not None else 0  # before packing takes any of it
    if auto_pack[0] and step_bytes is not None:
        auto_pack = _packing_fits(unet, step_bytes, memory)
    if pack == "auto" and agree is not None:
        everyone = agree(auto_pack[0])  # every rank asks, whatever its own answer: a collective
        if auto_pack[0] and not everyone:
            auto_pack = (False, "not used (another rank of this run would not pack: every rank runs the same layers)")
    if ipex == "off":
        notes.append(f"IPEX: off ({ipex_off_because})")
    elif ipex == "auto" and auto_pack[0]:
        # decided before IPEX is imported: importing it alone swaps in some of its kernels
        notes.append("IPEX: not used (" + (
            "stock torch with packed weights was faster than IPEX 2.8 on an AMX Xeon: 1.22x in bf16, 1.13x in "
            "fp32; --ipex on forces it)" if hardware.ipex_version() else f"{hardware.IPEX_NOT_INSTALLED})"))
    else:
        info = hardware.ipex_info()
        if not info.usable and ipex == "on":
            raise UserError(f"--ipex on, but IPEX cannot be used: {info.reason}")
        if ipex == "auto" and not info.auto:
            notes.append(f"IPEX: not used ({info.reason})")
        else:
            unet, vae, note = _apply_ipex(unet, vae, precision, _prepack_choice(info), info.installed or "")
            notes.append(note)
            if pack == "on":
                notes.append(f"packed weights: not applied (IPEX packs the {title}'s weights itself)")
            pack = "off"
    notes.extend(_apply_packing(unet, pack, auto_pack, title))
    if step_bytes is not None:
        _warn_if_short(unet, step_bytes, memory)
    if compile:
        # Compilation happens on the first call: the first step takes minutes, and on the
        # 2-core AVX2 machine the compiled UNet was slower than eager (docs/performance.md).
        unet = torch.compile(unet)
        notes.append(f"torch.compile: {title} wrapped (inductor CPU); the first step compiles it")
    return unet, vae, notes


def enable_checkpointing(unet: nn.Module, title: str = "UNet") -> str:
    """`--gradient-checkpointing`: diffusers' own, on the frozen UNet. Its blocks recompute under
    ``torch.is_grad_enabled()`` alone (diffusers 0.42 no longer asks for train mode), and
    torch.utils.checkpoint's non-reentrant form, which diffusers uses, gives the input gradient that
    reaches the vectors through the cross-attention though no UNet parameter requires grad; the packed
    layers' autograd functions save no tensors, so they recompute as they ran. Validation runs under
    no_grad, where nothing is checkpointed."""
    unet.enable_gradient_checkpointing()
    return f"gradient checkpointing: the {title}'s blocks recompute their activations in the backward pass"


def _auto_packing(precision: str, compile: bool, family: str = "sd") -> tuple[bool, str]:
    """What `--pack-weights auto` does: (packs, why not). Where it packs, `--ipex auto` leaves IPEX out:
    measured side by side in one venv (torch 2.8, 256 px, AMX Xeon), s/step packed / IPEX / stock were
    bf16 0.686 / 0.835 / 1.143 and fp32 1.875 / 2.122 / 2.206 (docs/performance.md). A compiled UNet
    is left to inductor."""
    if compile:
        return False, ""
    return packed.auto_choice(precision, family)


def module_bytes(module: nn.Module) -> int:
    """The bytes of a module's parameters, as it holds them now."""
    return sum(p.numel() * p.element_size() for p in module.parameters())


def _process_memory() -> int:
    """What this process can have: its share of MemAvailable (which counts file-mapped weights as free)
    among the ranks on this host, plus the anonymous memory it holds already, less the margin
    --nproc-per-node auto leaves too."""
    from xeontune import placement

    share = placement.available_memory_bytes() / placement.local_ranks()
    return int((share + placement.anonymous_bytes()) * (1 - placement.RESERVED_FRACTION))


def _memory_need(unet: nn.Module, step_bytes: int, packs: bool) -> int:
    """The run's memory: the UNet as held, plus ``step_bytes``. Packed layers hold the UNet twice,
    reordered (forward and input gradient); its plain weights' pages are handed back where they are
    mapped from a file, but a UNet converted in memory (anonymous) keeps its plain weights too."""
    unet_bytes = module_bytes(unet)
    if not packs:
        return unet_bytes + step_bytes
    held = unet_bytes - packed.file_mapped_bytes(unet.parameters())
    return 2 * unet_bytes + held + step_bytes


def _packing_fits(unet: nn.Module, step_bytes: int, memory: int) -> tuple[bool, str]:
    """Whether the packed UNet and the rest of the run (``step_bytes``) fit in ``memory``. SDXL in fp32
    does not on a 24 GB machine (two reordered UNets are 20.5 GB): there auto leaves the layers stock
    rather than run out of memory."""
    need = _memory_need(unet, step_bytes, packs=True)
    if need <= memory:
        return True, ""
    return False, (f"not used (the packed UNet and the rest of the run need about {need / 1e9:.1f} GB, more than the "
                   f"{memory / 1e9:.1f} GB this process can have; --pack-weights on forces it)")


def _warn_if_short(unet: nn.Module, step_bytes: int, memory: int) -> None:
    """Warn before the first step where the run, as prepared, may not fit in memory."""
    packs = any(isinstance(m, (packed.PackedConv2d, packed.PackedLinear)) for m in unet.modules())
    need = _memory_need(unet, step_bytes, packs)
    if need > memory:
        log.warning("this run needs about %.1f GB (UNet%s %.1f GB, the rest %.1f GB) and this machine has about %.1f GB "
                    "for it: it may run out of memory; --gradient-checkpointing or a lower --resolution needs less%s",
                    need / 1e9, " packed" if packs else "", (need - step_bytes) / 1e9, step_bytes / 1e9, memory / 1e9,
                    ", and --pack-weights off" if packs else "")


def _apply_packing(unet: nn.Module, pack: str, auto_pack: tuple[bool, str], title: str = "UNet") -> list[str]:
    """Pack the UNet's weights for oneDNN (stock torch) as ``pack`` says (``auto_pack``: what auto
    decided); the notes say what was done."""
    if pack == "off":
        return []
    if pack == "auto" and not auto_pack[0]:
        return [f"packed weights: {auto_pack[1]}"] if auto_pack[1] else []
    if pack == "on":
        ok, why = packed.available(next(unet.parameters()).dtype)
        if not ok:
            raise UserError(f"--pack-weights on, but {why}")
    start = time.perf_counter()
    report = packed.pack(unet)
    return [f"{report.describe(title)} ({time.perf_counter() - start:.1f} s)"]


def _prepack_choice(info: hardware.IpexInfo) -> bool:
    choice = os.environ.get(PREPACK_ENV, "auto")
    if choice not in ("auto", "on", "off"):
        raise UserError(f"{PREPACK_ENV} must be auto, on or off, got {choice!r}")
    return info.prepack if choice == "auto" else choice == "on"


IPEX_APPLIED = ": UNet optimized in "  # in the note of a run whose frozen models IPEX optimized


def ipex_applied(notes: list[str]) -> bool:
    """Whether prepare_frozen_models put the frozen models on IPEX (its notes say so)."""
    return any(note.startswith("IPEX ") and IPEX_APPLIED in note for note in notes)


def _apply_ipex(
    unet: nn.Module, vae: nn.Module, precision: str, prepack: bool, version: str
) -> tuple[nn.Module, nn.Module, str]:
    start = time.perf_counter()
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    unet = ipex_optimize_frozen(unet, dtype=dtype, prepack=prepack)
    # The VAE encodes outside autocast (latent cache, the baseline's per-step encode) and decodes
    # inside it (validation). IPEX's prepacked fp32 convolutions fail under bf16 autocast (oneDNN:
    # "could not create a primitive descriptor"), so with bf16 the VAE is left to stock torch.
    if precision == "fp32":
        vae = ipex_optimize_frozen(vae, dtype=torch.float32, prepack=prepack)
    packing = "convolutions prepacked, Linear layers left unpacked" if prepack else "no weight prepacking"
    vae_note = f"VAE in fp32 ({packing})" if precision == "fp32" else "VAE left to stock torch"
    return unet, vae, (
        f"IPEX {version}{IPEX_APPLIED}{precision} ({packing}), {vae_note} "
        f"({time.perf_counter() - start:.1f} s)"
    )


class _HiddenLinear(nn.Module):
    """Holds a Linear where `ipex.optimize` cannot see it (not a child module), so it is not prepacked."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self._held = [linear]  # a list, not an attribute of type Module: hidden from named_modules()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._held[0](x)


def _linears(model: nn.Module) -> list[tuple[str, nn.Linear]]:
    return [(name, m) for name, m in model.named_modules() if isinstance(m, nn.Linear) and name]


def ipex_optimize_frozen(model: nn.Module, *, dtype: torch.dtype, prepack: bool) -> nn.Module:
    """`ipex.optimize` a frozen module in eval mode, in place, never prepacking its Linear layers."""
    import intel_extension_for_pytorch as ipex

    # IPEX registers its own CPU group_norm / layer_norm kernels; autograd then warns on every
    # backward that it falls through them. The gradients equal stock torch's (checked in
    # tests/ipex/), so the warning is noise.
    warnings.filterwarnings("ignore", message=r"aten::(group|layer)_norm: an autograd kernel was not registered")
    model.eval().requires_grad_(False)
    linears = _linears(model) if prepack else []
    for name, linear in linears:
        model.set_submodule(name, _HiddenLinear(linear))
    try:
        optimized = ipex.optimize(model, dtype=dtype, inplace=True, weights_prepack=prepack)
    finally:
        for name, linear in linears:
            model.set_submodule(name, linear)
    if optimized is not model:  # inplace=True returns the same object; guard against a change
        for name, linear in linears:
            optimized.set_submodule(name, linear)
    if dtype == torch.bfloat16:
        # The hidden Linears missed IPEX's cast; cast them too so the whole model is one dtype.
        for _, linear in linears:
            linear.to(dtype)
    return optimized
