"""Every user mistake: a one-line error, exit code 2, and nothing written."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys

import pytest
import torch

from xeontune.cli import main
from xeontune.train import components


def run_cli(capsys, args):
    rc = main(["train", *args])
    err = capsys.readouterr().err.strip().splitlines()
    return rc, [line for line in err if line.startswith("error:")]


def replace(args, flag, value):
    args = list(args)
    args[args.index(flag) + 1] = value
    return args


def assert_one_line_error(capsys, args, out_dir, fragment):
    rc, errors = run_cli(capsys, args)
    assert rc == 2
    assert len(errors) == 1 and fragment in errors[0], errors
    assert not out_dir.exists(), "nothing may be written on bad input"


def test_missing_data_dir(capsys, base_args, tmp_path):
    args = replace(base_args, "--data-dir", str(tmp_path / "nope"))
    assert_one_line_error(capsys, args, tmp_path / "out", "does not exist")


def test_a_missing_data_dir_is_said_before_the_heavy_imports(base_args, tmp_path):
    """A rank's entry point (and `xeontune train`) says it before importing torch: seconds sooner."""
    args = replace(base_args, "--data-dir", str(tmp_path / "nope"))
    proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "xeontune.train", *args], capture_output=True,
                          text=True, timeout=120, env={**os.environ, "XEONTUNE_ALLOCATOR": "none"})
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 2 and len(errors) == 1 and "does not exist" in errors[0], proc.stderr[-3000:]
    imported = {line.rsplit("|", 1)[-1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")}
    assert "xeontune.train.options" in imported and "torch" not in imported
    assert not (tmp_path / "out").exists()


def test_empty_data_dir(capsys, base_args, tmp_path):
    (tmp_path / "empty").mkdir()
    assert_one_line_error(capsys, replace(base_args, "--data-dir", str(tmp_path / "empty")), tmp_path / "out", "is empty")
    (tmp_path / "empty" / "photos").mkdir()  # the images one folder too deep: said so, not "empty"
    assert_one_line_error(capsys, replace(base_args, "--data-dir", str(tmp_path / "empty")), tmp_path / "out",
                          "holds no files, only folders (photos)")


def test_no_readable_image(capsys, base_args, tmp_path):
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "broken.png").write_bytes(b"not a png at all")
    (bad / "notes.txt").write_text("hello")
    assert_one_line_error(capsys, replace(base_args, "--data-dir", str(bad)), tmp_path / "out", "no readable image")


@pytest.mark.slow
def test_corrupt_file_is_skipped_with_a_warning(caplog, base_args, sample_images, tmp_path):
    caplog.set_level(logging.WARNING, logger="xeontune.train.data")
    mixed = tmp_path / "mixed"
    shutil.copytree(sample_images, mixed)
    (mixed / "zz_corrupt.jpg").write_bytes(b"\xff\xd8 truncated jpeg")
    args = replace(base_args, "--data-dir", str(mixed))
    assert main(["train", *replace(args, "--max-train-steps", "1")]) == 0
    assert any("zz_corrupt.jpg" in r.getMessage() for r in caplog.records)
    assert (tmp_path / "out" / "learned_embeds.safetensors").is_file()


def test_placeholder_already_in_vocabulary(capsys, base_args, tmp_path):
    args = replace(base_args, "--placeholder-token", "toy")
    assert_one_line_error(capsys, args, tmp_path / "out", "already in the tokenizer's vocabulary")


def test_initializer_not_one_token(capsys, base_args, tmp_path):
    args = replace(base_args, "--initializer-token", "zqxw")
    assert_one_line_error(capsys, args, tmp_path / "out", "must be exactly one token")


def test_num_vectors_below_one(capsys, base_args, tmp_path):
    assert_one_line_error(capsys, base_args + ["--num-vectors", "0"], tmp_path / "out", "--num-vectors")


def test_resolution_not_multiple_of_8(capsys, base_args, tmp_path):
    assert_one_line_error(capsys, replace(base_args, "--resolution", "60"), tmp_path / "out", "multiple of 8")


def test_model_path_not_a_pipeline(capsys, base_args, tmp_path):
    (tmp_path / "notamodel").mkdir()
    args = replace(base_args, "--model", str(tmp_path / "notamodel"))
    assert_one_line_error(capsys, args, tmp_path / "out", "not a Stable Diffusion pipeline")


def test_an_inpainting_model_is_refused_in_one_line(capsys, base_args, tiny_model, tmp_path):
    """An inpainting (or depth, upscaling, pix2pix) UNet takes more channels than the latents: its first
    convolution failed inside oneDNN with a traceback."""
    from diffusers import UNet2DConditionModel

    inpainting = tmp_path / "inpainting"
    shutil.copytree(tiny_model, inpainting)
    config = dict(UNet2DConditionModel.load_config(inpainting / "unet"), in_channels=9)
    UNet2DConditionModel.from_config(config).save_pretrained(inpainting / "unet")
    args = replace(base_args, "--model", str(inpainting)) + ["--mixed-precision", "bf16"]
    os.environ[components.BF16_CACHE_ENV] = str(tmp_path / "cache")
    try:
        assert_one_line_error(capsys, args, tmp_path / "out", "takes 9 input channels, not the 4 of its latents")
    finally:
        del os.environ[components.BF16_CACHE_ENV]
    assert not (tmp_path / "cache").exists()  # refused from the configs, before a bf16 copy is written


def test_an_output_dir_below_a_file_is_refused_before_the_model_loads(capsys, base_args, tmp_path):
    (tmp_path / "afile").write_text("")
    args = replace(base_args, "--output-dir", str(tmp_path / "afile" / "out"))
    assert_one_line_error(capsys, args, tmp_path / "afile" / "out", f"{tmp_path / 'afile'} is a file, not a folder")


def test_a_users_own_pipeline_folder_is_not_replaced_by_the_saved_pipeline(capsys, base_args, tmp_path):
    out = tmp_path / "out"
    (out / "pipeline").mkdir(parents=True)
    (out / "pipeline" / "notes.txt").write_text("mine")
    rc, errors = run_cli(capsys, replace(base_args, "--output-dir", str(out)) + ["--save-as-full-pipeline"])
    assert rc == 2 and len(errors) == 1 and "is there and is not a saved pipeline" in errors[0], errors
    assert (out / "pipeline" / "notes.txt").read_text() == "mine" and sorted(os.listdir(out)) == ["pipeline"]


def test_unknown_hub_id_offline(capsys, base_args, tmp_path):
    args = replace(base_args, "--model", "nobody/no-such-model")  # the tests run with HF_HUB_OFFLINE=1
    assert_one_line_error(capsys, args, tmp_path / "out", "nobody/no-such-model is no folder here and, as a hub id, "
                                                          "not (all) in this machine's Hugging Face cache")


def _raise_hub_error(error_type):
    """A stand-in for the hub call that raises huggingface_hub's own exception, wrapped as transformers
    wraps it (an OSError raised from it), with a real 404 response: no network needed."""
    import httpx2
    from huggingface_hub.errors import RepositoryNotFoundError  # noqa: F401  (the type under test)

    def fake(model, *args, **kwargs):
        response = httpx2.Response(404, request=httpx2.Request("GET", f"https://huggingface.co/api/models/{model}"))
        try:
            raise error_type(f"404 Client Error: Repository Not Found for url: {response.url}", response=response)
        except error_type as exc:
            raise OSError(f"{model} is not a local folder and is not a valid model identifier") from exc

    return fake


def test_removed_runwayml_id_names_the_mirror(capsys, base_args, tmp_path, monkeypatch):
    from huggingface_hub.errors import RepositoryNotFoundError
    from transformers import CLIPTokenizer

    monkeypatch.setattr(CLIPTokenizer, "from_pretrained", _raise_hub_error(RepositoryNotFoundError))
    args = replace(base_args, "--model", "runwayml/stable-diffusion-v1-5")
    rc, errors = run_cli(capsys, args)
    assert rc == 2 and len(errors) == 1, errors
    assert "not found on the Hugging Face hub" in errors[0] and "moved or removed" in errors[0]
    assert "huggingface-cli login" in errors[0]
    assert "--model stable-diffusion-v1-5/stable-diffusion-v1-5" in errors[0]
    assert not (tmp_path / "out").exists()


def test_gated_hub_id_says_login(capsys, base_args, tmp_path, monkeypatch):
    from huggingface_hub.errors import GatedRepoError
    from transformers import CLIPTokenizer

    monkeypatch.setattr(CLIPTokenizer, "from_pretrained", _raise_hub_error(GatedRepoError))
    args = replace(base_args, "--model", "someone/gated-model")
    rc, errors = run_cli(capsys, args)
    assert rc == 2 and len(errors) == 1, errors
    assert "gated" in errors[0] and "huggingface-cli login" in errors[0] and "mirror" not in errors[0]


@pytest.mark.slow
def test_output_dir_holding_another_run(capsys, base_args, tmp_path):
    args = replace(base_args, "--max-train-steps", "1")
    assert main(["train", *args]) == 0
    before = (tmp_path / "out" / "learned_embeds.safetensors").read_bytes()
    rc, errors = run_cli(capsys, args)
    assert rc == 2 and len(errors) == 1 and "--overwrite" in errors[0]
    assert "it left no checkpoint" in errors[0] and "--resume-from-checkpoint" not in errors[0]  # none to resume
    assert (tmp_path / "out" / "learned_embeds.safetensors").read_bytes() == before
    assert main(["train", *args, "--overwrite", "--checkpointing-steps", "1"]) == 0
    rc, errors = run_cli(capsys, args)
    assert rc == 2 and len(errors) == 1 and "--resume-from-checkpoint latest to continue it" in errors[0]
    shutil.rmtree(tmp_path / "out" / "checkpoint-1")

    # a run that ended before its first step left only its config and an empty log: the same command
    # runs again without --overwrite (it said "holds another run" for a run that had trained nothing)
    (tmp_path / "out" / "learned_embeds.safetensors").unlink()
    (tmp_path / "out" / "metrics.jsonl").write_text("")
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["metrics.jsonl", "train_config.json"]
    assert main(["train", *args]) == 0

def bomb_png(path, width: int, height: int) -> None:
    """A PNG of a few bytes whose header declares ``width`` x ``height`` pixels."""
    import io
    import struct
    import zlib

    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (1, 1)).save(buf, format="PNG")
    data = bytearray(buf.getvalue())
    ihdr = data.index(b"IHDR")
    data[ihdr + 4:ihdr + 12] = struct.pack(">II", width, height)
    data[ihdr + 17:ihdr + 21] = struct.pack(">I", zlib.crc32(bytes(data[ihdr:ihdr + 17])))
    path.write_bytes(bytes(data))


@pytest.mark.slow  # trains a step
def test_decompression_bomb_is_skipped_with_a_warning(caplog, base_args, sample_images, tmp_path):
    from PIL import Image

    from xeontune.train.data import load_images

    caplog.set_level(logging.WARNING, logger="xeontune.train.data")
    mixed = tmp_path / "mixed"
    shutil.copytree(sample_images, mixed)
    side = int((2 * Image.MAX_IMAGE_PIXELS) ** 0.5) + 1  # past PIL's error threshold
    bomb_png(mixed / "zz_bomb.png", side, side)
    images, paths = load_images(mixed, 64, center_crop=False)
    assert len(paths) == len(images) == len(list(sample_images.iterdir()))
    assert any("zz_bomb.png" in r.getMessage() for r in caplog.records)
    args = replace(replace(base_args, "--data-dir", str(mixed)), "--max-train-steps", "1")
    assert main(["train", *args]) == 0


def test_exif_orientation_is_applied(tmp_path):
    """A phone photo stored sideways with orientation 6 ("rotate 90 clockwise to view") trains upright."""
    from PIL import Image

    from xeontune.train.data import load_images, preprocess

    upright = Image.new("RGB", (32, 64), (0, 0, 255))
    upright.paste((255, 0, 0), (0, 0, 32, 16))  # a red band at the top of a tall image
    stored = upright.transpose(Image.Transpose.ROTATE_90)  # how the camera wrote it: wide, band on the left
    exif = Image.Exif()
    exif[0x0112] = 6
    folder = tmp_path / "phone"
    folder.mkdir()
    stored.save(folder / "photo.png", exif=exif)
    images, _ = load_images(folder, 32, center_crop=False)
    assert torch.equal(images[0], preprocess(upright, 32, False))
    assert not torch.equal(images[0], preprocess(stored, 32, False))


@pytest.mark.slow
def test_overwrite_clears_only_a_runs_own_outputs(base_args, tmp_path):
    """--overwrite in a dir that never held a run touches nothing; in a run's dir, only what it wrote."""
    mine = tmp_path / "project"
    for rel in ("logs/notes.txt", "pipeline/model.bin", "validation/holiday.png", "learned_embeds-mine.bin"):
        (mine / rel).parent.mkdir(parents=True, exist_ok=True)
        (mine / rel).write_text("the user's own file")
    before = sorted(str(p.relative_to(mine)) for p in mine.rglob("*"))
    args = replace(replace(base_args, "--output-dir", str(mine)), "--max-train-steps", "2")
    assert main(["train", *args, "--overwrite", "--checkpointing-steps", "1", "--save-steps", "1"]) == 0
    assert all((mine / rel).exists() for rel in before), "the user's files were deleted"
    assert (mine / "checkpoint-1").is_dir() and (mine / "learned_embeds-steps-1.safetensors").is_file()

    # a second --overwrite run clears the first run's outputs, and still not the user's files
    assert main(["train", *args, "--overwrite", "--checkpointing-steps", "0", "--save-steps", "0"]) == 0
    assert not (mine / "checkpoint-1").exists() and not (mine / "learned_embeds-steps-1.safetensors").exists()
    assert (mine / "learned_embeds.safetensors").is_file()
    assert all((mine / rel).exists() for rel in before), "the user's files were deleted"


@pytest.mark.slow
def test_overwrite_deletes_only_the_runs_own_event_files_in_a_shared_logging_dir(base_args, tmp_path):
    """--logging-dir may be a folder other runs log to: --overwrite takes only the run's own files."""
    shared = tmp_path / "tensorboard"
    shared.mkdir()
    theirs = shared / "events.out.tfevents.1764000000.other-host.4242.0"
    theirs.write_bytes(b"another run's events")
    args = [*replace(base_args, "--max-train-steps", "1"), "--report-to", "tensorboard", "--logging-dir", str(shared)]
    assert main(["train", *args]) == 0
    first = set(shared.iterdir()) - {theirs}
    assert len(first) == 1
    assert main(["train", *args, "--overwrite"]) == 0
    second = set(shared.iterdir()) - {theirs}
    assert theirs.read_bytes() == b"another run's events", "another run's events were deleted"
    assert len(second) == 1 and not second & first, "the replaced run's own events stay"


def test_overwrite_refuses_a_dir_with_outputs_but_no_run(capsys, base_args, tmp_path):
    stray = tmp_path / "downloads"
    stray.mkdir()
    (stray / "learned_embeds.safetensors").write_text("someone else's embedding")
    rc, errors = run_cli(capsys, replace(base_args, "--output-dir", str(stray)) + ["--overwrite"])
    assert rc == 2 and len(errors) == 1 and "train_config.json" in errors[0], errors
    assert (stray / "learned_embeds.safetensors").read_text() == "someone else's embedding"


@pytest.mark.parametrize(("flags", "fragment"), [
    (["--adam-beta1", "1.5"], "--adam-beta1 and --adam-beta2"),
    (["--adam-beta2", "-1"], "--adam-beta1 and --adam-beta2"),
    (["--adam-epsilon", "-1"], "--adam-epsilon"),
    (["--adam-weight-decay", "-1"], "--adam-weight-decay"),
    (["--learning-rate", "inf"], "--learning-rate"),
    (["--learning-rate", "1e38"], "--learning-rate"),
    (["--lr-scheduler", "polynomial", "--lr-power", "-1"], "--lr-power"),
    (["--lr-power", "nan"], "--lr-power"),
    (["--lr-warmup-steps", "-5"], "--lr-warmup-steps"),
    (["--lr-num-cycles", "0"], "--lr-num-cycles"),
    (["--dist-timeout", "inf"], "--dist-timeout"),
    (["--dist-wait-timeout", "inf"], "--dist-wait-timeout"),
    (["--validation-prompt", "x", "--validation-inference-steps", "0"], "--validation-inference-steps"),
    (["--placeholder-token", " "], "must not contain spaces"),
    (["--placeholder-token", "<t> "], "must not contain spaces"),
])
def test_optimizer_schedule_and_timeout_values_are_checked_up_front(capsys, base_args, tmp_path, flags, fragment):
    """They gave torch's tracebacks (before or in the middle of the run), or trained with nonsense."""
    assert_one_line_error(capsys, base_args + flags, tmp_path / "out", fragment)


def test_config_file_values_are_not_coerced(capsys, base_args, tmp_path):
    config = tmp_path / "run.yaml"
    for text, fragment in (("placeholder_token: 2024\n", "must be text"), ("num_vectors: 2.7\n", "whole number"),
                           ("center_crop: treu\n", "true or false"), ("validation_prompt: [a, 2]\n", "must be text or a list of texts"),
                           ("initializer_token: [a, b]\n", "must be text")):
        config.write_text(text)
        args = [a for a in base_args if a != "<toy-bot>" and a != "--placeholder-token"] \
            if "placeholder_token" in text else base_args
        assert_one_line_error(capsys, args + ["--config", str(config)], tmp_path / "out", fragment)
    from xeontune.train.options import parse_args

    for text in ("validation_prompt: [a b, c]\n", "validation_prompt: a b\n"):  # a list of prompts, or one
        config.write_text(text)
        assert parse_args(base_args + ["--config", str(config)]).validation_prompt == (["a b", "c"] if "[" in text else ["a b"])
    config.write_text("mixed_precision: no\n")  # YAML's false: the example script's spelling

    assert parse_args(base_args + ["--config", str(config)]).mixed_precision == "fp32"
    config.write_text("adam_epsilon: 1e-8\nnum_vectors: '3'\ncenter_crop: 'yes'\n")  # YAML 1.1 reads 1e-8 as text
    read = parse_args(base_args + ["--config", str(config)])
    assert (read.adam_epsilon, read.num_vectors, read.center_crop) == (1e-8, 3, True)


@pytest.mark.slow
def test_a_run_whose_vectors_become_non_finite_stops_without_writing_them(capsys, base_args, tmp_path, monkeypatch):
    """The loss is checked at every step; vectors that overflowed in the optimizer step were written
    anyway (all inf, exit 0) when the last step's loss was still finite."""
    real_step = torch.optim.AdamW.step

    def overflowing_step(self, *args, **kwargs):
        result = real_step(self, *args, **kwargs)
        for group in self.param_groups:
            for p in group["params"]:
                p.data.fill_(float("inf"))
        return result

    monkeypatch.setattr(torch.optim.AdamW, "step", overflowing_step)
    assert main(["train", *replace(base_args, "--max-train-steps", "2"), "--mixed-precision", "fp32"]) == 1
    assert "vectors became non-finite at step 1" in capsys.readouterr().err
    assert not (tmp_path / "out" / "learned_embeds.safetensors").exists()


def test_a_pickled_weights_file_holding_more_than_tensors_is_one_line_that_never_suggests_unsafe_loading(
        capsys, base_args, tiny_model, tmp_path):
    import numpy as np
    from safetensors.torch import load_file

    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)
    weights = load_file(str(model / "text_encoder" / "model.safetensors"))
    (model / "text_encoder" / "model.safetensors").unlink()
    torch.save({**weights, "extra": np.float64(1.0)}, model / "text_encoder" / "pytorch_model.bin")
    rc, errors = run_cli(capsys, replace(base_args, "--model", str(model)))
    assert rc == 2 and len(errors) == 1, errors
    assert "text_encoder/pytorch_model.bin) holds more than tensors" in errors[0]
    assert "weights_only" not in errors[0] and "Traceback" not in capsys.readouterr().err
