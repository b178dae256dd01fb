"""Behaviour unchanged across the seam that lets a method declare what it trains (Method.trains): textual
inversion and LoRA learn today what they learned before it, against files written by that code
(tests/references/, commit 56779da), fp32, within cross-CPU rounding and after real movement."""

from __future__ import annotations

from pathlib import Path

import pytest
from safetensors.torch import load_file

from xeontune.cli import main

pytestmark = pytest.mark.slow

REFERENCES = Path(__file__).parents[1] / "references"
COMMON = ["--resolution", "64", "--max-train-steps", "3", "--mixed-precision", "fp32", "--checkpointing-steps", "0",
          "--save-steps", "0", "--seed", "0"]
RUNS = {
    "ti_sd1": ("tiny_model", ["--placeholder-token", "<toy-bot>", "--initializer-token", "toy", "--learning-rate",
                              "5e-3"], "learned_embeds"),
    "lora_sd1": ("tiny_model", ["--method", "lora", "--instance-prompt", "a photo of sks toy", "--learning-rate",
                                "1e-3", "--train-text-encoder"], "pytorch_lora_weights"),
    "lora_sdxl": ("sdxl_model", ["--method", "lora", "--instance-prompt", "a photo of sks toy", "--learning-rate",
                                 "1e-3"], "pytorch_lora_weights"),
}
TOLERANCE = 1e-5  # fp32 on another CPU kind: oneDNN's kernels round differently


@pytest.mark.parametrize("name", list(RUNS))
def test_the_methods_learn_what_they_learned_before_the_seam(request, sample_images, tmp_path, name):
    model, args, stem = RUNS[name]
    out = tmp_path / name
    assert main(["train", "--model", str(request.getfixturevalue(model)), "--data-dir", str(sample_images), *args,
                 *COMMON, "--output-dir", str(out)]) == 0
    got, want = load_file(out / f"{stem}.safetensors"), load_file(REFERENCES / f"{name}.safetensors")
    assert got.keys() == want.keys()
    diff = max(float((got[k] - want[k]).abs().max()) for k in want)
    # what moved: a LoRA's up weights start at zero; a token's vectors from its initializer's row
    moved = max(float(want[k].abs().max()) for k in want if "lora.up" in k or "lora_B" in k) if stem != \
        "learned_embeds" else None
    print(f"{name}: max abs difference from the reference {diff:.2e}")
    assert diff <= TOLERANCE, (name, diff)
    if moved is not None:
        assert moved >= 100 * TOLERANCE, (name, moved)
    else:
        from transformers import CLIPTextModel, CLIPTokenizer

        base = request.getfixturevalue(model)
        row = CLIPTokenizer.from_pretrained(base, subfolder="tokenizer").convert_tokens_to_ids("toy")
        initial = CLIPTextModel.from_pretrained(base, subfolder="text_encoder").get_input_embeddings().weight[row]
        assert float((want["<toy-bot>"][0] - initial.detach()).abs().max()) >= 100 * TOLERANCE
