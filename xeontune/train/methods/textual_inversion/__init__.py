"""Textual inversion: a new token's vectors in the text encoder(s) train; every model stays frozen
(diffusers' ``textual_inversion.py`` and ``textual_inversion_sdxl.py``). The method: ``method.py``."""

from __future__ import annotations

from typing import Any

from xeontune.train.methods.declaration import Bench, Declaration


def _bench_options(baseline: bool, args: Any) -> dict[str, Any]:
    # the example trains its whole token table (its other rows are restored after every step)
    return {"placeholder_token": "<bench-token>", "initializer_token": "toy", "train_full_table": baseline}


def _example_bf16(family: str) -> tuple[str, ...]:
    # the text encoder trains in fp32; SDXL's script casts its second encoder whole, token table included
    return ("unet", "vae", *(("text_encoder_2",) if family == "sdxl" else ()))


METHOD = Declaration(
    name="textual_inversion",
    summary="a new token's vectors; the models stay frozen",
    implementation="xeontune.train.methods.textual_inversion.method:TextualInversion",
    group="textual inversion",
    files=("learned_embeds",),
    defaults={"learning_rate": 5e-4, "output_dir": "textual_inversion_output", "random_flip": True},
    required=("placeholder_token", "initializer_token"),
    own=("save_format", "train_full_table"),
    # Issue 9's targets (2 cores, 256 px, bf16): >= 1.6x the example's steps/s, peak RSS <= 0.8x; issue 17's
    # for SDXL (512 px): >= 2.0x, peak RSS <= 0.6x in bf16 and 0.9x in fp32 (the fp32 UNet alone is 10.3 GB)
    bench=Bench(example="textual_inversion.py (SDXL: textual_inversion_sdxl.py)",
                targets={"speedup_min": 1.6, "rss_ratio_max": 0.8,
                         "families": {"sdxl": {"speedup_min": 2.0, "rss_ratio_max": {"bf16": 0.6, "fp32": 0.9}}}},
                options=_bench_options, example_bf16=_example_bf16),
)
