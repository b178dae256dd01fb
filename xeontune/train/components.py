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


def load(model: str, revision: str | None = None, variant: str | None = None) -> Components:
    """Load tokenizer, text encoder, VAE, UNet and noise scheduler, all frozen and in eval mode."""
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
        unet = UNet2DConditionModel.from_pretrained(model, subfolder="unet", variant=variant, **common)
        noise_scheduler = DDPMScheduler.from_pretrained(model, subfolder="scheduler", **common)
    except (OSError, ValueError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else exc.__class__.__name__
        raise UserError(f"cannot load a Stable Diffusion pipeline from {model!r}: {first}") from None
    for module in (text_encoder, vae, unet):
        module.requires_grad_(False)
        module.eval()
    return Components(tokenizer, text_encoder, vae, unet, noise_scheduler, unet_for_inference=unet)
