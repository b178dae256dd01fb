"""Loading the frozen parts of a Stable Diffusion pipeline, with one-line errors for bad paths."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import pickle
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from xeontune import hardware
from xeontune.errors import UserError
from xeontune.io import CACHE_ENV, cache_root, fsync_path
from xeontune.quiet import quiet_progress_bars
from xeontune.train import families
from xeontune.train.families import Family

log = logging.getLogger(__name__)



@dataclass
class Components:
    tokenizer: Any
    text_encoder: Any  # None while not held (freed once the prompts are cached, or not loaded yet)
    vae: Any
    denoiser: Any  # the UNet or transformer that the training step calls (may be compiled or IPEX-optimized)
    noise_scheduler: Any
    denoiser_for_inference: Any = None  # the plain denoiser, for validation and saving
    # *_cast: the part differs from its files (a bf16 copy, or half-precision files upcast to fp32),
    # so a saved full pipeline reloads it as its files hold it (loop.save_pipeline)
    denoiser_cast: bool = False
    text_encoder_cast: bool = False
    family: Family = None  # type: ignore[assignment]  # from model_index.json (train/families/); sd if None
    # a family's second and third tokenizers and text encoders (SDXL's second, SD3's T5), by their folders
    tokenizer_2: Any = None
    text_encoder_2: Any = None
    text_encoder_2_cast: bool = False
    tokenizer_3: Any = None
    text_encoder_3: Any = None
    text_encoder_3_cast: bool = False

    def __post_init__(self) -> None:
        if self.family is None:
            self.family = families.get("sd")

    @property
    def text_encoders(self) -> list[Any]:
        """The family's text encoders, in its order."""
        return [getattr(self, e.folder) for e in self.family.encoders]

    @property
    def tokenizers(self) -> list[Any]:
        return [getattr(self, e.tokenizer) for e in self.family.encoders]


def _check_local(path: Path) -> Family:
    """The pipeline's family, or a one-line error for a folder that is not a pipeline of one."""
    index = path / "model_index.json"
    if not index.is_file():
        raise UserError(f"{path} is not a Stable Diffusion pipeline (no model_index.json)")
    try:
        parts = json.loads(index.read_text())
    except json.JSONDecodeError:
        raise UserError(f"{index} is not valid JSON") from None
    family = families.of_index(parts, str(path))
    missing = [p for p in family.parts if p not in parts or not (path / p).is_dir()]
    if missing:
        raise UserError(f"{path} is not a Stable Diffusion pipeline (missing: {', '.join(missing)})")
    return family


def check_text_to_image(model: str, revision: str | None, family: Family | None = None) -> None:
    """A one-line error, from the configs before any weight loads, for an inpainting, depth, upscaling or
    instruct-pix2pix pipeline: its UNet takes the latents stacked with a mask, a depth map or an image,
    which textual inversion does not give it (its first convolution failed inside oneDNN with a traceback)."""
    import diffusers

    family = family or pipeline_family(model, revision)
    denoiser = getattr(diffusers, family.denoiser_class)
    takes = denoiser.load_config(model, subfolder=family.denoiser, revision=revision).get("in_channels", 4)
    latents = diffusers.AutoencoderKL.load_config(model, subfolder="vae", revision=revision).get("latent_channels", 4)
    if takes != family.denoiser_channels(latents):
        raise UserError(f"{model}'s {family.denoiser_title} takes {takes} input channels, not the "
                        f"{family.denoiser_channels(latents)} of its latents: an inpainting, depth, upscaling or "
                        "instruct-pix2pix model; xeontune trains text-to-image pipelines, whose textual inversions "
                        "and LoRAs these models load too")


def resolved(model: str) -> str:
    """A local model's path, ``~`` expanded, where it exists; else ``model`` as given (a hub id)."""
    local = Path(model).expanduser()
    return str(local) if local.exists() else model


def pipeline_family(model: str, revision: str | None = None) -> Family:
    """The family of a local pipeline or a hub id, from its model_index.json (no new flag needed); a hub
    id whose index cannot be read is taken for SD (loading its parts then says why in one line)."""
    local = Path(model).expanduser()
    if local.exists():
        return _check_local(local)
    from huggingface_hub import hf_hub_download

    try:
        index = hf_hub_download(model, "model_index.json", revision=revision)
        parts = json.loads(Path(index).read_text())
    except Exception:  # unreachable or not found: loading the parts below gives the one-line error
        return families.get("sd")
    return families.of_index(parts, model)


# The configs that say which model a checkpoint trained on: what differs between SD1 and SD2 (text encoder
# width, prediction type), SD and SDXL, or two shapes of one family.
_DENOISER_CONFIGS = ("unet/config.json", "transformer/config.json")
_IDENTITY_CONFIGS = (*_DENOISER_CONFIGS, "text_encoder/config.json", "text_encoder_2/config.json",
                     "text_encoder_3/config.json", "scheduler/scheduler_config.json")
_INCIDENTAL_KEYS = ("transformers_version", "torch_dtype", "dtype")  # a copy saved in another dtype is the same model


def model_identity(model: str, revision: str | None = None) -> dict[str, str] | None:
    """The model as a checkpoint records it: its path or hub id, its family and a hash of its parts'
    configs, read without loading a weight; None when the configs are not on this disk (the load will
    say why)."""
    local = Path(model).expanduser()
    configs: dict[str, Any] = {}
    index: Any = None
    for name in ("model_index.json", *_IDENTITY_CONFIGS):
        try:
            if local.exists():
                path = local / name
            else:
                from huggingface_hub import try_to_load_from_cache

                hit = try_to_load_from_cache(model, name, revision=revision)
                path = Path(hit) if isinstance(hit, str) else None
            if path is None or not path.is_file():
                continue
            config = json.loads(path.read_text())
        except (OSError, ValueError):
            return None
        if name == "model_index.json":
            index = config
        if isinstance(config, dict):
            configs[name] = {k: v for k, v in config.items() if not k.startswith("_") and k not in _INCIDENTAL_KEYS}
    configs.pop("model_index.json", None)  # the family below reads it whole (its _class_name)
    if not any(name in configs for name in _DENOISER_CONFIGS):
        return None
    digest = hashlib.sha256(json.dumps(configs, sort_keys=True).encode()).hexdigest()[:16]
    if not isinstance(index, dict):  # not on this disk: the parts whose configs are here stand for it
        index = {name.split("/")[0]: [] for name in configs}
    try:
        family = families.of_index(index, model).name
    except UserError:
        return None  # a family not trained here: the load says so in one line
    return {"model": model, "family": family, "config": digest}


def load(
    model: str, revision: str | None = None, variant: str | None = None, denoiser_dtype: Any = None,
    deferred: bool = False, half_linears: frozenset[str] = frozenset(),
) -> Components:
    """Load the family's tokenizers and text encoders, the VAE, the denoiser (UNet or transformer) and the
    training noise scheduler, all frozen and in eval mode.

    ``deferred``: the text encoders and the denoiser are left out (None), for a run that loads each encoder
    in turn to encode its prompts and frees it (``load_encoder``), then loads the denoiser (``load_denoiser``):
    no two of them are held together (SD3.5's T5-XXL is 9.5 GB in bf16, its transformer 4.5 GB).
    ``half_linears``: the encoders (by folder) whose half-precision Linear layers stay as loaded (a frozen
    encoder in bf16 training, whose Linear layers are cast to bf16 anyway): the rest of such an encoder is
    upcast, never the whole in fp32 (T5-XXL: 19 GB).

    ``denoiser_dtype`` (torch.bfloat16 for bf16 training): the frozen UNet is loaded in it once, rather
    than kept in fp32 and cast again by autocast at every step; that made its forward and backward
    1.24x faster at 256 px on a 2-core AMX Xeon (docs/performance.md) and halves its memory. The VAE
    stays in its files' dtype: it encodes the latent cache outside autocast."""
    import diffusers
    import transformers

    quiet_progress_bars()

    local = Path(model).expanduser()
    if local.exists():
        _check_local(local)
        model = str(local)
    elif model.startswith((".", "/", "~")):
        raise UserError(f"model path {model} does not exist")
    family = pipeline_family(model, revision)
    common = {"revision": revision}
    tokenizers: dict[str, Any] = {}  # the family's tokenizers, by folder
    with _loading(model, variant):
        for i, encoder in enumerate(family.encoders):
            tokenizers[encoder.tokenizer] = getattr(transformers, encoder.tokenizer_class).from_pretrained(
                model, subfolder=encoder.tokenizer, **common)
            if i == 0:
                check_text_to_image(model, revision, family)  # before any weights load
    components = Components(text_encoder=None, vae=None, denoiser=None, noise_scheduler=None, family=family,
                            **tokenizers)
    if not deferred:
        for encoder in family.encoders:
            load_encoder(components, model, encoder.folder, revision, variant, keep_linears=encoder.folder in half_linears)
    with _loading(model, variant):
        components.vae = diffusers.AutoencoderKL.from_pretrained(model, subfolder="vae", variant=variant, **common)
    if not deferred:
        load_denoiser(components, model, revision, variant, denoiser_dtype)
    with _loading(model, variant):
        components.noise_scheduler = getattr(diffusers, family.scheduler_class).from_pretrained(
            model, subfolder="scheduler", **common)
    components.vae.requires_grad_(False)
    components.vae.eval()
    _in_fp32(components.vae)
    return components


@contextmanager
def _loading(model: str, variant: str | None) -> Iterator[None]:
    """A model's files failing to load as one line: a pickle that holds more than tensors, a hub id missing
    or gated, or not in the cache offline, or the loader's own first line."""
    local = Path(model).expanduser()
    try:
        yield
    except pickle.UnpicklingError as exc:
        raise UserError(unsafe_pickle_message(model, exc)) from None
    except (OSError, ValueError) as exc:
        missing = hub_repo_missing(exc)
        if missing:
            raise UserError(not_found_message(model, gated=missing == "gated")) from None
        if not local.exists() and offline_miss(exc):
            mirror = MOVED_MODELS.get(model)
            raise UserError(f"{model} is no folder here and, as a hub id, not (all) in this machine's Hugging Face "
                            "cache; offline mode (HF_HUB_OFFLINE=1) cannot download it: run once without it"
                            + (f" (the guides' {model} is now {mirror})" if mirror else "")) from None
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else exc.__class__.__name__
        variants = sorted({f.name.split(".")[1].split("-")[0] for f in local.glob("*/*.*.safetensors")}) if local.is_dir() else []
        hint = f" (its weights are a variant: add --variant {variants[0]})" if variants and not variant else ""
        raise UserError(f"cannot load a Stable Diffusion pipeline from {model!r}: {first}{hint}") from None


def load_encoder(components: Components, model: str, folder: str, revision: str | None = None,
                 variant: str | None = None, keep_linears: bool = False) -> None:
    """The text encoder in ``folder`` into ``components``, frozen and in eval mode, half-precision weights
    upcast (``_in_fp32``; ``keep_linears``: all but its Linear layers)."""
    import transformers

    model = resolved(model)
    encoder = next(e for e in components.family.encoders if e.folder == folder)
    with _loading(model, variant):
        module = getattr(transformers, encoder.model_class).from_pretrained(
            model, subfolder=folder, variant=variant, revision=revision)
    module.requires_grad_(False)
    module.eval()
    setattr(components, folder, module)
    setattr(components, f"{folder}_cast", _in_fp32(module, keep_linears=keep_linears))


def load_denoiser(components: Components, model: str, revision: str | None = None, variant: str | None = None,
                  denoiser_dtype: Any = None) -> None:
    """The denoiser into ``components`` (``load`` leaves it out when deferred), frozen and in eval mode."""
    model = resolved(model)
    with _loading(model, variant):
        denoiser = _load_denoiser_in(components.family, denoiser_dtype, model, revision, variant)
    _set_denoiser(components, denoiser, denoiser_dtype)


def _set_denoiser(components: Components, denoiser: Any, dtype: Any) -> None:
    denoiser.requires_grad_(False)
    denoiser.eval()
    upcast = _in_fp32(denoiser) if dtype is None else False
    components.denoiser = components.denoiser_for_inference = denoiser
    components.denoiser_cast = dtype is not None or upcast


def unsafe_pickle_message(model: str, exc: BaseException) -> str:
    """One line for a pickled weights file (.bin) that holds more than tensors: torch's own message
    suggests weights_only=False, which would let the file run code; never that."""
    local = Path(model).expanduser()
    bins = sorted(str(p.relative_to(local)) for p in local.glob("*/*.bin")) if local.is_dir() else []
    what = next((line.split("Unsupported global:", 1)[1].split(" was not")[0].strip()
                 for line in str(exc).splitlines() if "Unsupported global:" in line), "other objects")
    return (f"{model}: a pickled weights file ({', '.join(bins) or '.bin'}) holds more than tensors ({what}); "
            "xeontune reads pickles as plain tensors only, so that a file cannot run code: convert it to "
            "safetensors where you trust its source")


def _in_fp32(module: Any, keep_linears: bool = False) -> bool:
    """Half-precision weights (a `--variant fp16`, or a model saved in fp16) in fp32, in place: the
    trainer computes in fp32, or in bf16 from fp32 text encoders and a bf16 UNet copy; CPU autocast
    refuses fp16 LayerNorm parameters and has no fast fp16 kernels. True if it cast (then a saved
    pipeline reloads the part as its files hold it). ``keep_linears``: the Linear layers stay as loaded
    (a frozen text encoder in bf16 training, cast_text_encoder_linears' next)."""
    import torch

    if module is None:
        return False
    if not keep_linears:
        if next(module.parameters()).dtype == torch.float32:
            return False
        module.float()
        return True
    cast = False
    for layer in module.modules():  # all but the Linear layers, whose weights are cast to bf16 next anyway
        if isinstance(layer, torch.nn.Linear):
            continue
        for name, param in list(layer.named_parameters(recurse=False)):
            if param.is_floating_point() and param.dtype != torch.float32:
                setattr(layer, name, torch.nn.Parameter(param.float(), requires_grad=param.requires_grad))
                cast = True
    return cast


# The hub repository that the guides name was removed in 2024; its maintained mirror:
MOVED_MODELS = {"runwayml/stable-diffusion-v1-5": "stable-diffusion-v1-5/stable-diffusion-v1-5"}


def _wrapped(exc: BaseException) -> Iterator[BaseException]:
    """``exc`` and the errors it wraps, as transformers and diffusers wrap huggingface_hub's (a short
    chain; never a loop on a cycle)."""
    seen: BaseException | None = exc
    for _ in range(8):
        if seen is None:
            return
        yield seen
        seen = seen.__cause__ or seen.__context__


def offline_miss(exc: BaseException) -> bool:
    """Whether the load failed because offline mode kept huggingface_hub from fetching a file the
    cache lacks (its OfflineModeIsEnabled, somewhere in the wrappers' chain)."""
    from huggingface_hub.errors import OfflineModeIsEnabled

    return any(isinstance(seen, OfflineModeIsEnabled) for seen in _wrapped(exc))


def hub_repo_missing(exc: BaseException) -> str | None:
    """"gated" or "missing" when the hub answered that the repository is gated / not found (404),
    looking through the wrappers transformers and diffusers raise around huggingface_hub's error."""
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError

    for seen in _wrapped(exc):
        if isinstance(seen, GatedRepoError):
            return "gated"
        if isinstance(seen, RepositoryNotFoundError):
            return "missing"
    return "missing" if "is not a valid model identifier" in str(exc) else None


def not_found_message(model: str, gated: bool = False) -> str:
    """One line: the likely causes of a hub 404, and the mirror when the id is a removed one."""
    if gated:
        why = "it is gated: accept its terms on huggingface.co and run `huggingface-cli login`"
    else:
        why = ("it was moved or removed, or it is private or gated and needs `huggingface-cli login`; "
               "a local path must start with ./ or /")
    mirror = MOVED_MODELS.get(model)
    hint = f"; {model} was removed from the hub in 2024, use its mirror --model {mirror}" if mirror else ""
    return f"model {model!r} was not found on the Hugging Face hub: {why}{hint}"


BF16_CACHE_ENV = CACHE_ENV  # the bf16 copies live in the project's cache (io.cache_root)


# Where each part's weights file is in a pipeline, and what its bf16 copy holds (see below).
WEIGHT_STEMS = {"unet": "diffusion_pytorch_model", "transformer": "diffusion_pytorch_model",
                "vae": "diffusion_pytorch_model", "text_encoder": "model", "text_encoder_2": "model",
                "text_encoder_3": "model"}
TEXT_LINEARS_FILE = "linears.safetensors"


def weights_files(model: str, part: str, revision: str | None, variant: str | None) -> list[Path]:
    """``part``'s weights on this disk (a local pipeline, or the hub cache): one file, or a sharded
    checkpoint's index and its shards (what `save_pretrained` writes above its shard size, as for an
    SDXL UNet in fp32); empty when they are not on disk."""
    name = f"{WEIGHT_STEMS[part]}{'.' + variant if variant else ''}"
    local = Path(model)
    if local.is_dir():
        found = [local / part / f"{name}{ext}" for ext in (".safetensors", ".bin")]
        single = next((f for f in found if f.is_file()), None)
        index = local / part / f"{name}.safetensors.index.json"
    else:
        from huggingface_hub import try_to_load_from_cache

        def cached(filename: str) -> Path | None:
            hit = try_to_load_from_cache(model, f"{part}/{filename}", revision=revision)
            return Path(hit) if isinstance(hit, str) else None

        single, index = cached(f"{name}.safetensors"), cached(f"{name}.safetensors.index.json")
    if single is not None:
        return [single]
    if index is None or not index.is_file():
        return []
    try:
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    except (OSError, ValueError, KeyError, AttributeError):
        return []
    files = [index.parent / shard for shard in shards]
    return [index, *files] if all(f.is_file() for f in files) else []


def files_dtype(model: str, part: str, revision: str | None, variant: str | None) -> Any:
    """The dtype ``part``'s safetensors files hold (torch.float16 for SDXL's `--variant fp16`), read
    from a header; None when the files are not on disk or not safetensors."""
    import torch
    from safetensors import safe_open

    files = weights_files(resolved(model), part, revision, variant)
    first = next((f for f in files if f.suffix == ".safetensors"), None)
    if first is None:
        return None
    with safe_open(first, "pt") as weights:
        key = next(iter(weights.keys()), None)
        stored = weights.get_slice(key).get_dtype() if key else None
    return {"F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32}.get(stored)


def bf16_copy_dir(model: str, revision: str | None, variant: str | None, part: str = "unet") -> Path | None:
    """Where the bf16 copy of this model's ``part`` lives: named by its source files' paths, sizes and
    modification times, so an updated model gets a new copy. None when the source is not on disk."""
    sources = weights_files(model, part, revision, variant)
    if not sources:
        return None
    stamp = []
    for source in (s.resolve() for s in sources):
        stat = source.stat()
        stamp.append(f"{source}|{stat.st_size}|{stat.st_mtime_ns}")
    key = hashlib.sha1("\n".join(stamp).encode()).hexdigest()[:16]
    root = cache_root()
    return root / f"{part.replace('_', '-')}-bf16" / key


def _load_denoiser_in(family: Family, dtype: Any, model: str, revision: str | None, variant: str | None) -> Any:
    """The frozen denoiser (a UNet, say) in ``dtype``. In bf16 it comes from a bf16 safetensors copy, written on first
    use from the model's files one tensor at a time (``_denoiser_copy``): loading that copy memory-maps it
    (no conversion, so no fp32 peak), and every rank on a node maps the same file, so the weights'
    pages are held once in the page cache, not once per rank. The first run maps the copy it just
    wrote, as every later run does (private converted weights would stay beside packed copies: 5.1 GB
    for SDXL). Files the copy is not made from so (an old pickled .bin) are converted in memory and
    the copy written from the converted model, as before."""
    import diffusers
    import torch

    cls, part = getattr(diffusers, family.denoiser_class), family.denoiser
    tried = False
    if dtype == torch.bfloat16 and files_dtype(model, part, revision, variant) == torch.bfloat16:
        # stored in bf16 already (SD3.5's and Flux's files): mapped from them as a copy would be, no copy made
        return cls.from_pretrained(model, subfolder=part, variant=variant, revision=revision, torch_dtype=dtype)
    if dtype == torch.bfloat16:
        copy, tried = _denoiser_copy(family, model, revision, variant)
        if copy is not None:
            return cls.from_pretrained(copy, torch_dtype=dtype)
    denoiser = cls.from_pretrained(model, subfolder=part, variant=variant, revision=revision, torch_dtype=dtype)
    copy = bf16_copy_dir(model, revision, variant, part) if dtype == torch.bfloat16 and not tried else None
    if copy is not None and not (copy / "config.json").is_file():
        _write_copy(lambda tmp: denoiser.save_pretrained(tmp, safe_serialization=True), copy, family.denoiser_title)
        if (copy / "config.json").is_file():  # written (or another rank's won the rename)
            del denoiser
            hardware.release_freed_memory()  # the converted weights, before anything sizes itself by MemAvailable
            return cls.from_pretrained(copy, torch_dtype=dtype)
    return denoiser


def _denoiser_copy(family: Family, model: str, revision: str | None, variant: str | None) -> tuple[Path | None, bool]:
    """The bf16 UNet copy's folder, written first if missing (a hub model's files are downloaded for
    it), or None; and whether writing it from the files was tried (then a failure was warned about,
    and the caller need not convert the model in memory only to fail to write it again)."""
    part = family.denoiser
    copy = bf16_copy_dir(model, revision, variant, part)
    if copy is None:
        _download_weights(model, part, revision, variant)
        copy = bf16_copy_dir(model, revision, variant, part)
    if copy is None:
        return None, False
    if (copy / "config.json").is_file():
        return copy, False
    from xeontune.train import tensorfiles

    try:
        _write_copy(lambda tmp: _write_denoiser_copy(family, model, revision, variant, tmp), copy,
                    family.denoiser_title)
    except tensorfiles.Unreadable as exc:
        log.info("the %s's files are not read tensor by tensor here (%s); converting it in memory", part, exc)
        return None, False
    finally:
        hardware.release_freed_memory()  # the allocator kept ~0.1 GB of the tensors it went through
    return (copy if (copy / "config.json").is_file() else None), True


def _write_denoiser_copy(family: Family, model: str, revision: str | None, variant: str | None,
                         folder: Path) -> None:
    """Write into ``folder`` what ``UNet2DConditionModel.from_pretrained(model, torch_dtype=torch.bfloat16)
    .save_pretrained(folder)`` writes, byte for byte, without the model: the config, and the weights
    read from the files, cast and written one tensor at a time (each cast as loading casts it). The
    first SDXL run held the fp32 weights' pages and the bf16 model at once to make it: a 15.4 GB peak,
    0.65 GB now (docs/performance.md). Raises tensorfiles.Unreadable (before writing any weight) for
    files whose tensors are not the model's, by name and shape."""
    import diffusers
    import torch
    from accelerate import init_empty_weights

    from xeontune.train import tensorfiles

    cls = getattr(diffusers, family.denoiser_class)
    sources = weights_files(model, family.denoiser, revision, variant)
    config_file = sources[0].parent / "config.json" if sources else None
    if config_file is None or not config_file.is_file():
        raise tensorfiles.Unreadable("no config.json beside the denoiser's weights")
    config = cls.load_config(str(config_file))
    if config.get("quantization_config"):
        raise tensorfiles.Unreadable("a quantized model")
    with init_empty_weights():  # the model's names and shapes, no memory
        empty = cls.from_config(config)
    empty.register_to_config(_name_or_path=model)  # as from_pretrained records it
    wanted = {name: tuple(t.shape) for name, t in empty.state_dict().items()}
    with ExitStack() as files:
        stored = tensorfiles.read_tensors(sources, files)
        if stored.keys() != wanted.keys() or any(s.shape != wanted[name] for name, s in stored.items()):
            raise tensorfiles.Unreadable("its tensors' names or shapes are not the model's")

        def bf16(s: tensorfiles.Stored) -> torch.Tensor:
            source = s.read()
            cast = source.to(torch.bfloat16) if source.is_floating_point() else source.clone()
            s.done(source)
            return cast

        entries = [tensorfiles.Entry(name, torch.bfloat16 if s.dtype.is_floating_point else s.dtype, s.shape,
                                     lambda s=s: bf16(s), s.where) for name, s in stored.items()]
        empty.save_config(folder)
        tensorfiles.write_safetensors(folder / "diffusion_pytorch_model.safetensors", entries, {"format": "pt"})


def _download_weights(model: str, part: str, revision: str | None, variant: str | None) -> None:
    """Fetch a hub model's ``part`` (config and safetensors weights) into the hub cache without loading
    it, so that its bf16 copy is made from the files; nothing when that fails (not a hub id, offline,
    only .bin weights): loading fetches and reports then."""
    if Path(model).expanduser().exists():
        return
    from huggingface_hub import hf_hub_download

    name = f"{WEIGHT_STEMS[part]}{'.' + variant if variant else ''}"

    def fetch(filename: str) -> Path:
        return Path(hf_hub_download(model, filename, subfolder=part, revision=revision))

    try:
        fetch("config.json")
        try:
            fetch(f"{name}.safetensors")
        except Exception:  # sharded, or no such file: the index says
            index = fetch(f"{name}.safetensors.index.json")
            for shard in sorted(set(json.loads(index.read_text())["weight_map"].values())):
                fetch(shard)
    except Exception as exc:
        log.debug("could not fetch %s's %s weights ahead of loading: %s", model, part, exc)


def ensure_bf16_copies(model: str, revision: str = "", variant: str = "") -> None:
    """Write the bf16 copies (UNet, text encoders' Linear layers) that are missing. The rank launcher
    runs this in a child process before starting ranks, so that they all map one file, none converts."""
    import torch

    model = resolved(model)
    revision_, variant_ = revision or None, variant or None
    try:
        family = pipeline_family(model, revision_)
        check_text_to_image(model, revision_, family)
    except UserError:
        return  # no copy for a model the ranks refuse (in one line) when they load it
    copy, tried = _denoiser_copy(family, model, revision_, variant_)
    if copy is None and not tried:  # files not read tensor by tensor: convert in memory and write
        _load_denoiser_in(family, torch.bfloat16, model, revision_, variant_)
    for part in family.encoder_names:
        copy = bf16_copy_dir(model, revision_, variant_, part)
        if copy is None or not (copy / TEXT_LINEARS_FILE).is_file():
            encoder = load_text_encoder(model, revision_, variant_, part)
            copy = copy or bf16_copy_dir(model, revision_, variant_, part)  # just downloaded
            if copy is not None and not (copy / TEXT_LINEARS_FILE).is_file():
                _write_linears_copy(_linears(encoder), torch.bfloat16, copy)


def _write_copy(save: Any, target: Path, what: str) -> None:
    """Write whole or not at all: ``save(folder)`` into a temporary folder beside the target, flushed
    to disk, then one rename (a copy that a power cut left half-written would fail every later run).
    Ranks that race here each write their own; the first rename wins, the others discard (which is why
    this is not io.atomic_dir: that replaces a folder another rank may have mapped already).
    A full or read-only disk costs only speed and memory: say so, leave no partial folder, go on."""
    from safetensors import SafetensorError  # safetensors' own I/O failures (ENOSPC...) are not OSError

    tmp: Path | None = None
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
        save(tmp)
        for file in tmp.iterdir():
            fsync_path(file)
        fsync_path(tmp)
        try:
            os.rename(tmp, target)
            tmp = None
            fsync_path(target.parent)
            log.info("wrote a bf16 copy of the %s to %s (later runs map it instead of converting)", what, target)
        except OSError:  # another rank or run got there first (a rename onto a full folder fails)
            pass
    except (OSError, SafetensorError) as exc:
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        log.warning("could not write the bf16 %s copy to %s (%s); loading converts it each time", what, target, reason)
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


def cast_text_encoder_linears(components: Components, dtype: Any, model: str = "", revision: str | None = None,
                              variant: str | None = None, part: str = "text_encoder") -> None:
    """bf16 training: the frozen text encoder's Linear layers (85 M of its 123 M parameters) in bf16.
    Autocast casts exactly these weights to bf16 at every step anyway, so the step computes the
    same numbers, bit for bit, without the casts: its forward and backward went from 0.109 to 0.084 s
    at SD1.5 size on a 2-core AMX Xeon (docs/performance.md).

    As for the UNet, the bf16 weights come from a copy on disk (written on first use) that every
    rank memory-maps: casting in each rank would hold 170 MB of private bf16 weights per rank on
    top of the fp32 pages the cast read. LayerNorms stay fp32 (CPU autocast leaves layer_norm's
    inputs in fp32 and refuses bf16 parameters with them), and so do the embeddings: the token table
    holds the trained rows.

    ``part``: "text_encoder", or SDXL's "text_encoder_2" (695 M parameters, 631 M of them in Linear
    layers), whose copy is written and mapped the same way."""
    import torch

    if dtype is None:
        return
    linears = _linears(getattr(components, part))
    if all(m.weight.dtype == dtype for m in linears.values()):  # loaded so from half-precision files (``load``)
        return
    copy = bf16_copy_dir(model, revision, variant, part) if model and dtype == torch.bfloat16 else None
    if copy is not None and not (copy / TEXT_LINEARS_FILE).is_file():
        _write_linears_copy(linears, dtype, copy)  # then mapped below, as every later run maps it
    if copy is not None and (copy / TEXT_LINEARS_FILE).is_file() and _map_linears(linears, copy / TEXT_LINEARS_FILE):
        setattr(components, f"{part}_cast", True)
        return
    for module in linears.values():
        module.to(dtype)
    setattr(components, f"{part}_cast", True)


def _linears(encoder: Any) -> dict[str, Any]:
    import torch

    return {name: m for name, m in encoder.named_modules() if isinstance(m, torch.nn.Linear)}


def _write_linears_copy(linears: dict[str, Any], dtype: Any, copy: Path) -> None:
    """The Linear layers' weights in ``dtype``, cast and written one tensor at a time (the file that
    `save_file` of them all cast would give), beside the fp32 encoder that every run loads anyway. The
    fp32 weights are memory-mapped from the model's files: the pages each cast read are handed back,
    or they would stay in this process (3.3 GB for SDXL's two encoders), which a later run never reads."""
    from xeontune.train import tensorfiles
    from xeontune.train.packed import release_file_pages

    def cast(t: Any) -> Any:
        if not t.is_floating_point():
            return t.detach()
        done = t.detach().to(dtype)
        if done.data_ptr() != t.data_ptr():
            release_file_pages(t.detach())
        return done

    entries = [tensorfiles.Entry(f"{name}.{key}", dtype if t.is_floating_point() else t.dtype, tuple(t.shape),
                                 lambda t=t: cast(t)) for name, m in linears.items() for key, t in m.state_dict().items()]
    _write_copy(lambda tmp: tensorfiles.write_safetensors(tmp / TEXT_LINEARS_FILE, entries), copy,
                "text encoder's Linear layers")
    hardware.release_freed_memory()


def _map_linears(linears: dict[str, Any], path: Path) -> bool:
    """Point each Linear at its memory-mapped bf16 tensors in ``path``; False (nothing changed) if the
    file does not hold exactly these layers in these shapes."""
    import torch
    from safetensors import safe_open

    try:
        with safe_open(str(path), "pt") as f:
            found = {key: f.get_tensor(key) for key in f.keys()}  # noqa: SIM118 (not a dict)
    except Exception as exc:  # a damaged copy costs only memory: convert instead
        log.warning("could not read the bf16 text encoder copy %s (%s); converting instead", path, exc)
        return False
    wanted = {f"{name}.{key}": t for name, m in linears.items() for key, t in m.state_dict().items()}
    if found.keys() != wanted.keys() or any(found[k].shape != t.shape for k, t in wanted.items()):
        log.warning("the bf16 text encoder copy %s does not match the model; converting instead", path)
        return False
    for name, module in linears.items():
        for key in ("weight", "bias"):
            if getattr(module, key) is not None:
                setattr(module, key, torch.nn.Parameter(found[f"{name}.{key}"], requires_grad=False))
    return True


def load_text_encoder(model: str, revision: str | None = None, variant: str | None = None,
                      part: str = "text_encoder") -> Any:
    """A text encoder as its files hold it (to save a full pipeline without the training dtype's rounding)."""
    import transformers

    model = resolved(model)
    family = pipeline_family(model, revision)
    known = [e for f in (family, *(families.get(n) for n in families.names())) for e in f.encoders if e.folder == part]
    if not known:
        raise UserError(f"{model} has no text encoder {part!r} that xeontune knows how to load")
    cls = getattr(transformers, known[0].model_class)
    return cls.from_pretrained(model, subfolder=part, variant=variant, revision=revision)


def load_as_stored(model: str, part: str, revision: str | None = None, variant: str | None = None) -> Any:
    """The UNet or VAE as its files hold it, in their dtype (diffusers would load fp16 files in fp32):
    what a saved full pipeline holds, without the training dtype's rounding or a doubled size."""
    import diffusers

    model = resolved(model)
    family = pipeline_family(model, revision)
    cls = diffusers.AutoencoderKL if part == "vae" else getattr(diffusers, family.denoiser_class)
    return cls.from_pretrained(model, subfolder=part, variant=variant,
                               revision=revision, torch_dtype=files_dtype(model, part, revision, variant))


def frozen_dtype(precision: str) -> Any:
    """The dtype a frozen denoiser is loaded in (and a frozen text encoder's Linear layers cast to) for a training precision (None: as its files hold it)."""
    import torch

    return torch.bfloat16 if precision == "bf16" else None
