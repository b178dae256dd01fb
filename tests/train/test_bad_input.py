"""Every user mistake: a one-line error, exit code 2, and nothing written."""

from __future__ import annotations

import logging
import shutil

from xeontune.cli import main


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


def test_empty_data_dir(capsys, base_args, tmp_path):
    (tmp_path / "empty").mkdir()
    assert_one_line_error(capsys, replace(base_args, "--data-dir", str(tmp_path / "empty")), tmp_path / "out", "is empty")


def test_no_readable_image(capsys, base_args, tmp_path):
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "broken.png").write_bytes(b"not a png at all")
    (bad / "notes.txt").write_text("hello")
    assert_one_line_error(capsys, replace(base_args, "--data-dir", str(bad)), tmp_path / "out", "no readable image")


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


def test_unknown_hub_id_offline(capsys, base_args, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    args = replace(base_args, "--model", "nobody/no-such-model")
    assert_one_line_error(capsys, args, tmp_path / "out", "cannot load a Stable Diffusion pipeline")


def test_output_dir_holding_another_run(capsys, base_args, tmp_path):
    args = replace(base_args, "--max-train-steps", "1")
    assert main(["train", *args]) == 0
    before = (tmp_path / "out" / "learned_embeds.safetensors").read_bytes()
    rc, errors = run_cli(capsys, args)
    assert rc == 2 and len(errors) == 1 and "--overwrite" in errors[0]
    assert (tmp_path / "out" / "learned_embeds.safetensors").read_bytes() == before
    assert main(["train", *args, "--overwrite"]) == 0
