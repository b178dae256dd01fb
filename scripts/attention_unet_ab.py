"""The UNet's forward and backward with torch's SDPA and with xeontune's attention processor, alternated in
one process (so that drift of a shared machine falls on both alike): the step-level figure behind
docs/performance.md's "Attention kernel" section.

    attention_unet_ab.py MODEL_DIR RESOLUTION ROUNDS [fp32|bf16] [MODE,...]

MODE: torch, auto or always (``attention.install``'s). Textual inversion's backward: the gradient flows
to the text states only, the UNet frozen. Prints each mode's median and fastest seconds per step and the
ratio of the medians, torch's over each other mode's.
"""

from __future__ import annotations

import statistics
import sys
import time

import torch
from diffusers import UNet2DConditionModel
from diffusers.models.attention_processor import AttnProcessor2_0

from xeontune.train import attention


def main(model: str, resolution: int, rounds: int, precision: str = "fp32", modes: str = "torch,auto") -> None:
    names = modes.split(",")
    unet = UNet2DConditionModel.from_pretrained(model, subfolder="unet").eval().requires_grad_(False)
    if attention.kernel() is not None:
        sys.exit("the kernel could not be built here")
    g = torch.Generator().manual_seed(0)
    latents = torch.randn(1, unet.config.in_channels, resolution // 8, resolution // 8, generator=g)
    text = torch.randn(1, 77, unet.config.cross_attention_dim, generator=g)

    def step() -> None:
        states = text.clone().requires_grad_(True)
        with torch.autocast("cpu", torch.bfloat16, enabled=precision == "bf16"):
            out = unet(latents, torch.tensor([500]), states).sample
        out.float().square().mean().backward()

    def use(name: str) -> None:
        if name == "torch":
            unet.set_attn_processor(AttnProcessor2_0())
        else:
            attention.install(unet, name)

    times: dict[str, list[float]] = {name: [] for name in names}
    for name in names:  # warm-up
        use(name)
        step()
    for r in range(rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            use(name)
            start = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - start)
    for name in names:
        print(f"{name}: median {statistics.median(times[name]):.3f} s, fastest {min(times[name]):.3f} s "
              f"({' '.join(f'{t:.2f}' for t in times[name])})")
    for name in names[1:]:
        print(f"torch / {name}: {statistics.median(times['torch']) / statistics.median(times[name]):.3f}x")


if __name__ == "__main__":
    if len(sys.argv) < 4:
        sys.exit(__doc__)
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), *sys.argv[4:])
