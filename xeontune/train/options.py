"""TrainOptions: every training flag, its example-script alias, the config file, and validation.

Precedence: built-in default < config file (YAML or TOML, same names) < command line. Flags are
kebab-case; the snake_case spelling of every flag is accepted too, as are the common example
script's names (``--pretrained_model_name_or_path``, ``--train_data_dir``, ...), so a command line
pasted from a guide works unchanged.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import math
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import xeontune.train.methods.declaration as methods
from xeontune.errors import UserError
from xeontune.train import families

log = logging.getLogger(__name__)

SCHEDULERS = ("constant", "constant_with_warmup", "linear", "cosine", "cosine_with_restarts", "polynomial")


def opt(default: Any, help: str, *, aliases: tuple[str, ...] = (), choices: tuple[str, ...] | None = None,
        type: Any = None, group: str = "training") -> Any:
    return field(default=default, metadata={"help": help, "aliases": aliases, "choices": choices,
                                            "type": type, "group": group})


@dataclass
class TrainOptions:
    method: str = opt("textual_inversion", "Each method's own options are in its group below; see docs/training.md",
                      group="method")  # choices and their help: train/methods' declarations
    # model and data
    model: str | None = opt(None, "hub id or local path of a Stable Diffusion 1.x/2.x or SDXL pipeline (required)",
                            aliases=("--pretrained_model_name_or_path",), group="model and data")
    revision: str | None = opt(None, "model revision (branch, tag or commit) on the hub", group="model and data")
    variant: str | None = opt(None, "weights variant, e.g. fp16", group="model and data")
    data_dir: str | None = opt(None, "folder of training images (required, or --dataset); beside them, optional captions "
                               "(IMAGE.txt, metadata.jsonl) and loss masks (IMAGE.mask.png: white learns, black "
                               "is ignored); see docs/training.md",
                               aliases=("--train_data_dir", "--instance_data_dir"),
                               group="model and data")
    dataset: str | None = opt(None, "a Hugging Face datasets dataset to train on instead of --data-dir: a folder "
                              "written by save_to_disk, parquet or arrow files (a file, a folder of them, or a glob), "
                              "or a hub id (with HF_HUB_OFFLINE=1: from the local cache); exported once into a "
                              "folder of images and metadata.jsonl under $XEONTUNE_CACHE (~/.cache/xeontune), which "
                              "training then reads as --data-dir; see docs/training.md",
                              aliases=("--dataset-name", "--dataset_name"), group="model and data")
    image_column: str = opt("image", "the column of --dataset that holds the images (an Image feature, image "
                            "bytes, or file paths, relative to the dataset's folder)", group="model and data")
    placeholder_token: str | None = opt(None, "the new token to learn, e.g. '<cat-toy>' (required; with "
                                        "--method lora: pivotal tuning, the token trains with the adapters)",
                                        group="textual inversion")
    initializer_token: str | None = opt(None, "one existing token to start from, e.g. 'toy' (required "
                                        "with --placeholder-token)",
                                        group="textual inversion")
    learnable_property: str = opt("object", "what the token captures; picks the prompt templates",
                                  choices=("object", "style"), group="textual inversion")
    num_vectors: int = opt(1, "vectors per placeholder (<tok>, <tok>_1, ...)", group="textual inversion")
    # LoRA
    instance_prompt: str | None = opt(
        None, "the prompt of every training image without a caption, e.g. 'a photo of sks toy'. An image's own "
        "caption comes first: IMAGE.txt beside it, or a line of DATA_DIR/metadata.jsonl ({\"file_name\": ..., "
        "\"text\": ...}); without either, textual inversion's templates (lora needs one of the two)",
        group="model and data")
    caption_column: str = opt("text", "the caption's field in DATA_DIR/metadata.jsonl, or the caption column of "
                              "--dataset", group="model and data")
    rank: int = opt(4, "the adapters' rank", aliases=("--lora-rank",), group="lora")
    lora_alpha: float | None = opt(None, "the adapters' alpha: their output is scaled by alpha / rank "
                                   "(default: the rank, so 1)", group="lora")
    lora_targets: str | None = opt(None, "the denoiser's modules that get adapters, comma-separated, names as they "
                                   "end in it (default: the model family's: to_q,to_k,to_v,to_out.0 for SD1.x/SD2/SDXL; "
                                   "SD3 adds its context stream's add_q_proj,add_k_proj,add_v_proj,to_add_out)",
                                   group="lora")
    lora_dropout: float = opt(0.0, "dropout on the adapters' input while training", group="lora")
    train_token_fraction: float = opt(1.0, "pivotal tuning (--method lora with --placeholder-token): the share of "
                                      "the steps in which the token trains beside the adapters; after it, only "
                                      "the adapters train", group="lora")
    with_prior_preservation: bool = opt(False, "DreamBooth's prior preservation: train on class images too "
                                        "(--class-data-dir, --class-prompt), so the model keeps drawing the class "
                                        "as it did", group="prior preservation")
    class_data_dir: str | None = opt(None, "folder of class images; the missing ones (of --num-class-images) are "
                                     "generated there by the base model before training", group="prior preservation")
    class_prompt: str | None = opt(None, "the class images' prompt, e.g. 'a photo of a dog'", group="prior preservation")
    num_class_images: int = opt(100, "class images to train on (the folder's first by name; generated up to "
                                "this many)", group="prior preservation")
    prior_loss_weight: float = opt(1.0, "weight of the class images' loss beside the instance images'", group="prior preservation")
    class_inference_steps: int = opt(25, "denoising steps per generated class image", group="prior preservation")
    sample_batch_size: int = opt(4, "class images each rank generates per pipeline call (as the example's "
                                 "--sample_batch_size; more threads a rank fill better with more, at more memory)",
                                 group="prior preservation")
    train_text_encoder: bool = opt(False, "lora: also put adapters on the text encoder(s)' q_proj, k_proj, v_proj "
                                   "and out_proj; full: train the text encoder(s) too (else their outputs are "
                                   "computed once per prompt)", group="lora")
    use_ema: bool = opt(False, "keep an exponential moving average of the UNet's weights (fp32, diffusers' "
                        "EMAModel, updated after every optimizer step); sample images and the saved pipeline and "
                        "single file use it", group="full fine-tuning")
    ema_decay: float = opt(0.9999, "the EMA's decay per step (--use-ema)", group="full fine-tuning")
    save_precision: str = opt("fp32", "the dtype of the single-file checkpoint (model.safetensors)",
                              choices=("fp32", "bf16"), group="full fine-tuning")
    shard: str = opt("none", "across ranks: optimizer keeps 1/N of the optimizer state on each of N ranks (ZeRO-1, "
                     "torch's ZeroRedundancyOptimizer; each rank then sends its share of the updated weights: one "
                     "more model's bytes a step on the wire); gradients also 1/N of the weights and gradients "
                     "between steps (torch's FSDP2; each block's weights gathered for its forward and backward); "
                     "full also frees them after the forward and gathers them again for the backward (least "
                     "memory, most traffic); auto takes the first of these that fits the node's ranks; none: every "
                     "rank holds all of it", choices=("none", "optimizer", "gradients", "full", "auto"),
                     group="full fine-tuning")
    fused_backward_pass: bool = opt(False, "step each weight inside the backward as soon as its gradient is ready "
                                    "and free that gradient (kohya's --fused_backward_pass): the step never holds "
                                    "all the gradients (SD1.5's UNet at 256 px in fp32: 2.8 GB less at the peak); "
                                    "the same update; one process, without --max-grad-norm (clipping needs every "
                                    "gradient first) or --compile", aliases=("--fused_backward_pass",),
                                    group="full fine-tuning")
    grad_compression: str = opt("none", "across ranks: the gradients' dtype on the wire; bf16 sends half the bytes "
                                "and adds them up in fp32 (docs/cluster.md)", choices=("none", "bf16"),
                                group="full fine-tuning")
    repeats: int = opt(100, "times each image appears per epoch", group="model and data")
    resolution: int = opt(512, "training image side in pixels (a multiple of 8)", group="model and data")
    center_crop: bool = opt(False, "crop images to a centered square before resizing (without buckets)",
                            group="model and data")
    random_crop: bool = opt(False, "crop images to a square at a random place before resizing, drawn once per image "
                            "from --seed (train_text_to_image.py's default; without buckets)", group="model and data")
    latent_cache_dir: str | None = opt(None, "where the images' VAE latents are kept, so that they are encoded once: "
                                       "a later run on the same images, or one restarted after a crash, reads them "
                                       "(default: $XEONTUNE_CACHE/latents, ~/.cache/xeontune/latents); 'none' keeps "
                                       "them in memory only", group="model and data")
    buckets: str = opt("auto", "aspect-ratio buckets: each image trains at the size of about --resolution squared "
                       "pixels nearest its aspect ratio (1:2 to 2:1), each batch from one bucket; auto: on when "
                       "some image is not nearest the square", choices=("auto", "on", "off"), group="model and data")
    bucket_step: int = opt(64, "the buckets' sides are multiples of this (64: what SD's UNets need)",
                           group="model and data")
    random_flip: bool | None = opt(None, "mirror images at random, with probability --flip-p (default: on for "
                                   "textual inversion, off for LoRA, as diffusers' examples and kohya; a flip "
                                   "doubles the latent cache's VAE work)", group="model and data")
    flip_p: float = opt(0.5, "probability of mirroring an image when --random-flip", group="model and data")
    # optimisation
    train_batch_size: int = opt(1, "images per rank per step; the global batch is this x ranks x "
                                "--gradient-accumulation-steps", aliases=("--batch-size",))
    gradient_accumulation_steps: int = opt(1, "micro-batches per optimizer step")
    max_train_steps: int | None = opt(None, "optimizer steps (overrides --num-train-epochs)")
    num_train_epochs: int = opt(1, "epochs, when --max-train-steps is not given")
    learning_rate: float | None = opt(None, "peak learning rate (default: 5e-4 for textual_inversion, 1e-4 for "
                                      "lora)")
    scale_lr: bool = opt(False, "multiply --learning-rate by the global batch (per-rank batch x accumulation x "
                         "ranks), so more ranks take proportionally larger steps")
    lr_scheduler: str = opt("constant", "learning-rate schedule", choices=SCHEDULERS)
    lr_warmup_steps: int = opt(0, "warm-up steps of the schedule")
    lr_num_cycles: int = opt(1, "hard restarts for cosine_with_restarts")
    lr_power: float = opt(1.0, "power of the polynomial schedule")
    adam_beta1: float = opt(0.9, "AdamW beta1")
    adam_beta2: float = opt(0.999, "AdamW beta2")
    adam_weight_decay: float = opt(1e-2, "AdamW weight decay")
    adam_epsilon: float = opt(1e-8, "AdamW epsilon")
    optimizer: str = opt("adamw", "adamw (torch's), or adafactor (transformers', without its relative step: "
                         "factored second moments, a fraction of AdamW's state; what fits SDXL's full fine-tuning in "
                         "64 GB)", choices=("adamw", "adafactor"))
    snr_gamma: float | None = opt(None, "min-SNR weighting (Hang et al. 2023): each sample's loss weighted by "
                                  "min(SNR, gamma) / SNR (v-prediction: / (SNR + 1)); the examples suggest 5.0")
    weighting_scheme: str | None = opt(None, "how flow matching draws timesteps and weighs their loss, as diffusers' "
                                       "examples: logit_normal, mode, none (uniform), sigma_sqrt, cosmap (default: "
                                       "the family's example's: logit_normal for SD3, none for Flux)",
                                       choices=("logit_normal", "mode", "none", "sigma_sqrt", "cosmap"),
                                       group="flow matching (SD3, Flux)")
    logit_mean: float = opt(0.0, "--weighting-scheme logit_normal: the normal's mean", group="flow matching (SD3, Flux)")
    logit_std: float = opt(1.0, "--weighting-scheme logit_normal: the normal's standard deviation",
                           group="flow matching (SD3, Flux)")
    mode_scale: float = opt(1.29, "--weighting-scheme mode: its scale", group="flow matching (SD3, Flux)")
    precondition_outputs: bool | None = opt(None, "compare the prediction, turned into clean latents, with the "
                                            "latents; --no-precondition-outputs: the velocity (noise - latents) "
                                            "(default: the family's example: on for SD3, off for Flux)",
                                            group="flow matching (SD3, Flux)")
    guidance_scale: float = opt(3.5, "Flux.1-dev: the guidance its transformer's guidance embedding is given while "
                                "training (the Flux example's --guidance_scale)", group="flow matching (SD3, Flux)")
    noise_offset: float = opt(0.0, "add this times a per-channel Gaussian offset to the noise (as the examples' "
                              "--noise_offset: darker darks and brighter brights)")
    max_grad_norm: float | None = opt(None, "clip the gradient norm of what trains (the token's vectors, the adapters) "
                                            "to this (off by default)")
    seed: int = opt(0, "seed of every random choice (samples, noise, timesteps, validation)")
    # hardware
    mixed_precision: str = opt("auto", "auto: bf16 only where the CPU has AMX or AVX512-BF16, else fp32",
                               choices=("auto", "bf16", "fp32", "no", "fp16"), group="hardware")
    ipex: str = opt("auto", "use intel-extension-for-pytorch when installed and compatible; auto leaves it out "
                    "where weights are packed (packed stock torch was faster)",
                    choices=("auto", "on", "off"), group="hardware")
    pack_weights: str = opt("auto", "reorder the frozen UNet's weights for oneDNN once instead of at every call "
                            "(stock torch; what IPEX's prepacking does; the step 1.6x faster in bf16 on an AMX Xeon with 2 "
                            "threads a rank): auto packs in both precisions wherever oneDNN runs the kernels (fp32 1.2x "
                            "faster too) and the packed copy fits in the memory available, but not bf16 on AMX with more "
                            "than 4 threads a rank (stock was 1.28x faster with 16); costs about twice the UNet's size in the "
                            "training dtype in memory per rank", choices=("auto", "on", "off"), group="hardware")
    compile: bool = opt(False, "torch.compile the UNet (inductor); measure before relying on it", group="hardware")
    attention: str = opt("auto", "the UNet's attention: torch's SDPA, or xeontune's CPU kernel (compiled for this CPU "
                         "on first use into $XEONTUNE_CACHE/kernels; torch's where it cannot be built, or for a call it "
                         "does not handle); auto picks by the rules measured in docs/performance.md",
                         choices=("auto", "torch", "xeontune"), group="hardware")
    gradient_checkpointing: bool = opt(
        False, "keep only each block's input of the frozen UNet through the forward pass and recompute the rest "
        "during the backward: trades memory for time (the UNet's forward runs twice a step: 1.22x the s/step "
        "measured on SD1.5 at 256 px in fp32) and is what fits SDXL in fp32 at 1024 px in 24 GB; the vectors get the same gradients. "
        "(The SDXL example script's --gradient_checkpointing checkpoints its text encoders; this flag, under either "
        "spelling, checkpoints the UNet, where the memory is)", group="hardware")
    nproc_per_node: str = opt("1", "data-parallel ranks on this machine, each pinned to its own physical cores: "
                              "a number, or auto (one rank per 2 cores from 4 cores up, one per core below, "
                              "as many as memory holds). The global batch grows with it: --train-batch-size x ranks; "
                              "--scale-lr scales the learning rate by that; see docs/performance.md", group="hardware")
    dist_backend: str = opt("gloo", "torch.distributed backend when launched on several ranks",
                            choices=("gloo", "ccl"), group="hardware")
    dist_timeout: float = opt(60.0, "seconds a collective inside a step may wait for a rank before the job fails",
                              group="hardware")
    dist_wait_timeout: float = opt(3600.0, "seconds ranks wait while one works alone (model loading, checkpoints, "
                                   "validation, saving the pipeline) before the job fails", group="hardware")
    # outputs
    output_dir: str = opt(None, "where the learned files, checkpoints and logs go (default: textual_inversion_output, "
                          "or lora_output for --method lora)", group="outputs")  # type: ignore[assignment]
    overwrite: bool = opt(False, "replace the outputs of a previous run in --output-dir", group="outputs")
    save_format: str = opt("diffusers", "learned_embeds format: diffusers ({token: vectors}) or a1111 (emb_params)",
                           choices=("diffusers", "a1111"), group="outputs")
    save_steps: int = opt(500, "also write a copy of the outputs every N steps (learned_embeds-steps-N"
                          ".safetensors; LoRA: pytorch_lora_weights[_kohya]-steps-N.safetensors; 0: never)",
                          group="outputs")
    save_as_full_pipeline: bool = opt(False, "also save the whole pipeline under OUTPUT_DIR/pipeline, with the new "
                                      "token in it (LoRA: fused into its weights)", group="outputs")
    checkpointing_steps: int = opt(500, "write a resumable checkpoint every N steps (0: never)", group="outputs")
    checkpoints_total_limit: int | None = opt(None, "keep at most this many checkpoints", group="outputs")
    resume_from_checkpoint: str | None = opt(None, "a checkpoint dir, or 'latest' in --output-dir",
                                             group="outputs")
    validation_prompt: list[str] | None = opt(None, "prompt for sample images, e.g. 'a photo of a <cat-toy>'; "
                                              "give it again for more prompts", group="outputs")
    num_validation_images: int = opt(4, "sample images per prompt per validation", group="outputs")
    validation_steps: int = opt(100, "make sample images every N steps (and at the end; 0: only at the end)",
                                group="outputs")
    validate_at_start: bool = opt(False, "also make sample images before the first step: the base model's (with "
                                  "its adapters at zero, or the token at its initializer), to compare against",
                                  group="outputs")
    validation_inference_steps: int = opt(25, "denoising steps per sample image", group="outputs")
    report_to: str = opt("jsonl", "metrics sink besides metrics.jsonl's always-on log: tensorboard, or wandb "
                         "(scalars and sample images; WANDB_MODE=offline keeps it on this disk)",
                         choices=("tensorboard", "wandb", "jsonl", "none"), group="outputs")
    logging_dir: str = opt("logs", "tensorboard dir, relative to --output-dir", group="outputs")
    # benchmark switches: the example script's approach, for `xeontune bench`'s baseline
    cache_latents: bool = opt(True, argparse.SUPPRESS, group="benchmark")
    cache_text: bool = opt(True, argparse.SUPPRESS, group="benchmark")  # frozen encoders: outputs once per prompt
    train_full_table: bool = opt(False, argparse.SUPPRESS, group="benchmark")

    # the --config file these options were read from, if any (set by parse_args, not a flag itself)
    config: str | None = None

    @property
    def placeholder_tokens(self) -> list[str]:
        assert self.placeholder_token is not None
        return [self.placeholder_token] + [f"{self.placeholder_token}_{i}" for i in range(1, self.num_vectors)]

    @property
    def lora_target_names(self) -> list[str]:
        """--lora-targets as names; [] where not given (the model family's default then)."""
        return [t.strip() for t in (self.lora_targets or "").split(",") if t.strip()]

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# Flags of the common example script that mean nothing on a CPU or here; accepted so pasted command
# lines still work, and reported once.
IGNORED_FLAGS = {
    "--enable_xformers_memory_efficient_attention": 0, "--allow_tf32": 0,
    "--no_safe_serialization": 0, "--push_to_hub": 0, "--local_rank": 1, "--dataloader_num_workers": 1,
    "--tokenizer_name": 1, "--validation_epochs": 1, "--hub_token": 1, "--hub_model_id": 1,
    "--use_8bit_adam": 0,  # bitsandbytes' 8-bit Adam: the vectors' optimizer state is a few KB here
}


def _fields() -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(TrainOptions) if f.name != "config"]


def _is_list(f: dataclasses.Field) -> bool:
    return str(f.type).startswith("list[")


def _base_type(f: dataclasses.Field) -> type:
    annotation = str(f.type)
    for name, typ in (("bool", bool), ("int", int), ("float", float)):
        if annotation.startswith(name):
            return typ
    return str


def build_parser(prog: str = "xeontune train") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog,
        # short: argparse prints the usage above every error, and all ~80 options made it 60 lines
        usage=f"%(prog)s [--method {{{','.join(methods.names())}}}] --model MODEL (--data-dir DIR | --dataset DATASET) "
        "[options]",
        description="Fine-tune a Stable Diffusion pipeline: a new token (--method textual_inversion, the default), "
        "low-rank adapters (--method lora) or every weight (--method full).",
        argument_default=argparse.SUPPRESS,
        epilog="Every flag also accepts its snake_case spelling and the example script's names "
        "(--pretrained_model_name_or_path, --train_data_dir, --dataset_name, ...). Values may come from --config FILE "
        "(YAML or TOML with the same names); the command line wins.",
    )
    parser.add_argument("--config", help="YAML or TOML file of options (same names as the flags)")
    groups: dict[str, argparse._ArgumentGroup] = {}
    for f in _fields():
        meta = f.metadata
        group = groups.setdefault(meta["group"], parser.add_argument_group(meta["group"]))
        kebab = "--" + f.name.replace("_", "-")
        aliases = (["--" + f.name] if "_" in f.name else []) + list(meta["aliases"])
        help_text, choices = meta["help"], meta["choices"]
        if f.name == "method":
            choices = methods.names()
            help_text = "what trains: " + "; ".join(f"{m.name}: {m.summary}" for m in methods.declarations()) + \
                f". {help_text}"
        if help_text is not argparse.SUPPRESS and f.default is not None and not isinstance(f.default, bool):
            help_text += f" (default: {f.default})"
        typ = _base_type(f)
        # The kebab flag is shown; aliases work the same but stay out of --help (the epilog names them).
        for names, shown in (([kebab], help_text), (aliases, argparse.SUPPRESS)):
            if not names:
                continue
            if typ is bool:
                group.add_argument(*names, dest=f.name, action=argparse.BooleanOptionalAction, help=shown)
            elif _is_list(f):  # given again for more values
                group.add_argument(*names, dest=f.name, action="append", type=typ, help=shown,
                                   metavar=f.name.upper())
            else:
                group.add_argument(*names, dest=f.name, type=typ, choices=choices, help=shown,
                                   metavar=f.name.upper() if not choices else None)
    for flag, nargs in IGNORED_FLAGS.items():
        if nargs:
            parser.add_argument(flag, dest=f"ignored{flag}", help=argparse.SUPPRESS)
        else:
            parser.add_argument(flag, dest=f"ignored{flag}", action="store_true", help=argparse.SUPPRESS)
    return parser


def load_config_file(path: str) -> dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        raise UserError(f"config file {p} {'is a folder' if p.is_dir() else 'does not exist'}")
    try:
        text = p.read_text()
    except UnicodeDecodeError:
        raise UserError(f"config file {p} is not text (YAML or TOML)") from None
    try:
        if p.suffix.lower() == ".toml":
            import tomllib

            data = tomllib.loads(text)
        else:
            import yaml

            data = yaml.safe_load(text) or {}
    except Exception as exc:  # a parse error in the user's file is the user's mistake
        raise UserError(f"cannot parse config file {p}: {str(exc).splitlines()[0]}") from None
    if not isinstance(data, dict):
        raise UserError(f"config file {p} must hold a mapping of option names to values")
    known = {f.name: f for f in _fields()}
    aliases = {a.lstrip("-"): f.name for f in _fields() for a in f.metadata["aliases"]}
    out: dict[str, Any] = {}
    for key, value in data.items():
        name = aliases.get(str(key), str(key).replace("-", "_"))
        if name not in known:
            raise UserError(f"config file {p}: unknown option {key!r}")
        typ = _base_type(known[name])
        if name == "mixed_precision" and value is False:  # YAML reads the example script's `no` as false
            value = "no"
        if name == "nproc_per_node" and isinstance(value, int) and not isinstance(value, bool):
            value = str(value)  # a count, or "auto"
        if _is_list(known[name]) and value is not None:  # one value or a list of them
            value = value if isinstance(value, list) else [value]
            if not all(isinstance(v, str) for v in value):
                raise UserError(f"config file {p}: {key} must be text or a list of texts, got {value!r}")
        elif value is not None:
            try:
                value = _config_value(value, typ)
            except ValueError:
                raise UserError(f"config file {p}: {key} must be {_TYPE_WORDS.get(typ, typ.__name__)}, "
                                f"got {value!r}") from None
        choices = known[name].metadata["choices"]
        if choices and value not in choices and not (value is None and known[name].default is None):
            raise UserError(f"config file {p}: {key} must be one of {', '.join(choices)}, got {value!r}")
        if name in HOME_PATHS and isinstance(value, str) and value.startswith("~"):
            value = os.path.expanduser(value)  # as a shell does on the command line; ranks get no shell
        out[name] = value
    return out


# The options that name a path: a config file's ~/... is the home folder, as it is on a command line.
HOME_PATHS = ("model", "data_dir", "dataset", "class_data_dir", "output_dir", "logging_dir", "resume_from_checkpoint")
_TYPE_WORDS = {str: "text (quoted)", int: "a whole number", float: "a number", bool: "true or false"}
_BOOL_WORDS = {"true": True, "yes": True, "on": True, "1": True, "false": False, "no": False, "off": False, "0": False}


def _config_value(value: Any, typ: Any) -> Any:
    """A config file's value as the option's type, never guessed: 2.7 is not a count, "treu" is not a
    bool, 2024 is not a token (ValueError). Numbers written as text are read as numbers: YAML 1.1 reads
    1e-8 (no dot) as a string."""
    if typ is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str | int) and str(value).lower() in _BOOL_WORDS:
            return _BOOL_WORDS[str(value).lower()]
    elif typ is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, str) and value.strip().lstrip("+-").isdigit():
            return int(value)
    elif typ is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            return float(value)  # ValueError for text that is not a number
    elif isinstance(value, typ):
        return value
    raise ValueError(value)


# Defaults that `xeontune launch` gives its ranks through the environment. They sit below the config
# file and the command line, so the user's own value wins in any spelling or from --config.
LAUNCH_DEFAULTS_ENV = {"dist_backend": "XEONTUNE_LAUNCH_DIST_BACKEND", "dist_timeout": "XEONTUNE_LAUNCH_DIST_TIMEOUT"}


def launch_defaults() -> dict[str, Any]:
    known = {f.name: f for f in _fields()}
    return {name: _base_type(known[name])(os.environ[var]) for name, var in LAUNCH_DEFAULTS_ENV.items()
            if os.environ.get(var)}


def parse_args(argv: list[str] | None) -> TrainOptions:
    return _parse(argv, build_parser())[0]


def _parse(argv: list[str] | None, parser: argparse.ArgumentParser) -> tuple[TrainOptions, set[str]]:
    """The options, and the names the command line or its --config file set (the rest: defaults)."""
    ns = vars(parser.parse_args(argv))
    ignored = [k.removeprefix("ignored") for k in ns if k.startswith("ignored")]
    if ignored:
        log.warning("ignoring flags with no meaning on a CPU here: %s", ", ".join(ignored))
    values: dict[str, Any] = launch_defaults()
    config = ns.pop("config", None)
    given = {k for k in ns if not k.startswith("ignored")}
    if config:
        from_file = load_config_file(config)
        values.update(from_file)
        given |= set(from_file)
    values.update({k: v for k, v in ns.items() if not k.startswith("ignored")})
    options = TrainOptions(**values)
    options.config = config
    return validate(options), given


def read_options(argv: list[str]) -> tuple[TrainOptions, set[str]]:
    """The options exactly as a rank reads them (command line, then --config, then defaults), and
    the names the user set, for a caller that is not the rank (the launcher, which ships them to
    the ranks): argparse's errors become one-line UserErrors."""
    parser = build_parser()

    def error(message: str) -> None:
        raise UserError(f"training options after --: {message}")

    parser.error = error  # type: ignore[method-assign]
    return _parse(argv, parser)


# What belongs to which method is each method's declaration (train/methods/: its options group, the
# options it takes from others, those it requires, its defaults). An option of another method set to
# anything but its default is a one-line error: it would be silently ignored.
TOKEN_METHOD = "textual_inversion"  # whose token another method may train beside its own (pivotal tuning)
PRIOR_GROUP = "prior preservation"  # DreamBooth's class images: a method takes them if it declares so


def method_of_option(f: dataclasses.Field) -> str | None:
    """The method an option belongs to, or None for an option of every method (or of prior preservation's
    shared group)."""
    for method in methods.declarations():
        if f.name in method.own or f.metadata["group"] == method.group:
            return method.name
    return None


def _check_method_options(o: TrainOptions) -> None:
    method = methods.get(o.method)
    for f in _fields():
        owner = method_of_option(f)
        if owner not in (None, o.method) and f.name not in method.borrows and getattr(o, f.name) != f.default:
            raise UserError(f"{_flag(f.name)} is an option of --method {owner}, not of --method {o.method}")
        if f.metadata["group"] == PRIOR_GROUP and not method.prior_preservation and getattr(o, f.name) != f.default:
            raise UserError(f"{_flag(f.name)} is prior preservation's, which --method {o.method} does not take")
    for name, value in method.defaults.items():
        if getattr(o, name) is None:
            setattr(o, name, value)


PRIOR_ONLY = ("class_data_dir", "class_prompt", "num_class_images", "prior_loss_weight", "class_inference_steps",
              "sample_batch_size")
PIVOTAL_ONLY = ("num_vectors", "learnable_property", "train_token_fraction")


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def require_dir(path: str | Path, what: str) -> None:
    """A one-line error unless ``path`` is a folder (light: the entry point checks --data-dir with it
    before importing torch, and reading the images checks it again)."""
    if not Path(path).is_dir():
        raise UserError(f"{what} {path} does not exist or is not a directory")

def validate(o: TrainOptions) -> TrainOptions:
    """Check what can be checked without loading anything; raise UserError with one line."""
    if o.method not in methods.names():
        raise UserError(f"--method must be one of {', '.join(methods.names())}, got {o.method!r}")
    method = methods.get(o.method)
    no_data = o.data_dir in (None, "") and o.dataset in (None, "")
    missing = [("--data-dir (or --dataset)" if n == "data_dir" else _flag(n))
               for n in ("model", "data_dir", *method.required)
               if (no_data if n == "data_dir" else getattr(o, n) in (None, ""))]
    if missing:
        raise UserError(f"missing required option(s): {', '.join(missing)}")
    if o.data_dir not in (None, "") and o.dataset not in (None, ""):
        raise UserError("--dataset and --data-dir both name the training images: give one")
    if o.dataset in (None, "") and o.image_column != TrainOptions.image_column:
        raise UserError("--image-column needs --dataset (a folder's images are its image files)")
    if o.dataset is not None and not (o.dataset.strip() and o.image_column.strip() and o.caption_column.strip()):
        raise UserError("--dataset, --image-column and --caption-column must not be empty")
    if o.center_crop and o.random_crop:
        raise UserError("--center-crop and --random-crop each choose the square: give one")
    if o.latent_cache_dir is not None and not o.latent_cache_dir.strip():
        raise UserError("--latent-cache-dir must not be empty (none: keep the latents in memory only)")
    if o.random_flip is None and o.flip_p != TrainOptions.flip_p and not method.defaults["random_flip"]:
        raise UserError(f"--flip-p needs --random-flip: --method {o.method} does not mirror images unless asked")
    _check_method_options(o)
    if o.mixed_precision == "no":
        o.mixed_precision = "fp32"
    o.nproc_per_node = str(o.nproc_per_node).strip().lower()  # a config file may give a number
    if o.mixed_precision == "fp16":
        raise UserError("--mixed-precision fp16 is not supported on CPUs; use bf16 (with AMX) or fp32")
    finite = math.isfinite
    checks = [
        (o.num_vectors >= 1, f"--num-vectors must be at least 1, got {o.num_vectors}"),
        (0 <= o.seed < 2**32, f"--seed must be between 0 and {2**32 - 1}, got {o.seed}"),
        (o.resolution > 0 and o.resolution % 8 == 0, f"--resolution must be a positive multiple of 8, got {o.resolution}"),
        (o.train_batch_size >= 1, "--train-batch-size must be at least 1"),
        (o.bucket_step >= 8 and o.bucket_step % 8 == 0, "--bucket-step must be a positive multiple of 8"),
        (o.gradient_accumulation_steps >= 1, "--gradient-accumulation-steps must be at least 1"),
        (o.max_train_steps is None or o.max_train_steps >= 1, "--max-train-steps must be at least 1"),
        (o.num_train_epochs >= 1, "--num-train-epochs must be at least 1"),
        (o.repeats >= 1, "--repeats must be at least 1"),
        (finite(o.learning_rate) and 0 < o.learning_rate <= 1e3, "--learning-rate must be positive and at most 1000"),
        (o.lr_warmup_steps >= 0, "--lr-warmup-steps must be >= 0"),
        (o.lr_num_cycles >= 1, "--lr-num-cycles must be at least 1"),
        (finite(o.lr_power) and o.lr_power > 0, "--lr-power must be positive"),
        (0 <= o.adam_beta1 < 1 and 0 <= o.adam_beta2 < 1, "--adam-beta1 and --adam-beta2 must be in [0, 1)"),
        (finite(o.adam_epsilon) and o.adam_epsilon >= 0, "--adam-epsilon must be >= 0"),
        (finite(o.adam_weight_decay) and o.adam_weight_decay >= 0, "--adam-weight-decay must be >= 0"),
        (0.0 <= o.flip_p <= 1.0, "--flip-p must be between 0 and 1"),
        (o.num_validation_images >= 1, "--num-validation-images must be at least 1"),
        (o.validation_steps >= 0, "--validation-steps must be >= 0"),
        (o.validation_inference_steps >= 1, "--validation-inference-steps must be at least 1"),
        (not o.validate_at_start or o.validation_prompt, "--validate-at-start needs --validation-prompt"),
        (o.save_steps >= 0 and o.checkpointing_steps >= 0, "--save-steps and --checkpointing-steps must be >= 0"),
        (o.checkpoints_total_limit is None or o.checkpoints_total_limit >= 1, "--checkpoints-total-limit must be >= 1"),
        (o.max_grad_norm is None or o.max_grad_norm > 0, "--max-grad-norm must be positive"),
        (o.snr_gamma is None or (finite(o.snr_gamma) and o.snr_gamma > 0), "--snr-gamma must be positive"),
        (finite(o.logit_std) and o.logit_std > 0, "--logit-std must be positive"),
        (finite(o.logit_mean) and finite(o.mode_scale), "--logit-mean and --mode-scale must be finite"),
        (finite(o.noise_offset) and o.noise_offset >= 0, "--noise-offset must be >= 0"),
        (0 < o.ema_decay < 1, "--ema-decay must be between 0 and 1"),
        (o.ema_decay == TrainOptions.ema_decay or o.use_ema, "--ema-decay needs --use-ema"),
        (finite(o.dist_timeout) and o.dist_timeout > 0, "--dist-timeout must be a positive number of seconds"),
        (o.nproc_per_node == "auto" or (o.nproc_per_node.isdigit() and int(o.nproc_per_node) >= 1),
         f"--nproc-per-node must be a positive number or auto, got {o.nproc_per_node!r}"),
        (finite(o.dist_wait_timeout) and o.dist_wait_timeout > 0, "--dist-wait-timeout must be a positive number of seconds"),
        (o.placeholder_token != "", "--placeholder-token must not be empty"),
        (o.placeholder_token is None or not any(c.isspace() for c in o.placeholder_token),
         "--placeholder-token must not contain spaces"),
        (o.instance_prompt is None or bool(o.instance_prompt.strip()),
         "--instance-prompt must not be empty (an image without a caption trains on it)"),
        (o.rank >= 1, f"--rank must be at least 1, got {o.rank}"),
        (o.lora_alpha is None or (finite(o.lora_alpha) and o.lora_alpha > 0), "--lora-alpha must be positive"),
        (0.0 <= o.lora_dropout < 1.0, "--lora-dropout must be in [0, 1)"),
        (0.0 < o.train_token_fraction <= 1.0, "--train-token-fraction must be in (0, 1]"),
        (not o.with_prior_preservation or (o.class_data_dir and o.class_prompt),
         "--with-prior-preservation needs --class-data-dir and --class-prompt"),
        (o.num_class_images >= 1, "--num-class-images must be at least 1"),
        (finite(o.prior_loss_weight) and o.prior_loss_weight >= 0, "--prior-loss-weight must be >= 0"),
        (o.class_inference_steps >= 1, "--class-inference-steps must be at least 1"),
        (o.sample_batch_size >= 1, "--sample-batch-size must be at least 1"),
        (o.method == TOKEN_METHOD or (o.placeholder_token is None) == (o.initializer_token is None),
         "pivotal tuning needs both --placeholder-token and --initializer-token"),
        (o.lora_targets is None or bool(o.lora_target_names), "--lora-targets must name at least one module"),
    ]
    for ok, message in checks:
        if not ok:
            raise UserError(message)
    if o.pack_weights == "on" and families.DENOISER in method.trains(o):
        raise UserError(f"--pack-weights on packs a frozen UNet's or transformer's weights; --method {o.method} trains them")
    if o.fused_backward_pass and (clash := _fused_backward_clash(o)):
        raise UserError(f"--fused-backward-pass steps each weight as soon as its gradient is ready: not with {clash}")
    if o.shard in ("gradients", "full") and (blocker := fsdp_refusal(o)):
        raise UserError(f"--shard {o.shard} (FSDP) does not take {blocker}; --shard optimizer does")
    # An option that would change nothing is a mistake to say, not to ignore (a user believes it acts).
    adam_only = [_flag(n) for n in ("adam_beta1", "adam_beta2", "adam_epsilon")
                 if o.optimizer != "adamw" and getattr(o, n) != getattr(TrainOptions, n)]
    if adam_only:
        raise UserError(f"{' and '.join(adam_only)} {'is' if len(adam_only) == 1 else 'are'} AdamW's; --optimizer "
                        f"{o.optimizer} does not use {'it' if len(adam_only) == 1 else 'them'}")
    pivotal = o.method != TOKEN_METHOD and "placeholder_token" in method.borrows  # the token beside what trains
    for needed, names in (("--with-prior-preservation", () if o.with_prior_preservation else PRIOR_ONLY),
                          ("--placeholder-token (pivotal tuning)",
                           PIVOTAL_ONLY if pivotal and o.placeholder_token is None else ())):
        stray = [_flag(n) for n in names if getattr(o, n) != getattr(TrainOptions, n)]
        if stray:
            raise UserError(f"{' and '.join(stray)} {'needs' if len(stray) == 1 else 'need'} {needed}")
    if not o.random_flip:
        o.flip_p = 0.0
    return o


def _fused_backward_clash(o: TrainOptions) -> str | None:
    """The option that --fused-backward-pass cannot run with, or None."""
    if o.max_grad_norm:
        return "--max-grad-norm (clipping needs every gradient first)"
    if o.compile:
        return "--compile (a compiled backward hands every gradient back at once)"
    if o.shard not in ("none", "auto"):
        return f"--shard {o.shard}"
    if o.nproc_per_node != "1":
        return f"--nproc-per-node {o.nproc_per_node} (it runs in one process; across ranks --shard saves memory)"
    return None


def fsdp_refusal(o: TrainOptions) -> str | None:
    """What keeps a run from FSDP's sharded weights (--shard gradients|full), or None: transformers'
    Adafactor cannot step sharded (DTensor) weights."""
    for blocker, present in (("--optimizer adafactor", o.optimizer == "adafactor"), ("--compile", o.compile)):
        if present:
            return blocker
    return None


if __name__ == "__main__":  # pragma: no cover - handy for checking a config file
    print(parse_args(sys.argv[1:]))
