"""`--method lora` end to end on the three tiny families (SD1.x, SD2, SDXL): what it writes loads into
diffusers in both layouts, it learns, it resumes exactly, ranks and packing and the text-encoder cache
change nothing, bf16 keeps the adapters in fp32, and its mistakes are one-line errors.

Tests that compare runs for equality pin `--mixed-precision fp32` (see test_trainer.py)."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import subprocess
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors import safe_open
from safetensors.torch import load_file

from tests.held_out import held_out_loss
from tests.one_line import one_line_error as one_line
from xeontune.train import loop, validation
from xeontune.train import packed as packed_layers
from xeontune.train.options import parse_args

pytestmark = pytest.mark.slow

DIFFUSERS_FILE = "pytorch_lora_weights.safetensors"
KOHYA_FILE = "pytorch_lora_weights_kohya.safetensors"
PROMPT = "a photo of sks toy"


@pytest.fixture
def model_of(request):
    """family -> the tiny model's path ("sd1": SD1.x, "sd2": v-prediction, "sdxl": two encoders)."""
    names = {"sd1": "tiny_model", "sd2": "sd2_model", "sdxl": "sdxl_model"}
    return lambda family: request.getfixturevalue(names[family])


@pytest.fixture
def lora_args(tiny_model, sample_images, tmp_path):
    """Flags of a short fp32 LoRA run of ``model`` (the tiny SD1.x one by default) into tmp_path/``out``."""

    def args(out: str = "out", model: Path = tiny_model) -> list[str]:
        return ["--method", "lora", "--instance-prompt", PROMPT, "--model", str(model), "--data-dir",
                str(sample_images), "--resolution", "64", "--max-train-steps", "3", "--checkpointing-steps", "0",
                "--save-steps", "0", "--mixed-precision", "fp32", "--learning-rate", "1e-3",
                "--output-dir", str(tmp_path / out)]

    return args


# Adam steps each element by about lr * g / (|g| + eps): an element whose gradient is a sum that cancels to
# about eps (of ~30k adapter elements, a few are) steps by up to lr on fp32 rounding alone, so runs that
# only sum in another order (packed kernels, two ranks) differed by 3e-5 at lr 1e-3 in one element of 256.
# A larger eps bounds what rounding can do (lr * rounding / eps) and hardly changes what trains: the
# adapters' gradients are mostly far above it.
SUMMATION_ORDER_SAFE = ["--adam-epsilon", "1e-5"]


def train(args, on_step=None):
    return loop.train(parse_args(args), on_step=on_step)


@pytest.fixture
def runs(monkeypatch):
    """The Run of every loop.train in the test, in order (the models as they trained, adapters and all)."""
    made = []
    setup = loop.setup

    def spy(*args, **kwargs):
        run, state = setup(*args, **kwargs)
        made.append(run)
        return run, state

    monkeypatch.setattr(loop, "setup", spy)
    return made


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


def state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def deltas(learned: dict[str, torch.Tensor], model: str, scale: float) -> dict[str, torch.Tensor]:
    """What the adapters of ``model`` add to its Linear weights (``scale`` * B @ A), by the weight's name."""
    out = {}
    for name, down in learned.items():
        if name.startswith(model + ".") and ".lora_A." in name:
            up = learned[name.replace(".lora_A.", ".lora_B.")]
            out[name.removeprefix(model + ".").replace(".lora_A.default.weight", ".weight")] = scale * up @ down
    return out


def fused(pipeline_cls, model: Path, out: Path, weight_name: str, parts: list[str]) -> dict[str, dict]:
    """The state dicts of ``parts`` of ``model`` with the file loaded, fused and unloaded by diffusers."""
    pipe = pipeline_cls.from_pretrained(str(model))
    pipe.load_lora_weights(str(out), weight_name=weight_name)
    pipe.fuse_lora()
    pipe.unload_lora_weights()
    return {part: state(getattr(pipe, part)) for part in parts}


def adapters_enabled(module: torch.nn.Module, enabled: bool) -> None:
    from peft.tuners.tuners_utils import BaseTunerLayer

    layers = [m for m in module.modules() if isinstance(m, BaseTunerLayer)]
    assert layers
    for layer in layers:
        layer.enable_adapters(enabled)


def trainable(run) -> dict[str, torch.nn.Parameter]:
    return dict(run.method.named_parameters())


# --- files, diffusers, kohya, the full pipeline --------------------------------------------------

FAMILY_RUNS = {  # family: (extra flags, alpha the files must carry, text encoders trained)
    "sd1": (["--train-text-encoder", "--rank", "4", "--lora-alpha", "8"], 8.0, ["text_encoder"]),
    "sd2": (["--rank", "2"], 2.0, []),  # alpha: the rank by default
    "sdxl": (["--train-text-encoder", "--rank", "4", "--lora-alpha", "8"], 8.0, ["text_encoder", "text_encoder_2"]),
}


@pytest.mark.parametrize("family", sorted(FAMILY_RUNS))
def test_both_files_load_into_diffusers_and_the_full_pipeline_holds_them(family, model_of, lora_args, tmp_path):
    """Both layouts, fused by diffusers, give the same UNet (and text encoders), which are the base's
    plus alpha/rank x B @ A of the adapters the run learned; --save-as-full-pipeline saved just that."""
    from diffusers import StableDiffusionPipeline, StableDiffusionXLPipeline

    extra, alpha, encoders = FAMILY_RUNS[family]
    model, out = model_of(family), tmp_path / "out"
    rank = int(extra[extra.index("--rank") + 1])
    result = train(lora_args(model=model) + extra + ["--max-train-steps", "2", "--save-steps", "1",
                                                     "--save-as-full-pipeline"])
    assert result.result_path == out / DIFFUSERS_FILE
    assert sorted(p.name for p in out.glob("*.safetensors")) == sorted(
        f"{stem}{step}.safetensors" for stem in ("pytorch_lora_weights", "pytorch_lora_weights_kohya")
        for step in ("", "-steps-1", "-steps-2"))
    for stem in ("pytorch_lora_weights", "pytorch_lora_weights_kohya"):  # the step copies hold their step's weights
        final, *copies = (load_file(str(out / f"{stem}{step}.safetensors")) for step in ("", "-steps-2", "-steps-1"))
        assert max_diff(final, copies[0]) == 0 and max_diff(final, copies[1]) > 0, stem
    assert {m.split(".", 1)[0] for m in result.learned} == {"unet", *encoders}

    kohya = load_file(str(out / KOHYA_FILE))
    prefixes = {"sd1": ("lora_unet_", "lora_te_"), "sd2": ("lora_unet_",),
                "sdxl": ("lora_unet_", "lora_te1_", "lora_te2_")}[family]
    assert all(k.startswith(prefixes) for k in kohya), sorted(kohya)[:5]
    assert all(any(k.startswith(p) for k in kohya) for p in prefixes)
    modules = {k.rsplit(".", 2)[0] for k in kohya if k.endswith(".lora_down.weight")}
    assert modules == {k.removesuffix(".alpha") for k in kohya if k.endswith(".alpha")}
    assert len(modules) == sum(".lora_A." in name for name in result.learned)
    assert all(float(kohya[f"{m}.alpha"]) == alpha for m in modules)
    from safetensors import safe_open

    with safe_open(str(out / KOHYA_FILE), "pt") as f:  # A1111 tells SD1 from SD2 LoRAs by it
        meta = f.metadata()
    assert (meta["ss_base_model_version"], meta["ss_v2"]) == {
        "sd1": ("sd_v1", "False"), "sd2": ("sd_v2_v", "True"), "sdxl": ("sdxl_base_v1-0", "False")}[family]

    pipeline_cls = StableDiffusionXLPipeline if family == "sdxl" else StableDiffusionPipeline
    base = pipeline_cls.from_pretrained(str(model))
    parts = ["unet", *encoders]
    bases = {part: state(getattr(base, part)) for part in parts}
    layouts = {name: fused(pipeline_cls, model, out, name, parts) for name in (DIFFUSERS_FILE, KOHYA_FILE)}
    for part in parts:
        a, b = (layouts[name][part] for name in (DIFFUSERS_FILE, KOHYA_FILE))
        assert max_diff(a, b) <= 1e-6, part
        want = deltas(result.learned, part, alpha / rank)
        moved = max(float(d.abs().max()) for d in want.values())
        assert moved > 1e-4, (part, moved)  # trained: far above fp32 rounding of the weights
        assert max_diff({k: a[k] - bases[part][k] for k in want}, want) <= 1e-6, part
        untouched = [k for k in a if k not in want]
        assert untouched and all(torch.equal(a[k], bases[part][k]) for k in untouched)

    full = pipeline_cls.from_pretrained(str(out / "pipeline"))
    for part in ["unet", "text_encoder", *(["text_encoder_2"] if family == "sdxl" else [])]:
        want = layouts[DIFFUSERS_FILE][part] if part in parts else state(getattr(base, part))
        assert max_diff(state(getattr(full, part)), want) <= 1e-6, part


# One target of each kind peft wraps in a UNet: attention's to_q, the transformers' proj_in/proj_out (1x1
# Conv2d in SD1.x, Linear in SDXL), ff's two Linear layers, a resnet's 3x3 conv1 and its time projection,
# and conv_in. convert_state_dict_to_diffusers renamed only to_q's adapters, so load_lora_weights (and the
# saved pipeline's merge) loaded one kind or the other, with a RuntimeWarning naming what had no weights.
EVERY_KIND = "to_q,proj_in,proj_out,ff.net.0.proj,ff.net.2,conv1,time_emb_proj,conv_in"
MERGE_TOLERANCE = 1e-6  # fp32: what merging the same adapters in another order can differ by


def merged_in_memory(model: torch.nn.Module, base: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Each wrapped layer's weight, by its name in ``base`` (the model before training), with the adapter
    the run holds in memory merged into it by peft's own arithmetic (alpha/rank x B @ A, or for a conv the
    composition of its two convs), not from any file."""
    from peft.tuners.lora import LoraLayer

    return {f"{name}.weight": base[f"{name}.weight"] + layer.get_delta_weight("default").detach().float()
            for name, layer in model.named_modules() if isinstance(layer, LoraLayer)}


@contextlib.contextmanager
def loading_warnings() -> Iterator[list[str]]:
    """What diffusers logs at WARNING or above (its own logger does not propagate) and what Python warns
    (peft's RuntimeWarning lists the targets a state dict had no weights for)."""
    import logging

    said: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            said.append(record.getMessage())

    handler, logger = Collect(logging.WARNING), logging.getLogger("diffusers")
    logger.addHandler(handler)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            yield said
    finally:
        logger.removeHandler(handler)
    said.extend(str(w.message) for w in caught)


@pytest.mark.parametrize("family", ["sd1", "sdxl"])
def test_every_kind_of_unet_target_loads_whole_from_the_diffusers_file(family, model_of, lora_args, runs, tmp_path):
    """The diffusers file, loaded by load_lora_weights and fused, and --save-as-full-pipeline's UNet are
    the base with every adapter the run trained merged: attention's, proj_in/out's, ff's, the convs' and
    time_emb_proj's alike; loading warns of nothing."""
    from diffusers import StableDiffusionPipeline, StableDiffusionXLPipeline
    from peft.tuners.lora import LoraLayer
    from torch import nn

    model, out = model_of(family), tmp_path / "out"
    train(lora_args(model=model) + ["--lora-targets", EVERY_KIND, "--rank", "4", "--lora-alpha", "8",
                                    "--train-text-encoder", "--save-as-full-pipeline"])
    models = runs[0].method.models
    pipeline_cls = StableDiffusionXLPipeline if family == "sdxl" else StableDiffusionPipeline
    base = pipeline_cls.from_pretrained(str(model))
    parts = list(models)  # the UNet and the text encoders: trained, so diffusers has no encoder to warn of
    bases = {part: state(getattr(base, part)) for part in parts}
    want = {part: merged_in_memory(models[part], bases[part]) for part in parts}

    wrapped = {name.removesuffix(".weight") for name in want["unet"]}
    assert all(any(name == t or name.endswith("." + t) for name in wrapped) for t in EVERY_KIND.split(","))
    assert {type(base.unet.get_submodule(name)) for name in wrapped} == {nn.Conv2d, nn.Linear}
    for name, weight in want["unet"].items():  # every adapter of the UNet trained, far above the tolerance
        moved = float((weight - bases["unet"][name]).abs().max())
        assert moved >= 100 * MERGE_TOLERANCE, (name, moved)

    pipe = pipeline_cls.from_pretrained(str(model))
    with loading_warnings() as said:
        pipe.load_lora_weights(str(out), weight_name=DIFFUSERS_FILE)
        loaded = {name for name, m in pipe.unet.named_modules() if isinstance(m, LoraLayer)}
        pipe.fuse_lora(components=parts)
        pipe.unload_lora_weights()
    assert not said, said
    assert loaded == wrapped, sorted(wrapped ^ loaded)[:8]
    full = pipeline_cls.from_pretrained(str(out / "pipeline"))
    for what, got in (("load_lora_weights", pipe), ("--save-as-full-pipeline", full)):
        for part in parts:
            weights = state(getattr(got, part))
            assert max_diff({k: weights[k] for k in want[part]}, want[part]) <= MERGE_TOLERANCE, (what, part)
            untouched = [k for k in weights if k not in want[part]]
            assert untouched and all(torch.equal(weights[k], bases[part][k]) for k in untouched), (what, part)


# --- equal results by other routes ----------------------------------------------------------------


# fp32, one step from the same adapters on the same inputs through the same (stock) layers: measured equal
# bit for bit. The packed layers `--pack-weights auto` picks on most CPUs sum in another order; their
# adapters match the stock layers' within 1e-5 (the packed test below, at SUMMATION_ORDER_SAFE's epsilon;
# at Adam's default 1e-8 one step here differed by 4.2e-5 packed, in elements whose gradient is ~eps).
STOCK_TOLERANCE = 1e-6


def test_one_step_equals_stock_diffusers_and_peft(tiny_model, lora_args, runs, monkeypatch):
    """One step of `--method lora` (fp32, rank 4, the default targets) moves the adapters where one step
    of stock diffusers + peft does, written as diffusers' train_dreambooth_lora.py writes it: add_adapter
    with peft's LoraConfig, the UNet's prediction on the same noisy latents, timesteps and text states,
    F.mse_loss against the same target, backward, torch's AdamW over the adapters. Both start from
    xeontune's initial adapters, so only the step itself is compared; xeontune runs the stock layers
    (`--pack-weights off`) that diffusers runs."""
    from diffusers import UNet2DConditionModel
    from peft import LoraConfig

    seen: dict[str, object] = {}
    setup = loop.setup  # `runs` spies on it already; this wrap sees each Run before its first step

    def capture_setup(*args, **kwargs):
        run, state = setup(*args, **kwargs)
        seen["initial"] = run.method.adapters()

        def unet_inputs(module, args, kwargs):
            seen.setdefault("unet", ([a.detach().clone() for a in args],
                                     {k: v.detach().clone() if torch.is_tensor(v) else v for k, v in kwargs.items()}))

        def gradients(optimizer, args, kwargs):
            seen.setdefault("grads", {name: p.grad.detach().clone() for name, p in run.method.named_parameters()})

        run.components.denoiser.register_forward_pre_hook(unet_inputs, with_kwargs=True)
        run.optimizer.register_step_pre_hook(gradients)
        return run, state

    sample_loss = loop.sample_loss

    def capture_loss(pred, target, *args, **kwargs):
        loss = sample_loss(pred, target, *args, **kwargs)
        seen.setdefault("target", target.detach().clone())
        seen.setdefault("loss", float(loss.detach()))
        return loss

    monkeypatch.setattr(loop, "setup", capture_setup)
    monkeypatch.setattr(loop, "sample_loss", capture_loss)
    result = train(lora_args() + ["--max-train-steps", "1", "--rank", "4", "--train-batch-size", "2",
                                  "--pack-weights", "off"])
    opts = runs[0].opts
    assert (opts.rank, opts.lora_alpha, runs[0].method.targets_of("unet"), opts.max_grad_norm) == (
        4, None, ["to_q", "to_k", "to_v", "to_out.0"], None)
    (noisy, timesteps, hidden), kwargs = seen["unet"]
    assert kwargs.get("added_cond_kwargs") is None and len(noisy) == 2

    unet = UNet2DConditionModel.from_pretrained(str(tiny_model), subfolder="unet")
    unet.requires_grad_(False)
    unet.add_adapter(LoraConfig(r=4, lora_alpha=4, init_lora_weights="gaussian",
                                target_modules=["to_k", "to_q", "to_v", "to_out.0"]))
    adapters = {f"unet.{name}": p for name, p in unet.named_parameters() if p.requires_grad}
    assert adapters.keys() == seen["initial"].keys()
    with torch.no_grad():
        for name, p in adapters.items():
            p.copy_(seen["initial"][name])
    optimizer = torch.optim.AdamW(list(adapters.values()), lr=opts.learning_rate,
                                  betas=(opts.adam_beta1, opts.adam_beta2), weight_decay=opts.adam_weight_decay,
                                  eps=opts.adam_epsilon)
    pred = unet(noisy, timesteps, hidden, return_dict=False)[0]
    loss = torch.nn.functional.mse_loss(pred.float(), seen["target"].float(), reduction="mean")
    loss.backward()
    stock_loss = float(loss.detach())
    stock_grads = {name: p.grad.detach().clone() for name, p in adapters.items()}
    optimizer.step()

    # Adam's first step moves each element by about lr * sign(gradient), whatever the gradient's scale:
    # the gradients are compared too, so a loss or alpha/rank scaled differently shows
    largest = max(float(g.abs().max()) for g in stock_grads.values())
    grad_diff = max_diff(seen["grads"], stock_grads)
    stock = {name: p.detach() for name, p in adapters.items()}
    diff = max_diff(result.learned, stock)
    up_moved = min(float(v.abs().max()) for k, v in stock.items() if ".lora_B." in k)  # each B starts at zero
    print(f"one step: loss {stock_loss:.6f} (xeontune {seen['loss']:.6f}); gradients max abs diff {grad_diff:.3g} "
          f"(largest {largest:.3g}); adapters max abs diff {diff:.3g}, every lora_B moved by at least {up_moved:.3g}")
    assert all(float(v.abs().max()) == 0 for k, v in seen["initial"].items() if ".lora_B." in k)
    assert abs(stock_loss - seen["loss"]) <= STOCK_TOLERANCE * stock_loss
    assert largest > 0 and grad_diff <= STOCK_TOLERANCE * largest
    assert up_moved >= 100 * STOCK_TOLERANCE
    assert diff <= STOCK_TOLERANCE


@pytest.mark.parametrize("family", ["sd1", "sd2", "sdxl"])
def test_lora_over_the_packed_base_learns_what_the_stock_layers_learn(family, model_of, lora_args, runs):
    ok, why = packed_layers.available(torch.float32)
    assert ok, f"oneDNN runs packed fp32 layers on every x86 CPU (test_packed.py asserts it too): {why}"
    from peft.tuners.lora import LoraLayer

    args = lora_args(model=model_of(family)) + SUMMATION_ORDER_SAFE
    results = {pack: train(args + ["--pack-weights", pack, "--overwrite"]) for pack in ("off", "on")}
    for run, pack in zip(runs, ("off", "on"), strict=True):
        bases = {type(m.base_layer).__name__ for m in run.components.denoiser.modules() if isinstance(m, LoraLayer)}
        assert bases == ({"PackedLinear"} if pack == "on" else {"Linear"}), (pack, bases)
    stock, packed = results["off"].learned, results["on"].learned
    assert max(float(v.abs().max()) for k, v in stock.items() if ".lora_B." in k) > 1e-4  # B starts at zero
    diff = max_diff(stock, packed)
    print(f"{family}: packed vs stock adapters max abs diff {diff:.3g}")
    assert diff <= 1e-5


def test_two_ranks_match_one_process_with_twice_the_batch(lora_args, tmp_path):
    """2 ranks x batch 1 = 1 process x batch 2; the ranks all-reduce the adapters' gradients only."""
    common = lora_args() + ["--train-text-encoder", "--scale-lr", "--no-random-flip", *SUMMATION_ORDER_SAFE]
    proc = subprocess.run([sys.executable, "-m", "xeontune.cli", "train", *common, "--output-dir",
                           str(tmp_path / "ranks"), "--nproc-per-node", "2", "--train-batch-size", "1"],
                          capture_output=True, text=True, timeout=600, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    one = train(common + ["--output-dir", str(tmp_path / "one"), "--train-batch-size", "2"])
    got, want = (load_file(str(tmp_path / d / DIFFUSERS_FILE)) for d in ("ranks", "one"))
    assert max(float(v.abs().max()) for k, v in want.items() if ".lora_B." in k or "lora.up" in k) > 1e-4
    diff = max_diff(got, want)
    print(f"2 ranks vs 1 process: max abs diff {diff:.3g}")
    assert diff <= 1e-5
    adapter_bytes = sum(v.numel() * 4 for v in one.learned.values())
    sent = [json.loads(line)["allreduce_bytes"] for line in (tmp_path / "ranks" / "metrics.jsonl").read_text().splitlines()]
    assert sent == [adapter_bytes + 4] * 3
    unet_bytes = sum(f.stat().st_size for f in (Path(common[common.index("--model") + 1]) / "unet").glob("*.safetensors"))
    assert adapter_bytes < unet_bytes / 10


@pytest.mark.parametrize("family", ["sd1", "sdxl"])  # SDXL caches both encoders' states and the pooled output
def test_the_text_cache_changes_nothing_and_frees_the_encoders(family, model_of, lora_args, runs):
    args = lora_args(model=model_of(family))
    cached = train(args)
    uncached = loop.train(dataclasses.replace(parse_args(args + ["--output-dir", args[-1] + "-uncached"]),
                                              cache_text=False))
    assert max(float(v.abs().max()) for k, v in cached.learned.items() if ".lora_B." in k) > 1e-4
    assert max_diff(cached.learned, uncached.learned) <= 1e-6
    # no validation, no pipeline: the cache frees every encoder
    assert runs[0].text_cache is not None and not any(runs[0].components.text_encoders)
    assert runs[1].text_cache is None and all(runs[1].components.text_encoders)
    assert len(runs[1].components.text_encoders) == (2 if family == "sdxl" else 1)


# --- resume -----------------------------------------------------------------------------------------


def resume_matches(common: list[str], tmp_path: Path) -> Path:
    """A resume from step 3 of a 6-step run ends where the straight run ended; the checkpoint's path."""
    straight = train(common + ["--output-dir", str(tmp_path / "a")])
    checkpoint = tmp_path / "a" / "checkpoint-3"
    resumed = train(common + ["--output-dir", str(tmp_path / "b"), "--resume-from-checkpoint", str(checkpoint)])
    at_three = torch.load(checkpoint / "state.pt", weights_only=True)["learned"]["tensors"]
    assert max_diff(straight.learned, at_three) > 1e-4  # steps 4-6 moved the adapters
    diff = max_diff(straight.learned, resumed.learned)
    print(f"resume: max abs diff {diff:.3g}")
    assert diff <= 1e-6
    assert [json.loads(line)["step"] for line in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()] == [4, 5, 6]
    return checkpoint


@pytest.mark.parametrize("family", ["sd2", "sdxl"])
def test_resume_matches_a_straight_run_in_the_other_families(family, model_of, lora_args, tmp_path):
    resume_matches(lora_args(model=model_of(family)) + ["--train-text-encoder", "--max-train-steps", "6",
                                                        "--checkpointing-steps", "3", "--lr-scheduler", "cosine"],
                   tmp_path)


def test_resume_matches_a_straight_run_and_refuses_other_checkpoints(lora_args, base_args, tmp_path, capsys,
                                                                      monkeypatch):
    common = lora_args() + ["--train-text-encoder", "--max-train-steps", "6", "--checkpointing-steps", "3",
                            "--lr-scheduler", "cosine", "--lora-dropout", "0.25"]
    checkpoint = resume_matches(common, tmp_path)
    # dropout's masks come from --seed: the same command again trains the same adapters
    train(common + ["--output-dir", str(tmp_path / "again")])
    first, rerun = (load_file(str(tmp_path / d / DIFFUSERS_FILE)) for d in ("a", "again"))
    assert max_diff(first, rerun) <= 1e-6

    # other adapters (a rank of 8): one line, exit 2, from the command line as a user runs it
    proc = subprocess.run([sys.executable, "-m", "xeontune.cli", "train", *common, "--rank", "8", "--output-dir",
                           str(tmp_path / "c"), "--resume-from-checkpoint", str(checkpoint)],
                          capture_output=True, text=True, timeout=600, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and "other adapters" in errors[0] and "rank 4" in errors[0], proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr

    # a textual inversion's checkpoint
    train(base_args + ["--max-train-steps", "1", "--checkpointing-steps", "1", "--output-dir", str(tmp_path / "ti")])

    # each found before a model loads (no load, no latent cache spent on a run that cannot resume)
    def no_load(*args, **kwargs):
        raise AssertionError("a model loaded")

    monkeypatch.setattr(loop, "load", no_load)
    no_encoders = [a for a in common if a != "--train-text-encoder"]
    for argv, said in (([*common, "--resume-from-checkpoint", str(tmp_path / "ti" / "checkpoint-1")],
                        "--method textual_inversion"),
                       ([*common, "--rank", "8", "--resume-from-checkpoint", str(checkpoint)], "rank 4"),
                       ([*no_encoders, "--resume-from-checkpoint", str(checkpoint)], "text encoders True"),
                       ([*common, "--placeholder-token", "<sks>", "--initializer-token", "toy", "--instance-prompt",
                         "a photo of <sks>", "--resume-from-checkpoint", str(checkpoint)], "pivotal token")):
        line = one_line_error(capsys, [*argv, "--output-dir", str(tmp_path / "d")])
        assert said in line, line
    assert not (tmp_path / "d").exists()
    monkeypatch.undo()
    # the same adapters named in another order resume, and end where the straight run did
    train(common + ["--lora-targets", "to_out.0,to_v,to_k,to_q", "--output-dir", str(tmp_path / "e"),
                    "--resume-from-checkpoint", str(checkpoint)])
    straight, reordered = (load_file(str(tmp_path / d / DIFFUSERS_FILE)) for d in ("a", "e"))
    assert max_diff(straight, reordered) <= 1e-6


# --- it learns --------------------------------------------------------------------------------------


# Measured, 20 steps x batch 2 at lr 5e-3 (fp32): the held-out loss fell by 0.0331 (sd1, 1.1120 -> 1.0789),
# 0.0164 (sd2, 0.5174 -> 0.5011) and 0.0153 (sdxl, 1.1519 -> 1.1366); moving each adapter tensor as far in
# a random direction changed it by at most 7.6e-4, 6.8e-4 and 4.3e-4 (either way): 24x to 43x less.
# Each bound is about half the drop measured; the drop must also be 5x chance's.
MIN_DROP = {"sd1": 0.015, "sd2": 0.008, "sdxl": 0.007}
CHANCE_FACTOR = 5


@pytest.fixture
def initial_adapters(runs, monkeypatch):
    """The adapters of every loop.train in the test as set up, before its first step, in order."""
    made = []
    setup = loop.setup

    def spy(*args, **kwargs):
        run, state = setup(*args, **kwargs)
        made.append(run.method.adapters())
        return run, state

    monkeypatch.setattr(loop, "setup", spy)
    return made


@pytest.mark.parametrize("family", ["sd1", "sd2", "sdxl"])
def test_it_really_learns(family, model_of, lora_args, runs, initial_adapters):
    """The adapters lower the denoising loss on held-out (image, noise, timestep) triples by MIN_DROP at
    least, and by more than CHANCE_FACTOR times what moving each adapter tensor as far (from its initial
    value) in a random direction changes it."""
    train(lora_args(model=model_of(family)) + ["--max-train-steps", "20", "--learning-rate", "5e-3",
                                               "--train-batch-size", "2"])
    run, initial = runs[0], initial_adapters[0]
    params = dict(run.method.named_parameters())
    learned = {name: p.detach().clone() for name, p in params.items()}

    def loss_with(adapters: dict[str, torch.Tensor]) -> float:
        with torch.no_grad():
            for name, p in params.items():
                p.copy_(adapters[name])
        return held_out_loss(run)

    before, after = loss_with(initial), loss_with(learned)
    generator = torch.Generator().manual_seed(0)
    chances = []
    for _ in range(3):
        moved = {}
        for name, start in initial.items():
            d = torch.randn(start.shape, generator=generator)
            moved[name] = start + d * (learned[name] - start).norm() / d.norm()
        chances.append(loss_with(moved) - before)
    chance = max(abs(c) for c in chances)
    drop = before - after
    print(f"{family}: held-out loss {before:.6f} -> {after:.6f} (lower by {drop:.3g}, {drop / before:.3%}); "
          f"random moves of that size: {', '.join(f'{c:+.3g}' for c in chances)}")
    assert drop >= MIN_DROP[family], f"the adapters lowered the held-out loss by {drop:.3g} ({before:.6f} -> " \
        f"{after:.6f}), less than {MIN_DROP[family]:g}"
    assert drop > CHANCE_FACTOR * chance, f"lowered by {drop:.3g}, and by chance up to {chance:.3g}"


# --- bf16, validation ---------------------------------------------------------------------------------


def test_bf16_trains_fp32_adapters_beside_the_bf16_unet(lora_args, tmp_path, runs):
    result = train(lora_args() + ["--mixed-precision", "bf16", "--train-text-encoder"])
    run = runs[0]
    params = trainable(run)
    assert {p.dtype for p in params.values()} == {torch.float32}
    assert {p.dtype for n, p in run.components.denoiser.named_parameters() if "lora_" not in n} == {torch.bfloat16}
    assert all(torch.isfinite(v).all() for v in result.learned.values())
    for model in ("unet", "text_encoder"):
        assert max(float(v.abs().max()) for k, v in result.learned.items()
                   if k.startswith(model + ".") and ".lora_B." in k) > 1e-4, model
    for name in (DIFFUSERS_FILE, KOHYA_FILE):
        with safe_open(str(tmp_path / "out" / name), "pt") as f:
            assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"F32"}, name  # noqa: SIM118 (not a dict)
    assert json.loads((tmp_path / "out" / "train_config.json").read_text())["precision"] == "bf16"


# Two steps at lr 5e-3 moved the validation image from the base UNet's by 3.05 levels of 255 on average
# (max 20; 62 % of the values by more than 1). At lr 1e-3 it was 0.62: within what a pixel's rounding
# could do, so the test trains at 5e-3. The bound is half the measured mean, above 1 level.
VALIDATION_MIN_DIFF = 1.5


def test_validation_images_are_made_with_the_adapters(lora_args, tmp_path, runs):
    """The saved image is what the run's models, adapters in, draw for the prompt and seed, and it is not the
    base UNet's: it differs from that by more on average than rounding a pixel could (1 level)."""
    args = lora_args() + ["--max-train-steps", "2", "--learning-rate", "5e-3", "--validation-prompt", PROMPT,
                          "--validation-steps", "1", "--num-validation-images", "1",
                          "--validation-inference-steps", "2"]
    train(args)
    folder = tmp_path / "out" / "validation"
    assert sorted(p.name for p in folder.glob("*.png")) == ["step-000001-0.png", "step-000002-0.png"]
    saved = np.asarray(Image.open(folder / "step-000002-0.png").convert("RGB"), dtype=np.int16)
    run = runs[0]

    def image() -> np.ndarray:
        made = validation.generate(run.components, run.method, PROMPT, num_images=1, steps=2, resolution=64,
                                   seed=run.opts.seed, autocast=run.autocast)
        return np.asarray(made[0].convert("RGB"), dtype=np.int16)

    assert np.array_equal(image(), saved)  # the same models, seed and prompt make the same image
    adapters_enabled(run.components.denoiser, False)
    base = image()
    diff = np.abs(base - saved)
    print(f"validation image vs the base UNet's: mean abs diff {diff.mean():.3f} of 255 (max {diff.max()}; "
          f"{(diff > 1).mean():.1%} of the values by more than 1)")
    assert diff.mean() >= VALIDATION_MIN_DIFF, diff.mean()


# --- mistakes ------------------------------------------------------------------------------------------


def one_line_error(capsys, args) -> str:
    return one_line(capsys, ["train", *args])


def test_bad_options_are_one_line_errors(lora_args, base_args, capsys, tmp_path):
    args = lora_args()
    at = args.index("--instance-prompt")
    assert "--instance-prompt" in one_line_error(capsys, args[:at] + args[at + 2:])
    assert "--placeholder-token" in one_line_error(capsys, args + ["--placeholder-token", "<x>"])
    assert "--instance-prompt" in one_line_error(capsys, base_args + ["--instance-prompt", "x"])
    assert "--rank" in one_line_error(capsys, args + ["--rank", "0"])
    assert "--instance-prompt must not be empty" in one_line_error(capsys, args[:at + 1] + [" "] + args[at + 2:])
    assert "--placeholder-token must not be empty" in one_line_error(
        capsys, args + ["--placeholder-token", "", "--initializer-token", "toy"])
    assert "--ipex" in one_line_error(capsys, args + ["--ipex", "on"])
    line = one_line_error(capsys, args + ["--lora-targets", "nonexistent_module"])
    assert "--lora-targets" in line and "nonexistent_module" in line
    line = one_line_error(capsys, args + ["--lora-targets", "to_q,to_kk,o_q"])  # a typo among good names
    assert "no module of the UNet is named to_kk, o_q " in line
    assert "to_out is a ModuleList" in one_line_error(capsys, args + ["--lora-targets", "to_q,to_out"])
    assert not (tmp_path / "out").exists()  # nothing written


def test_options_another_method_owns_are_one_line_errors(lora_args, base_args, capsys):
    for extra, flag in ((["--save-format", "a1111"], "--save-format"), (["--train-full-table"], "--train-full-table")):
        assert flag in one_line_error(capsys, lora_args() + extra)
    for extra, flag in ((["--rank", "8"], "--rank"), (["--train-text-encoder"], "--train-text-encoder"),
                        (["--lora-targets", "to_q"], "--lora-targets")):
        assert flag in one_line_error(capsys, base_args + extra)


def test_the_defaults_are_diffusers_examples(tiny_model, sample_images):
    """Rank 4, alpha = rank, the UNet's to_q/to_k/to_v/to_out.0 and the text encoder's q/k/v/out_proj, as
    diffusers' DreamBooth-LoRA examples (train_dreambooth_lora.py also names add_k_proj/add_v_proj, which
    SD's UNets lack); learning rate 1e-4, as the SDXL one (the issue's default for LoRA)."""
    from xeontune.train import methods
    from xeontune.train.components import load

    opts = parse_args(["--method", "lora", "--instance-prompt", PROMPT, "--model", str(tiny_model),
                       "--data-dir", str(sample_images), "--train-text-encoder"])
    assert (opts.rank, opts.learning_rate, opts.lora_dropout) == (4, 1e-4, 0.0)
    method = methods.create(opts)
    components = load(str(tiny_model))
    method.install(components)
    assert method.alpha == 4.0
    for model, targets in ((components.denoiser, {"to_q", "to_k", "to_v", "to_out.0"}),
                           (components.text_encoder, {"q_proj", "k_proj", "v_proj", "out_proj"})):
        wrapped = [name for name, m in model.named_modules() if hasattr(m, "lora_A")]
        matched = {t for t in targets for name in wrapped if name.endswith("." + t)}
        assert matched == targets and all(any(name.endswith("." + t) for t in targets) for name in wrapped)
        config = model.peft_config["default"]
        assert (config.r, config.lora_alpha, set(config.target_modules)) == (4, 4, targets)


def test_a_lora_rank_is_counted_without_the_text_encoders_it_frees(tiny_model, lora_args, base_args):
    """`--nproc-per-node auto`, `launch --ppn auto` and Slurm's `--ppn auto` divide memory by rank_memory:
    a LoRA whose frozen encoders' outputs are cached frees them, unless sample images or a saved
    pipeline need them, or they train."""
    from xeontune.train.ranks import _folder_bytes, rank_memory

    encoder = _folder_bytes(Path(tiny_model) / "text_encoder")
    ti, lora = parse_args(base_args), parse_args(lora_args())
    assert encoder > 0 and rank_memory(ti, "fp32") - rank_memory(lora, "fp32") == encoder
    for extra in (["--validation-prompt", "a photo of toy"], ["--save-as-full-pipeline"], ["--train-text-encoder"],
                  ["--placeholder-token", "<sks>", "--initializer-token", "toy"]):
        assert rank_memory(parse_args(lora_args() + extra), "fp32") == rank_memory(ti, "fp32"), extra


def test_the_single_node_test_takes_lora(sample_images, tiny_model, tmp_path):
    """`make single-node-test METHOD=lora`: trains, then both files fuse into the same UNet in diffusers."""
    script = Path(__file__).parents[2] / "scripts" / "single_node_test.py"
    proc = subprocess.run([sys.executable, str(script), "--method", "lora", "--model", str(tiny_model), "--data",
                           str(sample_images), "--steps", "2", "--resolution", "32", "--output-dir",
                           str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=600, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "the two layouts fuse to the same UNet" in proc.stdout
    assert (tmp_path / "out" / KOHYA_FILE).is_file()
