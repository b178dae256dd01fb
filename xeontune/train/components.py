"""Loading the frozen parts of a Stable Diffusion pipeline, with one-line errors for bad paths."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from xeontune.errors import UserError

log = logging.getLogger(__name__)

REQUIRED_PARTS = ("tokenizer", "text_encoder", "vae", "unet", "scheduler")


@dataclass
class Components:
    tokenizer: Any
    text_encoder: Any
    vae: Any
    unet: Any  # what the training step calls (may be compiled or IPEX-optimized)
    noise_scheduler: Any
    unet_for_inference: Any = None  # the plain UNet, for validation and saving
    unet_cast: bool = False  # the UNet was loaded in another dtype than its files hold (see load)


def _check_local(path: Path) -> None:
    index = path / "model_index.json"
    if not index.is_file():
        raise UserError(f"{path} is not a Stable Diffusion pipeline (no model_index.json)")
    try:
        parts = json.loads(index.read_text())
    except json.JSONDecodeError:
        raise UserError(f"{index} is not valid JSON") from None
    missing = [p for p in REQUIRED_PARTS if p not in parts or not (path / p).is_dir()]
    if missing:
        raise UserError(f"{path} is not a Stable Diffusion pipeline (missing: {', '.join(missing)})")


def load(
    model: str, revision: str | None = None, variant: str | None = None, unet_dtype: Any = None
) -> Components:
    """Load tokenizer, text encoder, VAE, UNet and noise scheduler, all frozen and in eval mode.

    ``unet_dtype`` (torch.bfloat16 for bf16 training): the frozen UNet is loaded in it once, rather
    than kept in fp32 and cast again by autocast at every step; that made its forward and backward
    1.24x faster at 256 px on a 2-core AMX Xeon (docs/performance.md) and halves its memory. The VAE
    stays in its files' dtype: it encodes the latent cache outside autocast."""
    import diffusers
    import transformers
    from diffusers import AutoencoderKL, DDPMScheduler, UNet2DConditionModel
    from transformers import CLIPTextModel, CLIPTokenizer

    transformers.utils.logging.disable_progress_bar()
    diffusers.utils.logging.disable_progress_bar()

    local = Path(model).expanduser()
    if local.exists():
        _check_local(local)
        model = str(local)
    elif model.startswith((".", "/", "~")):
        raise UserError(f"model path {model} does not exist")
    common = {"revision": revision}
    try:
        tokenizer = CLIPTokenizer.from_pretrained(model, subfolder="tokenizer", **common)
        text_encoder = CLIPTextModel.from_pretrained(model, subfolder="text_encoder", variant=variant, **common)
        vae = AutoencoderKL.from_pretrained(model, subfolder="vae", variant=variant, **common)
        unet = UNet2DConditionModel.from_pretrained(
            model, subfolder="unet", variant=variant, torch_dtype=unet_dtype, **common)
        noise_scheduler = DDPMScheduler.from_pretrained(model, subfolder="scheduler", **common)
    except (OSError, ValueError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else exc.__class__.__name__
        raise UserError(f"cannot load a Stable Diffusion pipeline from {model!r}: {first}") from None
    for module in (text_encoder, vae, unet):
        module.requires_grad_(False)
        module.eval()
    return Components(tokenizer, text_encoder, vae, unet, noise_scheduler, unet_for_inference=unet,
                      unet_cast=unet_dtype is not None)


def load_unet(model: str, revision: str | None = None, variant: str | None = None) -> Any:
    """The UNet as its files hold it (to save a full pipeline without the training dtype's rounding)."""
    from diffusers import UNet2DConditionModel

    local = Path(model).expanduser()
    return UNet2DConditionModel.from_pretrained(
        str(local) if local.exists() else model, subfolder="unet", variant=variant, revision=revision)


def unet_dtype(precision: str) -> Any:
    """The dtype the frozen UNet is loaded in for a training precision (None: as its files hold it)."""
    import torch

    return torch.bfloat16 if precision == "bf16" else None
