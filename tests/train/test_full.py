"""Full fine-tuning (--method full) on the tiny models: every UNet weight trains (and the text encoders'
with --train-text-encoder), in fp32 master weights under bf16 too; accumulation equals a larger batch;
a resume equals a straight run; the outputs load in diffusers and differ from the base model."""

from __future__ import annotations

import json
import sys

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
                                                              tmp_path, family, caplog):
    from diffusers import DiffusionPipeline

    model = {"sd": tiny_model, "sd2": sd2_model, "sdxl": sdxl_model}[family]
    with caplog.at_level("INFO", logger="xeontune.train"):
        result = loop.train(parse_args(full_args("out", model)))
    # packing reorders frozen weights: none is tried on a trained UNet
    assert "packed weights: not used (--method full trains the unet's weights)" in caplog.text
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
    # the single file is the folder: diffusers' from_single_file gives every part's weights back exactly
    single = type(saved).from_single_file(str(tmp_path / "out" / "model.safetensors"), config=str(model),
                                          local_files_only=True)
    for part in ("unet", "vae", "text_encoder", "text_encoder_2")[: 4 if family == "sdxl" else 3]:
        want, got = getattr(saved, part).state_dict(), getattr(single, part).state_dict()
        assert all(torch.equal(got[k], v) for k, v in want.items() if not k.endswith("position_ids")), part


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


def _layers() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Conv2d(4, 8, 3, padding=1), torch.nn.Conv2d(8, 8, 3, stride=2, padding=1,
                                                                                     groups=2, bias=False),
                               torch.nn.Flatten(2), torch.nn.Linear(4, 12), torch.nn.Linear(12, 6, bias=False))


def test_trained_layers_cast_again_in_the_backward_as_autocast_computes_and_keep_no_bf16_weights():
    """bf16_cast: a step of Conv2d and Linear layers (bias or none, stride, groups, 3-D input) under bf16 autocast
    gives the stock layers' output and gradients bit for bit, while autograd keeps no bf16 copy of a weight (the
    stock layers keep one per layer); outside autocast the stock forward runs (fp32 out)."""
    from xeontune.train import bf16_cast

    def step(model: torch.nn.Module) -> tuple[torch.Tensor, list[torch.Tensor], list[tuple]]:
        x = torch.randn(2, 4, 4, 4, generator=torch.Generator().manual_seed(1), requires_grad=True)
        kept: list[tuple] = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append((t.dtype, t.numel())) or t,
                                                      lambda t: t), torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(x)
        out.float().square().sum().backward()
        return out, [x.grad, *(p.grad for p in model.parameters())], kept

    stock, cast = _layers(), _layers()
    assert bf16_cast.install([cast]) == 4
    want_out, want_grads, stock_kept = step(stock)
    got_out, got_grads, cast_kept = step(cast)
    assert torch.equal(got_out, want_out) and got_out.dtype == torch.bfloat16
    for got, want in zip(got_grads, want_grads, strict=True):
        assert got.dtype == want.dtype and torch.equal(got, want)
    def bf16_elements(kept: list[tuple]) -> int:
        return sum(n for dtype, n in kept if dtype == torch.bfloat16)

    weights = sum(p.numel() for name, p in stock.named_parameters() if name.endswith("weight"))
    # the same bf16 inputs kept either way; the stock layers keep a bf16 copy of every weight besides
    assert bf16_elements(stock_kept) - bf16_elements(cast_kept) == weights
    assert cast(torch.randn(1, 4, 4, 4)).dtype == torch.float32  # no autocast: the stock forward


def test_a_bf16_full_run_casts_its_trained_layers_in_the_backward(full_args, tiny_model, caplog):
    """The loop installs bf16_cast on what --method full trains in bf16 (and says so); not in fp32."""
    for precision, said in (("bf16", True), ("fp32", False)):
        caplog.clear()
        with caplog.at_level("INFO", logger="xeontune.train"):
            loop.train(parse_args([*full_args("out", tiny_model), "--mixed-precision", precision,
                                   "--max-train-steps", "1", "--overwrite"]))
        assert ("trained weights: cast to bf16 in each layer's forward and again in its backward" in caplog.text) is said


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


def test_a_checkpoint_with_text_encoder_resumes_with_it_and_not_without(capsys, full_args, tiny_model):
    assert main(["train", *full_args("out", tiny_model, "--train-text-encoder", "--max-train-steps", "1",
                                     "--checkpointing-steps", "1")]) == 0
    capsys.readouterr()
    assert main(["train", *full_args("out", tiny_model, "--max-train-steps", "2", "--resume-from-checkpoint",
                                     "latest")]) == 2
    assert "trained with --train-text-encoder; this run must be too" in capsys.readouterr().err
    # and resumes with it (an SD1 pipeline has one text encoder: it was refused, as if it had two)
    assert main(["train", *full_args("out", tiny_model, "--train-text-encoder", "--max-train-steps", "2",
                                     "--resume-from-checkpoint", "latest")]) == 0, capsys.readouterr().err


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
    trained = ranks.frozen_weight_bytes(str(tiny_model), "bf16", trained=frozenset({"denoiser"}))
    # fp32 weights, gradients and AdamW's two moments (16 bytes a parameter) in place of a bf16 copy
    assert trained - frozen == stored_unet * 4 - stored_unet // 2
    # packing never applies to it
    assert ranks.frozen_weight_bytes(str(tiny_model), "bf16", packed=True, trained=frozenset({"denoiser"})) == trained


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


# --- the examples' training features ---------------------------------------------------------------


@pytest.mark.parametrize("which", ["tiny_model", "sd2_model"])
def test_the_min_snr_loss_equals_the_examples_formula(request, which):
    """train_text_to_image.py's lines, written out, against sample_loss with min_snr_weights."""
    from diffusers import DDPMScheduler
    from diffusers.training_utils import compute_snr

    from xeontune.train.data import Batch, min_snr_weights, sample_loss

    scheduler = DDPMScheduler.from_pretrained(str(request.getfixturevalue(which)), subfolder="scheduler")
    gen = torch.Generator().manual_seed(0)
    pred, target = torch.randn(4, 4, 8, 8, generator=gen), torch.randn(4, 4, 8, 8, generator=gen)
    timesteps = torch.tensor([1, 50, 500, 999])
    snr_gamma = 5.0
    # the example's computation
    snr = compute_snr(scheduler, timesteps)
    mse_loss_weights = torch.stack([snr, snr_gamma * torch.ones_like(timesteps)], dim=1).min(dim=1)[0]
    if scheduler.config.prediction_type == "epsilon":
        mse_loss_weights = mse_loss_weights / snr
    elif scheduler.config.prediction_type == "v_prediction":
        mse_loss_weights = mse_loss_weights / (snr + 1)
    loss = torch.nn.functional.mse_loss(pred.float(), target.float(), reduction="none")
    loss = loss.mean(dim=list(range(1, len(loss.shape)))) * mse_loss_weights
    want = loss.mean()

    batch = Batch(positions=[0, 1, 2, 3], image_index=torch.zeros(4), flip=torch.zeros(4), input_ids=None,
                  latent_eps=None, noise=None, timesteps=timesteps, prompt_index=None,
                  instance_count=None, bucket=0)
    got = sample_loss(pred, target, None, batch, 1.0, min_snr_weights(scheduler, timesteps, snr_gamma))
    assert torch.equal(got, want)
    assert abs(float(want) - float(torch.nn.functional.mse_loss(pred, target))) > 0.05  # the weights act


def test_ema_equals_diffusers_emamodel_on_the_same_updates(full_args, tiny_model, tmp_path):
    """The saved UNet is diffusers' EMAModel fed the weights after each optimizer step, from the base."""
    from diffusers import UNet2DConditionModel
    from diffusers.training_utils import EMAModel

    runs, after_each_step = [], []
    setup = loop.setup

    def spy(*a, **k):
        made = setup(*a, **k)
        runs.append(made[0])
        return made

    def snapshot(*_):
        # as parameters that train: EMAModel copies, not averages, what requires no grad
        after_each_step.append([torch.nn.Parameter(p.detach().clone()) for p in runs[0].method.models["unet"].parameters()])

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(loop, "setup", spy)
        result = loop.train(parse_args([*full_args("out", tiny_model, "--use-ema", "--ema-decay", "0.9",
                                                   "--learning-rate", "1e-3")]), on_step=snapshot)
    base = UNet2DConditionModel.from_pretrained(str(tiny_model), subfolder="unet")
    reference = EMAModel(base.parameters(), decay=0.9)
    for weights_now in after_each_step:
        reference.step(weights_now)
    reference.copy_to(base.parameters())
    saved = UNet2DConditionModel.from_pretrained(str(tmp_path / "out" / "pipeline"), subfolder="unet")
    names = [n for n, _ in saved.named_parameters()]
    got = {n: p.detach() for n, p in saved.named_parameters()}
    want = {n: p.detach() for n, p in base.named_parameters()}
    assert max(float((got[n] - want[n]).abs().max()) for n in names) <= 1e-6
    trained = weights(result, "unet")  # the raw weights go on: the EMA is not them
    assert max(float((got[n] - trained[n]).abs().max()) for n in names) > 1e-4


def test_a_resumed_run_with_adafactor_and_ema_equals_a_straight_one(full_args, tiny_model, tmp_path):
    from diffusers import UNet2DConditionModel

    extra = ("--optimizer", "adafactor", "--use-ema", "--ema-decay", "0.9", "--learning-rate", "1e-3")
    straight = loop.train(parse_args(full_args("straight", tiny_model, *extra, "--max-train-steps", "4")))
    assert main(["train", *full_args("resumed", tiny_model, *extra, "--max-train-steps", "2",
                                     "--checkpointing-steps", "2")]) == 0
    resumed = loop.train(parse_args([*full_args("resumed", tiny_model, *extra, "--max-train-steps", "4"),
                                     "--resume-from-checkpoint", "latest"]))
    a, b = weights(straight, "unet"), weights(resumed, "unet")
    base = base_parts(tiny_model)["unet"]
    assert max(float((a[k] - b[k]).abs().max()) for k in a) <= 1e-6
    assert max(float((a[k] - base[k]).abs().max()) for k in a) >= 1e-3
    ema = [UNet2DConditionModel.from_pretrained(str(tmp_path / run / "pipeline"), subfolder="unet").state_dict()
           for run in ("straight", "resumed")]
    assert max(float((ema[0][k] - ema[1][k]).abs().max()) for k in ema[0]) <= 1e-6


def test_the_noise_offset_changes_the_noise_alike_on_any_batching(full_args, tiny_model):
    common = ("--adam-epsilon", "1e-4", "--max-train-steps", "2", "--noise-offset", "0.1")
    plain = weights(loop.train(parse_args([*full_args("plain", tiny_model, *common[:-2]), "--train-batch-size", "2"])),
                    "unet")
    one = weights(loop.train(parse_args([*full_args("a", tiny_model, *common), "--train-batch-size", "2"])), "unet")
    two = weights(loop.train(parse_args([*full_args("b", tiny_model, *common), "--gradient-accumulation-steps", "2"])),
                  "unet")
    assert max(float((one[k] - two[k]).abs().max()) for k in one) <= 1e-6
    assert max(float((one[k] - plain[k]).abs().max()) for k in one) > 1e-5


@pytest.mark.parametrize(("flags", "said"), [
    (["--method", "lora", "--use-ema"], "--use-ema is an option of --method full"),
    (["--method", "full", "--ema-decay", "0.99"], "--ema-decay needs --use-ema"),
    (["--method", "full", "--optimizer", "adafactor", "--adam-beta1", "0.8"], "--adam-beta1 is AdamW's"),
    (["--method", "full", "--snr-gamma", "0"], "--snr-gamma must be positive"),
    (["--method", "full", "--noise-offset", "-1"], "--noise-offset must be >= 0"),
    (["--method", "lora", "--fused-backward-pass"], "--fused-backward-pass is an option of --method full"),
    (["--method", "full", "--fused-backward-pass", "--max-grad-norm", "1"],
     "--fused-backward-pass steps each weight as soon as its gradient is ready: not with --max-grad-norm"),
    (["--method", "full", "--fused_backward_pass", "--shard", "optimizer"], "not with --shard optimizer"),
    (["--method", "full", "--fused-backward-pass", "--compile"], "not with --compile"),
    (["--method", "full", "--fused-backward-pass", "--nproc-per-node", "2"], "not with --nproc-per-node 2"),
    (["--method", "full", "--pack-weights", "on"], "--pack-weights on packs a frozen UNet's or transformer's weights; --method full trains them"),
])
def test_the_features_bad_input_is_one_line(capsys, tiny_model, sample_images, tmp_path, flags, said):
    from tests.one_line import one_line_error

    line = one_line_error(capsys, ["train", "--model", str(tiny_model), "--data-dir", str(sample_images),
                                   "--instance-prompt", PROMPT, "--output-dir", str(tmp_path / "out"), *flags])
    assert said in line, line
    assert not (tmp_path / "out").exists()


def test_report_to_wandb_logs_scalars_and_sample_images_offline(full_args, tiny_model, tmp_path, monkeypatch):
    """WANDB_MODE=offline: the run's history holds the loss of every step and the validation images."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    out = tmp_path / "out"
    assert main(["train", *full_args("out", tiny_model), "--report-to", "wandb", "--validation-prompt", PROMPT,
                 "--num-validation-images", "1", "--validation-inference-steps", "2"]) == 0
    run_id = json.loads((out / "train_config.json").read_text())["run_id"]
    runs = list((out / "logs" / "wandb").glob(f"offline-run-*-{run_id}"))
    assert len(runs) == 1, list((out / "logs").rglob("*"))
    history = runs[0] / f"run-{run_id}.wandb"
    assert history.is_file() and history.stat().st_size > 0
    logged = history.read_bytes()
    assert b"train/loss" in logged and b"validation" in logged
    media = list(runs[0].rglob("*.png"))
    assert len(media) == 1, media
    # --overwrite clears this run's wandb folder, and the next run logs under its own id
    assert main(["train", *full_args("out", tiny_model), "--report-to", "wandb", "--overwrite"]) == 0
    assert not runs[0].exists()


def test_report_to_wandb_without_wandb_is_one_line(capsys, full_args, tiny_model, tmp_path, monkeypatch):
    from tests.one_line import one_line_error

    monkeypatch.setitem(sys.modules, "wandb", None)  # an import of it fails, as where it is not installed
    line = one_line_error(capsys, ["train", *full_args("out", tiny_model), "--report-to", "wandb"])
    assert "--report-to wandb needs wandb: pip install 'xeontune[wandb]'" in line


def test_a_nan_loss_stops_in_one_line_and_keeps_the_last_checkpoint(capsys, full_args, tiny_model, tmp_path,
                                                                      monkeypatch):
    from xeontune.train import checkpoint

    real, calls = loop.sample_loss, []

    def nan_at_step_3(*a, **k):
        calls.append(1)
        loss = real(*a, **k)
        return loss * float("nan") if len(calls) == 3 else loss

    monkeypatch.setattr(loop, "sample_loss", nan_at_step_3)
    capsys.readouterr()
    assert main(["train", *full_args("out", tiny_model, "--max-train-steps", "5", "--checkpointing-steps", "1")]) == 1
    err = capsys.readouterr().err
    assert [line for line in err.splitlines() if line.startswith("error:")] == [
        "error: loss became nan at step 3; lower --learning-rate"], err[-2000:]
    out = tmp_path / "out"
    assert [p.name for _, p in checkpoint.list_checkpoints(out)] == ["checkpoint-1", "checkpoint-2"]
    assert not (out / "model.safetensors").exists() and not (out / "pipeline").exists()


def test_save_precision_bf16_writes_a_bf16_single_file(full_args, tiny_model, tmp_path):
    from safetensors import safe_open

    result = loop.train(parse_args(full_args("out", tiny_model, "--max-train-steps", "1", "--save-precision", "bf16")))
    with safe_open(str(tmp_path / "out" / "model.safetensors"), "pt") as f:
        keys = list(f.keys())
        dtypes = {f.get_slice(k).get_dtype() for k in keys}
        w = f.get_tensor("model.diffusion_model.out.2.weight")
    assert dtypes <= {"BF16"} or dtypes - {"BF16"} <= {"I64"}, dtypes  # integers (if any) stay as they are
    assert torch.equal(w, weights(result, "unet")["conv_out.weight"].to(torch.bfloat16))


def test_weights_that_overflow_are_never_written(capsys, full_args, tiny_model, tmp_path, monkeypatch):
    """The weights are checked as they are written, not every step (a pass over the whole model): an
    overflow in the last optimizer step, with its loss still finite, writes no model file."""
    real_step = torch.optim.AdamW.step

    def overflowing_step(self, *args, **kwargs):
        result = real_step(self, *args, **kwargs)
        next(iter(self.param_groups[0]["params"])).data.fill_(float("inf"))
        return result

    monkeypatch.setattr(torch.optim.AdamW, "step", overflowing_step)
    capsys.readouterr()
    assert main(["train", *full_args("out", tiny_model, "--max-train-steps", "1")]) == 1
    assert "error: the weights became non-finite; lower --learning-rate" in capsys.readouterr().err
    assert not (tmp_path / "out" / "model.safetensors").exists() and not (tmp_path / "out" / "pipeline").exists()


def test_fused_backward_pass_steps_as_the_optimizer_does_holding_one_gradient_at_a_time(full_args, tiny_model,
                                                                                        monkeypatch):
    """--fused-backward-pass: the same weights as the plain step (AdamW over the UNet and the text encoder;
    Adafactor over 2 accumulated micro-steps), and while the backward runs no parameter holds a gradient
    but the one stepping."""
    from xeontune.train.fused_backward import FusedBackward

    held: list[int] = []
    step = FusedBackward._step

    def counting(self, p):
        if self.final:
            held.append(sum(q.grad is not None for group in self.optimizer.param_groups for q in group["params"]))
        step(self, p)

    monkeypatch.setattr(FusedBackward, "_step", counting)
    base = base_parts(tiny_model)
    for extra in (("--train-text-encoder",), ("--optimizer", "adafactor", "--gradient-accumulation-steps", "2",
                                              "--learning-rate", "1e-3")):
        plain = loop.train(parse_args(full_args(f"plain{len(extra)}", tiny_model, *extra)))
        held.clear()
        fused = loop.train(parse_args(full_args(f"fused{len(extra)}", tiny_model, *extra, "--fused-backward-pass")))
        for part in ("unet", "text_encoder") if "--train-text-encoder" in extra else ("unet",):
            a, b = weights(plain, part), weights(fused, part)
            assert max(float((a[k] - b[k]).abs().max()) for k in a) <= 1e-6, part
            assert moved_share(b, base[part], 1e-5) > 0.9, part
        if "--train-text-encoder" in extra:
            assert len(held) == 3 * len(plain.learned) and max(held) == 1, (len(held), max(held))


def test_fused_backward_pass_in_bf16_steps_as_the_plain_step(full_args, tiny_model):
    """The bf16 twin: under bf16 autocast (the trained layers' casts in the backward, bf16_cast) the weights of
    --fused-backward-pass are the plain step's, the UNet's and the text encoder's, and they moved."""
    base = base_parts(tiny_model)
    extra = ("--train-text-encoder", "--mixed-precision", "bf16", "--learning-rate", "1e-3")
    plain = loop.train(parse_args(full_args("plain", tiny_model, *extra)))
    fused = loop.train(parse_args(full_args("fused", tiny_model, *extra, "--fused-backward-pass")))
    for part in ("unet", "text_encoder"):
        a, b = weights(plain, part), weights(fused, part)
        assert max(float((a[k] - b[k]).abs().max()) for k in a) <= 1e-6, part
        assert moved_share(b, base[part], 1e-4) > 0.9, part


def test_the_rank_plan_counts_no_gradients_under_fused_backward_pass(tiny_model, sample_images):
    from xeontune.train import ranks

    def need(*extra: str) -> int:
        return ranks.rank_memory(parse_args(["--method", "full", "--model", str(tiny_model), "--data-dir",
                                             str(sample_images), "--instance-prompt", PROMPT, *extra]), "fp32")

    stored_unet = sum(p.stat().st_size for p in (tiny_model / "unet").glob("*.safetensors"))
    assert need() - need("--fused-backward-pass") == stored_unet  # its fp32 gradients
    # accumulated over micro-steps, the gradients are held until the last one
    assert need("--gradient-accumulation-steps", "2") == need("--fused-backward-pass", "--gradient-accumulation-steps", "2")


def test_the_rank_plan_counts_adafactors_state_from_the_models_shapes(tiny_model, tmp_path):
    """Adafactor keeps a row and a column of second moments per matrix or convolution, a vector whole: a
    (4, 2, 3, 3) convolution's state is 24 + 24 of its 72, a (8, 4) Linear's 8 + 4 of 32, an 8-bias 8."""
    from safetensors.torch import save_file

    from xeontune.train import ranks

    part = tmp_path / "unet"
    part.mkdir()
    save_file({"conv": torch.zeros(4, 2, 3, 3), "linear": torch.zeros(8, 4), "bias": torch.zeros(8)},
              str(part / "diffusion_pytorch_model.safetensors"))
    assert ranks.adafactor_state_share(part) == (48 + 12 + 8) / (72 + 32 + 8)
    assert ranks.adafactor_state_share(tmp_path / "absent") == ranks.ADAFACTOR_STATE_UNREAD
    stored_unet = sum(p.stat().st_size for p in (tiny_model / "unet").glob("*.safetensors"))
    adamw, adafactor = (ranks.frozen_weight_bytes(str(tiny_model), "fp32", trained=frozenset({"denoiser"}),
                                                  optimizer=optimizer) for optimizer in ("adamw", "adafactor"))
    share = ranks.adafactor_state_share(tiny_model / "unet")
    assert 0 < share < 1 and abs((adamw - adafactor) - (2 - share) * stored_unet) <= 16  # AdamW's 2 against it


def test_adafactor_state_numel_is_what_transformers_adafactor_keeps_as_the_run_makes_it(full_args, tiny_model):
    """The rank plan's count of Adafactor's state against the optimizer the run makes, stepped once over a
    vector, a Linear weight and a 3x3 convolution's."""
    from xeontune.train import ranks
    from xeontune.train.loop import make_optimizer

    params = [torch.nn.Parameter(torch.randn(*shape)) for shape in ((7,), (5, 3), (4, 2, 3, 3))]
    opts = parse_args(full_args("out", tiny_model, "--optimizer", "adafactor"))
    optimizer = make_optimizer(opts, params, 1e-3, fused=True)
    for p in params:
        p.grad = torch.randn_like(p)
    optimizer.step()
    for p in params:
        held = sum(t.numel() for t in optimizer.state[p].values() if isinstance(t, torch.Tensor) and t.dim() > 0)
        assert held == ranks.adafactor_state_numel(list(p.shape)), (p.shape, optimizer.state[p].keys())


def test_a_model_not_on_disk_counts_adafactors_state_by_its_familys_reference_shapes():
    """A hub id whose files are not here: Adafactor's share is the family's reference model's, computed from
    its shapes as adafactor_state_share computes it from headers (SDXL's UNet 0.095, not 0.5: 4 GB less)."""
    import math
    from dataclasses import replace

    from xeontune import models
    from xeontune.train import families, ranks

    def share(module) -> float:
        shapes = [list(t.shape) for t in module.state_dict().values()]
        return sum(map(ranks.adafactor_state_numel, shapes)) / sum(map(math.prod, shapes))

    with torch.device("meta"):
        built = {"sd": models.build_modules(models.DIMS["sd15-arch"], models.build_tokenizer(models.DIMS["sd15-arch"])),
                 "sdxl": models.build_modules(models.DIMS["sdxl-arch"], models.build_tokenizer(models.DIMS["sdxl-arch"])),
                 "sd3": {k: f() for k, f in models.sd3_parts(models.SD3_DIMS["sd35m-arch"]).items() if "token" not in k},
                 "flux": {k: f() for k, f in models.flux_parts(replace(models.SD3_DIMS["flux-arch"], layers=19,
                                                                        single_layers=38)).items() if "token" not in k}}
    for name, parts in built.items():
        family = families.get(name)
        for folder, value in family.adafactor_shares.items():
            assert abs(share(parts[folder]) - value) < 5e-4, (name, folder)
    adamw, adafactor = (ranks.frozen_weight_bytes("", "fp32", family="sdxl", trained=frozenset({"denoiser"}),
                                                  optimizer=optimizer) for optimizer in ("adamw", "adafactor"))
    unet = families.get("sdxl").default_bytes()["unet"]
    assert abs((adamw - adafactor) - (2 - 0.095) * unet) <= 16


def test_a_run_short_of_memory_is_told_what_saves_it(full_args, tiny_model, monkeypatch, caplog):
    from xeontune import placement

    monkeypatch.setattr(placement, "available_memory_bytes", lambda: 10**6)  # 1 MB: nothing fits
    with caplog.at_level("INFO", logger="xeontune.train"):
        loop.train(parse_args(full_args("out", tiny_model, "--max-train-steps", "1")))
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("memory plan:")]
    assert said and "it does not fit (the load may swap or be killed: --fused-backward-pass, --optimizer adafactor" in said[0]


def test_memory_hints_name_only_what_the_run_does_not_use_yet(tiny_model, sample_images):
    def hints(world: int, *extra: str) -> str:
        return "".join(loop.memory_hints(parse_args(["--method", "full", "--model", str(tiny_model), "--data-dir",
                                                     str(sample_images), "--instance-prompt", PROMPT, *extra]), world))

    assert hints(1) == "--fused-backward-pass, --optimizer adafactor, --gradient-checkpointing, --mixed-precision bf16, "
    assert hints(1, "--max-grad-norm", "1", "--optimizer", "adafactor", "--gradient-checkpointing") == \
        "--mixed-precision bf16, "  # clipping refuses the fused pass
    assert hints(2, "--mixed-precision", "bf16") == "--optimizer adafactor, --gradient-checkpointing, fewer ranks a node, --shard, "
