"""LoRA across a real 3-host local cluster: `launch -n 3` and `run --provider local -n 3`, each
family's adapters loaded into diffusers in both layouts (pytorch_lora_weights and its kohya twin).

3 ranks of batch 1 equal one process of batch 3 (fp32), with aspect-ratio buckets too: the adapters start
from --seed on every rank and their gradients are averaged by one flat all-reduce of the adapters' size.
A DreamBooth run (captions, a pivotal token, prior preservation, buckets) goes through `run` on 3 nodes."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from tests.cluster.clusterlib import assert_nothing_left, cli
from tests.trainlib import OFFLINE, lora_args, train_in_process

pytestmark = [pytest.mark.slow, pytest.mark.root]

DIFFUSERS_FILE, KOHYA_FILE = "pytorch_lora_weights.safetensors", "pytorch_lora_weights_kohya.safetensors"


@pytest.fixture(scope="module")
def families(tiny_model, sd2_model, sdxl_model):
    return {"sd": tiny_model, "sd2": sd2_model, "sdxl": sdxl_model}


def run_lora_args(model, data, out, batch: int, steps: int, *extra: str) -> list[str]:
    """trainlib.lora_args at 32 px, with the batch (a rank's) and steps, seed 7, no checkpoints, no random
    flip, and this module's prompt; ``extra`` last: it may override them (the last flag wins)."""
    return lora_args(model, data, out, "--train-batch-size", str(batch), "--max-train-steps", str(steps),
                     "--seed", "7", "--checkpointing-steps", "0", "--no-random-flip", *extra,
                     prompt="a photo of toy", resolution=32)


def fused(model, family: str, out=None, weight_name: str | None = None) -> dict[str, torch.Tensor]:
    """The UNet's and text encoders' weights of the pipeline, with the file's LoRA fused when given."""
    from diffusers import StableDiffusionPipeline, StableDiffusionXLPipeline

    cls = StableDiffusionXLPipeline if family == "sdxl" else StableDiffusionPipeline
    pipe = cls.from_pretrained(str(model), **({} if family == "sdxl" else {"safety_checker": None}))
    if weight_name:
        pipe.load_lora_weights(str(out), weight_name=weight_name)
        pipe.fuse_lora()
        pipe.unload_lora_weights()
    parts = ["unet", "text_encoder"] + (["text_encoder_2"] if family == "sdxl" else [])
    return {f"{p}.{k}": v.detach().clone() for p in parts for k, v in getattr(pipe, p).state_dict().items()}


FUSED_ATOL = 1e-6  # the two layouts, fused: the same weights up to rounding


def assert_loads_in_both_layouts(model, family: str, out, text_encoder: bool) -> None:
    """Both files, fused into the base pipeline, give the same weights; each trained part moved from the
    base's by 100x that tolerance (a file of untrained adapters would fuse to the base in both layouts)."""
    base = fused(model, family)
    a, b = fused(model, family, out, DIFFUSERS_FILE), fused(model, family, out, KOHYA_FILE)
    assert a.keys() == b.keys() == base.keys()
    assert max(float((a[k] - b[k]).abs().max()) for k in a) <= FUSED_ATOL
    for part in ["unet"] + (["text_encoder"] + (["text_encoder_2"] if family == "sdxl" else []) if text_encoder else []):
        moved = max(float((a[k] - base[k]).abs().max()) for k in a if k.startswith(part + "."))
        print(f"{family} {part}: the fused LoRA moved the base's weights by up to {moved:.3g}")
        assert moved >= 100 * FUSED_ATOL, f"{part}: the fused LoRA moved the base only {moved:.3g}"


def mixed_shapes(sample_images, folder):
    """The sample images as photos of mixed aspect ratios (2:1, square, 1:2, ...): three buckets at 64 px
    with --bucket-step 16."""
    from PIL import Image

    folder.mkdir()
    shapes = [(96, 48), (64, 64), (40, 80), (90, 50), (64, 60), (50, 100)]
    for i, (src, size) in enumerate(zip(sorted(sample_images.glob("*.png")), shapes, strict=True)):
        Image.open(src).resize(size).save(folder / f"toy_0{i}.png")
    return folder


BUCKETS = ("--resolution", "64", "--bucket-step", "16")


@pytest.mark.parametrize("family", ["sd", "sdxl"])  # SD2 differs from SD1 in its target: test_lora.py
def test_lora_on_three_ranks_matches_one_process_and_loads_in_both_layouts(local_cluster, families, sample_images,
                                                                          tmp_path, family):
    """SD1.x's photos are of mixed shapes: every step's global batch comes from one aspect-ratio bucket."""
    model = families[family]
    extra = ("--train-text-encoder",) if family != "sd2" else ()
    data = mixed_shapes(sample_images, tmp_path / "mixed") if family == "sd" else sample_images
    extra += BUCKETS if family == "sd" else ()
    dist = cli("launch", "-n", "3", "--name", local_cluster.name, "--",
               *run_lora_args(model, data, tmp_path / "dist", 1, 3, "--scale-lr", *extra), env=OFFLINE)
    assert dist.returncode == 0, dist.stdout[-3000:] + dist.stderr[-3000:]
    if family == "sd":
        assert "aspect-ratio buckets (width x height: images): 64x64: 2, 48x80: 2, 80x48: 2" in dist.stdout + dist.stderr
    train_in_process(run_lora_args(model, data, tmp_path / "one", 3, 3, "--scale-lr", *extra))
    got, want = load_file(tmp_path / "dist" / DIFFUSERS_FILE), load_file(tmp_path / "one" / DIFFUSERS_FILE)
    assert got.keys() == want.keys()
    diff = max(float((got[k] - want[k]).abs().max()) for k in want)
    # the up weights start at 0: what they hold is how far the adapters moved, in each trained part (two
    # runs that learned nothing agree too), 100x the tolerance at least
    parts = ("unet", "text_encoder", "text_encoder_2") if "--train-text-encoder" in extra else ("unet",)
    moved = {part: max((float(v.abs().max()) for k, v in want.items() if k.startswith(part + ".")
                        and k.endswith("up.weight")), default=0.0)  # lora.up / lora_linear_layer.up
             for part in parts if any(k.startswith(part + ".") for k in want)}
    print(f"{family}: 3 ranks vs 1 process max abs diff {diff:.3g}; up weights moved "
          + ", ".join(f"{k} {v:.3g}" for k, v in moved.items()))
    assert diff <= 1e-5
    assert moved.keys() >= {"unet"} and min(moved.values()) >= 100 * 1e-5, moved
    adapters = sum(t.numel() * t.element_size() for t in want.values())
    lines = [json.loads(line) for line in (tmp_path / "dist" / "metrics.jsonl").read_text().splitlines()]
    # the adapters' gradients and the loss; SDXL reads the first encoder's penultimate layer, so its last
    # layer's adapters get no gradient and are not sent
    sent = [r["allreduce_bytes"] - 4 for r in lines]
    assert all(0.9 * adapters < n <= adapters if family == "sdxl" and extra else n == adapters for n in sent), \
        (adapters, sent)
    assert_loads_in_both_layouts(model, family, tmp_path / "dist", text_encoder=bool(extra))


# SD1.x runs on three nodes in test_run_on_three_nodes_trains_dreambooth_... below (run differs from launch
# in no family's way; SD2's LoRA differs from SD1's in its target alone, which test_lora.py checks)
@pytest.mark.parametrize("family", ["sdxl"])
def test_run_on_three_nodes_trains_a_lora_and_fetches_both_files(root_home, cluster_name, families,
                                                                 sample_images, tmp_path, family):
    out = tmp_path / "out"
    proc = cli("run", "--provider", "local", "-n", "3", "--name", cluster_name, "--",
               *run_lora_args(families[family], sample_images, out, 1, 2, "--checkpointing-steps", "2"),
               env=OFFLINE)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert (out / DIFFUSERS_FILE).is_file() and (out / KOHYA_FILE).is_file() and (out / "checkpoint-2").is_dir()
    assert_loads_in_both_layouts(families[family], family, out, text_encoder=False)
    assert_nothing_left(cluster_name)


def test_run_on_three_nodes_trains_sd3_and_flux_as_one_process_does(root_home, cluster_name, sd3_model, flux_model,
                                                                   sample_images, tmp_path):
    """The flow-matching families through `run --provider local -n 3`: an SD3 LoRA and a Flux full fine-tune,
    3 ranks of batch 1, each what one process of batch 3 trains (fp32), after moving 100x the tolerance."""
    from diffusers import FluxTransformer2DModel

    from tests.trainlib import full_args

    sd3 = run_lora_args(sd3_model, sample_images, tmp_path / "sd3", 1, 3)
    flux = full_args(flux_model, sample_images, tmp_path / "flux", 1, 2, "--no-random-flip")
    for name, args in (("sd3", sd3), ("flux", flux)):
        proc = cli("run", "--provider", "local", "-n", "3", "--name", cluster_name, "--", *args, env=OFFLINE)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        assert json.loads((tmp_path / name / "train_config.json").read_text())["world_size"] == 3
        assert_nothing_left(cluster_name)  # run deletes its cluster: the name is free for the next
    train_in_process(run_lora_args(sd3_model, sample_images, tmp_path / "sd3-one", 3, 3))
    got, want = load_file(tmp_path / "sd3" / DIFFUSERS_FILE), load_file(tmp_path / "sd3-one" / DIFFUSERS_FILE)
    assert got.keys() == want.keys() and all(k.startswith("transformer.") for k in want)
    assert max(float((got[k] - want[k]).abs().max()) for k in want) <= 1e-5
    assert max(float(v.abs().max()) for k, v in want.items() if ".lora_B." in k) >= 100 * 1e-5
    train_in_process(full_args(flux_model, sample_images, tmp_path / "flux-one", 3, 2, "--no-random-flip"))

    def transformer(folder):
        return FluxTransformer2DModel.from_pretrained(str(folder), subfolder="transformer").state_dict()

    base, got, want = (transformer(f) for f in (flux_model, tmp_path / "flux" / "pipeline", tmp_path / "flux-one" / "pipeline"))
    scale = max(float(v.abs().max()) for v in want.values())
    assert max(float((want[k] - base[k]).abs().max()) for k in want) >= 100 * 1e-5 * scale
    assert max(float((got[k] - want[k]).abs().max()) for k in want) <= 1e-5 * scale


def test_run_on_slurm_trains_a_lora_on_three_ranks(slurm, xeontune_home, monkeypatch, families, sample_images,
                                                   tmp_path, capsys):
    from xeontune.cli import main

    monkeypatch.setenv("SLURM_CONF", slurm.env["SLURM_CONF"])
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "out"
    rc = main(["run", "--provider", "slurm", "-n", "3", "--name", "sl-lora", "--time", "10:00", "--",
               *run_lora_args(families["sd"], sample_images, out, 1, 2)])
    text = capsys.readouterr()
    assert rc == 0, text.out[-3000:] + text.err[-3000:] + slurm.log()
    assert json.loads((out / "train_config.json").read_text())["world_size"] == 3
    assert_loads_in_both_layouts(families["sd"], "sd", out, text_encoder=False)
    assert slurm.jobs() == []


def test_run_on_three_nodes_trains_dreambooth_with_captions_a_pivotal_token_and_prior_preservation(
        root_home, cluster_name, families, sample_images, tmp_path):
    """Issue 30's user: photos of mixed aspect ratios (buckets), some captioned, the rest under
    --instance-prompt, a new token trained with the LoRA, class images generated by the 3 ranks (the same
    set as one process draws), both files in diffusers."""
    import numpy as np
    from diffusers import StableDiffusionPipeline
    from PIL import Image

    from xeontune.cli import main

    data = mixed_shapes(sample_images, tmp_path / "data")
    for i in (0, 2, 4):
        (data / f"toy_0{i}.png").with_suffix(".txt").write_text(f"<sks> toy number {i} on a table")
    dreambooth = ["--placeholder-token", "<sks>", "--initializer-token", "toy", "--instance-prompt",
                  "a photo of <sks> toy", "--with-prior-preservation", "--class-prompt", "a photo of a toy",
                  "--num-class-images", "3", "--class-inference-steps", "2", *BUCKETS]
    out = tmp_path / "out"
    args = run_lora_args(families["sd"], data, out, 1, 2, *dreambooth, "--class-data-dir",
                         str(tmp_path / "class3"))
    proc = cli("run", "--provider", "local", "-n", "3", "--name", cluster_name, "--", *args, env=OFFLINE)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert {DIFFUSERS_FILE, KOHYA_FILE, "learned_embeds.safetensors"} <= {p.name for p in out.iterdir()}
    assert json.loads((out / "train_config.json").read_text())["world_size"] == 3
    assert_loads_in_both_layouts(families["sd"], "sd", out, text_encoder=False)
    assert_nothing_left(cluster_name)

    alone = run_lora_args(families["sd"], data, tmp_path / "one", 1, 1, *dreambooth, "--class-data-dir",
                          str(tmp_path / "class1"))
    assert main(["train", *alone]) == 0
    names = sorted(p.name for p in (tmp_path / "class3").iterdir())
    assert names == sorted(p.name for p in (tmp_path / "class1").iterdir()) and len(names) == 3
    for name in names:  # each image from its own seed, whichever rank drew it (8-bit pixels; threads may differ)
        a, b = (np.asarray(Image.open(tmp_path / d / name), dtype=np.int16) for d in ("class1", "class3"))
        assert int(np.abs(a - b).max()) <= 1, name

    pipe = StableDiffusionPipeline.from_pretrained(str(families["sd"]), safety_checker=None)
    toy = pipe.text_encoder.get_input_embeddings().weight[pipe.tokenizer.convert_tokens_to_ids("toy")].clone()
    pipe.load_lora_weights(str(out), weight_name=DIFFUSERS_FILE)
    pipe.load_textual_inversion(str(out / "learned_embeds.safetensors"))
    row = pipe.text_encoder.get_input_embeddings().weight[pipe.tokenizer.convert_tokens_to_ids("<sks>")]
    assert float((row - toy).abs().max()) > 1e-4  # the token trained
    assert pipe("a photo of <sks> toy", num_inference_steps=1, height=64, width=64).images[0].size == (64, 64)
    assert "aspect-ratio buckets (width x height: images): 64x64: 2, 48x80: 2, 80x48: 2" in proc.stdout + proc.stderr
