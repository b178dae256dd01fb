"""LoRA: peft's low-rank adapters beside the frozen UNet (and the text encoders' with
--train-text-encoder), with pivotal tuning's token when given --placeholder-token (diffusers'
``train_dreambooth_lora.py`` and ``train_dreambooth_lora_sdxl.py``). The method: ``method.py``."""

from __future__ import annotations

from typing import Any

from xeontune.errors import UserError
from xeontune.train.methods.declaration import Bench, Declaration


def _bench_options(baseline: bool, args: Any) -> dict[str, Any]:
    # the example runs its frozen text encoder every step
    return {"instance_prompt": "a photo of sks toy", "rank": args.rank, "cache_text": not baseline}


def _check_prompts(opts: Any, given: Any) -> None:
    """Captions or an instance prompt; with a pivotal token, at least one of them must name it (else
    textual inversion's templates, which do)."""
    token = opts.placeholder_token
    if not token and given is None:
        raise UserError("--method lora needs --instance-prompt, or a caption per image (IMAGE.txt or "
                        "metadata.jsonl in the data dir; see docs/training.md)")
    if token and given and not any(token in text for text in given.texts):
        raise UserError(f"pivotal tuning: no prompt contains --placeholder-token {token} ({given.where[0]}: "
                        f"{given.texts[0]!r}), so the token would never train")


METHOD = Declaration(
    name="lora",
    summary="low-rank adapters on the UNet's attention, and on the text encoders with --train-text-encoder",
    implementation="xeontune.train.methods.lora.method:Lora",
    group="lora",
    # diffusers' key layout, kohya's, and with pivotal tuning (--placeholder-token) the token's embedding
    files=("pytorch_lora_weights", "pytorch_lora_weights_kohya", "learned_embeds"),
    # no flips: a DreamBooth subject's text or asymmetry is part of it (train_dreambooth_lora.py does not flip)
    defaults={"learning_rate": 1e-4, "output_dir": "lora_output", "random_flip": False},
    borrows=("placeholder_token", "initializer_token", "num_vectors", "learnable_property"),  # pivotal tuning
    prior_preservation=True,
    # Issue 28's: >= 1.5x the example's steps/s at 512 px in bf16 (1.8x on an AVX2-only CPU in fp32 at
    # 256 px), peak RSS <= 0.6x its own
    bench=Bench(example="train_dreambooth_lora.py (SDXL: train_dreambooth_lora_sdxl.py)",
                targets={"speedup_min": {"bf16": 1.5, "fp32": 1.8}, "rss_ratio_max": 0.6},
                options=_bench_options),
    # adapters beside frozen models; a pivotal token trains in the text encoders
    trains_text_encoders=lambda opts: bool(opts.train_text_encoder or opts.placeholder_token),
    check_prompts=_check_prompts,
)
