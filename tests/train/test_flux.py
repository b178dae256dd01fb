"""Flux.1 on the family seam (train/families/flux.py), on the tiny Flux.1-dev-shaped model: prompts as
FluxPipeline encodes them, the transformer given packed latents, position ids, the timestep as a fraction
and the guidance, as diffusers' Flux example gives them; LoRA files that FluxPipeline.load_lora_weights and
ComfyUI's layout load; full fine-tuning with T5 frozen."""

from __future__ import annotations

import torch
from safetensors.torch import load_file

from tests.one_line import one_line_error as one_line
from tests.train.test_lora import (
    DIFFUSERS_FILE,
    KOHYA_FILE,
    MERGE_TOLERANCE,
    max_diff,
    merged_in_memory,
    state,
)
from tests.train.test_sd3 import PROMPT, runs, sd3_args  # noqa: F401  (runs: the fixture)
from xeontune.train import families, loop
from xeontune.train.options import parse_args


def test_prompts_and_the_transformer_inputs_are_the_flux_examples(flux_model):
    from diffusers import FluxPipeline

    from xeontune.train import components

    loaded = components.load(str(flux_model))
    family = loaded.family
    assert family.name == "flux"
    ids = [t([PROMPT], padding="max_length", truncation=True, max_length=e.max_length or t.model_max_length,
             return_tensors="pt").input_ids for t, e in zip(loaded.tokenizers, family.encoders, strict=True)]
    with torch.no_grad():
        hidden, pooled = family.encode(loaded.text_encoders, ids)
        want, want_pooled, _ = FluxPipeline.from_pretrained(str(flux_model)).encode_prompt(
            PROMPT, PROMPT, max_sequence_length=512)
    assert hidden.shape == want.shape and torch.allclose(hidden, want, atol=1e-6)
    assert torch.allclose(pooled, want_pooled, atol=1e-6)

    opts = parse_args(sd3_args(flux_model, ".", "o", "--guidance-scale", "2.5"))
    family = family.for_run(opts)
    assert (family.precondition, opts.weighting_scheme or family.weighting) == (False, "none")  # the example's
    scheduler = loaded.noise_scheduler
    index = torch.tensor([3, 700])
    latents, noise = torch.randn(2, 16, 8, 6), torch.randn(2, 16, 8, 6)
    noisy = family.noisy(scheduler, latents, noise, index)
    sigma = (scheduler.timesteps[index] / 1000).reshape(-1, 1, 1, 1)  # unshifted: dynamic shifting samples only
    assert torch.allclose(noisy, (1 - sigma) * latents + sigma * noise)
    seen = {}

    class Echo(torch.nn.Module):  # gives back the packed latents it is given, and keeps what it was given
        config = loaded.denoiser.config

        def forward(self, **kwargs):
            seen.update(kwargs)
            return (kwargs["hidden_states"],)

    pred = family.predict(scheduler, Echo(), noisy, index, hidden.expand(2, -1, -1),
                          family.conditions(pooled.expand(2, -1), None))
    assert torch.equal(pred, noisy)  # packed into 2x2 patches and back
    assert seen["hidden_states"].shape == (2, 4 * 3, 16 * 4)
    assert torch.equal(seen["timestep"], scheduler.timesteps[index] / 1000)
    assert torch.equal(seen["guidance"], torch.tensor([2.5, 2.5]))
    assert seen["img_ids"].shape == (12, 3) and seen["img_ids"][-1].tolist() == [0, 3, 2]  # (row, col) of a patch
    assert seen["txt_ids"].shape == (hidden.shape[1], 3) and not seen["txt_ids"].any()
    assert torch.equal(family.target(scheduler, latents, noise, index), noise - latents)


def test_lora_files_load_into_flux_and_comfyui_layout(flux_model, sample_images, tmp_path, runs):  # noqa: F811
    from diffusers import FluxPipeline

    out = tmp_path / "out"
    loop.train(parse_args(sd3_args(flux_model, sample_images, out, "--train-text-encoder", "--rank", "4",
                                   "--lora-alpha", "8", "--save-as-full-pipeline")))
    models = runs[0].method.models
    assert set(models) == {"transformer", "text_encoder"}  # T5 never trains
    base = FluxPipeline.from_pretrained(str(flux_model))
    bases = {part: state(getattr(base, part)) for part in models}
    want = {part: merged_in_memory(models[part], bases[part]) for part in models}
    wrapped = {name.removesuffix(".weight") for name in want["transformer"]}
    for target in families.get("flux").lora_targets:  # the example's: attention and feed-forward, both streams
        assert any(name.endswith("." + target) for name in wrapped), target
    pipe = FluxPipeline.from_pretrained(str(flux_model))
    pipe.load_lora_weights(str(out), weight_name=DIFFUSERS_FILE)
    pipe.fuse_lora(components=list(models))
    pipe.unload_lora_weights()
    full = FluxPipeline.from_pretrained(str(out / "pipeline"))
    for what, got in (("load_lora_weights", pipe), ("--save-as-full-pipeline", full)):
        for part in models:
            weights = state(getattr(got, part))
            assert max_diff({k: weights[k] for k in want[part]}, want[part]) <= MERGE_TOLERANCE, (what, part)
    moved = [n for n, w in want["transformer"].items() if max_diff({n: w}, {n: bases["transformer"][n]}) > 1e-4]
    assert len(moved) > len(want["transformer"]) // 2
    diffusers_file, comfy = load_file(str(out / DIFFUSERS_FILE)), load_file(str(out / KOHYA_FILE))
    adapters = [k for k in diffusers_file if k.startswith("transformer.") and ".lora_A." in k]
    for key in adapters:
        name = "lora_transformer_" + key.removeprefix("transformer.").removesuffix(".lora_A.weight").replace(".", "_")
        assert torch.equal(comfy[f"{name}.lora_down.weight"], diffusers_file[key])
        assert float(comfy[f"{name}.alpha"]) == 8.0
    assert len([k for k in comfy if k.startswith("lora_transformer_")]) == 3 * len(adapters)
    # `make single-node-test MODEL=<flux folder> METHOD=lora`'s checks of these files, and its default size
    # (the VAE's: Flux's transformer names none)
    script = _single_node_test()
    assert script.native_resolution(str(flux_model)) == 64
    assert script.load_lora(str(flux_model), families.get("flux"), out) == 0


def _single_node_test():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).parents[2] / "scripts" / "single_node_test.py"
    spec = importlib.util.spec_from_file_location("single_node_test", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_both_text_encoders_are_freed_before_the_first_step(flux_model, sample_images, tmp_path, monkeypatch):
    seen = []
    step = loop.train_step

    def first(run, index):
        seen.append((run.components.text_encoder, run.components.text_encoder_2, run.text_cache is not None))
        return step(run, index)

    monkeypatch.setattr(loop, "train_step", first)
    loop.train(parse_args(sd3_args(flux_model, sample_images, tmp_path / "o", "--max-train-steps", "1")))
    assert seen == [(None, None, True)]


def test_full_fine_tuning_trains_the_transformer_and_clip_not_t5(flux_model, sample_images, tmp_path, capsys):
    from diffusers import FluxPipeline

    loop.train(parse_args(sd3_args(flux_model, sample_images, tmp_path / "full", "--method", "full",
                                   "--train-text-encoder", "--learning-rate", "1e-4")))
    base = FluxPipeline.from_pretrained(str(flux_model))
    saved = FluxPipeline.from_pretrained(str(tmp_path / "full" / "pipeline"))
    for part in ("transformer", "text_encoder"):
        assert max_diff(state(getattr(base, part)), state(getattr(saved, part))) > 1e-5, part
    assert max_diff(state(base.text_encoder_2), state(saved.text_encoder_2)) == 0
    line = one_line(capsys, ["train", *sd3_args(flux_model, sample_images, tmp_path / "o", "--method",
                                                "textual_inversion", "--placeholder-token", "<t>",
                                                "--initializer-token", "toy")])
    assert "a flux model (Flux.1)" in line
