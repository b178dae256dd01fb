"""Flags, example-script aliases, config files and their precedence."""

from __future__ import annotations

import pytest

from xeontune.errors import UserError
from xeontune.train.options import parse_args

REQUIRED = ["--model", "m", "--data-dir", "d", "--placeholder-token", "<t>", "--initializer-token", "toy"]


def test_kebab_flags_and_defaults():
    o = parse_args(REQUIRED + ["--num-vectors", "3", "--resolution", "256", "--no-random-flip"])
    assert (o.model, o.data_dir, o.num_vectors, o.resolution) == ("m", "d", 3, 256)
    assert o.flip_p == 0.0 and o.learnable_property == "object" and o.mixed_precision == "auto"
    assert o.placeholder_tokens == ["<t>", "<t>_1", "<t>_2"]


def test_example_script_command_line_is_accepted():
    o = parse_args([
        "--pretrained_model_name_or_path", "runwayml/stable-diffusion-v1-5", "--train_data_dir", "./cat",
        "--learnable_property", "object", "--placeholder_token", "<cat-toy>", "--initializer_token", "toy",
        "--resolution", "512", "--train_batch_size", "1", "--gradient_accumulation_steps", "4",
        "--max_train_steps", "3000", "--learning_rate", "5.0e-04", "--scale_lr", "--lr_scheduler", "constant",
        "--lr_warmup_steps", "0", "--output_dir", "textual_inversion_cat", "--mixed_precision", "no",
        "--enable_xformers_memory_efficient_attention", "--dataloader_num_workers", "8", "--center_crop",
        "--use_8bit_adam",  # the SDXL script's: bitsandbytes, for a few KB of optimizer state here
    ])
    assert o.model == "runwayml/stable-diffusion-v1-5" and o.data_dir == "./cat"
    assert o.gradient_accumulation_steps == 4 and o.max_train_steps == 3000 and o.scale_lr and o.center_crop
    assert o.mixed_precision == "fp32"  # "no" is the example script's spelling of full precision


@pytest.mark.parametrize("suffix", [".yaml", ".toml"])
def test_config_file_with_command_line_override(tmp_path, suffix):
    cfg = tmp_path / f"run{suffix}"
    if suffix == ".yaml":
        cfg.write_text("model: m\ndata-dir: d\nplaceholder_token: '<t>'\ninitializer_token: toy\n"
                       "learning_rate: 0.001\nnum_vectors: 2\nlr_scheduler: cosine\n")
    else:
        cfg.write_text('model = "m"\ndata_dir = "d"\nplaceholder_token = "<t>"\ninitializer_token = "toy"\n'
                       'learning_rate = 0.001\nnum_vectors = 2\nlr_scheduler = "cosine"\n')
    o = parse_args(["--config", str(cfg), "--num-vectors", "4"])
    assert (o.learning_rate, o.num_vectors, o.lr_scheduler, o.model) == (0.001, 4, "cosine", "m")


def test_a_config_files_home_paths_are_expanded_as_a_shell_expands_the_command_lines(tmp_path, monkeypatch):
    """A rank gets the options as flags and no shell: a config file's ~/dog must reach it as a path."""
    monkeypatch.setenv("HOME", str(tmp_path))
    cfg = tmp_path / "run.yaml"
    cfg.write_text("model: ~/sd\ndata_dir: ~/dog\nclass_data_dir: ~/class\noutput_dir: ~/out\nmethod: lora\n"
                   "placeholder_token: '~t'\ninitializer_token: toy\nresume_from_checkpoint: latest\n"
                   "with_prior_preservation: true\nclass_prompt: a photo of a dog\n")
    o = parse_args(["--config", str(cfg)])
    assert (o.model, o.data_dir, o.output_dir) == (f"{tmp_path}/sd", f"{tmp_path}/dog", f"{tmp_path}/out")
    assert o.class_data_dir == f"{tmp_path}/class"
    assert o.placeholder_token == "~t" and o.resume_from_checkpoint == "latest"  # not a path: as written


def test_config_file_errors(tmp_path):
    cfg = tmp_path / "bad.yaml"
    cfg.write_text("model: m\nnot_an_option: 1\n")
    with pytest.raises(UserError, match="unknown option 'not_an_option'"):
        parse_args(["--config", str(cfg)])
    cfg.write_text("lr_scheduler: sometimes\n")
    with pytest.raises(UserError, match="lr_scheduler must be one of"):
        parse_args(["--config", str(cfg)])
    with pytest.raises(UserError, match="does not exist"):
        parse_args(["--config", str(tmp_path / "missing.yaml")])
    with pytest.raises(UserError, match="is a folder"):
        parse_args(["--config", str(tmp_path)])
    cfg.write_bytes(b"\x89PNG\r\n\x1a\n\xff\xfe")  # an image given by mistake
    with pytest.raises(UserError, match="is not text"):
        parse_args(["--config", str(cfg)])


@pytest.mark.parametrize(("flags", "message"), [
    (["--num-vectors", "0"], "--num-vectors must be at least 1"),
    (["--resolution", "100"], "multiple of 8"),
    (["--mixed-precision", "fp16"], "fp16 is not supported"),
    (["--train-batch-size", "0"], "--train-batch-size"),
    (["--seed", str(3 * 10**15)], "--seed must be between 0 and 4294967295"),  # overflowed the sample plan's seeds
    (["--seed", "-1"], "--seed must be between 0"),
    (["--validate-at-start"], "--validate-at-start needs --validation-prompt"),
])
def test_invalid_values(flags, message):
    with pytest.raises(UserError, match=message):
        parse_args(REQUIRED + flags)


def test_missing_required():
    with pytest.raises(UserError, match="--placeholder-token, --initializer-token"):
        parse_args(["--model", "m", "--data-dir", "d"])


def test_textual_inversion_mirrors_images_by_default_and_lora_only_when_asked():
    """As the example scripts: textual_inversion.py flips (flip_p 0.5), train_dreambooth_lora.py does not."""
    ti = parse_args(REQUIRED)
    assert ti.random_flip is True and ti.flip_p == 0.5
    lora = ["--method", "lora", "--model", "m", "--data-dir", "d"]
    assert (parse_args(lora).random_flip, parse_args(lora).flip_p) == (False, 0.0)
    assert parse_args(lora + ["--random-flip"]).flip_p == 0.5
    assert parse_args(lora + ["--random_flip", "--flip-p", "0.25"]).flip_p == 0.25  # the SDXL example's spelling
    with pytest.raises(UserError, match="^--flip-p needs --random-flip: --method lora does not mirror"):
        parse_args(lora + ["--flip-p", "0.25"])
    assert parse_args(REQUIRED + ["--no-random-flip"]).flip_p == 0.0
