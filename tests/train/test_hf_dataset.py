"""--dataset: Hugging Face datasets (save_to_disk folders, parquet and arrow files, a hub id from the
cache) exported once into a folder of images and metadata.jsonl, which training reads as --data-dir;
the export's reuse and its lock; and each mistake as one line, before any model loads."""

from __future__ import annotations

import io
import json
import logging
import os
import shutil
import threading
import time
from pathlib import Path

import datasets
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

from tests.one_line import one_line_error
from xeontune.cli import main
from xeontune.train import hf_dataset
from xeontune.train.options import parse_args

CAPTIONS = [f"a photo of sks toy {['red', 'blue'][i % 2]}" for i in range(6)]
FEATURES = datasets.Features({"image": datasets.Image(), "text": datasets.Value("string")})


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    """Exports in a cache of this test's own, and datasets' own cache too (a hub id's entry lives there)."""
    monkeypatch.setenv("XEONTUNE_CACHE", str(tmp_path / "xeontune-cache"))
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf-datasets"))
    monkeypatch.delenv(hf_dataset.EXPORT_ENV, raising=False)


def pngs(sample_images) -> list[Path]:
    return sorted(Path(sample_images).glob("*.png"))


def stored(sample_images, captions=CAPTIONS, **columns) -> datasets.Dataset:
    """The 6 sample images as an Image column holding their bytes, with ``captions``."""
    images = [{"bytes": p.read_bytes(), "path": p.name} for p in pngs(sample_images)]
    return datasets.Dataset.from_dict({"image": images, "text": captions, **columns}, features=FEATURES)


def options(dataset, *more):
    return parse_args(["--model", "m", "--method", "lora", "--dataset", str(dataset), *more])


def metadata(folder) -> list[dict]:
    return [json.loads(line) for line in (Path(folder) / "metadata.jsonl").read_text().splitlines()]


# --- through the trainer: the same run as on the equal folder ---------------------------------------------


def train_args(model, out, *data):
    return ["train", "--method", "lora", "--model", str(model), *data, "--resolution", "64", "--max-train-steps", "2",
            "--learning-rate", "1e-3", "--checkpointing-steps", "0", "--save-steps", "0", "--mixed-precision", "fp32",
            "--output-dir", str(out)]


@pytest.fixture(scope="module")
def folder_weights(tiny_model, sample_images, tmp_path_factory):
    """LoRA trained on the sample images in a folder, each captioned by IMAGE.txt."""
    folder = shutil.copytree(sample_images, tmp_path_factory.mktemp("folder") / "data")
    for path, caption in zip(pngs(folder), CAPTIONS, strict=True):
        path.with_suffix(".txt").write_text(caption)
    out = tmp_path_factory.mktemp("folder-run") / "out"
    assert main(train_args(tiny_model, out, "--data-dir", str(folder))) == 0
    weights = load_file(out / "pytorch_lora_weights.safetensors")
    assert max(float(v.abs().max()) for k, v in weights.items() if "lora.up" in k) > 1e-4  # it trained (up starts at 0)
    return weights


@pytest.mark.slow
@pytest.mark.parametrize("source", ["save_to_disk", "parquet folder", "arrow files"])
def test_a_dataset_trains_exactly_as_the_folder_with_the_same_captions(source, tiny_model, sample_images, tmp_path,
                                                                       folder_weights, capsys):
    ds = stored(sample_images)
    more = []
    if source == "save_to_disk":
        ds.save_to_disk(str(tmp_path / "ds"))
        given = tmp_path / "ds"
    elif source == "parquet folder":  # in the hub's layout, with other column names, and the examples' spellings
        ds = ds.rename_columns({"image": "picture", "text": "caption"})
        ds.to_parquet(str(tmp_path / "ds" / "data" / "train-00000-of-00001.parquet"))
        given = tmp_path / "ds"
        more = ["--image_column", "picture", "--caption_column", "caption"]
    else:  # the arrow files a save_to_disk folder holds, by glob
        ds.save_to_disk(str(tmp_path / "saved"))
        given = f"{tmp_path / 'saved'}/*.arrow"
    flag = "--dataset_name" if source == "parquet folder" else "--dataset"
    out = tmp_path / "out"
    assert main(train_args(tiny_model, out, flag, str(given), *more)) == 0
    weights = load_file(out / "pytorch_lora_weights.safetensors")
    assert weights.keys() == folder_weights.keys()
    assert all(torch.equal(weights[k], folder_weights[k]) for k in weights)
    # what it trained on: the export, with every caption, named in the run's config
    config = json.loads((out / "train_config.json").read_text())
    export = Path(config["data_dir"])
    assert config["dataset"] == str(given) and export.parent == Path(os.environ["XEONTUNE_CACHE"]) / "datasets"
    caption = "caption" if source == "parquet folder" else "text"
    assert metadata(export) == [{"file_name": f"{i:05d}.png", caption: text} for i, text in enumerate(CAPTIONS)]
    for i, png in enumerate(pngs(sample_images)):  # the stored bytes, as they were
        assert (export / f"{i:05d}.png").read_bytes() == png.read_bytes()


# --- the export -----------------------------------------------------------------------------------------


def test_the_export_is_made_once_and_reused_until_the_files_change(sample_images, tmp_path, monkeypatch):
    stored(sample_images).to_parquet(str(tmp_path / "train.parquet"))
    first = hf_dataset.resolve(opts := options(tmp_path / "train.parquet"))
    assert opts.data_dir == str(first) and hf_dataset._complete(first)["images"] == 6
    assert not [p for p in first.parent.iterdir() if ".load." in p.name or p.name.endswith(".tmp")]

    def no_load(*_args):
        raise AssertionError("a complete export is reused without reading the dataset")

    with monkeypatch.context() as m:
        m.setattr(hf_dataset, "_load", no_load)
        assert hf_dataset.resolve(options(tmp_path / "train.parquet")) == first
    stored(sample_images, captions=[c.upper() for c in CAPTIONS]).to_parquet(str(tmp_path / "train.parquet"))
    os.utime(tmp_path / "train.parquet", ns=(1, 1))  # a rewrite within the clock's step changes the time too
    second = hf_dataset.resolve(options(tmp_path / "train.parquet"))
    assert second != first and metadata(second)[0]["text"] == CAPTIONS[0].upper()
    # other columns are another export
    assert hf_dataset.resolve(options(tmp_path / "train.parquet", "--caption-column", "text")) == second


def test_ranks_resolving_at_once_export_once_and_all_take_it(sample_images, tmp_path, monkeypatch):
    stored(sample_images).save_to_disk(str(tmp_path / "ds"))
    export, exports = hf_dataset._export, []

    def slow_export(*args):
        exports.append(1)
        time.sleep(0.5)  # the others reach the lock meanwhile
        return export(*args)

    monkeypatch.setattr(hf_dataset, "_export", slow_export)
    found: list[Path] = []
    threads = [threading.Thread(target=lambda: found.append(hf_dataset.resolve(options(tmp_path / "ds"))))
               for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(exports) == 1 and len(found) == 3 and len(set(found)) == 1


def test_image_paths_resolve_beside_the_dataset_and_missing_files_are_one_warning(sample_images, tmp_path, caplog):
    root = tmp_path / "ds"
    shutil.copytree(sample_images, root / "imgs")
    files = [f"imgs/{p.name}" for p in pngs(sample_images)]
    files[2:2] = ["imgs/gone.png", "/nowhere/else.jpg"]
    captions = [*CAPTIONS[:2], "x", "y", *CAPTIONS[2:]]
    # a path relative to the saved dataset's folder: its images are beside it, in ../imgs
    ds = datasets.Dataset.from_dict({"file": [f"../{f}" if not f.startswith("/") else f for f in files],
                                     "text": captions})
    ds.save_to_disk(str(root / "saved"))
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(root / "imgs" / "toy_00.png", 0o666 & ~umask)  # the mode the export's files get: linked
    os.chmod(root / "imgs" / "toy_01.png", 0o600)  # another: copied, so the user's file keeps its mode
    with caplog.at_level(logging.WARNING, logger="xeontune.train"):
        export = hf_dataset.resolve(options(root / "saved", "--image-column", "file"))
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "skipped 2 of 8 rows" in warnings[0] and "does not exist" in warnings[0], warnings
    assert [row["text"] for row in metadata(export)] == CAPTIONS
    assert [row["file_name"] for row in metadata(export)] == [f"{i:05d}.png" for i in (0, 1, 4, 5, 6, 7)]
    assert (export / "00004.png").read_bytes() == (sample_images / "toy_02.png").read_bytes()
    assert os.path.samefile(export / "00000.png", root / "imgs" / "toy_00.png")
    assert not os.path.samefile(export / "00001.png", root / "imgs" / "toy_01.png")
    assert (root / "imgs" / "toy_01.png").stat().st_mode & 0o777 == 0o600
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="xeontune.train"):  # reused: said again
        assert hf_dataset.resolve(options(root / "saved", "--image-column", "file")) == export
    assert "skipped 2 of 8 rows" in caplog.text


def test_stored_bytes_keep_their_format_and_unreadable_ones_are_skipped(tmp_path, caplog):
    def encoded(fmt):
        buffer = io.BytesIO()
        Image.new("RGB", (64, 64), (200, 10, 10)).save(buffer, fmt)
        return buffer.getvalue()

    jpeg, webp, gif = encoded("JPEG"), encoded("WEBP"), encoded("GIF")
    images = [{"bytes": jpeg, "path": None}, {"bytes": webp, "path": "from/a/photo.webp"}, {"bytes": gif, "path": None},
              {"bytes": b"not an image", "path": None}, None]
    datasets.Dataset.from_dict({"image": images, "text": ["a", "b", "c", "d", "e"]},
                               features=FEATURES).to_parquet(str(tmp_path / "x.parquet"))
    with caplog.at_level(logging.WARNING, logger="xeontune.train"):
        export = hf_dataset.resolve(options(tmp_path / "x.parquet"))
    assert [row["file_name"] for row in metadata(export)] == ["00000.jpg", "00001.webp"]
    assert (export / "00000.jpg").read_bytes() == jpeg and (export / "00001.webp").read_bytes() == webp
    assert "1 of 5 rows" in caplog.text and "format the trainer does not read" in caplog.text  # the GIF
    assert "no image PIL reads" in caplog.text and "it has no image" in caplog.text


def test_a_saved_dataset_dict_gives_its_train_split_alone(sample_images, tmp_path):
    empty = datasets.Dataset.from_dict({"image": [], "text": []}, features=FEATURES)  # not even read
    datasets.DatasetDict({"test": empty, "train": stored(sample_images)}).save_to_disk(str(tmp_path / "dd"))
    assert [row["text"] for row in metadata(hf_dataset.resolve(options(tmp_path / "dd")))] == CAPTIONS
    datasets.DatasetDict({"only": stored(sample_images)}).save_to_disk(str(tmp_path / "one"))
    assert len(metadata(hf_dataset.resolve(options(tmp_path / "one")))) == 6


def put_in_the_hub_cache(ds: datasets.Dataset, repo_id: str, tmp_path: Path) -> None:
    """What `load_dataset(repo_id)` online leaves in datasets' cache, made offline: the parquet builder's
    prepared arrow files under <namespace>___<name>/default/0.0.0/<hash>, which load_dataset reads with
    HF_HUB_OFFLINE=1 (its CachedDatasetModuleFactory)."""
    from datasets.packaged_modules.parquet.parquet import Parquet

    namespace, name = repo_id.split("/")
    ds.to_parquet(str(tmp_path / "hub.parquet"))
    Parquet(cache_dir=str(tmp_path / "build"), dataset_name=name, config_id="default", config_name="default",
            hash="0123abcd", data_files={"train": [str(tmp_path / "hub.parquet")]}).download_and_prepare()
    shutil.move(tmp_path / "build" / name, Path(datasets.config.HF_DATASETS_CACHE) / f"{namespace}___{name}")


def test_a_hub_id_is_read_from_the_cache_offline(sample_images, tmp_path, monkeypatch):
    assert datasets.config.HF_HUB_OFFLINE  # tests/conftest.py: no test reaches the hub
    put_in_the_hub_cache(stored(sample_images), "someone/toy-captions", tmp_path)
    export = hf_dataset.resolve(options("someone/toy-captions"))
    assert export.name.startswith("someone--toy-captions-")
    assert [row["text"] for row in metadata(export)] == CAPTIONS
    assert hf_dataset.resolve(options("someone/toy-captions")) == export  # its fingerprint is the cache's


def test_a_launcher_hands_its_ranks_the_export(sample_images, tmp_path, monkeypatch):
    """`xeontune run` gives its ranks --data-dir <the export>; `xeontune train --nproc-per-node N` passes
    the export to its ranks in the environment, and they take it without loading the dataset."""
    from xeontune.job.spec import rank_args, read_request

    stored(sample_images).save_to_disk(str(tmp_path / "ds"))
    request = read_request(["--", "--model", "org/model", "--method", "lora", "--dataset", str(tmp_path / "ds"),
                            "--output-dir", str(tmp_path / "out")])
    hf_dataset.for_the_ranks(request.options, request.given)
    flags = rank_args(request.options, request.given)
    assert "--dataset" not in flags and flags[flags.index("--data-dir") + 1] == request.options.data_dir
    assert (Path(request.options.data_dir) / "metadata.jsonl").is_file()

    opts = options(tmp_path / "ds")
    hf_dataset.resolve(opts)
    monkeypatch.setattr(hf_dataset, "locate", lambda _given: pytest.fail("a rank handed the export reads nothing"))
    with hf_dataset.handed_to_ranks(opts):
        rank = options(tmp_path / "ds")
        assert hf_dataset.resolve(rank) == Path(opts.data_dir)
    assert hf_dataset.EXPORT_ENV not in os.environ


def test_the_examples_spelling_and_a_config_file(tmp_path, monkeypatch):
    assert options("x").dataset == "x"
    assert parse_args(["--model", "m", "--dataset_name", "org/name", "--placeholder-token", "<t>",
                       "--initializer-token", "toy"]).dataset == "org/name"
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "c.yaml").write_text("dataset_name: ~/pokemon\nimage_column: picture\n")
    opts = parse_args(["--config", str(tmp_path / "c.yaml"), "--model", "m", "--method", "lora"])
    assert opts.dataset == str(tmp_path / "pokemon") and opts.image_column == "picture" and opts.data_dir is None


# --- mistakes: one line each, before any model loads ------------------------------------------------------


def mistake_args(tmp_path, *data):
    return ["train", "--method", "lora", "--model", str(tmp_path / "no-model-here"), *data,
            "--output-dir", str(tmp_path / "out")]


@pytest.mark.parametrize("mistake, expected", [
    ("no image column", "has no column 'image' (--image-column); its columns: picture, text"),
    ("no caption column", "has no column 'caption' (--caption-column); its columns: image, text"),
    ("caption not text", "the caption of row 0 (counting from 0; column 'text') is list, not text: \"['a photo"),
    ("caption null", "the caption of row 3 (counting from 0; column 'text') is missing (null)"),
    ("no rows", "has no rows"),
    ("no rows in parquet", "has no rows"),
    ("splits but no train", "has the splits test, validation and none is named train"),
    ("not images", "column 'image' (--image-column) holds Value('int64'), not images"),
    ("with data dir", "--dataset and --data-dir both name the training images: give one"),
    ("folder of other files", "is neither a saved dataset (a folder written by datasets' save_to_disk) nor parquet"),
    ("csv file", "a file must end in .parquet or .arrow"),
    ("no such path", "does not exist (a saved dataset's folder, parquet or arrow files, or a hub id"),
    ("uncached hub id", "--dataset someone/not-cached is not a file or folder here, and with HF_HUB_OFFLINE=1 it "
                        "must be in the Hugging Face datasets cache"),
    ("image column without dataset", "--image-column needs --dataset"),
])
def test_dataset_mistakes_are_one_line_errors(mistake, expected, sample_images, tmp_path, capsys):
    path = tmp_path / "ds"
    data = ["--dataset", str(path)]
    if mistake == "no image column":
        stored(sample_images).rename_column("image", "picture").save_to_disk(str(path))
    elif mistake == "no caption column":
        stored(sample_images).save_to_disk(str(path))
        data += ["--caption-column", "caption"]
    elif mistake == "caption not text":  # a list of captions per image (some datasets have them)
        datasets.Dataset.from_dict({"image": [p.read_bytes() for p in pngs(sample_images)],
                                    "text": [[c] for c in CAPTIONS]}).save_to_disk(str(path))
    elif mistake == "caption null":
        stored(sample_images, captions=[*CAPTIONS[:3], None, *CAPTIONS[4:]]).save_to_disk(str(path))
    elif mistake == "no rows":
        datasets.Dataset.from_dict({"image": [], "text": []}, features=FEATURES).save_to_disk(str(path))
    elif mistake == "no rows in parquet":
        datasets.Dataset.from_dict({"image": [], "text": []}, features=FEATURES).to_parquet(str(path / "a.parquet"))
    elif mistake == "splits but no train":
        datasets.DatasetDict({"test": stored(sample_images), "validation": stored(sample_images)}).save_to_disk(str(path))
    elif mistake == "not images":
        datasets.Dataset.from_dict({"image": [1, 2], "text": ["a", "b"]}).save_to_disk(str(path))
    elif mistake == "with data dir":
        stored(sample_images).save_to_disk(str(path))
        data += ["--data-dir", str(sample_images)]
    elif mistake == "folder of other files":
        shutil.copytree(sample_images, path)
    elif mistake == "csv file":
        (tmp_path / "ds.csv").write_text("image,text\n")
        data = ["--dataset", str(tmp_path / "ds.csv")]
    elif mistake == "uncached hub id":
        data = ["--dataset", "someone/not-cached"]
    elif mistake == "image column without dataset":
        data = ["--data-dir", str(sample_images), "--image-column", "picture"]
    line = one_line_error(capsys, mistake_args(tmp_path, *data))
    assert expected in line, line
    assert not (tmp_path / "out").exists()
    exports = Path(os.environ["XEONTUNE_CACHE"]) / "datasets"
    assert not exports.exists() or not [p for p in exports.iterdir() if not p.name.endswith(".lock")]
