"""A trained run as a diffusers pipeline: assembled from what the run holds, saved whole (atomically).

A part the method trained (``Method.trains``) goes in as it trained, in fp32 (or --save-precision).
A frozen part goes in as the model's files hold it: reloaded where the run held it otherwise (a bf16
copy, half-precision files upcast, Linear layers cast) or changed it in place (``modified_parts``,
then ``merged_into``), or where the run freed it (text encoders whose outputs were cached, the VAE
once the latents were)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from xeontune.io import atomic_dir
from xeontune.train.components import Components, files_dtype, load_as_stored, load_text_encoder
from xeontune.train.families import DENOISER


def assemble_pipeline(components: Components, opts: Any, method: Any) -> Any:
    trained, modified = components.family.trained_parts(method.trains), method.modified_parts

    def as_stored(part: str, module: Any, cast: bool) -> Any:
        """The part as the model's files hold it: reloaded when held otherwise (``cast``), freed, or when
        the files hold another dtype (diffusers loads half-precision files in fp32 itself)."""
        stored = files_dtype(opts.model, part, opts.revision, opts.variant)
        if module is None or cast or (stored is not None and stored != module.dtype):
            return load_as_stored(opts.model, part, opts.revision, opts.variant)
        return module

    family = components.family
    denoiser = components.denoiser_for_inference
    if DENOISER not in trained:
        denoiser = as_stored(family.denoiser, denoiser, components.denoiser_cast or family.denoiser in modified)
    vae = components.vae
    vae = as_stored("vae", None if vae is None or vae.encoder is None else vae, False)
    encoders = {}
    for name in components.family.encoder_names:
        encoder = getattr(components, name)
        if name not in trained and (encoder is None or getattr(components, f"{name}_cast") or name in modified):
            encoder = load_text_encoder(opts.model, opts.revision, opts.variant, name)  # likewise its Linear layers
        encoders[name] = encoder
    tokenizers = {e.tokenizer: getattr(components, e.tokenizer) for e in components.family.encoders}
    return family.pipeline({"vae": vae, family.denoiser: denoiser, "scheduler": components.noise_scheduler,
                            **tokenizers, **encoders})


def save_pipeline(components: Components, opts: Any, method: Any, target: Path, pipe: Any = None) -> Path:
    """The pipeline folder at ``target`` (replaced whole, or left as it was if the save fails)."""
    pipe = pipe if pipe is not None else assemble_pipeline(components, opts, method)
    with method.merged_into(pipe), atomic_dir(target) as tmp:
        pipe.save_pretrained(tmp)
    return target


def save_single_file(pipe: Any, family: Any, path: Path, opts: Any) -> Path:
    """The original Stable Diffusion layout in one .safetensors (train/single_file.py), at --save-precision;
    ``family`` (train/families/) says where its text encoders go."""
    import torch

    from xeontune.train.single_file import save_single_file as write

    dtype = torch.bfloat16 if opts.save_precision == "bf16" else torch.float32
    return write(pipe, family.single_file_text(pipe), path, dtype=dtype)
