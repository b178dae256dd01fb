"""The family seam: a fake model family, known to the toolkit only through train/families' contract and its
registration by name (as SD's and SDXL's are), trains a whole model and a LoRA end to end, samples and
saves (as the fake method proves the method seam). Its pipelines are the tiny SD's files under another
class name; its math differs from SD's (the encoder's penultimate layer, the clean latents as the target),
and so do its file layouts (its own single-file and kohya prefixes, its own kohya model version). Had the
loop, the saving or the methods taken any of these from SD rather than from the family, the outputs would
not carry the fake's names, or would equal SD's."""

from __future__ import annotations

import json
import shutil
from collections import Counter
from typing import Any, ClassVar

import pytest
from safetensors import safe_open
from safetensors.torch import load_file

from tests.one_line import one_line_error
from xeontune.cli import main
from xeontune.errors import UserError
from xeontune.train import families
from xeontune.train.components import model_identity, pipeline_family
from xeontune.train.families import Encoder
from xeontune.train.families.sd import StableDiffusion

CALLS: Counter[str] = Counter()


class FakeFamily(StableDiffusion):
    name = "fake"
    summary = "the fake family of the seam's test"
    encoders: ClassVar[tuple[Encoder, ...]] = (
        Encoder("tokenizer", "text_encoder", "CLIPTextModel", linear_share=0.5, default_bytes=1e6,
                kohya_prefix="lora_fake_te_"),)
    refuses: ClassVar[dict[str, str]] = {"textual_inversion": "its encoder has no token table to grow"}

    @classmethod
    def recognizes(cls, model_index) -> bool:
        return model_index.get("_class_name") == "FakeDiffusionPipeline"

    def encoder_output(self, index: int, encoder: Any, input_ids: Any) -> Any:
        CALLS["encode"] += 1
        return encoder(input_ids, output_hidden_states=True).hidden_states[-2]

    def noisy(self, scheduler, latents, noise, timesteps):
        CALLS["noisy"] += 1
        return super().noisy(scheduler, latents, noise, timesteps)

    def target(self, scheduler, latents, noise, timesteps):
        CALLS["target"] += 1
        return latents  # the clean latents (x0), not the noise

    def pipeline(self, parts):
        CALLS["pipeline"] += 1
        return super().pipeline(parts)

    def single_file_text(self, pipe) -> list[tuple[str, str, bool]]:
        CALLS["single_file_text"] += 1
        return [("text_encoder", "fake_text.", False)]

    def kohya_version(self, unet_config, scheduler_config) -> str:
        return "fake_v1"

    def activation_bytes(self, resolution: int, precision: str) -> float:
        CALLS["activation_bytes"] += 1
        return super().activation_bytes(resolution, precision)


FAMILY = FakeFamily()


@pytest.fixture
def fake_family(tiny_model, tmp_path):
    """The tiny SD pipeline's files as a FakeDiffusionPipeline, its family registered by name."""
    model = tmp_path / "fake-model"
    shutil.copytree(tiny_model, model)
    index = json.loads((model / "model_index.json").read_text())
    (model / "model_index.json").write_text(json.dumps({**index, "_class_name": "FakeDiffusionPipeline"}))
    families.register("fake", __name__)
    CALLS.clear()
    yield model
    families.unregister("fake")


def test_a_family_is_known_by_its_model_index_and_an_unknown_one_refused_in_one_line(fake_family, tiny_model,
                                                                                    sample_images, tmp_path, capsys):
    assert pipeline_family(str(fake_family)) is FAMILY
    assert pipeline_family(str(tiny_model)).name == "sd"
    # what a checkpoint records of the model: the family its model_index.json names (by class name here)
    assert model_identity(str(fake_family))["family"] == "fake" and model_identity(str(tiny_model))["family"] == "sd"
    video = tmp_path / "video"
    video.mkdir()
    (video / "model_index.json").write_text(json.dumps({"_class_name": "StableVideoDiffusionPipeline",
                                                        "unet": ["diffusers", "UNetSpatioTemporalConditionModel"],
                                                        "image_encoder": ["transformers", "CLIPVisionModel"]}))
    with pytest.raises(UserError) as refused:
        pipeline_family(str(video))
    message = str(refused.value)
    assert "\n" not in message and "StableVideoDiffusionPipeline" in message
    assert all(name in message for name in ("sd (SD1.x, SD2.x)", "sdxl (SDXL)", "fake"))
    # a method the family refuses: one line, and nothing written (the run stops before any model loads)
    out = tmp_path / "ti"
    line = one_line_error(capsys, ["train", "--model", str(fake_family), "--data-dir", str(sample_images),
                                   "--placeholder-token", "<t>", "--initializer-token", "toy", "--output-dir", str(out)])
    assert "--method textual_inversion does not apply to" in line and "no token table" in line
    assert not out.exists() or not [p for p in out.iterdir() if not p.name.startswith(".")]


@pytest.mark.slow
def test_a_fake_family_trains_samples_and_saves_through_the_contract_alone(fake_family, tiny_model, sample_images,
                                                                           tmp_path):
    def run(model, out, *extra):
        assert main(["train", "--model", str(model), "--data-dir", str(sample_images), "--resolution", "64",
                     "--mixed-precision", "fp32", "--instance-prompt", "a photo of sks toy", "--seed", "0",
                     "--checkpointing-steps", "0", "--save-steps", "0", "--train-text-encoder",
                     "--output-dir", str(out), *extra]) == 0

    full = ["--method", "full", "--max-train-steps", "2", "--learning-rate", "1e-3",
            "--validation-prompt", "a photo of sks toy", "--validation-steps", "2", "--num-validation-images", "1"]
    run(fake_family, tmp_path / "fake", *full)
    # the step's math, the sample images' pipeline, the memory plan and the single file: all the family's
    assert CALLS["encode"] >= 2 and CALLS["noisy"] == CALLS["target"] == 2, CALLS
    assert CALLS["pipeline"] >= 2 and CALLS["single_file_text"] == 1 and CALLS["activation_bytes"] >= 1, CALLS
    assert list((tmp_path / "fake" / "validation").glob("*.png"))
    single = load_file(tmp_path / "fake" / "model.safetensors")
    text_keys = [k for k in single if not k.startswith(("model.diffusion_model.", "first_stage_model."))]
    assert text_keys and all(k.startswith("fake_text.") for k in text_keys)
    # the same files and flags read as SD train otherwise: the fake's target and encoding reached the step
    run(tiny_model, tmp_path / "sd", *full)
    fake, sd = (load_file(tmp_path / name / "pipeline" / "unet" / "diffusion_pytorch_model.safetensors")
                for name in ("fake", "sd"))
    assert max(float((fake[k] - sd[k]).abs().max()) for k in sd) > 1e-4

    run(fake_family, tmp_path / "lora", "--method", "lora", "--max-train-steps", "1")
    kohya = tmp_path / "lora" / "pytorch_lora_weights_kohya.safetensors"
    with safe_open(kohya, "pt") as adapters:
        keys, metadata = list(adapters.keys()), adapters.metadata()  # noqa: SIM118 (not a dict)
    assert any(k.startswith("lora_fake_te_") for k in keys) and not any(k.startswith("lora_te") for k in keys)
    assert metadata["ss_base_model_version"] == "fake_v1"
