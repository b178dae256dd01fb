"""Full fine-tuning: every weight of the denoiser (UNet or transformer) trains, and the text encoders' with --train-text-encoder
(diffusers' ``train_text_to_image.py`` on captioned images, ``train_dreambooth.py`` with an instance
prompt and prior preservation).

The trained parts are the pipeline's own modules (``trains``): the loop loads them with fp32 master
weights, which bf16 autocast computes from, and wraps the UNet in DDP, whose buckets all-reduce the
gradients while the backward still runs (and skip the micro-steps of --gradient-accumulation-steps).
The text encoders' gradients, when they train, are all-reduced flat by the loop.

Files: the whole pipeline in ``pipeline/`` (diffusers' folder) at the end, and the single-file
checkpoint in the original Stable Diffusion layout, ``model.safetensors`` (``model-steps-N`` copies
with --save-steps), which A1111, ComfyUI and kohya read.
"""

from __future__ import annotations

import contextlib
import copy
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from xeontune.errors import TrainingError, UserError
from xeontune.train.methods import Method
from xeontune.train.methods.full import ENCODERS
from xeontune.train.methods.full import METHOD as DECLARED
from xeontune.train.outputs import learned_file

STEM = DECLARED.files[0]
log = logging.getLogger("xeontune.train")


def swap(params: list[nn.Parameter], tensors: list[torch.Tensor]) -> None:
    """Each parameter and its tensor (same shape and dtype) exchange storages."""
    pairs = list(zip(params, tensors, strict=True))
    for p, t in pairs:  # all checked before any is swapped
        if p.shape != t.shape or p.dtype != t.dtype:
            raise TrainingError(f"the EMA holds a {tuple(t.shape)} {t.dtype} weight for a {tuple(p.shape)} {p.dtype} one")
    for p, t in pairs:
        p.data, t.data = t.data, p.data


class FullFineTuning(Method):
    name = "full"
    learns = "weights"
    uses_ipex = False  # IPEX's optimize() is for frozen eval-mode models; the trained UNet stays stock

    # the denoiser by its folder ("unet"), and "text_encoder"(, "text_encoder_2"...) with --train-text-encoder
    models: dict[str, nn.Module]

    def install(self, components: Any) -> None:
        self.components = components
        self.denoiser_name = components.family.denoiser
        self.models = {self.denoiser_name: components.denoiser}
        if self.opts.train_text_encoder:
            self.models.update(components.family.trainable_encoders(components))
        for model in self.models.values():
            model.requires_grad_(True)
            model.train()  # as the examples train them (SD's blocks have no dropout by default)
        self.ema: Any = None
        self.ema_sharded = False  # its shadows are shares of the UNet's sharded weights (after_sharding)
        if self.opts.use_ema:  # diffusers' own EMA, as the examples keep it: fp32 shadows of the UNet
            self.ema = self._new_ema(self.models[self.denoiser_name].parameters())

    def _new_ema(self, params: Any) -> Any:
        from diffusers.training_utils import EMAModel

        denoiser = self.models[self.denoiser_name]  # model_cls: the plain class (fully_shard changes it)
        plain_class = self.ema.model_cls if self.ema is not None else type(denoiser)
        return EMAModel(params, decay=self.opts.ema_decay, model_cls=plain_class, model_config=denoiser.config)

    def after_sharding(self) -> None:
        """The EMA's shadows become shares of the UNet's sharded weights, as those did (nothing stepped yet:
        a fresh EMA over them). EMAModel steps them as it steps whole tensors (DTensor operations)."""
        if self.ema is not None:
            self.ema = self._new_ema(self.models[self.denoiser_name].parameters())
            self.ema_sharded = True

    def prompts(self, given: Any) -> list[str]:
        return list(given.texts)

    def named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        return [(f"{model_name}.{name}", p) for model_name, model in self.models.items()
                for name, p in model.named_parameters()]

    def parameters(self) -> list[nn.Parameter]:
        return [p for _, p in self.named_parameters()]

    def ddp_modules(self) -> list[nn.Module]:
        return [self.models[self.denoiser_name]]  # the text encoders, when they train, are all-reduced flat by the loop

    def use_ddp(self, wrapped: list[nn.Module]) -> None:
        self.components.denoiser = wrapped[0]  # what the step calls; denoiser_for_inference stays the bare module

    def sharded_modules(self) -> list[nn.Module]:
        return list(self.models.values())  # sharded, the text encoders' gradients are FSDP's too

    @contextlib.contextmanager
    def stand_in(self, copies: list[nn.Module] | None, write_back: bool = False) -> Iterator[None]:
        """The copies in the models' places, and a sharded EMA gathered whole beside them (every rank enters:
        a collective); ``write_back``: the whole EMA (a resume loaded it) cut back into the shares."""
        from xeontune.train import data_parallel

        sharded_ema = self.ema if self.ema_sharded else None
        if sharded_ema is not None:
            shadows = data_parallel.gather_whole(sharded_ema.shadow_params, keep=copies is not None)
            whole_ema = None if shadows is None else copy.copy(sharded_ema)  # its counters, whole shadows
            if whole_ema is not None:
                whole_ema.shadow_params = shadows
        if copies is None:
            yield
            return
        c = self.components
        before = dict(self.models), c.denoiser_for_inference, {name: getattr(c, name) for name in c.family.encoder_names}
        if sharded_ema is not None:
            self.ema, self.ema_sharded = whole_ema, False
        self.models = dict(zip(self.models, copies, strict=True))
        c.denoiser_for_inference = self.models[self.denoiser_name]
        for name in ENCODERS:
            if name in self.models:
                setattr(c, name, self.models[name])
        try:
            yield
        finally:
            self.models, c.denoiser_for_inference, encoders = before
            for name, encoder in encoders.items():
                setattr(c, name, encoder)
            if sharded_ema is not None:
                loaded, self.ema, self.ema_sharded = self.ema, sharded_ema, True
                if write_back:  # the loaded counters and decay, and each rank's shares of the loaded shadows
                    sharded_ema.__dict__.update({**vars(loaded), "shadow_params": data_parallel.cut_to_shares(
                        loaded.shadow_params, list(self.models[self.denoiser_name].parameters()))})

    def check_gradient(self, summary: dict[int, tuple[bool, bool]] | None = None) -> None:
        """Every trained model got a finite gradient, not zero throughout."""
        if summary is None:
            summary = {id(p): (bool(torch.isfinite(p.grad).all()), bool(p.grad.ne(0).any()))
                       for p in self.parameters() if p.grad is not None}
        for model_name, model in self.models.items():
            seen = [summary[id(p)] for p in model.parameters() if id(p) in summary]
            if not all(finite for finite, _ in seen) or not any(moved for _, moved in seen):
                raise TrainingError(f"the {model_name}'s weights received no usable gradient after the first "
                                    "backward pass; a backend broke the gradient path")

    def after_step(self) -> None:
        if self.ema is not None:
            self.ema.step(self.models[self.denoiser_name].parameters())

    @contextlib.contextmanager
    def inference(self, components: Any) -> Iterator[None]:
        """Sample images from the EMA's weights where there is one (as the examples validate)."""
        with self.ema_weights():
            yield

    @contextlib.contextmanager
    def ema_weights(self) -> Iterator[None]:
        """The UNet holds the EMA's weights inside (its own are put back after): the two swap storages, so no
        third copy of the UNet is made (EMAModel's store/copy_to would), and the values are the same."""
        if self.ema is None:
            yield
            return
        params = list(self.models[self.denoiser_name].parameters())
        swap(params, self.ema.shadow_params)
        try:
            yield
        finally:
            swap(params, self.ema.shadow_params)

    def finite(self) -> bool:
        """Not a pass over the whole model every step (0.3-0.5 s for SD1.5's UNet on 2 cores): a weight that
        went non-finite makes the next step's loss so, which the loop checks; what is written (the files,
        a checkpoint) is checked as it is written (``_require_finite``)."""
        return True

    def _require_finite(self) -> None:
        if not all(bool(torch.isfinite(p).all()) for p in self.parameters()):
            raise TrainingError("the weights became non-finite; lower --learning-rate")

    def learned(self) -> dict[str, torch.Tensor]:
        """The trained weights by name (views of the live ones: a copy would be the model's size again)."""
        return {name: p.detach() for name, p in self.named_parameters()}

    def state(self) -> dict[str, Any]:
        self._require_finite()
        ema = None if self.ema is None else self.ema.state_dict()
        return {"learned": {"tensors": self.learned(), "models": list(self.models), "ema": ema}}

    def check_state(self, state: Any, where: str) -> None:
        learned = state.learned or {}
        saved = list(learned.get("models", ()))
        # ``trains`` names both encoders whatever the family holds; the checkpoint, the models it had
        if any(m in ENCODERS for m in saved) != self.opts.train_text_encoder:
            said = "with" if any(m in ENCODERS for m in saved) else "without"
            raise UserError(f"checkpoint {where} was trained {said} --train-text-encoder; this run must be too")
        if (learned.get("ema") is not None) != self.opts.use_ema:
            said = "with" if learned.get("ema") is not None else "without"
            raise UserError(f"checkpoint {where} was trained {said} --use-ema; this run must be too")

    def load_state(self, state: Any, where: str) -> None:
        self.check_state(state, where)
        tensors = state.learned["tensors"]
        mine = self.named_parameters()
        if set(tensors) != {name for name, _ in mine} or any(tensors[n].shape != p.shape for n, p in mine):
            raise UserError(f"checkpoint {where} holds weights of another shape than this model's")
        with torch.no_grad():
            for name, p in mine:
                p.copy_(tensors[name])
        if self.ema is not None:
            self.ema.load_state_dict(state.learned["ema"])

    def save(self, output_dir: Path, step: int, final: bool) -> Path:
        """The single file (each step copy too); at the end, the pipeline folder as well."""
        from xeontune.train import saving

        self._require_finite()
        if not self.components.family.single_file:  # the pipeline folder alone, at the end
            target = output_dir / "pipeline"
            if not final:
                if not getattr(self, "said_no_copies", False):
                    log.warning("--save-steps: no step copies of a full %s fine-tune (it is written as a pipeline "
                                "folder at the end); --checkpointing-steps keeps the state", self.components.family.summary)
                    self.said_no_copies = True
                return target
            with self.ema_weights():
                return saving.save_pipeline(self.components, self.opts, self, target)
        pipe = saving.assemble_pipeline(self.components, self.opts, self)
        path = output_dir / learned_file(STEM, None if final else step)
        with self.ema_weights():  # the EMA's weights are what the examples save
            saving.save_single_file(pipe, self.components.family, path, self.opts)
            if final:
                saving.save_pipeline(self.components, self.opts, self, output_dir / "pipeline", pipe)
        return path
