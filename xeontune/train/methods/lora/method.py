"""LoRA: peft's low-rank adapters beside the frozen UNet's (and, with --train-text-encoder, the text
encoders') attention layers, as diffusers' DreamBooth-LoRA examples add them.

The base layers stay as the trainer prepared them (bf16 copies, packed for oneDNN): peft wraps each
target Linear, whose frozen forward and input gradient then run packed, and adds the adapter's two
small Linear layers beside it. The adapters and their optimizer state are fp32 whatever the precision
(autocast runs their matmuls in bf16 where the run is bf16). Their initial values come from --seed,
so every rank starts from the same adapters without a broadcast.

Pivotal tuning (``--placeholder-token``): textual inversion's token trains beside the adapters (the
recipe of diffusers' advanced SDXL DreamBooth-LoRA script), for the first ``--train-token-fraction`` of
the steps, and is saved as ``learned_embeds.safetensors`` (SDXL: ``clip_l`` / ``clip_g``).

Files: ``pytorch_lora_weights.safetensors`` in diffusers' layout (``pipeline.load_lora_weights``), the
same weights in kohya's layout (``pytorch_lora_weights_kohya.safetensors``: ``lora_unet_...``,
``lora_te_`` / ``lora_te1_`` / ``lora_te2_`` and ``.alpha``), which A1111 and ComfyUI read.
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from xeontune.errors import TrainingError, UserError
from xeontune.io import atomic_paths, disk_errors
from xeontune.train.families import DENOISER
from xeontune.train.methods import Method
from xeontune.train.methods.lora import METHOD as DECLARED
from xeontune.train.methods.textual_inversion.method import TextualInversion
from xeontune.train.outputs import learned_file

DIFFUSERS_STEM, KOHYA_STEM, TOKEN_STEM = DECLARED.files
TEXT_ENCODER_TARGETS = ("q_proj", "k_proj", "v_proj", "out_proj")  # CLIP's attention, as diffusers' examples

log = logging.getLogger("xeontune.train")


# The layers peft puts adapters on (peft's LoRA: "only the following modules are supported"); the
# UNet's are Linear and Conv2d.
LORA_LAYERS = (nn.Linear, nn.Embedding, nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.MultiheadAttention)


def check_targets(denoiser: nn.Module, targets: list[str], title: str = "UNet") -> None:
    """A one-line error for a --lora-targets entry that names no module of the denoiser (peft matches a
    name whole or as the end of a module's dotted path, and skips an entry that matches nothing as long
    as another one matches: a typo would train fewer adapters than asked, silently), or one that names
    a module peft cannot wrap (a block, such as to_out or attn1: peft would raise with its repr)."""
    modules = list(denoiser.named_modules())
    unmatched = []
    for target in targets:
        matched = [m for name, m in modules if name == target or name.endswith("." + target)]
        if not matched:
            unmatched.append(target)
        elif not all(isinstance(m, LORA_LAYERS) for m in matched):
            kind = next(type(m).__name__ for m in matched if not isinstance(m, LORA_LAYERS))
            raise UserError(f"--lora-targets: {target} is a {kind}, not a layer LoRA can wrap: name the Linear or "
                            "Conv2d layers in it (such as to_out.0 in to_out)")
    if unmatched:
        raise UserError(f"--lora-targets: no module of the {title} is named {', '.join(unmatched)} (names end a module's "
                        "path, as in to_q, to_out.0, ff.net.2, proj_in, conv1)")


class Lora(Method):
    name = "lora"
    learns = "adapters"
    uses_ipex = False  # IPEX 2.8 prepacks Linear layers whose gradients the adapters need; packed stock torch is used

    models: dict[str, nn.Module]  # the denoiser's folder ("unet"), "text_encoder", ...: the models holding adapters

    def __init__(self, opts: Any) -> None:
        super().__init__(opts)
        # pivotal tuning: the token is textual inversion's, trained beside the adapters
        self.token = TextualInversion(opts) if opts.placeholder_token else None

    def token_steps(self, max_steps: int) -> int:
        """The steps in which a pivotal-tuning token trains (the first ones)."""
        return max(1, round(self.opts.train_token_fraction * max_steps))

    @property
    def alpha(self) -> float:
        return float(self.opts.lora_alpha or self.opts.rank)

    @property
    def modified_parts(self) -> set[str]:
        return set(self.models)

    def config(self, targets: list[str] | tuple[str, ...]) -> Any:
        from peft import LoraConfig

        return LoraConfig(r=self.opts.rank, lora_alpha=self.alpha, lora_dropout=self.opts.lora_dropout,
                          init_lora_weights="gaussian", target_modules=list(targets))

    def install(self, components: Any) -> None:
        from peft import inject_adapter_in_model

        opts = self.opts
        self.family = components.family
        self.denoiser_name = components.family.denoiser
        self.base_model_version = components.family.kohya_version(components.denoiser.config,
                                                                  components.noise_scheduler.config)
        token_rows = []
        if self.token:
            self.token.install(components)  # its rows are spliced in before peft wraps the encoders' layers
            token_rows = self.token.parameters()
        self.models = {self.denoiser_name: components.denoiser}
        if opts.train_text_encoder:
            self.models.update(components.family.trainable_encoders(components))
        # Seeded apart from every other random stream: each rank makes the same adapters.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(opts.seed)
            for name, model in self.models.items():
                targets = self.targets_of(name)
                if name == self.denoiser_name:
                    check_targets(model, targets, self.family.denoiser_title)
                # peft's own injection (what diffusers' add_adapter runs): transformers' add_adapter
                # demands a newer peft than diffusers does, and the adapters are the same
                inject_adapter_in_model(self.config(targets), model, adapter_name="default")
        for _, p in self.named_parameters():
            p.data = p.data.float()
        for p in token_rows:  # peft froze every parameter of the models it wrapped but its own: these too
            p.requires_grad_(True)
        # Loaded models are in eval mode, which would switch the adapters' dropout off while training.
        self.dropouts = [m for model in self.models.values() for name, m in model.named_modules()
                         if ".lora_dropout." in name and isinstance(m, nn.Dropout)]
        for dropout in self.dropouts:
            dropout.train()

    def named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """The adapters' parameters (not a pivotal token's rows, which live in a text encoder too)."""
        return [(f"{model_name}.{name}", p) for model_name, model in self.models.items()
                for name, p in model.named_parameters() if p.requires_grad and ".lora_" in name]

    def prompts(self, given: Any) -> list[str]:
        return self.token.prompts(given) if self.token else list(given.texts)

    def parameters(self) -> list[nn.Parameter]:
        return [p for _, p in self.named_parameters()] + (self.token.parameters() if self.token else [])

    def ddp_modules(self) -> list[nn.Module]:
        return self.token.ddp_modules() if self.token else []  # the adapters are all-reduced flat by the loop

    def use_ddp(self, wrapped: list[nn.Module]) -> None:
        if self.token:
            self.token.use_ddp(wrapped)

    def before_update(self, step: int, max_steps: int) -> None:
        """After --train-token-fraction of the steps the token stops: without gradients AdamW leaves it."""
        if not self.token:
            return
        stop = self.token_steps(max_steps)
        if step >= stop:
            if step == stop:
                log.info("the token %s stops after step %d of %d (--train-token-fraction %g); the adapters go on",
                         self.opts.placeholder_token, step, max_steps, self.opts.train_token_fraction)
            for p in self.token.parameters():
                p.grad = None

    def after_step(self) -> None:
        if self.token:
            self.token.after_step()

    def check_gradient(self) -> None:
        """The adapters' up weights (zero at the start) must get a finite gradient, not zero for a whole model.
        A layer whose output nothing reads gets none (SDXL conditions on the first text encoder's
        penultimate hidden states: its last layer's adapters never train, as in diffusers' examples)."""
        for model_name in self.models:
            grads = [p.grad for name, p in self.named_parameters() if name.startswith(model_name + ".")
                     and ".lora_B." in name and p.grad is not None]
            if any(not torch.isfinite(g).all() for g in grads) or not any(bool(g.abs().sum() > 0) for g in grads):
                raise TrainingError(f"the LoRA adapters of the {model_name} received no usable gradient after the "
                                    "first backward pass; a backend broke the gradient path")
        if self.token:
            self.token.check_gradient()

    def learned(self) -> dict[str, torch.Tensor]:
        """The adapters by name; a pivotal token's vectors as ``token``."""
        return self.adapters() | ({"token": self.token.learned()} if self.token else {})

    def adapters(self) -> dict[str, torch.Tensor]:
        return {name: p.detach().clone() for name, p in self.named_parameters()}

    def state(self) -> dict[str, Any]:
        return {"learned": {"tensors": self.adapters(), "rank": self.opts.rank, "alpha": self.alpha,
                            "targets": self.targets_of(self.denoiser_name), "models": list(self.models)},
                **(self.token.state() if self.token else {})}

    def check_state(self, state: Any, where: str) -> None:
        saved = state.learned or {}
        # the same adapters whatever the order --lora-targets names them in
        mine = {"rank": self.opts.rank, "alpha": self.alpha, "targets": sorted(set(self.targets_of(DENOISER))),
                "text encoders": self.opts.train_text_encoder}
        saved = {**saved, "targets": sorted(set(saved.get("targets", ()))),
                 "text encoders": any(m.startswith("text_encoder") for m in saved.get("models", ()))}
        self._same_settings(saved, mine, where)
        if (state.vectors is not None) != (self.token is not None):
            raise UserError(f"checkpoint {where} was trained {'with' if state.vectors is not None else 'without'} a "
                            "pivotal token (--placeholder-token); this run must be too")

    @staticmethod
    def _same_settings(saved: dict[str, Any], mine: dict[str, Any], where: str, shapes_differ: bool = False) -> None:
        if shapes_differ or any(saved.get(k) != v for k, v in mine.items()):
            have = ", ".join(f"{k} {saved.get(k)}" for k in mine)
            want = ", ".join(f"{k} {v}" for k, v in mine.items())
            raise UserError(f"checkpoint {where} holds other adapters ({have}) than this run makes ({want})")

    def load_state(self, state: Any, where: str) -> None:
        self.check_state(state, where)
        saved = state.learned or {}
        mine = self.state()["learned"]
        shapes = [{k: v.shape for k, v in d.get("tensors", {}).items()} for d in (saved, mine)]
        # check_state compared the settings; the installed models must hold the same adapters too
        self._same_settings(saved, {"models": mine["models"]}, where, shapes_differ=shapes[0] != shapes[1])
        with torch.no_grad():
            for name, p in self.named_parameters():
                p.copy_(saved["tensors"][name])
        if self.token:
            self.token.load_state(state, where)

    # --- files -------------------------------------------------------------------------------------

    def peft_state_dicts(self) -> dict[str, dict[str, torch.Tensor]]:
        """Each model's adapters as peft names them (``...to_q.lora_A.weight``), fp32."""
        from peft.utils import get_peft_model_state_dict

        return {name: {k: v.detach().float().contiguous() for k, v in get_peft_model_state_dict(model).items()}
                for name, model in self.models.items()}

    def save(self, output_dir: Path, step: int, final: bool) -> Path:
        from diffusers.utils import convert_state_dict_to_diffusers

        layers = self.peft_state_dicts()
        path = output_dir / learned_file(DIFFUSERS_STEM, None if final else step)
        pipeline = self.family.pipeline_type()
        kwargs: dict[str, Any] = {f"{name}_lora_layers": self.family.lora_layout(sd) if name == self.denoiser_name
                                  else convert_state_dict_to_diffusers(sd) for name, sd in layers.items()}
        # the adapters' settings (alpha above all) travel in the file's metadata, as diffusers writes them
        kwargs.update({f"{name}_lora_adapter_metadata": self.config(self.targets_of(name)).to_dict()
                       for name in layers})
        kohya = output_dir / learned_file(KOHYA_STEM, None if final else step)
        token = output_dir / learned_file(TOKEN_STEM, None if final else step)
        finals = [path, kohya, *([token] if self.token else [])]
        with disk_errors(path):
            output_dir.mkdir(parents=True, exist_ok=True)
        # every layout written first, then all renamed: a failed write (a full disk) leaves none half-way
        with tempfile.TemporaryDirectory(dir=output_dir, prefix=".lora-") as tmp, disk_errors(path), \
                atomic_paths(finals, durable=True) as targets:
            pipeline.save_lora_weights(tmp, weight_name=path.name, **kwargs)
            os.replace(Path(tmp) / path.name, targets[0])
            self.write_kohya(layers, targets[1], step)
            if self.token:
                os.replace(self.token.save(Path(tmp), step, final), targets[2])
        if final:
            self.final_path = path
        return path

    def targets_of(self, model_name: str) -> list[str]:
        """The modules of ``model_name`` (a text encoder's folder; else the denoiser) that get adapters:
        --lora-targets, or the family's default for its denoiser."""
        if model_name.startswith("text_encoder"):
            return list(TEXT_ENCODER_TARGETS)
        if self.opts.lora_targets:
            return list(self.opts.lora_target_names)
        family = getattr(self, "family", None)
        if family is None:  # before the models load (a checkpoint's settings checked against this run's)
            from xeontune.train.components import pipeline_family

            family = pipeline_family(self.opts.model, self.opts.revision)
        return list(family.lora_targets)

    def write_kohya(self, layers: dict[str, dict[str, torch.Tensor]], path: Path, step: int) -> Path:
        """kohya's layout: ``lora_unet_<module path with _>.lora_down.weight`` / ``.lora_up.weight`` /
        ``.alpha``; each text encoder's under the prefix its model family gives (``lora_te_`` for SD1.x/SD2's
        one, ``lora_te1_`` and ``lora_te2_`` for SDXL's two)."""
        from diffusers.utils import convert_state_dict_to_kohya
        from safetensors.torch import save_file

        prefixed = {f"{name}.{k}": v for name, sd in layers.items() for k, v in sd.items()}
        # diffusers names the encoders' adapters lora_te1_, lora_te2_, ... in the family's order
        prefixes = {f"lora_te{i}_": e.kohya_prefix for i, e in enumerate(self.family.encoders, start=1)}
        # and the denoiser's "lora_unet_" (a UNet) or its folder's name (a transformer)
        prefixes["lora_unet_" if self.denoiser_name == "unet" else f"{self.denoiser_name}_"] = \
            self.family.kohya_denoiser_prefix
        kohya = {}
        for key, value in convert_state_dict_to_kohya(prefixed).items():
            if key.endswith(".alpha"):  # diffusers writes alpha = rank there; ours may differ
                value = torch.tensor(self.alpha)
            ours = next((p for p in prefixes if key.startswith(p)), None)
            if ours is not None:
                key = prefixes[ours] + key.removeprefix(ours)
            kohya[key] = value.contiguous()
        metadata = {"ss_network_module": "networks.lora", "ss_network_dim": str(self.opts.rank),
                    "ss_network_alpha": str(self.alpha), "ss_steps": str(step),
                    "ss_base_model_version": self.base_model_version,
                    "ss_v2": str(self.base_model_version.startswith("sd_v2"))}
        save_file(kohya, str(path), metadata=metadata)  # into save()'s temporary file
        return path

    # --- using what was learned --------------------------------------------------------------------

    @contextlib.contextmanager
    def inference(self, components: Any) -> Iterator[None]:
        """The adapters stay in the models; only their dropout is off."""
        for dropout in self.dropouts:
            dropout.eval()
        try:
            with self.token.inference(components) if self.token else contextlib.nullcontext():
                yield
        finally:
            for dropout in self.dropouts:
                dropout.train()

    @contextlib.contextmanager
    def merged_into(self, pipeline: Any) -> Iterator[None]:
        """The final file loaded into the pipeline's fresh parts by diffusers itself, fused into their
        weights, and the adapters' modules dropped: a plain pipeline, the LoRA in its weights."""
        path: Path = self.final_path
        pipeline.load_lora_weights(str(path.parent), weight_name=path.name, adapter_name="xeontune")
        pipeline.fuse_lora(components=list(self.models), lora_scale=1.0)
        pipeline.unload_lora_weights()
        with self.token.merged_into(pipeline) if self.token else contextlib.nullcontext():
            yield
