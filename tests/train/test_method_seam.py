"""The method seam: a fake method, known to the toolkit only through its declaration (registered by name,
as the built-in ones are) and train/methods' contract, takes its own options, trains, checkpoints,
resumes, validates and saves a pipeline end to end (as the fake provider proves the provider seam). Had
the loop reached past the contract (a textual inversion's ``embedding`` or ``placeholder``, say), this
method, which has neither, would fail with an AttributeError; had the options named the built-in
methods, its defaults and its refusals of the others' options would not be its declaration's."""

from __future__ import annotations

import contextlib
from collections import Counter

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from xeontune.errors import UserError
from xeontune.train import loop, methods
from xeontune.train.methods import declaration
from xeontune.train.options import build_parser, parse_args

CALLS: Counter[str] = Counter()


class FakeMethod(methods.Method):
    """Learns a per-channel bias added to the UNet's output (a hook on conv_out)."""

    name = "fake"

    def install(self, components) -> None:
        CALLS["install"] += 1
        conv_out = components.denoiser.conv_out
        self.bias = nn.Parameter(torch.zeros(conv_out.out_channels, 1, 1))
        conv_out.register_forward_hook(lambda _m, _i, out: out + self.bias.to(out.dtype))

    def prompts(self, given) -> list[str]:
        CALLS["prompts"] += 1
        return ["a photo of a toy", "a good photo of the toy"]

    def parameters(self) -> list[nn.Parameter]:
        return [self.bias]

    def check_gradient(self) -> None:
        CALLS["check_gradient"] += 1
        assert self.bias.grad is not None and bool(self.bias.grad.abs().sum() > 0)

    def after_step(self) -> None:
        CALLS["after_step"] += 1

    def learned(self) -> torch.Tensor:
        return self.bias.detach().clone()

    def state(self) -> dict:
        CALLS["state"] += 1
        return {"learned": {"bias": self.learned()}}

    def load_state(self, state, where: str) -> None:
        CALLS["load_state"] += 1
        with torch.no_grad():
            self.bias.copy_(state.learned["bias"])

    def save(self, output_dir, step: int, final: bool):
        CALLS["save_final" if final else "save_step"] += 1
        path = output_dir / ("fake.safetensors" if final else f"fake-steps-{step}.safetensors")
        save_file({"bias": self.learned()}, str(path))
        return path

    @contextlib.contextmanager
    def inference(self, components):
        CALLS["inference"] += 1
        yield

    @contextlib.contextmanager
    def merged_into(self, pipeline):
        CALLS["merged_into"] += 1
        yield


METHOD = declaration.Declaration(
    name="fake", summary="a bias on the UNet's output", implementation=FakeMethod, group="fake",
    files=("fake",), defaults={"learning_rate": 2e-3, "output_dir": "fake_output", "random_flip": False},
    trains_text_encoders=lambda opts: False)  # so the loop caches the encoders' outputs for it


@pytest.fixture
def fake_method():
    declaration.register("fake", __name__)  # found by name, as the built-in methods' packages are
    CALLS.clear()
    yield CALLS
    declaration.unregister("fake")


def fake_options(base_args, out, *extra):
    # base_args are textual inversion's: its own options (the token) are not the fake method's
    given = [a for a in base_args if a not in ("--placeholder-token", "<toy-bot>", "--initializer-token", "toy")]
    return parse_args(["--method", "fake", *given, "--output-dir", str(out), "--mixed-precision", "fp32", *extra])


def test_a_method_is_known_by_its_declaration_alone(fake_method, base_args, tmp_path):
    opts = fake_options(base_args, tmp_path / "out")
    assert opts.learning_rate == 2e-3 and not opts.random_flip  # its declared defaults
    with pytest.raises(UserError, match="--placeholder-token is an option of --method textual_inversion, not of "
                                        "--method fake"):
        parse_args(["--method", "fake", *base_args])
    with pytest.raises(UserError, match="--with-prior-preservation is prior preservation's, which --method fake "
                                        "does not take"):
        fake_options(base_args, tmp_path / "out", "--with-prior-preservation")
    assert "fake: a bias on the UNet's output" in build_parser().format_help().replace("\n", " ").replace("  ", " ")
    assert isinstance(methods.create(opts), FakeMethod)


@pytest.mark.slow
def test_a_fake_method_trains_resumes_and_saves_through_the_contract_alone(fake_method, base_args, tmp_path):
    straight = loop.train(fake_options(base_args, tmp_path / "straight", "--max-train-steps", "4",
                                       "--checkpointing-steps", "2", "--save-steps", "2",
                                       "--validation-prompt", "a photo of a toy", "--validation-steps", "4",
                                       "--num-validation-images", "1", "--validation-inference-steps", "2",
                                       "--save-as-full-pipeline"))
    assert straight.learned.abs().max() > 1e-4  # moved from its zeros
    assert straight.result_path == tmp_path / "straight" / "fake.safetensors"
    assert torch.equal(load_file(straight.result_path)["bias"], straight.learned)
    assert (tmp_path / "straight" / "fake-steps-2.safetensors").is_file()
    assert (tmp_path / "straight" / "pipeline" / "model_index.json").is_file()
    assert (tmp_path / "straight" / "validation" / "step-000004-0.png").is_file()
    assert fake_method["check_gradient"] == 1 and fake_method["after_step"] == 4
    assert fake_method["state"] == 2 and fake_method["inference"] == 1 and fake_method["merged_into"] == 1

    resumed = loop.train(fake_options(base_args, tmp_path / "straight", "--max-train-steps", "4",
                                      "--checkpointing-steps", "2", "--resume-from-checkpoint",
                                      str(tmp_path / "straight" / "checkpoint-2")))
    assert fake_method["load_state"] == 1
    assert torch.allclose(resumed.learned, straight.learned, atol=1e-7, rtol=0)
