"""Images of more than 8 bits a channel (16-bit PNGs, integer and float TIFFs) read by their range, not
clipped; and the caption files' refusals (not UTF-8, too long, a folder) as one line naming the file."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from tests.one_line import one_line_error
from xeontune.errors import UserError
from xeontune.train.buckets import load_training_images
from xeontune.train.data import load_images_with_crops, mask_tensor
from xeontune.train.images import mask_weights
from xeontune.train.options import parse_args
from xeontune.train.prompts import MAX_CAPTION_CHARS, image_prompts

MID_16 = 32896  # 0x8080: 128 of 255 in 16 bits


def grey(mode: str, value: float, size: tuple[int, int] = (16, 16)) -> Image.Image:
    dtype = {"I;16": np.uint16, "I": np.int32, "F": np.float32}[mode]
    return Image.fromarray(np.full(size[::-1], value, dtype=dtype))


def one_image_folder(tmp_path: Path, img: Image.Image, name: str) -> Path:
    folder = tmp_path / "data"
    folder.mkdir()
    img.save(folder / name)
    return folder


WIDE_GREYS = [("I;16", MID_16, "grey.png"), ("I;16", MID_16, "grey.tif"), ("I", MID_16, "grey.tif"),
              ("F", 0.5, "grey.tif")]


@pytest.mark.parametrize("mode, value, name", WIDE_GREYS)
def test_wide_images_decode_by_their_range_to_mid_grey(tmp_path, mode, value, name):
    img = grey(mode, value)
    assert img.mode == mode
    folder = one_image_folder(tmp_path, img, name)
    with Image.open(folder / name) as back:
        assert back.mode == mode  # the file reads back in the mode under test
    pixels, _, _ = load_images_with_crops(folder, 16, False)
    assert abs(float((pixels.mean() + 1) * 127.5) - 128) < 1.5, "not mid-grey: clipped to white or black"


@pytest.mark.parametrize("mode, value, name", WIDE_GREYS)
def test_wide_images_decode_to_mid_grey_in_buckets(tmp_path, mode, value, name):
    folder = one_image_folder(tmp_path, grey(mode, value, (64, 32)), name)
    images = load_training_images(parse_args(["--model", "m", "--data-dir", str(folder), "--placeholder-token",
                                              "<t>", "--initializer-token", "t", "--resolution", "32",
                                              "--bucket-step", "16", "--buckets", "on"]))
    assert images.bucketed
    pixels = images.parts[0].pixels[:]
    assert abs(float((pixels.mean() + 1) * 127.5) - 128) < 1.5


def test_a_16_bit_mask_weighs_by_its_range(tmp_path):
    folder = one_image_folder(tmp_path, Image.new("RGB", (16, 16)), "toy.png")
    grey("I;16", MID_16).save(folder / "toy.mask.png")
    masks = mask_tensor(mask_weights([folder / "toy.png"], [(16, 16)], 16, False))
    assert masks is not None and abs(float(masks.mean()) - 128 / 255) < 0.01


@pytest.mark.parametrize("mode, value, message", [
    ("F", 128.0, "holds float pixels from 128 to 128: only floats from 0 to 1 are read"),
    ("F", float("nan"), "holds float pixels that are no numbers"),
    ("I", 70000, "holds 32-bit pixels from 70000 to 70000: only 0 to 65535 (16 bits) are read"),
    ("I", -5, "holds 32-bit pixels from -5 to -5"),
    ("I", 128, "holds 32-bit pixels no brighter than 128"),
])
def test_wide_images_out_of_range_are_refused_in_one_line(tmp_path, mode, value, message):
    folder = one_image_folder(tmp_path, grey(mode, value), "odd.tif")
    with pytest.raises(UserError) as err:
        load_images_with_crops(folder, 16, False)
    assert f"image {folder / 'odd.tif'} {message}" in str(err.value) and "\n" not in str(err.value)


def test_a_float_mask_out_of_range_is_refused_naming_the_mask(tmp_path):
    folder = one_image_folder(tmp_path, Image.new("RGB", (16, 16)), "toy.png")
    grey("F", 2.0).save(folder / "toy.mask.tif")
    shutil.move(folder / "toy.mask.tif", folder / "toy.mask.png")  # a TIFF named .png: PIL reads it by content
    with pytest.raises(UserError, match=f"mask {folder / 'toy.mask.png'} holds float pixels from 2 to 2"):
        mask_tensor(mask_weights([folder / "toy.png"], [(16, 16)], 16, False))


def test_the_cli_refuses_a_float_image_out_of_range_in_one_line(capsys, base_args, tmp_path):
    folder = one_image_folder(tmp_path, grey("F", 255.0), "odd.tif")
    args = ["train", *base_args]
    args[args.index("--data-dir") + 1] = str(folder)
    assert "odd.tif holds float pixels from 255 to 255" in one_line_error(capsys, args)


# --- captions ------------------------------------------------------------------------------------------


@pytest.fixture
def folder(tmp_path) -> Path:
    """Two images, toy_0.png and toy_1.png, to caption."""
    root = tmp_path / "captioned"
    root.mkdir()
    for i in range(2):
        Image.new("RGB", (16, 16), (i * 100, 50, 50)).save(root / f"toy_{i}.png")
    return root


def prompts_of(folder: Path):
    return image_prompts(folder, sorted(folder.glob("*.png")), instance_prompt="a toy")


def refused(folder: Path) -> str:
    with pytest.raises(UserError) as err:
        prompts_of(folder)
    assert "\n" not in str(err.value)
    return str(err.value)


def test_a_metadata_jsonl_that_is_not_utf8_is_refused_as_a_txt_caption_is(folder):
    line = json.dumps({"file_name": "toy_0.png", "text": "a toy"}).encode()
    (folder / "metadata.jsonl").write_bytes(line + b"\n" + line.replace(b"a toy", b"caf\xe9 toy") + b"\n")
    assert refused(folder) == f"{folder / 'metadata.jsonl'} line 2 is not UTF-8 text (byte 0xe9)"
    (folder / "metadata.jsonl").unlink()
    (folder / "toy_1.txt").write_bytes(b"a toy\non a caf\xe9 table\n")
    assert refused(folder) == f"caption {folder / 'toy_1.txt'} line 2 is not UTF-8 text (byte 0xe9)"
    (folder / "toy_1.txt").write_bytes(b"\xef\xbb\xbfa toy\n\xe9")  # after a byte-order mark: the same line
    assert refused(folder) == f"caption {folder / 'toy_1.txt'} line 2 is not UTF-8 text (byte 0xe9)"


def test_a_json_caption_holding_a_line_separator_is_one_line(folder):
    rows = [{"file_name": "toy_0.png", "text": "a toy\u2028on a table"}, {"file_name": "toy_1.png", "text": "b\x85c"}]
    (folder / "metadata.jsonl").write_text("".join(json.dumps(r, ensure_ascii=False) + "\r\n" for r in rows),
                                           encoding="utf-8")
    assert prompts_of(folder).texts == ["a toy on a table", "b c"]


def test_a_byte_order_mark_is_no_part_of_a_caption(folder):
    (folder / "toy_0.txt").write_text("a toy", encoding="utf-8-sig")
    (folder / "metadata.jsonl").write_text(json.dumps({"file_name": "toy_1.png", "text": "b"}), encoding="utf-8-sig")
    assert prompts_of(folder).texts == ["a toy", "b"]


def test_captions_over_the_limit_are_refused(folder):
    (folder / "toy_0.txt").write_text("  " + "w" * MAX_CAPTION_CHARS + "\n\n")  # at the limit once read
    assert len(prompts_of(folder).texts[0]) == MAX_CAPTION_CHARS
    (folder / "toy_0.txt").write_text("x" * 10_000_000)  # 10 MB
    assert refused(folder).startswith(f"caption {folder / 'toy_0.txt'} is 10000000 characters long: over "
                                      f"{MAX_CAPTION_CHARS:,}")
    (folder / "toy_0.txt").unlink()
    (folder / "metadata.jsonl").write_text(json.dumps({"file_name": "toy_1.png", "text": "y" * 20_000}) + "\n")
    assert refused(folder).startswith(f"{folder / 'metadata.jsonl'} line 1: the caption of 'toy_1.png' is 20000 "
                                      "characters long")


def test_caption_files_that_are_folders_are_refused(folder):
    (folder / "metadata.jsonl").mkdir()
    assert refused(folder) == f"{folder / 'metadata.jsonl'} is a folder, not a file of captions"
    (folder / "metadata.jsonl").rmdir()
    (folder / "toy_1.txt").mkdir()
    assert refused(folder) == f"caption {folder / 'toy_1.txt'} is a folder, not a file of captions"
    (folder / "toy_1.txt").rmdir()
    (folder / "toy_1.txt").symlink_to(folder / "gone.txt")
    assert refused(folder) == f"caption {folder / 'toy_1.txt'} is a broken link, not a file of captions"
