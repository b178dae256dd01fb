"""Model families as plug-ins: what differs between SD1.x/SD2, SDXL and the families after them.

Each family is a module under train/families/ whose ``FAMILY`` implements the ``Family`` contract below; the
rest of the toolkit asks the family of the run's model (``components.family``, or
``components.pipeline_family``/``get`` before any model loads) and never names one:

- ``sd``: SD1.x and SD2.x (one CLIP text encoder, a UNet, DDPM noise with epsilon or v-prediction);
- ``sdxl``: SDXL (two text encoders, the second's pooled projection and the images' size/crop conditions);
- ``sd3``: SD3 and SD3.5 (an MMDiT transformer, three text encoders with T5, flow matching);
- ``flux``: Flux.1 (a transformer over packed latents, CLIP's pooled output and T5, a guidance embedding).

A family says, without importing torch (its modules import diffusers and transformers inside the calls):
which pipelines are its own (``recognizes`` a model_index.json) and which parts they hold, its text encoders
(tokenizer and encoder folders, transformers class, what of them is Linear layers), how prompts become the
denoiser's conditioning (``encode``, ``conditions``), how a timestep is drawn (``timestep_density``), the
noised input, the denoiser's call, the target and the loss weights (``noisy``, ``predict``, ``target``,
``loss_weights``), the diffusers
pipeline that samples and saves (``pipeline``), the original single-file layout (``single_file_text``), its
memory figures for the rank plan (``activation_bytes``, ``default_bytes``), where packed weights lose
(``packing_refusal``), kohya's names for it, and how each method's example script holds its models in
`xeontune bench` (``example_bf16``) and its own targets there (``bench_targets``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from xeontune.errors import UserError
from xeontune.registry import Registry

DENOISER = "denoiser"  # a method's name for the part that denoises in ``trains`` (``Family.denoiser``: its folder)
# the pipeline parts a method may train (``Declaration.trains``): the denoiser (a UNet or a transformer, as the
# family has it) and the text encoders by their folders
PARTS = (DENOISER, "text_encoder", "text_encoder_2", "text_encoder_3")


@dataclass(frozen=True)
class Encoder:
    """One text encoder of a family, in the order its hidden states are joined."""

    tokenizer: str  # its tokenizer's folder in the pipeline
    folder: str  # its own folder ("text_encoder", "text_encoder_2", ...): also its name in the pipeline and the run
    model_class: str  # the transformers class that loads it
    linear_share: float  # of its parameters in Linear layers (held in bf16 under bf16 while frozen)
    default_bytes: float  # its fp32 size, for the memory plan of a hub model not on this disk
    embedding_key: str = ""  # its vectors' key in a textual-inversion file of several encoders (A1111's)
    kohya_prefix: str = "lora_te_"  # its adapters' prefix in kohya's LoRA layout
    tokenizer_class: str = "CLIPTokenizer"
    trainable: bool = True  # False: frozen whatever the method (SD3's T5, as diffusers' examples keep it)
    max_length: int | None = None  # the tokens a prompt is padded and cut to (None: the tokenizer's own limit)


class Family:
    """The contract; see the module's docstring."""

    name: ClassVar[str]
    summary: ClassVar[str]  # which models, for messages and docs
    pipeline_class: ClassVar[str]  # the diffusers pipeline that samples, saves and loads LoRA files
    # what that pipeline is given beside the parts (no safety checker, no watermark): also for from_pretrained
    pipeline_options: ClassVar[Mapping[str, Any]] = {}
    encoders: ClassVar[tuple[Encoder, ...]]
    denoiser: ClassVar[str] = "unet"  # the denoiser's folder in the pipeline (and its parameters' prefix in a run)
    denoiser_class: ClassVar[str] = "UNet2DConditionModel"  # the diffusers class that loads it
    denoiser_title: ClassVar[str] = "UNet"  # what messages call it
    scheduler_class: ClassVar[str] = "DDPMScheduler"  # the training noise scheduler's diffusers class
    lora_targets: ClassVar[tuple[str, ...]] = ("to_q", "to_k", "to_v", "to_out.0")  # the denoiser's, by default
    kohya_denoiser_prefix: ClassVar[str] = "lora_unet_"  # the denoiser's adapters' prefix in kohya's LoRA layout
    denoiser_params: ClassVar[float]  # the denoiser's parameters, for the memory plan of a model not on disk
    vae_bytes: ClassVar[float]
    # by folder: Adafactor's state as a share of the part's weights in the reference model (ranks'
    # adafactor_state_share from its shapes, on the meta device), for a model whose files are not on disk
    adafactor_shares: ClassVar[Mapping[str, float]] = {}
    bench_targets: ClassVar[Mapping[str, Mapping[str, Any]]] = {}  # per method: targets overriding the method's
    # per method: the bench baseline's options where this family's example script differs from the method's
    bench_baseline: ClassVar[Mapping[str, Mapping[str, Any]]] = {}
    refuses: ClassVar[Mapping[str, str]] = {}  # the methods that do not apply to it, each with why
    single_file: ClassVar[bool] = True  # whether a full fine-tune is also written in the original single-file layout

    @classmethod
    def recognizes(cls, model_index: Mapping[str, Any]) -> bool:
        raise NotImplementedError

    @property
    def other_parts(self) -> tuple[str, ...]:
        return ("vae", self.denoiser, "scheduler")

    @property
    def parts(self) -> tuple[str, ...]:
        """The folders a pipeline of this family must have."""
        return tuple(p for e in self.encoders for p in (e.tokenizer, e.folder)) + self.other_parts

    @property
    def encoder_names(self) -> tuple[str, ...]:
        return tuple(e.folder for e in self.encoders)

    def denoiser_channels(self, latent_channels: int) -> int:
        """The input channels of this family's text-to-image denoiser for the VAE's latent channels (Flux
        packs 2x2 patches); another count is an inpainting, depth or other conditioned model."""
        return latent_channels

    def trained_parts(self, trains: frozenset[str]) -> frozenset[str]:
        """Of a method's ``trains``, what trains in this family (an encoder it keeps frozen does not)."""
        frozen = {e.folder for e in self.encoders if not e.trainable}
        return frozenset(trains - frozen)

    def trainable_encoders(self, components: Any) -> dict[str, Any]:
        """The text encoders a method may train, by folder."""
        return {e.folder: getattr(components, e.folder) for e in self.encoders if e.trainable}

    # --- prompts and the training target -----------------------------------------------------------

    def encode(self, encoders: list[Any], input_ids: list[Any]) -> tuple[Any, Any]:
        """(the denoiser's text hidden states, a pooled embedding or None) of tokenized prompts, one id
        tensor per encoder: each encoder's output joined."""
        return self.join([self.encoder_output(i, encoder, ids)
                          for i, (encoder, ids) in enumerate(zip(encoders, input_ids, strict=True))])

    def encoder_output(self, index: int, encoder: Any, input_ids: Any) -> Any:
        """What the family takes of its ``index``-th encoder's output for these prompts. Each encoder's alone,
        so that a run can hold one encoder at a time (loop.TextCache) and join them after."""
        raise NotImplementedError

    def join(self, outputs: list[Any]) -> tuple[Any, Any]:
        """(hidden states, pooled embedding or None) from every encoder's ``encoder_output``, in order."""
        raise NotImplementedError

    def conditions(self, pooled: Any, sizes: Any) -> dict[str, Any] | None:
        """The denoiser's added conditions from the pooled embedding and each sample's (original size, crop
        top-left, target size) (B, 6), or None where it takes none."""
        return None

    def for_run(self, opts: Any) -> Family:
        """This family with a run's options that change how it trains (SD3's --precondition-outputs)."""
        return self

    def check_options(self, opts: Any) -> None:
        """A one-line error for a training option that does not apply to this family (before any model loads)."""

    def timestep_density(self, opts: Any) -> Any:
        """A function of a torch.Generator giving u in [0, 1) (a timestep's index is u times the scheduler's
        training timesteps), or None for uniform integer timesteps (drawn as the examples draw them)."""
        return None

    def noisy(self, scheduler: Any, latents: Any, noise: Any, timesteps: Any) -> Any:
        """The latents noised at ``timesteps`` (training timestep indices; what the denoiser is given)."""
        raise NotImplementedError

    def predict(self, scheduler: Any, denoiser: Any, noisy: Any, timesteps: Any, hidden: Any,
                conditions: dict[str, Any] | None) -> Any:
        """The denoiser's prediction, in the target's terms, for the noised latents."""
        raise NotImplementedError

    def target(self, scheduler: Any, latents: Any, noise: Any, timesteps: Any) -> Any:
        """What the prediction is compared with."""
        raise NotImplementedError

    def loss_weights(self, scheduler: Any, timesteps: Any, opts: Any) -> Any:
        """Each sample's loss weight (B,), or None for an unweighted mean."""
        return None

    # --- pipelines and files -----------------------------------------------------------------------

    def pipeline(self, parts: Mapping[str, Any]) -> Any:
        """The diffusers pipeline over ``parts`` (the vae, denoiser, scheduler, tokenizers and encoders by
        folder name): for sample images and for saving."""
        return self.pipeline_type()(**parts, **self.pipeline_options)

    def sampling_scheduler(self, training: Any) -> Any:
        """A scheduler that samples images (validation, class images), made from the training one's config:
        never the training one itself, whose timesteps and sigmas a pipeline's set_timesteps replaces."""
        return type(training).from_config(training.config)

    def pipeline_type(self) -> Any:
        """The diffusers pipeline class (its ``save_lora_weights`` writes LoRA files this family loads)."""
        import diffusers

        return getattr(diffusers, self.pipeline_class)

    def lora_layout(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """The denoiser's adapters (peft's names) as the family's pipeline's ``save_lora_weights`` is given
        them; peft's own names by default (what diffusers' SD3 and Flux examples save)."""
        return state_dict

    def single_file_text(self, pipe: Any) -> list[tuple[str, str, bool]]:
        """The text encoders in the original single-file layout: (pipeline attribute, key prefix, whether
        the layout is OpenCLIP's)."""
        raise NotImplementedError

    def kohya_version(self, unet_config: Any, scheduler_config: Any) -> str:
        """kohya's ``ss_base_model_version`` for a LoRA of this model."""
        raise NotImplementedError

    # --- memory and speed --------------------------------------------------------------------------

    def activation_bytes(self, resolution: int, precision: str) -> float:
        """What one image of a training step holds beside the weights (measured, grown with the pixels)."""
        raise NotImplementedError

    def default_bytes(self) -> dict[str, float]:
        """The fp32 bytes of each part of this family's reference model, for a hub id not on this disk."""
        return {self.denoiser: self.denoiser_params * 4, "vae": self.vae_bytes,
                **{e.folder: e.default_bytes for e in self.encoders}}

    def packing_refusal(self, precision: str, amx: bool) -> str:
        """Why `--pack-weights auto` does not pack this family's frozen denoiser here (measured), or ""."""
        return ""

    def example_bf16(self, method: str) -> tuple[str, ...]:
        """The models ``method``'s example script casts to bf16 in a bf16 run (the rest it keeps in fp32)."""
        raise NotImplementedError


_REGISTRY: Registry[Family] = Registry("model family", "FAMILY", Family)
for _name in ("sd", "sdxl", "sd3", "flux"):
    _REGISTRY.register(_name, f"xeontune.train.families.{_name}")
register, unregister, names, get = _REGISTRY.register, _REGISTRY.unregister, _REGISTRY.names, _REGISTRY.get


def check_method(family: Family, method: str, model: str, opts: Any = None) -> None:
    """A one-line error, before any weight loads, for a method (or an option) that does not apply to the
    model's family."""
    why = family.refuses.get(method)
    if why is not None:
        raise UserError(f"--method {method} does not apply to {model}, a {family.name} model ({family.summary}): {why}")
    if opts is not None:
        family.check_options(opts)


def of_index(model_index: Mapping[str, Any], where: str) -> Family:
    """The family of a pipeline's model_index.json; a one-line error naming the supported ones otherwise.
    The last registered is asked first: a later family is the more specific one (SDXL's index would pass
    for SD's but for its second encoder; a plug-in's for either)."""
    for name in reversed(names()):
        family = get(name)
        if family.recognizes(model_index):
            return family
    what = str(model_index.get("_class_name") or "pipeline of unknown class")
    supported = "; ".join(f"{name} ({get(name).summary})" for name in names())
    raise UserError(f"{where} is a {what}, a model family xeontune does not train (it trains: {supported})")
