"""The single-file checkpoint in the original Stable Diffusion layout (train/single_file.py): diffusers'
own single-file loader reads every tensor in it back into the very weights written, for SD1, SD2 (OpenCLIP
text encoder, v-prediction) and SDXL; the file costs no copy of the model beyond what the layout needs.

The tiny models' dimensions are no real model's, so ``from_single_file`` cannot infer their architecture
from the weights (it takes all three for SD1.5 and would fetch that config from the Hub): ``config=`` the
model's folder gives it, offline."""

from __future__ import annotations

import pytest
import torch

from xeontune.train.single_file import original_state_dict, save_single_file

FIXTURES = {"sd": "tiny_model", "sd2": "sd2_model", "sdxl": "sdxl_model"}
KINDS = sorted(FIXTURES)
PARTS = ("unet", "vae", "text_encoder", "text_encoder_2")


def text(kind: str, pipe):
    """Where the model family puts ``pipe``'s text encoders in the file."""
    from xeontune.train import families

    return families.get("sdxl" if kind == "sdxl" else "sd").single_file_text(pipe)


def pipeline_class(kind: str):
    from diffusers import StableDiffusionPipeline, StableDiffusionXLPipeline

    return StableDiffusionXLPipeline if kind == "sdxl" else StableDiffusionPipeline


def parts(pipe) -> dict[str, torch.nn.Module]:
    return {name: getattr(pipe, name) for name in PARTS if getattr(pipe, name, None) is not None}


@pytest.fixture(scope="module")
def perturbed(request):
    """kind -> (model folder, its pipeline with every weight moved by seeded noise): a file written from
    the base weights cannot pass for it."""
    made: dict[str, tuple] = {}

    def get(kind: str):
        if kind not in made:
            folder = request.getfixturevalue(FIXTURES[kind])
            pipe = pipeline_class(kind).from_pretrained(str(folder))
            base = {name: {k: v.clone() for k, v in m.state_dict().items()} for name, m in parts(pipe).items()}
            generator = torch.Generator().manual_seed(7)
            with torch.no_grad():
                for module in parts(pipe).values():
                    for p in module.parameters():
                        p.add_(torch.randn(p.shape, generator=generator) * 0.01)
            for name, module in parts(pipe).items():
                assert all(not torch.equal(v, base[name][k]) for k, v in module.state_dict().items())
            made[kind] = folder, pipe
        return made[kind]

    return get


def load_back(kind: str, path, folder, **kwargs):
    from diffusers.utils import logging

    verbosity = logging.get_verbosity()
    logging.set_verbosity_error()  # its progress bars
    try:
        return pipeline_class(kind).from_single_file(str(path), config=str(folder), local_files_only=True, **kwargs)
    finally:
        logging.set_verbosity(verbosity)


@pytest.mark.parametrize("kind", KINDS)
def test_from_single_file_loads_back_every_weight_exactly(perturbed, tmp_path, kind):
    folder, pipe = perturbed(kind)
    path = save_single_file(pipe, text(kind, pipe), tmp_path / "model.safetensors")
    assert path == tmp_path / "model.safetensors"
    assert [p.name for p in tmp_path.iterdir()] == ["model.safetensors"]  # no temporary file left
    loaded = load_back(kind, path, folder)
    assert parts(loaded).keys() == parts(pipe).keys()
    for name, module in parts(pipe).items():
        mine, theirs = module.state_dict(), getattr(loaded, name).state_dict()
        assert mine.keys() == theirs.keys(), name
        differ = [k for k in mine if theirs[k].dtype != torch.float32 or not torch.equal(mine[k], theirs[k])]
        assert not differ, f"{name}: {differ[:5]}"
    assert loaded.scheduler.config.prediction_type == pipe.scheduler.config.prediction_type


def assert_read_one_for_one(state: dict[str, torch.Tensor], pipe, kind: str) -> None:
    """diffusers' converters turn each part's tensors into exactly that part's weights, one for one (q, k
    and v come from one in_proj each): nothing in the file is left over, nothing read twice."""
    from diffusers.loaders.single_file_utils import (
        convert_ldm_clip_checkpoint,
        convert_ldm_unet_checkpoint,
        convert_ldm_vae_checkpoint,
        convert_open_clip_checkpoint,
    )

    def under(prefix: str) -> list[str]:
        return [k for k in state if k.startswith(prefix)]

    def names(keys) -> set[str]:  # CLIPTextModel's keys have no "text_model." (transformers >= 5.6)
        return {k.removeprefix("text_model.") for k in keys}

    def open_clip(encoder, prefix: str) -> None:
        read = convert_open_clip_checkpoint(encoder, state, prefix=prefix)
        in_proj = [k for k in under(prefix) if ".in_proj_" in k]
        ignored = 1 if kind == "sd2" else 0  # SD2's text_projection: read for its size only
        assert len(read) == len(under(prefix)) + 2 * len(in_proj) - ignored
        assert names(read) == names(encoder.state_dict())

    unet = convert_ldm_unet_checkpoint(state, dict(pipe.unet.config))
    assert len(unet) == len(under("model.diffusion_model.")) and set(unet) == set(pipe.unet.state_dict())
    vae = convert_ldm_vae_checkpoint(state, dict(pipe.vae.config))
    assert len(vae) == len(under("first_stage_model.")) and set(vae) == set(pipe.vae.state_dict())
    prefixes = ["model.diffusion_model.", "first_stage_model."]
    if kind == "sd2":
        open_clip(pipe.text_encoder, "cond_stage_model.model.")
        prefixes.append("cond_stage_model.model.")
    else:
        first = "conditioner.embedders.0.transformer." if kind == "sdxl" else "cond_stage_model.transformer."
        clip = convert_ldm_clip_checkpoint(state)
        assert len(clip) == len(under(first)) and names(clip) == names(pipe.text_encoder.state_dict())
        prefixes.append(first)
    if kind == "sdxl":
        open_clip(pipe.text_encoder_2, "conditioner.embedders.1.model.")
        prefixes.append("conditioner.embedders.1.model.")
    markers = {"v_pred"} if pipe.scheduler.config.prediction_type == "v_prediction" else set()
    assert {k for k in state if not k.startswith(tuple(prefixes))} == markers


@pytest.mark.parametrize("kind", KINDS)
def test_diffusers_reads_every_tensor_in_the_file(perturbed, tmp_path, kind):
    from safetensors.torch import load_file

    _, pipe = perturbed(kind)
    assert_read_one_for_one(load_file(save_single_file(pipe, text(kind, pipe), tmp_path / "m.safetensors")), pipe, kind)


# Real dimensions, on the meta device (no memory, no weights): the originals' key counts. The released
# SD1.5 and SDXL base files hold these plus a CLIP position_ids buffer (and SDXL OpenCLIP's logit_scale),
# which no loader reads; SD2's OpenCLIP has a 24th layer that diffusers' 23-layer encoder dropped.
REAL = {"sd": ("sd15-arch", "v1", {"model.diffusion_model.": 686, "first_stage_model.": 248,
                                   "cond_stage_model.transformer.": 196}),
        "sd2": ("sd15-arch", "v2", {"model.diffusion_model.": 686, "first_stage_model.": 248,
                                    "cond_stage_model.model.": 281, "v_pred": 1}),
        "sdxl": ("sdxl-arch", "xl_base", {"model.diffusion_model.": 1680, "first_stage_model.": 248,
                                          "conditioner.embedders.0.": 196, "conditioner.embedders.1.": 389})}
# where the original puts each resampler: after the resnet, after the transformer where there is one
RESAMPLERS = {"sd": ["input_blocks.3.0.op", "input_blocks.6.0.op", "input_blocks.9.0.op", "output_blocks.2.1.conv",
                     "output_blocks.5.2.conv", "output_blocks.8.2.conv"],
              "sdxl": ["input_blocks.3.0.op", "input_blocks.6.0.op", "output_blocks.2.2.conv", "output_blocks.5.2.conv"]}


@pytest.mark.parametrize("kind", KINDS)
def test_real_dimensions_give_the_original_files_keys(kind):
    import dataclasses
    import types

    from diffusers.loaders.single_file_utils import infer_diffusers_model_type

    from xeontune import models

    arch, model_type, counts = REAL[kind]
    dims = models.DIMS[arch]
    if kind == "sd2":  # SD2.1-768: OpenCLIP-H's 23 layers, 1024-wide cross-attention, linear projections
        dims = dataclasses.replace(dims, text_hidden=1024, text_layers=23, text_heads=16, text_intermediate=4096,
                                   text_act="gelu", linear_projection=True, head_dims=(5, 10, 20, 20),
                                   prediction_type="v_prediction")
    tokenizer = models.build_tokenizer(dims)
    with torch.device("meta"):
        pipe = types.SimpleNamespace(**models.build_modules(dims, tokenizer))
    state = original_state_dict(pipe, text(kind, pipe))
    assert {prefix: len([k for k in state if k.startswith(prefix)]) for prefix in counts} == counts
    assert len(state) == sum(counts.values())
    assert infer_diffusers_model_type(state) == model_type  # what from_single_file(path) alone goes by
    found = sorted(k.removeprefix("model.diffusion_model.").removesuffix(".weight") for k in state
                   if k.endswith((".op.weight", ".conv.weight")) and k.startswith("model.diffusion_model."))
    assert found == RESAMPLERS["sdxl" if kind == "sdxl" else "sd"]
    assert_read_one_for_one(state, pipe, kind)


@pytest.mark.parametrize("kind", KINDS)
def test_the_layout_is_the_original(perturbed, kind):
    """The keys and shapes by which loaders tell the models apart (checked with diffusers' own detectors)."""
    from diffusers.loaders import single_file_utils as sfu

    _, pipe = perturbed(kind)
    state = original_state_dict(pipe, text(kind, pipe))
    assert sfu.is_clip_model(state) == (kind == "sd")
    assert sfu.is_open_clip_model(state) == (kind == "sd2")
    assert sfu.is_clip_sdxl_model(state) == sfu.is_open_clip_sdxl_model(state) == (kind == "sdxl")
    # the VAE's mid-block attention: 1x1 convolutions, as the original's
    q = state["first_stage_model.encoder.mid.attn_1.q.weight"]
    assert q.ndim == 4 and q.shape[2:] == (1, 1)
    assert torch.equal(q[:, :, 0, 0], pipe.vae.encoder.mid_block.attentions[0].to_q.weight)
    if kind != "sd":
        encoder = pipe.text_encoder_2 if kind == "sdxl" else pipe.text_encoder
        prefix = "conditioner.embedders.1.model." if kind == "sdxl" else "cond_stage_model.model."
        attn = encoder.state_dict()
        layer = "text_model.encoder.layers.1.self_attn" if kind == "sdxl" else "encoder.layers.1.self_attn"
        qkv = torch.cat([attn[f"{layer}.{p}_proj.weight"] for p in "qkv"])
        assert torch.equal(state[f"{prefix}transformer.resblocks.1.attn.in_proj_weight"], qkv)
        projection = state[prefix + "text_projection"]
        expected = (encoder.text_projection.weight.T if kind == "sdxl"
                    else torch.eye(encoder.config.hidden_size))  # SD2: none, i.e. the identity
        assert torch.equal(projection, expected)
    assert ("v_pred" in state) == (pipe.scheduler.config.prediction_type == "v_prediction")


@pytest.mark.parametrize("kind", KINDS)
def test_the_renamed_state_is_the_models_own_memory(perturbed, kind):
    """Only the concatenated q/k/v, the transposed (or identity) projections and the marker are new."""
    _, pipe = perturbed(kind)
    own = {t.untyped_storage().data_ptr() for m in parts(pipe).values() for t in m.state_dict().values()}
    new = [k for k, t in original_state_dict(pipe, text(kind, pipe)).items() if t.untyped_storage().data_ptr() not in own]
    assert all(k.endswith(("in_proj_weight", "in_proj_bias", "text_projection", "v_pred")) for k in new), new
    assert bool(new) == (kind != "sd")


@pytest.mark.parametrize("kind", KINDS)
def test_bf16_round_trips_within_bf16_rounding(perturbed, tmp_path, kind):
    from safetensors import safe_open
    from safetensors.torch import load_file

    folder, pipe = perturbed(kind)
    path = save_single_file(pipe, text(kind, pipe), tmp_path / "model-bf16.safetensors", dtype=torch.bfloat16,
                            metadata={"xeontune.step": "3"})
    assert {t.dtype for t in load_file(path).values()} == {torch.bfloat16}
    with safe_open(str(path), "pt") as f:
        assert f.metadata() == {"xeontune.step": "3"}
    assert all(p.dtype == torch.float32 for m in parts(pipe).values() for p in m.parameters())  # left as it was
    loaded = load_back(kind, path, folder, torch_dtype=torch.float32)
    for name, module in parts(pipe).items():
        theirs = getattr(loaded, name).state_dict()
        differ = [k for k, v in module.state_dict().items()
                  if not torch.equal(theirs[k].float(), v.to(torch.bfloat16).float())]
        assert not differ, f"{name}: {differ[:5]}"


def test_an_unknown_weight_is_refused(perturbed, tmp_path):
    _, pipe = perturbed("sd")
    pipe.unet.register_buffer("extra_scale", torch.ones(1))  # a weight the original layout has no place for
    try:
        with pytest.raises(ValueError, match="extra_scale"):
            save_single_file(pipe, text("sd", pipe), tmp_path / "model.safetensors")
    finally:
        del pipe.unet.extra_scale
    assert not list(tmp_path.iterdir())
