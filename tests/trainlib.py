"""How the tests run the trainer, in one place: in this process (through ``loop.train`` or the CLI), offline,
and the flags of a short LoRA run. Light to import: the trainer's modules load when a run starts."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

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


def full_args(model, data, out, batch: int, steps: int, *extra: str) -> list[str]:
    """The flags (after `xeontune train`) of a full fine-tuning of ``model`` on ``data`` into ``out``: fp32 at
    32 px, lr 1e-3, no checkpoints or step copies. Adam's first steps are sign-like: its epsilon 1e-4 keeps a
    near-zero gradient's rounding small. ``extra`` comes last (the last flag wins)."""
    return ["--method", "full", "--model", str(model), "--data-dir", str(data), "--instance-prompt", "a photo of toy",
            "--resolution", "32", "--train-batch-size", str(batch), "--max-train-steps", str(steps),
            "--learning-rate", "1e-3", "--seed", "7", "--output-dir", str(out), "--checkpointing-steps", "0",
            "--save-steps", "0", "--mixed-precision", "fp32", "--adam-epsilon", "1e-4", *extra]


def unet_weights(folder) -> dict:
    """The UNet's weights of a pipeline folder (a base model's, or a full fine-tuning's ``pipeline/``)."""
    from diffusers import UNet2DConditionModel

    return {k: v.detach().clone() for k, v in UNet2DConditionModel.from_pretrained(str(folder), subfolder="unet")
            .state_dict().items()}


def assert_same_unet(got, want, base, rel: float = 1e-5) -> None:
    """``got``'s UNet equals ``want``'s within ``rel`` of the weights' largest value, and ``want``'s moved
    from ``base``'s by 100x that at least (two runs that learned nothing agree too)."""
    got, want, base = unet_weights(got), unet_weights(want), unet_weights(base)
    scale = max(float(w.abs().max()) for w in want.values())
    diff = max(float((got[k] - want[k]).abs().max()) for k in want)
    moved = max(float((want[k] - base[k]).abs().max()) for k in want)
    assert diff <= rel * scale and moved >= 100 * rel * scale, (diff, moved, scale)


def lora_args(model, data, out, *extra: str, prompt: str = "a photo of sks toy", resolution: int = 64) -> list[str]:
    """The flags (after `xeontune train`) of a LoRA run of ``model`` on ``data`` into ``out``: fp32, lr 1e-3,
    no step copies, Adam's epsilon 1e-5 (its default 1e-8 magnifies the rounding of a near-zero gradient
    past 1e-5: test_lora.py). ``extra`` comes last: it may override these (the last flag wins)."""
    return ["--method", "lora", "--instance-prompt", prompt, "--model", str(model), "--data-dir", str(data),
            "--resolution", str(resolution), "--mixed-precision", "fp32", "--learning-rate", "1e-3",
            "--save-steps", "0", "--adam-epsilon", "1e-5", "--output-dir", str(out), *extra]


class ThreadRanks:
    """``latent_cache.Spread`` for ranks that are threads of this process: a gather meets at a barrier."""

    def __init__(self, world: int) -> None:
        self.world = world
        self.values: list[object] = [None] * world
        self.barrier = threading.Barrier(world, timeout=60)

    def rank_view(self, rank: int):
        ranks = self

        class View:
            def __init__(self) -> None:
                self.rank, self.world = rank, ranks.world

            def gather(self, value: object) -> list[object]:
                ranks.values[rank] = value
                ranks.barrier.wait()
                values = list(ranks.values)
                ranks.barrier.wait()  # nobody's next gather overwrites a value before every rank copied it
                return values

        return View()

    def run(self, work: Callable[[int, Any], Any]) -> list[Any]:
        """``work(rank, spread)`` on every rank at once; what each returned, or the first rank's error (the
        cause, not a barrier the others then saw break)."""
        results: list[Any] = [None] * self.world

        def one(rank: int) -> None:
            try:
                results[rank] = work(rank, self.rank_view(rank))
            except BaseException as exc:  # noqa: BLE001 (raised below, in the caller's thread)
                results[rank] = exc

        threads = [threading.Thread(target=one, args=(r,)) for r in range(self.world)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        failed = [r for r in results if isinstance(r, BaseException)]
        if failed:
            raise next((r for r in failed if not isinstance(r, threading.BrokenBarrierError)), failed[0])
        return results
