"""`--gradient-checkpointing`: the frozen UNet recomputes its blocks in the backward pass.

The vectors must get the same gradients (fp32, pinned: the recompute runs the same kernels on the
same inputs), also with packed layers (their autograd functions run again under the recompute), and
the UNet must really keep fewer activations.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from xeontune.train import loop
from xeontune.train.options import parse_args


def _args(base_args, kind, sdxl_model, tmp_path, *extra):
    model = [] if kind == "tiny" else ["--model", str(sdxl_model)]
    return [*base_args, *model, "--mixed-precision", "fp32", "--max-train-steps", "3", "--learning-rate", "0.005",
            "--checkpointing-steps", "0", "--save-steps", "0", "--output-dir", str(tmp_path / "-".join(extra)), *extra]


def _saved_bytes_and_grad(run) -> tuple[int, torch.Tensor]:
    """One forward and backward of the step's math: the bytes autograd keeps for the backward pass
    (each storage once) and the gradient of the vectors."""
    batch = run.plan.batch(run.positions(0, 0))
    latents = run.latents.sample(batch)
    noisy = run.components.noise_scheduler.add_noise(latents, batch.noise, batch.timesteps)
    storages: dict[int, int] = {}

    def keep(t: torch.Tensor) -> torch.Tensor:
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        hidden, added = run.encode_text(batch)
        pred = run.components.denoiser(noisy, batch.timesteps, hidden, added_cond_kwargs=added).sample
    F.mse_loss(pred, run.target(latents, batch.noise, batch.timesteps)).backward()
    grad = torch.cat([p.grad.flatten() for p in run.embedding.parameters()])
    return sum(storages.values()), grad


@pytest.mark.parametrize("kind", ["tiny", "sdxl-tiny"])
def test_checkpointing_keeps_less_and_gives_the_same_gradient(base_args, sdxl_model, tmp_path, kind):
    runs = {}
    for flag in ("--no-gradient-checkpointing", "--gradient-checkpointing"):
        opts = parse_args(_args(base_args, kind, sdxl_model, tmp_path, flag, "--pack-weights", "off"))
        run, _ = loop.setup(opts, loop.make_accelerator(opts))
        runs[flag] = _saved_bytes_and_grad(run)
        checkpointed = [m for m in run.components.denoiser.modules() if getattr(m, "gradient_checkpointing", False)]
        assert bool(checkpointed) == (flag == "--gradient-checkpointing")
        assert any("gradient checkpointing" in n for n in run.backend_notes) == (flag == "--gradient-checkpointing")
    (plain_bytes, plain_grad), (ckpt_bytes, ckpt_grad) = runs.values()
    assert ckpt_bytes < 0.7 * plain_bytes  # measured at 64 px: tiny 0.22, sdxl-tiny 0.25
    assert plain_grad.abs().sum() > 0
    assert torch.allclose(ckpt_grad, plain_grad, rtol=0, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["tiny", "sdxl-tiny"])
def test_checkpointed_training_learns_the_same_vectors_packed_or_not(base_args, sdxl_model, tmp_path, kind):
    """Three steps with and without checkpointing, with stock and with packed layers (fp32, which
    packs wherever oneDNN runs: every x86 CPU the project meets)."""
    opts = parse_args(_args(base_args, kind, sdxl_model, tmp_path))
    initial = loop.setup(opts, loop.make_accelerator(opts))[0].embedding.learned()
    for pack in ("off", "on"):
        plain = loop.train(parse_args(_args(base_args, kind, sdxl_model, tmp_path, "--pack-weights", pack))).vectors
        ckpt = loop.train(parse_args(_args(base_args, kind, sdxl_model, tmp_path, "--pack-weights", pack,
                                           "--gradient-checkpointing"))).vectors
        assert (plain - initial).abs().max() > 1e-3  # it trained
        assert torch.allclose(ckpt, plain, rtol=0, atol=1e-5), (pack, (ckpt - plain).abs().max())
