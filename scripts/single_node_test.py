#!/usr/bin/env python
"""`make single-node-test`: build the tiny model and sample images if missing, train a few steps
offline, then prove the result loads with diffusers' own `load_textual_inversion` (textual
inversion) or `load_lora_weights` (`METHOD=lora`: both files, diffusers' and kohya's layouts), or the pipeline
folder and the single file (`METHOD=full`)."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from xeontune.train.families import Family

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from xeontune.quiet import quiet_libraries  # noqa: E402  (after HF_HUB_OFFLINE: the hub reads it at import)

quiet_libraries()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="models/tiny")
    parser.add_argument("--data", default="data/sample")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--method", default="textual_inversion", choices=("textual_inversion", "lora", "full"))
    parser.add_argument("--output-dir", default=None, help="default: textual_inversion_output or lora_output")
    parser.add_argument("--token", default="<toy-bot>")
    parser.add_argument("--resolution", type=int, default=0, help="pixels (default: the model's own size)")
    args = parser.parse_args()

    from xeontune import models
    from xeontune.train.__main__ import main as train_main

    if args.model == "models/tiny" and not (Path(args.model) / "model_index.json").is_file():
        print(f"building the tiny pipeline in {args.model}")
        models.build_pipeline("tiny", args.model)
    if args.data == "data/sample" and not Path(args.data).is_dir():
        print(f"writing sample images to {args.data}")
        models.write_sample_data(args.data)

    from xeontune.train.components import pipeline_family

    family = pipeline_family(args.model)
    args.output_dir = args.output_dir or f"{args.method}_output"
    own = (["--placeholder-token", args.token, "--initializer-token", "toy"] if args.method == "textual_inversion"
           else ["--method", args.method, "--instance-prompt", "a photo of sks toy"])
    rc = train_main([
        "--model", args.model, "--data-dir", args.data, *own,
        "--resolution", str(args.resolution or native_resolution(args.model)),
        "--max-train-steps", str(args.steps), "--output-dir", args.output_dir, "--overwrite",
    ])
    if rc:
        return rc
    if args.method == "lora":
        return load_lora(args.model, family, Path(args.output_dir))
    if args.method == "full":
        return load_full(args.model, family, Path(args.output_dir))

    import diffusers

    diffusers.utils.logging.disable_progress_bar()
    embeds = Path(args.output_dir) / "learned_embeds.safetensors"
    pipe = family.pipeline_type().from_pretrained(args.model, **family.pipeline_options)
    before = len(pipe.tokenizer)
    if len(family.encoders) > 1:  # one vector set per text encoder, loaded into each (docs/training.md)
        from safetensors.torch import load_file

        vectors = load_file(embeds)
        for encoder in family.encoders:
            pipe.load_textual_inversion(vectors[encoder.embedding_key], token=args.token,
                                        text_encoder=getattr(pipe, encoder.folder),
                                        tokenizer=getattr(pipe, encoder.tokenizer))
    else:
        pipe.load_textual_inversion(str(embeds))
    added = [t for t in pipe.tokenizer.get_vocab() if t.startswith(args.token)]
    print(f"loaded {embeds} with diffusers' load_textual_inversion: added token(s) {added} "
          f"(vocabulary {before} -> {len(pipe.tokenizer)})")
    return 0 if added else 1


def load_full(model: str, family: Family, out: Path) -> int:
    """The pipeline folder and the single file, each loaded by diffusers: the same UNet, not the base's."""
    import diffusers

    diffusers.utils.logging.disable_progress_bar()
    cls = family.pipeline_type()
    base = cls.from_pretrained(model).unet.state_dict()
    folder = cls.from_pretrained(str(out / "pipeline")).unet.state_dict()
    single = cls.from_single_file(str(out / "model.safetensors"), config=model, local_files_only=True).unet.state_dict()
    moved = max(float((folder[k] - base[k]).abs().max()) for k in base)
    same = max(float((folder[k] - single[k]).abs().max()) for k in base)
    print(f"loaded {out / 'pipeline'} and {out / 'model.safetensors'} with diffusers: the UNet moved by up to "
          f"{moved:.2e} from the base; the two differ by {same:.1e}")
    return 0 if moved > 0 and same == 0 else 1


def load_lora(model: str, family: Family, out: Path) -> int:
    """Both LoRA files fused into the model's UNet by diffusers' own loader: the same weights, not the base's."""
    import diffusers

    diffusers.utils.logging.disable_progress_bar()
    fused = {}
    for name in ("pytorch_lora_weights.safetensors", "pytorch_lora_weights_kohya.safetensors"):
        pipe = family.pipeline_type().from_pretrained(model, **family.pipeline_options)
        base = {k: v.clone() for k, v in pipe.unet.state_dict().items()}
        pipe.load_lora_weights(str(out), weight_name=name)
        pipe.fuse_lora()
        pipe.unload_lora_weights()  # the adapters' modules out: the plain UNet, the LoRA in its weights
        fused[name] = pipe.unet.state_dict()
        moved = max(float((fused[name][k] - base[k]).abs().max()) for k in base)
        print(f"loaded {out / name} with diffusers' load_lora_weights: UNet weights moved by up to {moved:.2e}")
    a, b = fused.values()
    same = max(float((a[k] - b[k]).abs().max()) for k in a)
    print(f"the two layouts fuse to the same UNet (max difference {same:.1e})")
    return 0 if moved > 0 and same <= 1e-6 else 1


def native_resolution(model: str) -> int:
    """The pixel size the model's UNet was built for (64 for the tiny models, 512 for SD1.5, 1024 for
    SDXL): its sample size times the VAE's downscaling."""
    from diffusers import AutoencoderKL, UNet2DConditionModel

    unet = UNet2DConditionModel.load_config(model, subfolder="unet")  # a folder or a downloaded hub id
    vae = AutoencoderKL.load_config(model, subfolder="vae")
    return int(unet["sample_size"]) * 2 ** (len(vae["block_out_channels"]) - 1)


if __name__ == "__main__":
    sys.exit(main())
