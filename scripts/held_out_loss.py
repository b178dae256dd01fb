"""The held-out denoising loss of trained UNets, for learning parity with diffusers' example scripts.

    held_out_loss.py BASE_PIPELINE DATA_DIR PROMPT UNET_DIR...

Each UNet (a folder holding config.json and its weights: a saved pipeline's unet/) is scored on the
same (image, noise, timestep) triples, drawn from seeds no training run uses, against the scheduler's
own target (noise, or velocity for v-prediction), with the base pipeline's VAE and text encoder:
the mean squared error over 48 triples. Prints one line per UNet: the loss and the folder.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch
from diffusers import StableDiffusionPipeline, UNet2DConditionModel
from PIL import Image

TRIPLES, SEED = 48, 10_000


def main(base: str, data: str, prompt: str, unets: list[str]) -> None:
    pipe = StableDiffusionPipeline.from_pretrained(base, safety_checker=None)
    scheduler, size = pipe.scheduler, pipe.unet.config.sample_size * pipe.vae_scale_factor
    paths = sorted(p for p in Path(data).iterdir() if p.suffix.lower() in (".png", ".jpg", ".jpeg"))
    pixels = torch.stack([torch.from_numpy(np.asarray(Image.open(p).convert("RGB").resize((size, size)),
                                                      dtype=np.float32) / 127.5 - 1).permute(2, 0, 1) for p in paths])
    gen = torch.Generator().manual_seed(SEED)
    with torch.no_grad():
        dist = pipe.vae.encode(pixels).latent_dist
        ids = pipe.tokenizer([prompt], padding="max_length", max_length=pipe.tokenizer.model_max_length,
                             truncation=True, return_tensors="pt").input_ids
        hidden = pipe.text_encoder(ids)[0]
    triples = []
    for i in range(TRIPLES):
        k = i % len(paths)
        latent = (dist.mean[k] + dist.std[k] * torch.randn(dist.mean[k].shape, generator=gen)) \
            * pipe.vae.config.scaling_factor
        noise = torch.randn(latent.shape, generator=gen)
        t = torch.randint(scheduler.config.num_train_timesteps, (1,), generator=gen)
        triples.append((latent[None], noise[None], t))
    for folder in unets:
        unet = UNet2DConditionModel.from_pretrained(folder).eval()
        losses = []
        with torch.no_grad():
            for latent, noise, t in triples:
                noisy = scheduler.add_noise(latent, noise, t)
                target = scheduler.get_velocity(latent, noise, t) \
                    if scheduler.config.prediction_type == "v_prediction" else noise
                pred = unet(noisy, t, hidden).sample
                losses.append(float(torch.nn.functional.mse_loss(pred, target)))
        print(f"{np.mean(losses):.4f}  {folder}")


if __name__ == "__main__":
    if len(sys.argv) < 5:
        sys.exit(__doc__)
    main(sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:])
