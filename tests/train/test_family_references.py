"""Behaviour unchanged across the family seam (train/families/): every method on every family (SD1, SD2
v-prediction, SDXL) learns what it learned before SD and SDXL moved behind it, against fingerprints of
files written by the code before the move (tests/references/families.json, commit 21bddb6), fp32.

A fingerprint is, per tensor of the run's result, its sum (in fp64) and 4 of its values spread over it:
small enough to keep in git for whole pipelines, and not passed by a change that moves any weight. On the
CPU kind, torch and thread count that wrote them the values are equal bit for bit (printed); elsewhere the
kernels round otherwise, and they agree within ``TOLERANCE`` of the weights' scale after real movement.

XEONTUNE_WRITE_REFERENCES=1 writes them again: only for a change meant to alter these results (say so)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from xeontune.cli import main

pytestmark = pytest.mark.slow

REFERENCES = Path(__file__).parents[1] / "references" / "families.json"
COMMON = ["--resolution", "64", "--max-train-steps", "3", "--mixed-precision", "fp32", "--checkpointing-steps", "0",
          "--save-steps", "0", "--seed", "0"]
TI = ["--placeholder-token", "<toy-bot>", "--initializer-token", "toy", "--learning-rate", "5e-3"]
LORA = ["--method", "lora", "--instance-prompt", "a photo of sks toy", "--learning-rate", "1e-3",
        "--train-text-encoder"]
FULL = ["--method", "full", "--instance-prompt", "a photo of sks toy", "--learning-rate", "1e-3",
        "--train-text-encoder", "--adam-epsilon", "1e-4"]
# (model fixture, flags, the result file whose tensors are compared, what it started from: the base
# model's tensors of the same names, or None where the result is all new)
RUNS = {
    "ti_sd2": ("sd2_model", TI, "learned_embeds"),
    "ti_sdxl": ("sdxl_model", TI, "learned_embeds"),
    "lora_sd2": ("sd2_model", LORA, "pytorch_lora_weights"),
    "lora_sdxl_te": ("sdxl_model", LORA, "pytorch_lora_weights"),
    "full_sd1": ("tiny_model", FULL, "model"),
    "full_sd2": ("sd2_model", FULL, "model"),
    "full_sdxl": ("sdxl_model", FULL, "model"),
}
SAMPLES = 4
TOLERANCE = 1e-5  # of the weights' largest value: fp32 on another CPU kind


def fingerprint(tensors: dict[str, torch.Tensor]) -> dict[str, list[float]]:
    """Per tensor: its fp64 sum, then ``SAMPLES`` of its values at evenly spaced flat positions."""
    out = {}
    for name, tensor in sorted(tensors.items()):
        flat = tensor.detach().float().flatten()
        where = torch.linspace(0, flat.numel() - 1, min(SAMPLES, flat.numel())).long()
        out[name] = [float(flat.double().sum())] + [float(v) for v in flat[where]]
    return out


def _machine() -> str:
    # the threads too: a reduction split otherwise rounds otherwise (one thread a pytest-xdist worker)
    return f"{torch.__version__} {torch.backends.cpu.get_cpu_capability()} {torch.get_num_threads()} threads"


@pytest.mark.parametrize("name", list(RUNS))
def test_every_family_learns_what_it_learned_before_the_family_seam(request, sample_images, tmp_path, name):
    model, args, stem = RUNS[name]
    out = tmp_path / name
    assert main(["train", "--model", str(request.getfixturevalue(model)), "--data-dir", str(sample_images), *args,
                 *COMMON, "--output-dir", str(out)]) == 0
    got = fingerprint(load_file(out / f"{stem}.safetensors"))
    if os.environ.get("XEONTUNE_WRITE_REFERENCES") == "1":
        saved = json.loads(REFERENCES.read_text()) if REFERENCES.is_file() else {}
        saved[name] = {"machine": _machine(), "tensors": got}
        REFERENCES.write_text(json.dumps(saved, sort_keys=True, separators=(",", ":")) + "\n")
        return
    want = json.loads(REFERENCES.read_text())[name]
    assert got.keys() == want["tensors"].keys()
    values = {k: torch.tensor(v[1:], dtype=torch.float64) for k, v in want["tensors"].items()}
    scale = max(float(v.abs().max()) for v in values.values() if v.numel())
    diff = max(float((torch.tensor(got[k][1:], dtype=torch.float64) - v).abs().max()) for k, v in values.items()
               if v.numel())
    sums = max(abs(got[k][0] - v[0]) / max(1.0, abs(v[0])) for k, v in want["tensors"].items())
    print(f"{name}: largest difference from the reference {diff:.2e} (sums {sums:.2e}), written on "
          f"{want['machine']}, here {_machine()}")
    if want["machine"] == _machine():
        assert diff == 0 and sums == 0, (name, diff, sums)
    assert diff <= TOLERANCE * scale and sums <= 1e-4, (name, diff, sums, scale)
    _assert_moved(request, model, stem, out, name)


def _assert_moved(request, model: str, stem: str, out: Path, name: str) -> None:
    """The result moved from where it started by far more than the tolerance (runs that learned nothing agree
    too): a LoRA's up weights start at zero, a token's vectors at its initializer's row, full's weights at the
    base model's (its own single file, written by the same code)."""
    result = load_file(out / f"{stem}.safetensors")
    if stem == "pytorch_lora_weights":
        moved = max(float(v.abs().max()) for k, v in result.items() if "lora.up" in k or "lora_B" in k)
    elif stem == "learned_embeds":
        from transformers import CLIPTextModel, CLIPTokenizer

        base = request.getfixturevalue(model)
        row = CLIPTokenizer.from_pretrained(base, subfolder="tokenizer").convert_tokens_to_ids("toy")
        initial = CLIPTextModel.from_pretrained(base, subfolder="text_encoder").get_input_embeddings().weight[row]
        first = result["clip_l" if "clip_l" in result else "<toy-bot>"][0]  # SDXL's: A1111's layout
        moved = float((first[: initial.numel()] - initial.detach()).abs().max())
    else:
        from diffusers import UNet2DConditionModel

        base = UNet2DConditionModel.from_pretrained(request.getfixturevalue(model), subfolder="unet").state_dict()
        trained = UNet2DConditionModel.from_pretrained(out / "pipeline", subfolder="unet").state_dict()
        moved = max(float((trained[k] - base[k]).abs().max()) for k in base)
    assert moved >= 100 * TOLERANCE, (name, moved)
