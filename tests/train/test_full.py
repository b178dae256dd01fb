"""Full fine-tuning (--method full) on the tiny models: every UNet weight trains (and the text encoders'
with --train-text-encoder), in fp32 master weights under bf16 too; accumulation equals a larger batch;
a resume equals a straight run; the outputs load in diffusers and differ from the base model."""

from __future__ import annotations

import pytest
import torch

from xeontune.cli import main
from xeontune.train import loop
from xeontune.train.options import parse_args

pytestmark = pytest.mark.slow

PROMPT = "a photo of sks toy"


@pytest.fixture
def full_args(tiny_model, sample_images, tmp_path):
    def args(out: str = "out", model=tiny_model, *extra: str) -> list[str]:
        return ["--method", "full", "--instance-prompt", PROMPT, "--model", str(model), "--data-dir",
                str(sample_images), "--resolution", "32", "--max-train-steps", "3", "--checkpointing-steps", "0",
                "--save-steps", "0", "--mixed-precision", "fp32", "--learning-rate", "1e-4", "--seed", "3",
                "--output-dir", str(tmp_path / out), *extra]

    return args


def base_parts(model, family: str = "sd") -> dict[str, dict[str, torch.Tensor]]:
    from diffusers import StableDiffusionPipeline, StableDiffusionXLPipeline

    cls = StableDiffusionXLPipeline if family == "sdxl" else StableDiffusionPipeline
    pipe = cls.from_pretrained(str(model), **({} if family == "sdxl" else {"safety_checker": None}))
    parts = ["unet", "text_encoder"] + (["text_encoder_2"] if family == "sdxl" else [])
    return {p: {k: v.detach().clone() for k, v in getattr(pipe, p).state_dict().items()} for p in parts}


def moved_share(trained: dict[str, torch.Tensor], base: dict[str, torch.Tensor], floor: float) -> float:
    """The share of tensors that moved by more than ``floor`` somewhere."""
    assert trained.keys() == base.keys()
    return sum(float((trained[k] - base[k]).abs().max()) > floor for k in base) / len(base)


def weights(result, part: str) -> dict[str, torch.Tensor]:
    return {k.removeprefix(part + "."): v for k, v in result.learned.items() if k.startswith(part + ".")}


@pytest.mark.parametrize("family", ["sd", "sd2", "sdxl"])
def test_every_unet_weight_trains_and_the_pipeline_holds_them(full_args, tiny_model, sd2_model, sdxl_model,
                                                              tmp_path, family):
    from diffusers import DiffusionPipeline

    model = {"sd": tiny_model, "sd2": sd2_model, "sdxl": sdxl_model}[family]
    result = loop.train(parse_args(full_args("out", model)))
    base = base_parts(model, family)
    unet = weights(result, "unet")
    # AdamW moves every weight with a gradient by about the learning rate a step
    assert moved_share(unet, base["unet"], 1e-5) == 1.0, "some UNet weight did not train"
    assert all(p.dtype == torch.float32 for p in unet.values())
    saved = DiffusionPipeline.from_pretrained(str(tmp_path / "out" / "pipeline"))
    got = saved.unet.state_dict()
    assert all(torch.equal(got[k], unet[k]) for k in unet), "the saved pipeline's UNet is not the trained one"
    for part in ("text_encoder", "text_encoder_2")[: 2 if family == "sdxl" else 1]:  # frozen: as the base
        assert all(torch.equal(getattr(saved, part).state_dict()[k], v) for k, v in base[part].items())


def test_train_text_encoder_trains_it_too(full_args, tiny_model, tmp_path):
    result = loop.train(parse_args(full_args("out", tiny_model, "--train-text-encoder")))
    base = base_parts(tiny_model)
    # every parameter moves but the keys' biases: softmax ignores what adds the same to every key, so
    # their gradient is zero up to rounding
    encoder = {k: v for k, v in weights(result, "text_encoder").items() if not k.endswith("k_proj.bias")}
    assert moved_share(encoder, {k: base["text_encoder"][k] for k in encoder}, 1e-5) == 1.0
    assert moved_share(weights(result, "unet"), base["unet"], 1e-5) == 1.0


def test_bf16_keeps_fp32_master_weights_and_trains(full_args, tiny_model):
    runs = []
    setup = loop.setup

    def spy(*a, **k):
        made = setup(*a, **k)
        runs.append(made[0])
        return made

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(loop, "setup", spy)
        result = loop.train(parse_args([*full_args("out", tiny_model), "--mixed-precision", "bf16",
                                        "--learning-rate", "1e-3"]))
    assert runs[0].precision == "bf16"
    unet = weights(result, "unet")
    assert all(p.dtype == torch.float32 for p in unet.values()), "a trained part must keep fp32 master weights"
    assert moved_share(unet, base_parts(tiny_model)["unet"], 1e-4) == 1.0


def test_accumulating_four_steps_of_one_equals_a_batch_of_four(full_args, tiny_model):
    # Adam's epsilon raised: its first steps are sign-like, which magnifies a near-zero gradient's rounding
    common = ("--adam-epsilon", "1e-4", "--max-train-steps", "2")
    one = loop.train(parse_args([*full_args("a", tiny_model, *common), "--train-batch-size", "4"]))
    four = loop.train(parse_args([*full_args("b", tiny_model, *common), "--gradient-accumulation-steps", "4"]))
    base = base_parts(tiny_model)["unet"]
    a, b = weights(one, "unet"), weights(four, "unet")
    diff = max(float((a[k] - b[k]).abs().max()) for k in a)
    moved = max(float((a[k] - base[k]).abs().max()) for k in a)
    assert moved >= 100 * 1e-6 and diff <= 1e-6, (diff, moved)


def test_a_resumed_run_equals_a_straight_one(full_args, tiny_model):
    common = ("--max-train-steps", "4")
    straight = loop.train(parse_args(full_args("straight", tiny_model, *common)))
    assert main(["train", *full_args("resumed", tiny_model, "--max-train-steps", "2", "--checkpointing-steps", "2")]) == 0
    resumed = loop.train(parse_args([*full_args("resumed", tiny_model, *common), "--resume-from-checkpoint", "latest"]))
    base = base_parts(tiny_model)["unet"]
    a, b = weights(straight, "unet"), weights(resumed, "unet")
    assert max(float((a[k] - b[k]).abs().max()) for k in a) <= 1e-6
    assert max(float((a[k] - base[k]).abs().max()) for k in a) >= 1e-4


def test_a_checkpoint_with_text_encoder_does_not_resume_without(capsys, full_args, tiny_model):
    assert main(["train", *full_args("out", tiny_model, "--train-text-encoder", "--max-train-steps", "1",
                                     "--checkpointing-steps", "1")]) == 0
    capsys.readouterr()
    assert main(["train", *full_args("out", tiny_model, "--max-train-steps", "2", "--resume-from-checkpoint",
                                     "latest")]) == 2
    assert "trained with --train-text-encoder; this run must be too" in capsys.readouterr().err


def test_full_needs_captions_or_an_instance_prompt(capsys, tiny_model, sample_images, tmp_path):
    assert main(["train", "--method", "full", "--model", str(tiny_model), "--data-dir", str(sample_images),
                 "--output-dir", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "--method full needs a caption per image" in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()


def test_the_rank_plan_counts_a_trained_unets_gradients_and_optimizer_state(tiny_model):
    from xeontune.train import ranks

    stored_unet = sum(p.stat().st_size for p in (tiny_model / "unet").glob("*.safetensors"))
    frozen = ranks.frozen_weight_bytes(str(tiny_model), "bf16")
    trained = ranks.frozen_weight_bytes(str(tiny_model), "bf16", trained=frozenset({"unet"}))
    # fp32 weights, gradients and AdamW's two moments (16 bytes a parameter) in place of a bf16 copy
    assert trained - frozen == stored_unet * 4 - stored_unet // 2
    # packing never applies to it
    assert ranks.frozen_weight_bytes(str(tiny_model), "bf16", packed=True, trained=frozenset({"unet"})) == trained


def test_captions_past_the_token_limit_are_said_once(full_args, sample_images, tmp_path, caplog):
    import shutil

    data = tmp_path / "captioned"
    shutil.copytree(sample_images, data)
    for i, image in enumerate(sorted(data.glob("*.png"))):
        words = " ".join(["very"] * 100) if i < 2 else "short"
        image.with_suffix(".txt").write_text(f"a {words} toy")
    args = [a if a != str(sample_images) else str(data) for a in full_args("out")]
    args = [a for a in args if a not in ("--instance-prompt", PROMPT)] + ["--max-train-steps", "1"]
    caplog.set_level("WARNING", logger="xeontune.train")
    loop.train(parse_args(args))
    said = [r.message for r in caplog.records if "longer than the text encoder's" in r.message]
    assert said == ["1 of the 2 distinct prompts are longer than the text encoder's 77 tokens and are cut there"], said
