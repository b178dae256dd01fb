"""Full fine-tuning: every weight of the UNet trains, and the text encoders' with --train-text-encoder
(diffusers' ``train_text_to_image.py`` on captioned images, ``train_dreambooth.py`` with an instance
prompt and prior preservation). The method: ``method.py``."""

from __future__ import annotations

from typing import Any

from xeontune.errors import UserError
from xeontune.train.families import DENOISER, PARTS
from xeontune.train.methods.declaration import Bench, Declaration

ENCODERS = tuple(p for p in PARTS if p != DENOISER)  # whatever the family holds (``trains`` is told before it loads)


def _bench_options(baseline: bool, args: Any) -> dict[str, Any]:
    # --use-ema as the example's --use_ema; --optimizer for both variants (the example has AdamW only: the
    # speedup stays the trainer's, not the optimizer's)
    return {"instance_prompt": "a photo of sks toy", "cache_text": not baseline,
            "use_ema": getattr(args, "use_ema", False), "optimizer": getattr(args, "optimizer", "adamw")}


def _trains(opts: Any) -> frozenset[str]:
    return frozenset({DENOISER, *(ENCODERS if opts.train_text_encoder else ())})


def _check_prompts(opts: Any, given: Any) -> None:
    if given is None:
        raise UserError("--method full needs a caption per image (IMAGE.txt or metadata.jsonl in the data dir, "
                        "or --caption-column of a dataset) or --instance-prompt; see docs/training.md")


METHOD = Declaration(
    name="full",
    summary="every weight of the UNet, and of the text encoders with --train-text-encoder",
    implementation="xeontune.train.methods.full.method:FullFineTuning",
    group="full fine-tuning",
    # the original Stable Diffusion single file (the pipeline folder, pipeline/, is written beside it)
    files=("model",),
    # train_text_to_image.py's README runs 1e-5 (its default, 1e-4, is for a large batch); no flips by default
    defaults={"learning_rate": 1e-5, "output_dir": "full_output", "random_flip": False},
    borrows=("train_text_encoder",),
    prior_preservation=True,
    # Issue 47's: >= 1.4x the example's steps/s (bf16 at 512 px on AVX512-BF16 and AMX, fp32 at 256 px on
    # AVX2), peak RSS <= 0.8x its own
    bench=Bench(example="train_text_to_image.py", targets={"speedup_min": 1.4, "rss_ratio_max": 0.8},
                options=_bench_options),
    trains=_trains,
    trains_text_encoders=lambda opts: opts.train_text_encoder,
    check_prompts=_check_prompts,
)
