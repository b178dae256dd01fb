"""How the tests run the trainer, in one place: in this process (through ``loop.train`` or the CLI), offline,
and the flags of a short LoRA run. Light to import: the trainer's modules load when a run starts."""

from __future__ import annotations

import pytest

# The environment of a command that trains (a fresh process, or a cluster's ranks): no model hub.
OFFLINE = {"HF_HUB_OFFLINE": "1"}


def train(args: list[str], on_step=None):
    """``loop.train`` on the parsed ``args`` (the flags of `xeontune train`): the run's result."""
    from xeontune.train import loop
    from xeontune.train.options import parse_args

    return loop.train(parse_args(args), on_step=on_step)


def train_in_process(args: list[str]) -> None:
    """A single-process reference, in this process: the same trainer, offline, without a process start
    (whose imports cost about 7 s on 2 cores)."""
    from xeontune.cli import main

    with pytest.MonkeyPatch.context() as mp:
        for key, value in OFFLINE.items():
            mp.setenv(key, value)
        assert main(["train", *args]) == 0


def lora_args(model, data, out, *extra: str, prompt: str = "a photo of sks toy", resolution: int = 64) -> list[str]:
    """The flags (after `xeontune train`) of a LoRA run of ``model`` on ``data`` into ``out``: fp32, lr 1e-3,
    no step copies, Adam's epsilon 1e-5 (its default 1e-8 magnifies the rounding of a near-zero gradient
    past 1e-5: test_lora.py). ``extra`` comes last: it may override these (the last flag wins)."""
    return ["--method", "lora", "--instance-prompt", prompt, "--model", str(model), "--data-dir", str(data),
            "--resolution", str(resolution), "--mixed-precision", "fp32", "--learning-rate", "1e-3",
            "--save-steps", "0", "--adam-epsilon", "1e-5", "--output-dir", str(out), *extra]
