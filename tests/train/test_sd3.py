"""SD3 / SD3.5 on the family seam (train/families/sd3.py), on the tiny SD3.5-shaped model: flow matching as
diffusers' SD3 example computes it, prompts encoded as StableDiffusion3Pipeline encodes them, LoRA files
that the pipeline's load_lora_weights and ComfyUI's layout load, full fine-tuning, and T5 freed once the
prompts are cached."""

from __future__ import annotations

import dataclasses

import pytest
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
from xeontune.train import families, loop
from xeontune.train.options import parse_args

PROMPT = "a photo of sks toy"


def sd3_args(model, images, out, *more: str) -> list[str]:
    return ["--method", "lora", "--instance-prompt", PROMPT, "--model", str(model), "--data-dir", str(images),
            "--resolution", "64", "--max-train-steps", "3", "--checkpointing-steps", "0", "--save-steps", "0",
            "--mixed-precision", "fp32", "--learning-rate", "1e-3", "--output-dir", str(out), *more]


@pytest.fixture
def runs(monkeypatch):
    made = []
    setup = loop.setup

    def spy(*args, **kwargs):
        run, st = setup(*args, **kwargs)
        made.append(run)
        return run, st

    monkeypatch.setattr(loop, "setup", spy)
    return made


def test_the_tiny_model_is_sd3_shaped(sd3_model):
    from diffusers import StableDiffusion3Pipeline

    from xeontune.train.components import pipeline_family

    assert pipeline_family(str(sd3_model)).name == "sd3"
    pipe = StableDiffusion3Pipeline.from_pretrained(str(sd3_model))
    t = pipe.transformer.config
    # SD3.5's: patches of 2, RMS-normed attention, a dual-attention block; 16 latent channels with a shift
    assert (t.patch_size, t.qk_norm, tuple(t.dual_attention_layers), t.in_channels) == (2, "rms_norm", (0,), 16)
    assert t.joint_attention_dim == pipe.text_encoder_3.config.d_model
    assert t.pooled_projection_dim == pipe.text_encoder.config.projection_dim + pipe.text_encoder_2.config.projection_dim
    assert pipe.vae.config.shift_factor and pipe.scheduler.config.shift == 3.0
    ids = pipe.tokenizer_3(PROMPT).input_ids
    assert ids[-1] == pipe.tokenizer_3.eos_token_id and pipe.tokenizer_3.unk_token_id not in ids
    assert pipe.tokenizer_3.tokenize("a photo of a toy") == ["\u2581a", "\u2581photo", "\u2581of", "\u2581a", "\u2581toy"]


def test_prompts_reach_the_transformer_as_the_sd3_pipeline_encodes_them(sd3_model):
    from diffusers import StableDiffusion3Pipeline

    from xeontune.train import components

    loaded = components.load(str(sd3_model))
    family = loaded.family
    ids = [t([PROMPT], padding="max_length", truncation=True, max_length=e.max_length or t.model_max_length,
             return_tensors="pt").input_ids for t, e in zip(loaded.tokenizers, family.encoders, strict=True)]
    with torch.no_grad():
        hidden, pooled = family.encode(loaded.text_encoders, ids)
        pipe = StableDiffusion3Pipeline.from_pretrained(str(sd3_model))
        want, _, want_pooled, _ = pipe.encode_prompt(PROMPT, PROMPT, PROMPT, do_classifier_free_guidance=False,
                                                     max_sequence_length=77)
    assert hidden.shape == want.shape == (1, 77 + 77, pipe.text_encoder_3.config.d_model)
    assert torch.allclose(hidden, want, atol=1e-6) and torch.allclose(pooled, want_pooled, atol=1e-6)


def test_flow_matching_is_the_sd3_examples(sd3_model):
    """Noised input, timestep, preconditioned prediction, target, loss weights and the timestep density, each
    against what train_dreambooth_lora_sd3.py computes with diffusers' own functions."""
    from diffusers import FlowMatchEulerDiscreteScheduler
    from diffusers.training_utils import compute_density_for_timestep_sampling, compute_loss_weighting_for_sd3

    scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(str(sd3_model), subfolder="scheduler")
    opts = parse_args(["--model", str(sd3_model), "--data-dir", ".", "--instance-prompt", PROMPT, "--method", "lora"])
    family = families.get("sd3").for_run(opts)
    index = torch.tensor([0, 17, 500, 999])
    timesteps = scheduler.timesteps[index]
    # the example's get_sigmas: each timestep looked up in the schedule
    sigmas = torch.stack([scheduler.sigmas[(scheduler.timesteps == t).nonzero().item()] for t in timesteps])
    sigmas = sigmas.reshape(-1, 1, 1, 1)
    gen = torch.Generator().manual_seed(0)
    latents, noise, out = (torch.randn(4, 16, 4, 4, generator=gen) for _ in range(3))
    noisy = family.noisy(scheduler, latents, noise, index)
    assert torch.equal(noisy, (1 - sigmas) * latents + sigmas * noise)
    called = {}

    def transformer(**kwargs):
        called.update(kwargs)
        return (out,)

    hidden, pooled = torch.randn(4, 9, 8), torch.randn(4, 6)
    pred = family.predict(scheduler, transformer, noisy, index, hidden, family.conditions(pooled, None))
    assert torch.equal(called["timestep"], timesteps) and called["pooled_projections"] is pooled
    assert torch.equal(pred, out * (-sigmas) + noisy)  # --precondition-outputs (the example's default)
    assert torch.equal(family.target(scheduler, latents, noise, index), latents)
    plain = families.get("sd3").for_run(dataclasses.replace(opts, precondition_outputs=False))
    assert torch.equal(plain.predict(scheduler, transformer, noisy, index, hidden, None), out)
    assert torch.equal(plain.target(scheduler, latents, noise, index), noise - latents)
    for scheme in ("sigma_sqrt", "cosmap"):
        weights = family.loss_weights(scheduler, index, dataclasses.replace(opts, weighting_scheme=scheme))
        assert torch.equal(weights, compute_loss_weighting_for_sd3(scheme, sigmas).flatten())
    assert family.loss_weights(scheduler, index, opts) is None  # logit_normal weighs every sample 1
    for scheme in ("logit_normal", "mode", "none"):
        density = family.timestep_density(dataclasses.replace(opts, weighting_scheme=scheme, logit_mean=0.3))
        drawn = [density(torch.Generator().manual_seed(s)) for s in range(5)]
        want = [float(compute_density_for_timestep_sampling(scheme, 1, 0.3, 1.0, 1.29,
                                                            generator=torch.Generator().manual_seed(s))[0])
                for s in range(5)]
        assert drawn == want and len(set(drawn)) == 5


def test_lora_files_load_into_stable_diffusion_3_and_comfyui_layout(sd3_model, sample_images, tmp_path, runs):
    """The diffusers file, loaded by StableDiffusion3Pipeline.load_lora_weights and fused, and
    --save-as-full-pipeline's parts are the base with the adapters the run holds merged in (the transformer's
    both streams and the CLIP encoders'; T5 has none); the second file holds the same adapters under ComfyUI's
    lora_transformer_ names with their alpha."""
    from diffusers import StableDiffusion3Pipeline

    out = tmp_path / "out"
    loop.train(parse_args(sd3_args(sd3_model, sample_images, out, "--train-text-encoder", "--rank", "4",
                                   "--lora-alpha", "8", "--save-as-full-pipeline")))
    models = runs[0].method.models
    assert set(models) == {"transformer", "text_encoder", "text_encoder_2"}
    base = StableDiffusion3Pipeline.from_pretrained(str(sd3_model))
    bases = {part: state(getattr(base, part)) for part in models}
    want = {part: merged_in_memory(models[part], bases[part]) for part in models}
    targets = ("add_q_proj", "add_k_proj", "add_v_proj", "to_add_out", "to_q", "to_k", "to_v", "to_out.0")
    wrapped = {name.removesuffix(".weight") for name in want["transformer"]}
    assert all(any(name.endswith(".attn." + t) for name in wrapped) for t in targets)
    stuck = {name for name, weight in want["transformer"].items()
             if float((weight - bases["transformer"][name]).abs().max()) < 100 * MERGE_TOLERANCE}
    # the last block is context-only: its context queries' outputs are dropped, so their adapter gets no gradient
    last = base.transformer.config.num_layers - 1
    assert stuck == {f"transformer_blocks.{last}.attn.add_q_proj.weight"}

    pipe = StableDiffusion3Pipeline.from_pretrained(str(sd3_model))
    pipe.load_lora_weights(str(out), weight_name=DIFFUSERS_FILE)
    pipe.fuse_lora(components=list(models))
    pipe.unload_lora_weights()
    full = StableDiffusion3Pipeline.from_pretrained(str(out / "pipeline"))
    for what, got in (("load_lora_weights", pipe), ("--save-as-full-pipeline", full)):
        for part in models:
            weights = state(getattr(got, part))
            assert max_diff({k: weights[k] for k in want[part]}, want[part]) <= MERGE_TOLERANCE, (what, part)
        assert all(torch.equal(v, base.text_encoder_3.state_dict()[k]) for k, v in state(got.text_encoder_3).items())

    diffusers_file, comfy = load_file(str(out / DIFFUSERS_FILE)), load_file(str(out / KOHYA_FILE))
    for key, value in diffusers_file.items():
        if not key.startswith("transformer.") or ".lora_A." not in key:
            continue
        module = key.removeprefix("transformer.").removesuffix(".lora_A.weight")
        name = "lora_transformer_" + module.replace(".", "_")
        assert torch.equal(comfy[f"{name}.lora_down.weight"], value)
        assert torch.equal(comfy[f"{name}.lora_up.weight"], diffusers_file[key.replace(".lora_A.", ".lora_B.")])
        assert float(comfy[f"{name}.alpha"]) == 8.0
    assert not [k for k in comfy if k.startswith("transformer")]


def test_t5_is_freed_once_the_prompts_are_cached_and_never_trains(sd3_model, sample_images, tmp_path, runs):
    loop.train(parse_args(sd3_args(sd3_model, sample_images, tmp_path / "lora")))
    run = runs[0]
    assert run.components.text_encoder_3 is None and run.text_cache is not None
    # the latents as the example makes them: (x - shift_factor) * scaling_factor of the VAE's draw
    part, batch = run.latents.parts[0], run.plan.batch([0, 1])
    shift, scale = part.shift, part.scaling
    assert shift > 0 and scale > 1  # SD3's VAE's (0.0609, 1.5305)
    got = part.sample(batch)
    part.shift = 0.0
    assert torch.allclose(got, part.sample(batch) - shift * scale, atol=1e-6)
    # and the timesteps drawn from the weighting scheme's density (logit-normal: few near either end)
    drawn = torch.cat([run.plan.batch([i]).timesteps for i in range(400)]).float() / 1000
    assert run.plan.timestep_density is not None and 0.4 < float(drawn.mean()) < 0.6
    assert float(((drawn < 0.05) | (drawn > 0.95)).float().mean()) < 0.05  # uniform: 10 %
    loop.train(parse_args(sd3_args(sd3_model, sample_images, tmp_path / "full", "--method", "full",
                                   "--train-text-encoder", "--learning-rate", "1e-4")))
    full = runs[1]
    assert set(full.method.models) == {"transformer", "text_encoder", "text_encoder_2"}
    assert not any(p.requires_grad for p in full.components.text_encoder_3.parameters())
    from diffusers import StableDiffusion3Pipeline

    base = StableDiffusion3Pipeline.from_pretrained(str(sd3_model))
    saved = StableDiffusion3Pipeline.from_pretrained(str(tmp_path / "full" / "pipeline"))
    for part in ("transformer", "text_encoder", "text_encoder_2"):  # each moved far past rounding
        before, after = state(getattr(base, part)), state(getattr(saved, part))
        assert max_diff(before, after) > 1e-5, part
    assert max_diff(state(base.text_encoder_3), state(saved.text_encoder_3)) == 0


def test_the_transformer_loads_after_the_text_encoders_are_freed_and_trains_as_before(sd3_model, sample_images,
                                                                                       tmp_path, runs, monkeypatch):
    """A LoRA run that caches its prompts encodes them, frees CLIP-L, CLIP-G and T5, then loads the transformer:
    the two are never held together (T5-XXL is 9.5 GB in bf16 beside SD3.5 Medium's 4.5 GB transformer). The
    adapters it trains are those of the old order (everything loaded at once), bit for bit in fp32."""
    from xeontune.train import components as components_module

    held = []
    load_denoiser = components_module.load_denoiser

    def spy(components, *args, **kwargs):
        held.append([e is not None for e in components.text_encoders])
        assert components.denoiser is None
        return load_denoiser(components, *args, **kwargs)

    monkeypatch.setattr(loop, "load_denoiser", spy)
    loop.train(parse_args(sd3_args(sd3_model, sample_images, tmp_path / "first", "--seed", "3")))
    assert held == [[False, False, False]]
    monkeypatch.setattr(loop, "encodes_first", lambda opts: False)  # the old order
    loop.train(parse_args(sd3_args(sd3_model, sample_images, tmp_path / "together", "--seed", "3")))
    assert len(held) == 1  # not called: loaded with the rest
    first, together = (load_file(str(tmp_path / name / DIFFUSERS_FILE)) for name in ("first", "together"))
    base = {k: v for k, v in state(runs[0].components.denoiser).items() if "lora_B" in k}
    assert base and max(float(v.abs().max()) for v in base.values()) > 1e-4  # the adapters moved from zero
    assert first.keys() == together.keys() and all(torch.equal(first[k], together[k]) for k in first)


def test_a_half_precision_t5_is_never_upcast_whole_in_bf16(sd3_model, sample_images, tmp_path, runs, monkeypatch):
    """SD3.5's and Flux's text encoders are stored in half precision. In bf16 training a frozen one keeps its
    Linear layers as loaded (T5-XXL in fp32 would be 19 GB): only its norms and embeddings are upcast. The
    encoders load one at a time, each freed before the next. The cached outputs are those of the encoders
    all loaded together, upcast whole and their Linear layers cast back to bf16 (the old way), bit for bit."""
    from diffusers import StableDiffusion3Pipeline

    from xeontune.train import components as components_module
    from xeontune.train.components import cast_text_encoder_linears, frozen_dtype
    from xeontune.train.loop import TextCache, precision_autocast

    half = tmp_path / "half"
    StableDiffusion3Pipeline.from_pretrained(str(sd3_model), torch_dtype=torch.bfloat16).save_pretrained(half)
    loaded, held = {}, []
    load_encoder = components_module.load_encoder

    def spy(components, model, folder, *args, **kwargs):
        held.append(sum(e is not None for e in components.text_encoders))  # none held as the next loads
        load_encoder(components, model, folder, *args, **kwargs)
        loaded[folder] = {(isinstance(m, torch.nn.Linear), p.dtype) for m in getattr(components, folder).modules()
                          for p in m.parameters(recurse=False)}

    monkeypatch.setattr(loop, "load_encoder", spy)
    loop.train(parse_args(sd3_args(half, sample_images, tmp_path / "out", "--mixed-precision", "bf16",
                                   "--max-train-steps", "1")))
    assert held == [0, 0, 0]
    for folder in ("text_encoder", "text_encoder_2", "text_encoder_3"):
        assert loaded[folder] == {(True, torch.bfloat16), (False, torch.float32)}, folder
    run = runs[0]
    old = components_module.load(str(half))  # every encoder upcast whole, then its Linear layers cast
    old.family = run.components.family
    for folder in ("text_encoder", "text_encoder_2", "text_encoder_3"):
        assert {p.dtype for p in getattr(old, folder).parameters()} == {torch.float32}
        cast_text_encoder_linears(old, frozen_dtype("bf16"), part=folder)
    expected = TextCache(old, run.plan.all_prompt_ids, precision_autocast("bf16"))
    assert torch.equal(run.text_cache.hidden, expected.hidden) and torch.equal(run.text_cache.pooled, expected.pooled)


def test_bf16_trains_sd3_on_every_cpu(sd3_model, sample_images, tmp_path, runs):
    """--mixed-precision bf16 (the precision an AMX or AVX512-BF16 CPU picks): the frozen transformer from its
    bf16 copy, the adapters fp32, and they move."""
    loop.train(parse_args(sd3_args(sd3_model, sample_images, tmp_path / "o", "--mixed-precision", "bf16")))
    run = runs[0]
    assert run.precision == "bf16"
    assert next(run.components.denoiser_for_inference.parameters()).dtype == torch.bfloat16
    adapters = run.method.adapters()
    assert {t.dtype for t in adapters.values()} == {torch.float32}
    assert max(float(t.abs().max()) for k, t in adapters.items() if ".lora_B." in k) > 1e-4


def test_sample_images_and_class_images_leave_the_training_schedule_as_it_was(sd3_model, sample_images, tmp_path,
                                                                              runs):
    """The pipelines that draw validation and class images set their own timesteps; the run's training
    scheduler keeps its 1000 (an index past a sampler's few raised IndexError)."""
    loop.train(parse_args(sd3_args(
        sd3_model, sample_images, tmp_path / "o", "--max-train-steps", "2", "--validation-prompt", PROMPT,
        "--validation-steps", "1", "--num-validation-images", "1", "--with-prior-preservation",
        "--class-data-dir", str(tmp_path / "class"), "--class-prompt", "a photo of toy", "--num-class-images", "2",
        "--class-inference-steps", "2")))
    scheduler = runs[0].components.noise_scheduler
    assert len(scheduler.timesteps) == len(scheduler.sigmas) == 1000
    assert len(list((tmp_path / "class").glob("*.png"))) == 2
    assert len(list((tmp_path / "o" / "validation").glob("*.png"))) == 2


def test_what_does_not_apply_to_sd3_is_one_line(sd3_model, tiny_model, sample_images, tmp_path, capsys):
    def line(model, *more: str) -> str:
        return one_line(capsys, ["train", *sd3_args(model, sample_images, tmp_path / "o"), *more])

    ti = line(sd3_model, "--method", "textual_inversion", "--placeholder-token", "<t>", "--initializer-token", "toy")
    assert "--method textual_inversion does not apply to" in ti and "a sd3 model" in ti
    assert "--weighting-scheme" in line(sd3_model, "--snr-gamma", "5")
    assert "pivotal tuning" in line(sd3_model, "--placeholder-token", "<t>", "--initializer-token", "toy")
    assert "multiples of 16" in line(sd3_model, "--resolution", "72")
    assert "multiples of 16" in line(sd3_model, "--bucket-step", "24")
    assert "--snr-gamma" in line(tiny_model, "--weighting-scheme", "cosmap")
    assert not (tmp_path / "o").exists()
