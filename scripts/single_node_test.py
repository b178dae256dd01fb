#!/usr/bin/env python
"""`make single-node-test`: build the tiny model and sample images if missing, train a few steps
offline, then prove the result loads with diffusers' own `load_textual_inversion` (textual
inversion) or `load_lora_weights` (`METHOD=lora`: both files, diffusers' and kohya's layouts), or the pipeline
folder and the single file (`METHOD=full`). `MODEL=` another model's folder (`xeontune model sd3-tiny DIR`)
trains that one."""

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
    """The pipeline folder and (where the family has that layout) the single file, each loaded by diffusers:
    the same denoiser, not the base's."""
    import diffusers

    diffusers.utils.logging.disable_progress_bar()
    cls = family.pipeline_type()
    base = getattr(cls.from_pretrained(model), family.denoiser).state_dict()
    folder = getattr(cls.from_pretrained(str(out / "pipeline")), family.denoiser).state_dict()
    moved = max(float((folder[k] - base[k]).abs().max()) for k in base)
    if not family.single_file:
        print(f"loaded {out / 'pipeline'} with diffusers: the {family.denoiser_title} moved by up to {moved:.2e} "
              "from the base")
        return 0 if moved > 0 else 1
    single = cls.from_single_file(str(out / "model.safetensors"), config=model, local_files_only=True).unet.state_dict()
    same = max(float((folder[k] - single[k]).abs().max()) for k in base)
    print(f"loaded {out / 'pipeline'} and {out / 'model.safetensors'} with diffusers: the UNet moved by up to "
          f"{moved:.2e} from the base; the two differ by {same:.1e}")
    return 0 if moved > 0 and same == 0 else 1


def load_lora(model: str, family: Family, out: Path) -> int:
    """The diffusers file fused into the model's denoiser by diffusers' own loader: other weights than the
    base's. kohya's UNet layout is loaded and fused the same way and must give the same weights; a
    transformer's (``lora_transformer_``, which ComfyUI reads and diffusers does not) must hold the same
    tensors under ComfyUI's names."""
    import diffusers
    from safetensors.torch import load_file

    diffusers.utils.logging.disable_progress_bar()
    names = ["pytorch_lora_weights.safetensors", "pytorch_lora_weights_kohya.safetensors"]
    loadable = names if family.kohya_denoiser_prefix == "lora_unet_" else names[:1]
    fused = {}
    for name in loadable:
        pipe = family.pipeline_type().from_pretrained(model, **family.pipeline_options)
        denoiser = getattr(pipe, family.denoiser)
        base = {k: v.clone() for k, v in denoiser.state_dict().items()}
        pipe.load_lora_weights(str(out), weight_name=name)
        pipe.fuse_lora()
        pipe.unload_lora_weights()  # the adapters' modules out: the plain denoiser, the LoRA in its weights
        fused[name] = denoiser.state_dict()
        moved = max(float((fused[name][k] - base[k]).abs().max()) for k in base)
        print(f"loaded {out / name} with diffusers' load_lora_weights: {family.denoiser_title} weights moved by up "
              f"to {moved:.2e}")
    if len(fused) == 2:
        a, b = fused.values()
        same = max(float((a[k] - b[k]).abs().max()) for k in a)
        print(f"the two layouts fuse to the same UNet (max difference {same:.1e})")
        return 0 if moved > 0 and same <= 1e-6 else 1
    ours, theirs = (load_file(str(out / name)) for name in names)
    prefix = f"{family.denoiser}."
    pairs = [(k, family.kohya_denoiser_prefix + k.removeprefix(prefix).replace(".lora_A.weight", "").replace(".", "_")
              + ".lora_down.weight") for k in ours if k.startswith(prefix) and ".lora_A." in k]
    same = bool(pairs) and all(k2 in theirs and bool((ours[k1] == theirs[k2]).all()) for k1, k2 in pairs)
    print(f"{out / names[1]} holds the same {len(pairs)} adapters under ComfyUI's {family.kohya_denoiser_prefix} "
          f"names: {'yes' if same else 'NO'}")
    return 0 if moved > 0 and same else 1


def native_resolution(model: str) -> int:
    """The pixel size the model's denoiser was built for (64 for the tiny models, 512 for SD1.5, 1024 for
    SDXL): its sample size times the VAE's downscaling."""
    import diffusers

    from xeontune.train.components import pipeline_family

    family = pipeline_family(model)
    denoiser = getattr(diffusers, family.denoiser_class).load_config(model, subfolder=family.denoiser)
    vae = diffusers.AutoencoderKL.load_config(model, subfolder="vae")  # a folder or a downloaded hub id
    if "sample_size" not in denoiser:  # Flux's transformer has none: the VAE's own, in pixels
        return int(vae["sample_size"])
    return int(denoiser["sample_size"]) * 2 ** (len(vae["block_out_channels"]) - 1)


if __name__ == "__main__":
    sys.exit(main())
