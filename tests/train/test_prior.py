"""Prior preservation: the loss is the example's formula, each batch adds class samples drawn apart
from the instance samples, class images are generated where missing (resuming a stopped generation,
the same set on several ranks as on 1), and ranks train what 1 process does with their batches together."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image
from safetensors.torch import load_file

from tests.one_line import one_line_error
from xeontune.cli import main
from xeontune.errors import UserError
from xeontune.train.data import Batch, SamplePlan, sample_loss
from xeontune.train.data_check import check_training_data
from xeontune.train.images import read_images
from xeontune.train.options import parse_args
from xeontune.train.prior import GENERATED, class_image_names, missing_names

LORA_FILE = "pytorch_lora_weights.safetensors"


def test_the_loss_is_the_examples_instance_plus_weighted_prior_loss():
    torch.manual_seed(0)
    pred, target = torch.randn(4, 4, 8, 8), torch.randn(4, 4, 8, 8)
    batch = Batch(positions=[0, 1], image_index=torch.zeros(4), flip=torch.zeros(4), input_ids=torch.zeros(4, 77),
                  latent_eps=pred, noise=pred, timesteps=torch.zeros(4), instance_count=2)
    # train_dreambooth_lora.py: chunk into instance and prior halves, mse each, add the weighted prior
    model_pred, model_pred_prior = torch.chunk(pred, 2, dim=0)
    target_, target_prior = torch.chunk(target, 2, dim=0)
    want = F.mse_loss(model_pred.float(), target_.float(), reduction="mean") + \
        0.7 * F.mse_loss(model_pred_prior.float(), target_prior.float(), reduction="mean")
    assert torch.equal(sample_loss(pred, target, None, batch, 0.7), want)
    white = torch.ones(4, 1, 8, 8)  # an instance mask of all white changes nothing, the class half has none
    assert torch.equal(sample_loss(pred, target, white, batch, 0.7), want)


def test_a_batch_holds_its_instance_samples_then_class_samples_with_the_class_prompt():
    common = dict(seed=5, num_images=4, repeats=2, prompt_ids=torch.arange(3)[:, None].expand(3, 77),
                  latent_shape=(4, 8, 8), num_train_timesteps=1000, flip_p=0.5)
    plain = SamplePlan(**common).batch([6, 7, 8])
    with_class = SamplePlan(**common, num_class_images=5).batch([6, 7, 8])
    assert with_class.instance_count == 3 and len(with_class.image_index) == 6
    for name in ("image_index", "flip", "noise", "latent_eps", "timesteps"):  # instance samples as without
        assert torch.equal(getattr(with_class, name)[:3], getattr(plain, name)[:3]), name
    assert with_class.prompt_index[:3].max() < 2  # templates drawn from the instance rows only
    assert with_class.prompt_index[3:].tolist() == [2, 2, 2]  # the class prompt: the last row
    assert all(4 <= i < 9 for i in with_class.image_index[3:].tolist())  # class images come after the 4
    assert not torch.equal(with_class.noise[3:], with_class.noise[:3])  # draws of their own
    seen = SamplePlan(**common, num_class_images=5).batch(list(range(10))).image_index[10:].tolist()
    assert sorted(seen) == [4, 4, 5, 5, 6, 6, 7, 7, 8, 8]  # every class image once per 5 positions


def test_missing_names_count_the_users_own_class_images():
    assert missing_names([], 3) == [GENERATED.format(i) for i in range(3)]
    assert missing_names(["dog1.jpg", GENERATED.format(1)], 4) == [GENERATED.format(0), GENERATED.format(2)]
    assert missing_names(["a.png", "b.png", "c.png"], 2) == []


def test_a_damaged_class_image_counts_as_missing_and_the_next_readable_one_takes_its_place(tmp_path):
    """Not N-1 class images for N asked: a damaged generated image is drawn again, and the first N
    readable images of the folder are read (not the first N files, one of them unreadable)."""
    for i in range(3):
        Image.new("RGB", (8, 8), (i * 80, 0, 0)).save(tmp_path / GENERATED.format(i))
    whole = (tmp_path / GENERATED.format(0)).read_bytes()
    (tmp_path / GENERATED.format(0)).write_bytes(whole[: len(whole) // 2])  # cut short, as by a full disk
    assert class_image_names(tmp_path) == [GENERATED.format(1), GENERATED.format(2)]
    assert missing_names(class_image_names(tmp_path), 3) == [GENERATED.format(0)]
    assert [p.name for p, _ in read_images(tmp_path, limit=2)] == [GENERATED.format(1), GENERATED.format(2)]


def prior_args(model, data, class_dir, out, *more) -> list[str]:
    return ["train", "--method", "lora", "--instance-prompt", "a photo of sks toy", "--with-prior-preservation",
            "--class-data-dir", str(class_dir), "--class-prompt", "a photo of a toy", "--num-class-images", "3",
            "--class-inference-steps", "2", "--prior-loss-weight", "0.5", "--model", str(model), "--data-dir",
            str(data), "--resolution", "64", "--mixed-precision", "fp32", "--learning-rate", "1e-3",
            "--max-train-steps", "2", "--checkpointing-steps", "0", "--save-steps", "0", "--output-dir", str(out),
            "--adam-epsilon", "1e-5", *more]


@pytest.mark.slow
def test_a_stopped_generation_resumes_and_the_class_loss_counts(tiny_model, sample_images, tmp_path, monkeypatch):
    class_dir = tmp_path / "class"
    write_bytes = Path.write_bytes

    def stop_in_the_second_image(path: Path, data: bytes) -> int:  # Ctrl-C half-way through writing it
        if not path.name.startswith("." + GENERATED.format(1)):  # prior.write's temporary file of image 1
            return write_bytes(path, data)
        write_bytes(path, data[: len(data) // 2])
        raise KeyboardInterrupt

    monkeypatch.setattr(Path, "write_bytes", stop_in_the_second_image)
    assert main(prior_args(tiny_model, sample_images, class_dir, tmp_path / "a")) == 130
    monkeypatch.undo()
    first = {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in class_dir.iterdir()}
    assert sorted(first) == [GENERATED.format(0)]  # no half-written file
    assert main(prior_args(tiny_model, sample_images, class_dir, tmp_path / "b")) == 0
    after = {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in class_dir.iterdir()}
    assert sorted(after) == [GENERATED.format(i) for i in range(3)]
    assert all(after[name] == first[name] for name in first)  # not drawn again
    image = np.asarray(Image.open(class_dir / GENERATED.format(2)))
    assert image.shape == (64, 64, 3) and image.std() > 0
    # the class images train: another prior weight gives other adapters
    assert main(prior_args(tiny_model, sample_images, class_dir, tmp_path / "c", "--prior-loss-weight", "0")) == 0
    b, c = (load_file(tmp_path / d / LORA_FILE) for d in ("b", "c"))
    apart = max(float((b[k] - c[k]).abs().max()) for k in b)
    print(f"prior loss weight 0.5 vs 0: adapters {apart:.3g} apart")
    # 100x the 1e-5 within which runs that should agree do (the rank test below): not rounding
    assert apart >= 100 * 1e-5, apart


@pytest.mark.slow
def test_two_ranks_generate_the_same_class_images_and_train_what_one_process_does(tiny_model, sample_images,
                                                                                 tmp_path):
    """(3 ranks on the namespace cluster: tests/cluster/test_lora_cluster.py.)"""
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    args = prior_args(tiny_model, sample_images, tmp_path / "class3", tmp_path / "ranks", "--no-random-flip",
                      "--scale-lr", "--nproc-per-node", "2", "--train-batch-size", "1")
    proc = subprocess.run([sys.executable, "-m", "xeontune.cli", *args], capture_output=True, text=True,
                          timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    rate = re.search(r"generated 3 class images in ([\d.]+) s: ([\d.]+) images/s over 2 rank\(s\)", proc.stderr)
    assert rate, proc.stderr[-2000:]
    seconds, per_s = float(rate[1]), float(rate[2])  # seconds rounded to 0.1
    assert 3 / (seconds + 0.05) <= per_s <= 3 / max(seconds - 0.05, 1e-3), rate[0]
    assert proc.stderr.count("class images in") == 1  # rank 0 alone says it
    assert main(prior_args(tiny_model, sample_images, tmp_path / "class1", tmp_path / "one", "--no-random-flip",
                           "--scale-lr", "--train-batch-size", "2")) == 0
    names = sorted(p.name for p in (tmp_path / "class1").iterdir())
    assert names == sorted(p.name for p in (tmp_path / "class3").iterdir()) == [GENERATED.format(i) for i in range(3)]
    for name in names:  # each image from its own seed, whichever rank drew it (8-bit pixels; threads may differ)
        a, b = (np.asarray(Image.open(tmp_path / d / name), dtype=np.int16) for d in ("class1", "class3"))
        assert int(np.abs(a - b).max()) <= 1, name
    got, want = (load_file(tmp_path / d / LORA_FILE) for d in ("ranks", "one"))
    assert max(float(v.abs().max()) for k, v in want.items() if "lora.up" in k) > 1e-4
    diff = max(float((got[k] - want[k]).abs().max()) for k in want)
    print(f"prior preservation, 2 ranks vs 1 process x2: max abs diff {diff:.3g}")
    assert diff <= 1e-5


def test_prior_preservation_mistakes_are_one_line_errors(tiny_model, sample_images, tmp_path, capsys):
    args = prior_args(tiny_model, sample_images, tmp_path / "class", tmp_path / "out")
    at = args.index("--class-prompt")
    assert "needs --class-data-dir and --class-prompt" in one_line_error(capsys, args[:at] + args[at + 2:])
    at = args.index("--with-prior-preservation")
    assert "need --with-prior-preservation" in one_line_error(capsys, args[:at] + args[at + 1:])
    assert "--sample-batch-size must be at least 1" in one_line_error(capsys, args + ["--sample-batch-size", "0"])
    # a prior-preservation option without it would change nothing: said, not ignored
    lora_only = args[:at] + args[at + 1:args.index("--class-data-dir")] + args[args.index("--prior-loss-weight") + 2:]
    assert main(lora_only + ["--num-class-images", "3", "--prior-loss-weight", "0.5"]) == 2
    assert "--num-class-images and --prior-loss-weight need --with-prior-preservation" in capsys.readouterr().err
    (tmp_path / "afile").write_text("")
    at = args.index("--class-data-dir") + 1
    assert "--class-data-dir " + str(tmp_path / "afile") + " is a file" in one_line_error(
        capsys, args[:at] + [str(tmp_path / "afile")] + args[at + 1:])
    assert "is the --data-dir" in one_line_error(capsys, args[:at] + [str(sample_images)] + args[at + 1:])
    ti = ["train", "--placeholder-token", "<x>", "--initializer-token", "toy", "--with-prior-preservation",
          *args[args.index("--class-data-dir"):args.index("--prior-loss-weight")], "--model", str(tiny_model),
          "--data-dir", str(sample_images)]
    assert "--with-prior-preservation is prior preservation's, which --method textual_inversion does not take" in \
        one_line_error(capsys, ti)
    assert not (tmp_path / "class").exists()


def test_a_folder_named_like_a_class_image_is_refused_before_the_model_loads(tiny_model, sample_images, tmp_path,
                                                                             capsys, monkeypatch):
    """A folder class-00000.png in --class-data-dir is no class image: generating that image would fail only
    after the model loaded and drew the others. `run`'s check and the rank refuse it up front, in one line."""
    class_dir = tmp_path / "class"
    (class_dir / GENERATED.format(0)).mkdir(parents=True)
    Image.new("RGB", (64, 64), "gray").save(class_dir / "mine.png")
    from xeontune.train import loop

    def no_model(*args, **kwargs):
        raise AssertionError("the model loaded")

    monkeypatch.setattr(loop, "load", no_model)
    args = prior_args(tiny_model, sample_images, class_dir, tmp_path / "out")
    line = one_line_error(capsys, args)
    assert f"holds a folder named like an image, {class_dir / GENERATED.format(0)}" in line
    with pytest.raises(UserError, match="folder named like an image"):
        check_training_data(parse_args(args[1:]))  # `xeontune run`'s check on the user's machine
    assert sorted(p.name for p in class_dir.iterdir()) == [GENERATED.format(0), "mine.png"]

@pytest.mark.slow
def test_bench_times_prior_preservation_against_the_examples_with_a_class_sample_per_instance_sample(tiny_model,
                                                                                                   tmp_path):
    """`xeontune bench --method lora --with-prior-preservation` steps on instance and class samples: the
    counted model FLOPs per step double. (The baseline takes the same options: bench.variant_options.)"""
    import json

    figures = {}
    for prior in (False, True):
        out = tmp_path / f"bench-{prior}.json"
        assert main(["bench", "--method", "lora", "--model", str(tiny_model), "--resolution", "64", "--steps", "1",
                     "--warmup", "1", "--allocator", "none", "--matmul-size", "256", "--ranks-per-node", "none",
                     "--no-rss", "--no-baseline", "--mixed-precision", "fp32", "--json-out", str(out),
                     *(["--with-prior-preservation"] if prior else [])]) == 0
        figures[prior] = json.loads(out.read_text())
    assert figures[True]["config"]["prior_preservation"] is True
    ratio = figures[True]["model_gflop_per_step"] / figures[False]["model_gflop_per_step"]
    assert 1.9 < ratio < 2.1, ratio


@pytest.mark.slow
def test_bench_times_class_image_generation_against_the_examples_pipeline(tiny_model, capsys, tmp_path):
    import json

    assert main(["bench", "--class-images", "2", "--model", str(tiny_model), "--resolution", "64",
                 "--class-inference-steps", "2", "--mixed-precision", "fp32", "--allocator", "none", "--json",
                 "--json-out", str(tmp_path / "class.json")]) == 0
    figures = json.loads(capsys.readouterr().out)
    assert json.loads((tmp_path / "class.json").read_text()) == figures  # --json-out too (it was ignored)
    assert figures["images"] == 2 and figures["steps"] == 2 and figures["resolution"] == 64
    assert figures["xeontune_images_per_s"] > 0 and figures["example_images_per_s"] > 0
    assert figures["speedup"] == pytest.approx(figures["xeontune_images_per_s"] / figures["example_images_per_s"])
