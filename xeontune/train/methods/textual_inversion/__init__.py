"""Textual inversion: a new token's vectors in the text encoder(s) train; every model stays frozen
(diffusers' ``textual_inversion.py`` and ``textual_inversion_sdxl.py``). The method: ``method.py``."""

from __future__ import annotations

from typing import Any

from xeontune.errors import UserError
from xeontune.train.methods.declaration import Bench, Declaration


def _bench_options(baseline: bool, args: Any) -> dict[str, Any]:
    # the example trains its whole token table (its other rows are restored after every step)
    return {"placeholder_token": "<bench-token>", "initializer_token": "toy", "train_full_table": baseline}


def _check_prompts(opts: Any, given: Any) -> None:
    """Every caption (or the instance prompt) must name the token: the vectors learn only through
    prompts that contain it."""
    token = opts.placeholder_token
    for text, where in zip(given.texts, given.where, strict=True) if given else ():
        if token not in text:
            raise UserError(f"the prompt {text!r} ({where}) does not contain --placeholder-token {token}: "
                            "textual inversion learns only from prompts that name the token")


METHOD = Declaration(
    name="textual_inversion",
    summary="a new token's vectors; the models stay frozen",
    implementation="xeontune.train.methods.textual_inversion.method:TextualInversion",
    group="textual inversion",
    files=("learned_embeds",),
    defaults={"learning_rate": 5e-4, "output_dir": "textual_inversion_output", "random_flip": True},
    required=("placeholder_token", "initializer_token"),
    own=("save_format", "train_full_table"),
    # Issue 9's targets (2 cores, 256 px, bf16): >= 1.6x the example's steps/s, peak RSS <= 0.8x (a model
    # family may hold its own: families/sdxl.py)
    bench=Bench(example="textual_inversion.py (SDXL: textual_inversion_sdxl.py)",
                targets={"speedup_min": 1.6, "rss_ratio_max": 0.8}, options=_bench_options),
    check_prompts=_check_prompts,
)
