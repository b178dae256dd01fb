"""The held-out flow-matching loss of LoRA files on an SD3 or Flux pipeline, for learning parity with
diffusers' train_dreambooth_lora_sd3.py / train_dreambooth_lora_flux.py.

    held_out_flow_loss.py BASE_PIPELINE DATA_DIR PROMPT RESOLUTION LORA_FILE...

Each LoRA file is loaded into the base pipeline by its own load_lora_weights and scored on the same
(image, noise, sigma) triples, drawn from seeds no training run uses (sigma uniform in (0, 1)), against the
velocity (noise - latents) that both scripts train towards (SD3's preconditioned loss is the same
quantity scaled by sigma squared): the mean squared error over 48 triples. Prints one line per file: the
loss and the file. "base" as a file scores the pipeline without a LoRA.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch
from PIL import Image

TRIPLES, SEED = 48, 10_000


def main(base: str, data: str, prompt: str, resolution: int, files: list[str]) -> None:
    import diffusers

    from xeontune.train.components import pipeline_family

    family = pipeline_family(base)
    family_run = family.for_run(_Plain())  # the raw prediction: the velocity
    paths = sorted(p for p in Path(data).iterdir() if p.suffix.lower() in (".png", ".jpg", ".jpeg"))
    pixels = torch.stack([torch.from_numpy(np.asarray(Image.open(p).convert("RGB").resize((resolution, resolution)),
                                                      dtype=np.float32) / 127.5 - 1).permute(2, 0, 1) for p in paths])
    for file in files:
        pipe = getattr(diffusers, family.pipeline_class).from_pretrained(base)
        if file != "base":
            pipe.load_lora_weights(str(Path(file).parent), weight_name=Path(file).name)
        vae, scheduler = pipe.vae, pipe.scheduler
        gen = torch.Generator().manual_seed(SEED)
        with torch.no_grad():
            dist = vae.encode(pixels).latent_dist
            encoded = pipe.encode_prompt(prompt, prompt, prompt, do_classifier_free_guidance=False,
                                         max_sequence_length=77) if family.name == "sd3" else \
                pipe.encode_prompt(prompt, prompt, max_sequence_length=512)
            hidden, pooled = (encoded[0], encoded[2]) if family.name == "sd3" else (encoded[0], encoded[1])
            conditions = family_run.conditions(pooled, None)
            losses = []
            for i in range(TRIPLES):
                k = i % len(paths)
                latent = (dist.mean[k] + dist.std[k] * torch.randn(dist.mean[k].shape, generator=gen))
                latent = ((latent - vae.config.shift_factor) * vae.config.scaling_factor)[None]
                noise = torch.randn(latent.shape, generator=gen)
                index = torch.randint(scheduler.config.num_train_timesteps, (1,), generator=gen)
                sigma = scheduler.sigmas[index].reshape(-1, 1, 1, 1)
                noisy = (1 - sigma) * latent + sigma * noise
                pred = family_run.predict(scheduler, getattr(pipe, family.denoiser), noisy, index, hidden,
                                          conditions)
                losses.append(float(torch.nn.functional.mse_loss(pred, noise - latent)))
        print(f"{np.mean(losses):.6f} {file}", flush=True)


class _Plain:
    """The options for_run reads: the raw prediction (the velocity), Flux's default guidance."""

    precondition_outputs = False
    guidance_scale = 3.5


if __name__ == "__main__":
    if len(sys.argv) < 6:
        sys.exit(__doc__)
    main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5:])
