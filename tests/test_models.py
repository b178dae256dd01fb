"""The offline model builder and the sample data."""

from __future__ import annotations

import hashlib

import pytest

from xeontune import models
from xeontune.cli import main


def test_tiny_pipeline_loads_with_diffusers_and_knows_its_words(tiny_model):
    from diffusers import StableDiffusionPipeline

    pipe = StableDiffusionPipeline.from_pretrained(str(tiny_model), safety_checker=None)
    tok = pipe.tokenizer
    assert tok.model_max_length == 77
    for word in ("toy", "cat", "painting", "photo"):
        assert len(tok.encode(word, add_special_tokens=False)) == 1, word
    assert len(tok.encode("<toy-bot>", add_special_tokens=False)) > 1
    assert pipe.text_encoder.get_input_embeddings().weight.shape[0] == len(tok)
    assert pipe.text_encoder.config.eos_token_id == tok.eos_token_id


def test_sd15_vocabulary_has_clips_size():
    vocab, merges = models.tokenizer_files(models._template_words(), 49408)
    assert len(vocab) == 49408 and sorted(vocab.values()) == list(range(49408))
    assert vocab["<|endoftext|>"] == 49407 and merges


def test_sample_data_is_deterministic(tmp_path):
    a = models.write_sample_data(tmp_path / "a", count=3, size=64, seed=1)
    b = models.write_sample_data(tmp_path / "b", count=3, size=64, seed=1)
    c = models.write_sample_data(tmp_path / "c", count=3, size=64, seed=2)

    def digest(files):
        return [hashlib.sha256(f.read_bytes()).hexdigest() for f in files]

    assert digest(a) == digest(b) != digest(c)
    assert len(set(digest(a))) == 3  # varied poses and backgrounds


def test_cli_bad_model_kind_and_count(capsys, tmp_path):
    assert main(["sample-data", str(tmp_path / "x"), "--count", "0"]) == 2
    assert "--count must be at least 1" in capsys.readouterr().err


def test_model_never_replaces_what_is_already_there(capsys, tmp_path):
    """The pipeline replaces its folder whole: a folder of images, a file or the current folder given by
    mistake is refused, untouched."""
    images = tmp_path / "images"
    models.write_sample_data(images, count=2, size=32)
    (tmp_path / "notes.txt").write_text("keep")
    for target in (images, tmp_path / "notes.txt", "."):
        assert main(["model", "tiny", str(target)]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("error: ") and "\n" not in err
    assert len(list(images.glob("*.png"))) == 2 and (tmp_path / "notes.txt").read_text() == "keep"
    (tmp_path / "empty").mkdir()
    assert main(["model", "tiny", str(tmp_path / "empty")]) == 0 and (tmp_path / "empty" / "model_index.json").is_file()


def test_a_path_that_cannot_be_written_is_one_line(capsys, tmp_path):
    (tmp_path / "file").write_text("")
    for target in (tmp_path / "file", tmp_path / "file" / "images"):  # checked up front: a user mistake
        assert main(["sample-data", str(target)]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("error: ") and "is a file, not a folder" in err and "\n" not in err, err
    for target in (tmp_path / "file", tmp_path / "file" / "model"):  # an empty file too: not "not empty"
        assert main(["model", "tiny", str(target)]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("error: ") and "is a file, not a folder" in err and "\n" not in err, err


def test_sdxl_arch_has_sdxl_base_dimensions_without_allocating_them():
    """Sized on the meta device: the real SDXL-base parameter counts, no 14 GB in memory."""
    import torch

    dims = models.DIMS["sdxl-arch"]
    with torch.device("meta"):
        parts = models.build_modules(dims, models.build_tokenizer(dims))
    count = {name: sum(p.numel() for p in m.parameters()) for name, m in parts.items() if hasattr(m, "parameters")}
    assert round(count["unet"] / 1e6) == 2567  # SDXL-base's UNet: 2,567,463,684
    assert round(count["text_encoder_2"] / 1e6) == 695  # OpenCLIP bigG with its projection
    assert round(count["text_encoder"] / 1e6) == 123  # CLIP ViT-L, as in SD1.5
    unet = parts["unet"].config
    assert unet.cross_attention_dim == 768 + 1280 and unet.addition_embed_type == "text_time"
    assert unet.projection_class_embeddings_input_dim == 6 * 256 + 1280 == 2816


def test_sd35m_and_flux_arch_have_the_real_widths_without_allocating_them():
    """Sized on the meta device: SD3.5 Medium's parts as its configs build them, and Flux.1-dev's widths at
    the reduced depth the build says it has."""
    import torch

    def counts(kind, build):
        with torch.device("meta"):
            parts = build(models.SD3_DIMS[kind])
        return parts, {n: round(sum(p.numel() for p in m.parameters()) / 1e6) for n, m in parts.items()
                       if hasattr(m, "parameters")}

    parts, count = counts("sd35m-arch", models.build_sd3_modules)
    assert count == {"text_encoder": 124, "text_encoder_2": 695, "text_encoder_3": 4762, "transformer": 2243, "vae": 84}
    config = parts["transformer"].config
    assert (config.num_layers, config.caption_projection_dim, config.joint_attention_dim, config.pos_embed_max_size,
            len(config.dual_attention_layers)) == (24, 1536, 4096, 384, 13)
    assert len(parts["tokenizer"]) == 49408 and len(parts["tokenizer_3"]) == 32128
    parts, count = counts("flux-arch", models.build_flux_modules)
    assert count["transformer"] == 1310 and count["text_encoder_2"] == 4762
    config = parts["transformer"].config
    assert (config.num_attention_heads * config.attention_head_dim, config.guidance_embeds) == (3072, True)
    assert "2 of its 19 dual-stream" in models.NOTES["flux-arch"]


def test_sd3_and_flux_tiny_build_offline_and_sample_in_their_pipelines(tmp_path, capsys):
    from diffusers import FluxPipeline, StableDiffusion3Pipeline

    for kind, cls in (("sd3-tiny", StableDiffusion3Pipeline), ("flux-tiny", FluxPipeline)):
        assert main(["model", kind, str(tmp_path / kind)]) == 0
        pipe = cls.from_pretrained(str(tmp_path / kind))
        assert pipe("a photo of a toy", num_inference_steps=1, height=64, width=64).images[0].size == (64, 64)


def test_a_half_precision_kind_is_written_part_by_part_in_bf16_with_the_same_layout(tmp_path, monkeypatch):
    """sd35m-arch and flux-arch are made in bf16 one part at a time (their T5 would not fit a 24 GB machine in
    fp32): shown at tiny size, the folder has the fp32 build's files and model_index.json, every weight is
    bf16, and the pipeline loads it."""
    import json
    from dataclasses import replace

    import torch
    from diffusers import FluxPipeline, StableDiffusion3Pipeline
    from safetensors import safe_open

    for kind, cls in (("sd3-tiny", StableDiffusion3Pipeline), ("flux-tiny", FluxPipeline)):
        monkeypatch.setitem(models.SD3_DIMS, f"{kind}-half", replace(models.SD3_DIMS[kind], half=True))
        monkeypatch.setattr(models, "KINDS", (*models.KINDS, f"{kind}-half"))
        full, half = models.build_pipeline(kind, tmp_path / kind), models.build_pipeline(f"{kind}-half", tmp_path / f"{kind}-h")
        names = lambda root: sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())  # noqa: E731
        assert names(full) == names(half)
        assert json.loads((half / "model_index.json").read_text()) == json.loads((full / "model_index.json").read_text())
        dtypes = set()
        for file in half.glob("*/*.safetensors"):
            with safe_open(str(file), "pt") as f:
                dtypes |= {f.get_slice(k).get_dtype() for k in f.keys()}  # noqa: SIM118 (not a dict)
        assert dtypes == {"BF16"}, dtypes
        assert torch.get_default_dtype() == torch.float32  # restored after each part
        assert cls.from_pretrained(str(half), torch_dtype=torch.bfloat16).transformer.dtype == torch.bfloat16


def test_sdxl_and_sd2_tiny_build_offline_and_load_in_their_diffusers_pipelines(tmp_path):
    from diffusers import StableDiffusionPipeline, StableDiffusionXLPipeline

    assert main(["model", "sdxl-tiny", str(tmp_path / "xl")]) == 0
    assert main(["model", "sd2-tiny", str(tmp_path / "sd2")]) == 0
    xl = StableDiffusionXLPipeline.from_pretrained(str(tmp_path / "xl"))
    assert xl.text_encoder_2.__class__.__name__ == "CLIPTextModelWithProjection"
    assert xl.unet.config.cross_attention_dim == xl.text_encoder.config.hidden_size + xl.text_encoder_2.config.hidden_size
    assert xl.unet.config.projection_class_embeddings_input_dim == (
        6 * xl.unet.config.addition_time_embed_dim + xl.text_encoder_2.config.projection_dim)
    assert len(xl.tokenizer_2.encode("toy", add_special_tokens=False)) == 1
    image = xl("a photo of a toy", num_inference_steps=1, height=64, width=64).images[0]
    assert image.size == (64, 64)
    sd2 = StableDiffusionPipeline.from_pretrained(str(tmp_path / "sd2"), safety_checker=None)
    assert sd2.scheduler.config.prediction_type == "v_prediction"
    assert sd2.text_encoder.config.hidden_act == "gelu" and sd2.unet.config.use_linear_projection


def test_a_file_system_error_on_a_named_path_is_one_line(capsys, tmp_path):
    """What the commands do not check up front (a read-only folder, a full disk): the CLI's
    exit_status turns an OSError that names a file into one line and exit 1; one that names none (a
    socket, a library's own I/O) keeps its traceback."""
    from xeontune.errors import exit_status

    def write_into_a_file():
        (tmp_path / "file").write_text("")
        (tmp_path / "file" / "x").write_text("")

    assert exit_status(write_into_a_file) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and str(tmp_path / "file" / "x") in err and "\n" not in err
    def lose_a_connection():
        raise ConnectionResetError("peer gone")

    with pytest.raises(ConnectionResetError):
        exit_status(lose_a_connection)
