"""Pivotal tuning: `--method lora --placeholder-token` trains textual inversion's token beside the
adapters, stops the token after `--train-token-fraction` of the steps, and writes both files, which
load into diffusers together. fp32 throughout (the tests compare runs)."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from safetensors.torch import load_file

from tests.one_line import one_line_error
from xeontune.cli import main
from xeontune.train import tokens

pytestmark = pytest.mark.slow

LORA_FILE = "pytorch_lora_weights.safetensors"


def pivotal_args(model, data, out, *more) -> list[str]:
    return ["train", "--method", "lora", "--placeholder-token", "<sks>", "--initializer-token", "toy",
            "--model", str(model), "--data-dir", str(data), "--resolution", "64", "--mixed-precision", "fp32",
            "--learning-rate", "1e-2", "--checkpointing-steps", "0", "--output-dir", str(out), *more]


def test_the_token_stops_after_its_fraction_while_the_adapters_go_on_and_both_files_load(tiny_model,
                                                                                        sample_images, tmp_path,
                                                                                        caplog, capsys):
    from diffusers import StableDiffusionPipeline

    caplog.set_level(logging.INFO, logger="xeontune.train")
    out = tmp_path / "out"
    # no --instance-prompt and no captions: textual inversion's templates, which name the token
    assert main(pivotal_args(tiny_model, sample_images, out, "--max-train-steps", "4", "--save-steps", "1",
                             "--train-token-fraction", "0.5", "--num-vectors", "2",
                             "--save-as-full-pipeline")) == 0
    names = {p.name for p in out.glob("*.safetensors")}
    assert {"learned_embeds.safetensors", LORA_FILE, "pytorch_lora_weights_kohya.safetensors"} <= names
    said = capsys.readouterr().out  # the last line names every file a user takes away
    assert f"wrote {out / LORA_FILE} and beside it pytorch_lora_weights_kohya.safetensors, " \
           "learned_embeds.safetensors (loss " in said, said[-1000:]
    stops = [r.getMessage() for r in caplog.records if "stops after step" in r.getMessage()]
    assert stops == ["the token <sks> stops after step 2 of 4 (--train-token-fraction 0.5); the adapters go on"]
    token = [load_file(out / f"learned_embeds-steps-{s}.safetensors")["<sks>"] for s in (1, 2, 3, 4)]
    lora = [load_file(out / f"pytorch_lora_weights-steps-{s}.safetensors") for s in (1, 2, 3, 4)]

    pipe = StableDiffusionPipeline.from_pretrained(str(tiny_model))
    toy = pipe.text_encoder.get_input_embeddings().weight[pipe.tokenizer.convert_tokens_to_ids("toy")].detach()
    moved = float((token[1] - toy).abs().max())
    print(f"token moved {moved:.2e} in 2 steps; steps 3-4 changed it by "
          f"{float((token[3] - token[1]).abs().max()):.1e}")
    assert moved > 1e-3 and float((token[1] - token[0]).abs().max()) > 1e-4  # trained in steps 1 and 2
    assert torch.equal(token[2], token[1]) and torch.equal(token[3], token[1])  # then not at all
    assert max(float((lora[3][k] - lora[2][k]).abs().max()) for k in lora[3]) > 1e-5  # the adapters went on

    pipe.load_lora_weights(str(out), weight_name=LORA_FILE)
    pipe.load_textual_inversion(str(out / "learned_embeds.safetensors"))
    ids = pipe.tokenizer.convert_tokens_to_ids(["<sks>", "<sks>_1"])
    assert pipe.tokenizer.unk_token_id not in ids
    assert torch.equal(pipe.text_encoder.get_input_embeddings().weight[ids].detach(), token[3])
    image = pipe("a photo of <sks>", num_inference_steps=1, height=64, width=64).images[0]
    assert image.size == (64, 64)
    full = StableDiffusionPipeline.from_pretrained(str(out / "pipeline"))  # the token and the fused LoRA
    assert torch.equal(full.text_encoder.get_input_embeddings().weight[ids].detach(), token[3])
    assert not torch.equal(full.unet.state_dict()["down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_q.weight"],
                           pipe.unet.state_dict()["down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_q.base_layer.weight"])


def test_sdxl_pivotal_tuning_writes_clip_l_and_clip_g_and_resumes_exactly(sdxl_model, sample_images, tmp_path):
    from diffusers import StableDiffusionXLPipeline

    # with adapters in both text encoders too (peft's wrapping once froze the token's rows in them)
    args = ["--instance-prompt", "a photo of <sks>", "--train-text-encoder", "--max-train-steps", "4",
            "--train-token-fraction", "0.5", "--save-steps", "0"]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    assert main(pivotal_args(sdxl_model, sample_images, straight, *args, "--save-steps", "1")) == 0
    # the token trains in steps 1 and 2 (half of 4), in both encoders, then stops while the adapters go on
    copies = [load_file(straight / f"learned_embeds-steps-{n}.safetensors") for n in (1, 2, 3)]
    copies.append(load_file(straight / "learned_embeds.safetensors"))
    for key in ("clip_l", "clip_g"):
        assert not torch.equal(copies[0][key], copies[1][key]), key
        assert torch.equal(copies[1][key], copies[2][key]) and torch.equal(copies[2][key], copies[3][key]), key
    lora_copies = [load_file(straight / LORA_FILE.replace(".safetensors", f"-steps-{n}.safetensors")) for n in (2, 3)]
    assert any(not torch.equal(lora_copies[0][k], lora_copies[1][k]) for k in lora_copies[0])
    # stopped after step 1 (the token still training), resumed through the token's stop at step 2
    assert main(pivotal_args(sdxl_model, sample_images, resumed, *args[:-4], "--max-train-steps", "1",
                             "--checkpointing-steps", "1", "--save-steps", "0")) == 0
    assert main(pivotal_args(sdxl_model, sample_images, resumed, *args, "--resume-from-checkpoint", "latest")) == 0
    for name in ("learned_embeds.safetensors", LORA_FILE):
        want, got = load_file(straight / name), load_file(resumed / name)
        assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want), name
    embeds = load_file(straight / "learned_embeds.safetensors")
    assert sorted(embeds) == ["clip_g", "clip_l"]
    assert {k.split(".", 1)[0] for k in load_file(straight / LORA_FILE)} == {"unet", "text_encoder", "text_encoder_2"}

    pipe = StableDiffusionXLPipeline.from_pretrained(str(sdxl_model))
    initial = [enc.get_input_embeddings().weight[tok.convert_tokens_to_ids("toy")].detach().clone()
               for tok, enc in ((pipe.tokenizer, pipe.text_encoder), (pipe.tokenizer_2, pipe.text_encoder_2))]
    pipe.load_lora_weights(str(straight), weight_name=LORA_FILE)
    for key, tokenizer, encoder, start in (("clip_l", pipe.tokenizer, pipe.text_encoder, initial[0]),
                                           ("clip_g", pipe.tokenizer_2, pipe.text_encoder_2, initial[1])):
        pipe.load_textual_inversion(embeds[key], token="<sks>", text_encoder=encoder, tokenizer=tokenizer)
        row = encoder.get_input_embeddings().weight[tokenizer.convert_tokens_to_ids("<sks>")].detach()
        assert torch.equal(row, embeds[key][0]) and float((row - start).abs().max()) > 1e-4, key
    assert pipe("a photo of <sks>", num_inference_steps=1, height=64, width=64).images[0].size == (64, 64)


def test_pivotal_mistakes_are_one_line_errors(tiny_model, sample_images, tmp_path, capsys):
    base = pivotal_args(tiny_model, sample_images, tmp_path / "out")
    at = base.index("--initializer-token")
    assert "needs both --placeholder-token and --initializer-token" in one_line_error(capsys, base[:at] + base[at + 2:])
    assert "--train-token-fraction must be in (0, 1]" in one_line_error(capsys, base + ["--train-token-fraction", "0"])
    lora_only = ["train", "--method", "lora", "--instance-prompt", "x", *base[base.index("--model"):]]
    assert "--train-token-fraction needs --placeholder-token" in one_line_error(
        capsys, lora_only + ["--train-token-fraction", "0.5"])
    assert "--num-vectors and --learnable-property need --placeholder-token (pivotal tuning)" in one_line_error(
        capsys, lora_only + ["--num-vectors", "2", "--learnable-property", "style"])
    line = one_line_error(capsys, base + ["--instance-prompt", "a photo of a toy"])
    assert "no prompt contains --placeholder-token <sks>" in line
    assert not (tmp_path / "out").exists()


def test_bf16_dreambooth_with_every_part_trains_fp32_adapters_and_token(sdxl_model, sample_images, tmp_path):
    """The bf16 path on every CPU (tiny SDXL): a pivotal token, prior preservation, photos of mixed shapes in
    buckets and a mask, together: the adapters and the token stay fp32 and finite, and the adapters move."""
    from PIL import Image

    data = tmp_path / "data"
    data.mkdir()
    for i, (src, size) in enumerate(zip(sorted(sample_images.glob("*.png")), [(96, 48), (64, 64), (40, 80)],
                                        strict=False)):
        Image.open(src).resize(size).save(data / f"toy_{i}.png")
    Image.new("L", (64, 64), 255).save(data / "toy_1.mask.png")
    out = tmp_path / "out"
    assert main(pivotal_args(sdxl_model, data, out, "--mixed-precision", "bf16", "--max-train-steps", "2",
                             "--save-steps", "0", "--bucket-step", "16", "--with-prior-preservation",
                             "--class-data-dir", str(tmp_path / "class"), "--class-prompt", "a photo of a toy",
                             "--num-class-images", "2", "--class-inference-steps", "1")) == 0
    config = json.loads((out / "train_config.json").read_text())
    assert config["precision"] == "bf16"
    lora, embeds = load_file(out / LORA_FILE), load_file(out / "learned_embeds.safetensors")
    assert all(v.dtype == torch.float32 for v in [*lora.values(), *embeds.values()])
    assert max(float(v.abs().max()) for k, v in lora.items() if "lora.up" in k) > 1e-4
    assert all(bool(v.isfinite().all()) for v in [*lora.values(), *embeds.values()])
    assert len(list((tmp_path / "class").glob("class-*.png"))) == 2


def test_a_token_without_gradient_is_one_error_that_does_not_blame_ipex(tiny_model, sample_images, tmp_path,
                                                                       monkeypatch, capsys):
    """The token trains beside the adapters, never on IPEX: "Try --ipex off" would send the user astray."""
    original = tokens.SplicedEmbedding.forward
    monkeypatch.setattr(tokens.SplicedEmbedding, "forward",
                        lambda self, ids: original(self, ids).detach() + 0 * self.vectors.sum())
    assert main(pivotal_args(tiny_model, sample_images, tmp_path / "out", "--max-train-steps", "1")) == 1
    err = capsys.readouterr().err
    assert "placeholder vectors received no usable gradient" in err and "ipex" not in err.lower(), err
