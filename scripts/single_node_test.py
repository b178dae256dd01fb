#!/usr/bin/env python
"""`make single-node-test`: build the tiny model and sample images if missing, train a few steps
offline, then prove the result loads with diffusers' own `load_textual_inversion`."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from xeontune.quiet import quiet_libraries  # noqa: E402  (after HF_HUB_OFFLINE: the hub reads it at import)

quiet_libraries()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="models/tiny")
    parser.add_argument("--data", default="data/sample")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--output-dir", default="textual_inversion_output")
    parser.add_argument("--token", default="<toy-bot>")
    args = parser.parse_args()

    from xeontune import models
    from xeontune.train.__main__ import main as train_main

    if args.model == "models/tiny" and not (Path(args.model) / "model_index.json").is_file():
        print(f"building the tiny pipeline in {args.model}")
        models.build_pipeline("tiny", args.model)
    if args.data == "data/sample" and not Path(args.data).is_dir():
        print(f"writing sample images to {args.data}")
        models.write_sample_data(args.data)

    resolution = "64" if args.model == "models/tiny" else "512"
    rc = train_main([
        "--model", args.model, "--data-dir", args.data, "--placeholder-token", args.token,
        "--initializer-token", "toy", "--resolution", resolution, "--max-train-steps", str(args.steps),
        "--output-dir", args.output_dir, "--overwrite",
    ])
    if rc:
        return rc

    import diffusers
    from diffusers import StableDiffusionPipeline

    diffusers.utils.logging.disable_progress_bar()
    embeds = Path(args.output_dir) / "learned_embeds.safetensors"
    pipe = StableDiffusionPipeline.from_pretrained(args.model, safety_checker=None, requires_safety_checker=False)
    before = len(pipe.tokenizer)
    pipe.load_textual_inversion(str(embeds))
    added = [t for t in pipe.tokenizer.get_vocab() if t.startswith(args.token)]
    print(f"loaded {embeds} with diffusers' load_textual_inversion: added token(s) {added} "
          f"(vocabulary {before} -> {len(pipe.tokenizer)})")
    return 0 if added else 1


if __name__ == "__main__":
    sys.exit(main())
