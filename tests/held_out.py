"""The learning tests' measure, shared by every method's tests."""

from __future__ import annotations

import torch


def held_out_loss(run) -> float:
    """The denoising loss on (image, noise, timestep) triples never trained on, against the scheduler's
    own target (noise, or velocity for v-prediction), with the models as ``run`` holds them now."""
    losses = []
    with torch.no_grad():
        for start in range(10_000, 10_048, 8):
            batch = run.plan.batch(list(range(start, start + 8)))
            latents = run.latents.sample(batch)
            noisy = run.components.noise_scheduler.add_noise(latents, batch.noise, batch.timesteps)
            hidden, added = run.encode_text(batch)
            pred = run.components.denoiser(noisy, batch.timesteps, hidden, added_cond_kwargs=added).sample
            losses.append(torch.nn.functional.mse_loss(pred, run.target(latents, batch.noise, batch.timesteps)))
    return float(torch.stack(losses).mean())
