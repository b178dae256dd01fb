"""Sample images with what the run learned applied, saved as PNG (and logged to tensorboard)."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import torch

from xeontune.io import atomic_path


def make_pipeline(components) -> Any:
    """The model family's diffusers pipeline over the run's models, with its sampling scheduler."""
    family = components.family
    pipe = family.pipeline({
        "vae": components.vae, family.denoiser: components.denoiser_for_inference,
        "scheduler": family.sampling_scheduler(components.noise_scheduler),
        **{name: getattr(components, name) for e in family.encoders for name in (e.tokenizer, e.folder)}})
    pipe.set_progress_bar_config(disable=True)
    return pipe


@torch.no_grad()
def generate(
    components, method, prompt: str, *, num_images: int, steps: int, resolution: int, seed: int, autocast
) -> list:
    """Run the pipeline on the frozen models with what ``method`` learned applied (train/methods:
    ``inference``). Return PIL images."""
    with method.inference(components):
        pipe = make_pipeline(components)
        generator = torch.Generator().manual_seed(seed)
        images = []
        with autocast() if autocast else contextlib.nullcontext():
            for _ in range(num_images):
                out = pipe(prompt, num_inference_steps=steps, generator=generator, height=resolution,
                           width=resolution)
                images.append(out.images[0])
        return images


def save_images(images: list, out_dir: Path, step: int, prompts: list[str] | None = None) -> list[Path]:
    """``step-NNNNNN-I.png``, each with its prompt and step as PNG text (``prompt``, ``step``)."""
    from PIL.PngImagePlugin import PngInfo

    paths = []
    for i, image in enumerate(images):
        path = out_dir / f"step-{step:06d}-{i}.png"
        info = PngInfo()
        info.add_text("step", str(step))
        if prompts:
            info.add_text("prompt", prompts[i])
        with atomic_path(path) as tmp:
            image.save(tmp, format="PNG", pnginfo=info)
        paths.append(path)
    return paths
