"""A pipeline as one ``.safetensors`` in the original Stable Diffusion layout: what A1111, ComfyUI and
kohya read, and what diffusers' ``from_single_file`` loads.

The names are the exact inverse of diffusers' own single-file loader (``loaders/single_file_utils.py``:
``convert_ldm_unet_checkpoint``, ``convert_ldm_vae_checkpoint``, ``convert_ldm_clip_checkpoint``,
``convert_open_clip_checkpoint``), so the file loads back into the same weights, bit for bit:

* UNet ``model.diffusion_model.*``: ``input_blocks`` / ``middle_block`` / ``output_blocks``, numbered
  one slot per resnet (plus one for a down block's downsampler), ``.0`` the resnet, ``.1`` the
  transformer, the upsampler after them.
* VAE ``first_stage_model.*``: ``down.N.block.M``, ``up`` numbered from the bottom, ``mid.attn_1`` with
  1x1-conv weights (4-D) where diffusers has Linear layers.
* Text encoders, under the prefixes their model family gives (``Family.single_file_text``): OpenAI
  CLIP (SD1.x, SDXL's first) keeps the HF names under
  ``cond_stage_model.transformer.`` / ``conditioner.embedders.0.transformer.``; OpenCLIP (SD2.x,
  SDXL's second) is OpenCLIP's own module layout under ``cond_stage_model.model.`` /
  ``conditioner.embedders.1.model.``: q, k and v concatenated into ``in_proj_*``, ``resblocks``,
  ``ln_final``, ``positional_embedding`` and ``text_projection`` as a matrix (HF's Linear weight, transposed).

A tensor is written as a view of the model's own wherever the layouts agree: saving costs memory only
for the concatenated q/k/v, the transposed projections and, at another ``dtype``, the cast copy.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from xeontune.io import atomic_path

UNET = "model.diffusion_model."
VAE = "first_stage_model."
# A pipeline's text encoders in the file: (the pipeline's attribute, key prefix, whether OpenCLIP's layout)
TextLayout = list[tuple[str, str, bool]]

# diffusers' ResnetBlock2D parts as the original UNet's ResBlock names them (in_layers = norm, act, conv)
_UNET_RESNET = {"norm1": "in_layers.0", "conv1": "in_layers.2", "norm2": "out_layers.0", "conv2": "out_layers.3",
                "time_emb_proj": "emb_layers.1", "conv_shortcut": "skip_connection"}
_UNET_TOP = {"conv_in": "input_blocks.0.0", "time_embedding.linear_1": "time_embed.0",
             "time_embedding.linear_2": "time_embed.2", "conv_norm_out": "out.0", "conv_out": "out.2",
             # SDXL's size/crop + pooled-text embedding ("text_time"): the original's label_emb
             "add_embedding.linear_1": "label_emb.0.0", "add_embedding.linear_2": "label_emb.0.2"}
_VAE_ATTENTION = {"group_norm": "norm", "to_q": "q", "to_k": "k", "to_v": "v", "to_out.0": "proj_out"}
_OPEN_CLIP_LAYER = {"layer_norm1": "ln_1", "layer_norm2": "ln_2", "mlp.fc1": "mlp.c_fc", "mlp.fc2": "mlp.c_proj",
                    "self_attn.out_proj": "attn.out_proj"}
_OPEN_CLIP_TOP = {"embeddings.token_embedding.weight": "token_embedding.weight",
                  "embeddings.position_embedding.weight": "positional_embedding",
                  "final_layer_norm.weight": "ln_final.weight", "final_layer_norm.bias": "ln_final.bias"}


def _unknown(part: str, key: str) -> ValueError:
    # a part this mapping does not know would be left out of the file, or load nowhere: refuse instead
    return ValueError(f"{part} weight {key!r} has no place in the original Stable Diffusion layout")


def _split(key: str, head: int) -> tuple[list[str], str]:
    parts = key.split(".")
    return parts[:head], ".".join(parts[head:])


def _unet_name(key: str, per_block: int, up_attention: set[int]) -> str:
    parts = key.split(".")
    if parts[0] in ("down_blocks", "up_blocks"):
        block, kind, j, rest = int(parts[1]), parts[2], int(parts[3]), ".".join(parts[4:])
    elif parts[0] == "mid_block":
        block, kind, j, rest = 0, parts[1], int(parts[2]), ".".join(parts[3:])
    else:
        module, _, leaf = key.rpartition(".")
        if module not in _UNET_TOP:
            raise _unknown("UNet", key)
        return f"{_UNET_TOP[module]}.{leaf}"
    first, _, tail = rest.partition(".")
    if kind == "resnets" and first in _UNET_RESNET:
        rest = f"{_UNET_RESNET[first]}.{tail}"
    elif kind.endswith("samplers") and first == "conv":
        rest = tail
    elif kind != "attentions":
        raise _unknown("UNet", key)
    slots = per_block + 1  # a down block: its resnets, then its downsampler; an up block: one resnet more
    if parts[0] == "down_blocks":
        slot = 1 + block * slots  # input_blocks.0 is conv_in
        places = {"resnets": f"input_blocks.{slot + j}.0", "attentions": f"input_blocks.{slot + j}.1",
                  "downsamplers": f"input_blocks.{slot + per_block}.0.op"}
    elif parts[0] == "up_blocks":
        slot = block * slots
        # the upsampler follows the block's last resnet and, where the block has them, its transformer
        places = {"resnets": f"output_blocks.{slot + j}.0", "attentions": f"output_blocks.{slot + j}.1",
                  "upsamplers": f"output_blocks.{slot + per_block}.{2 if block in up_attention else 1}.conv"}
    else:  # resnet, transformer, resnet
        places = {"resnets": f"middle_block.{2 * j}", "attentions": "middle_block.1"}
    if kind not in places:
        raise _unknown("UNet", key)
    return f"{places[kind]}.{rest}"


def _unet(unet: Any) -> Iterator[tuple[str, torch.Tensor]]:
    per_block = unet.config.layers_per_block
    if not isinstance(per_block, int):  # the original layout (and diffusers' loader) numbers blocks evenly
        raise ValueError("a UNet with a different number of layers per block has no original layout")
    up_attention = {i for i, block in enumerate(unet.up_blocks) if getattr(block, "attentions", None)}
    for key, tensor in unet.state_dict().items():
        yield UNET + _unet_name(key, per_block, up_attention), tensor


def _vae_name(key: str, up_blocks: int) -> str:
    if key.startswith(("quant_conv.", "post_quant_conv.")):
        return key
    side, _, rest = key.partition(".")
    if side not in ("encoder", "decoder"):
        raise _unknown("VAE", key)
    parts = rest.split(".")
    if rest.startswith(("conv_in.", "conv_out.")):
        name = rest
    elif rest.startswith("conv_norm_out."):
        name = "norm_out." + parts[-1]
    elif parts[0] in ("down_blocks", "up_blocks") and len(parts) > 4:
        # the original numbers the decoder's up blocks from the bottom, as its encoder's down blocks
        index = int(parts[1]) if parts[0] == "down_blocks" else up_blocks - 1 - int(parts[1])
        where = f"{'down' if parts[0] == 'down_blocks' else 'up'}.{index}"
        tail = ".".join(parts[4:])
        if parts[2] == "resnets":
            name = f"{where}.block.{parts[3]}.{tail.replace('conv_shortcut', 'nin_shortcut')}"
        elif parts[2] in ("downsamplers", "upsamplers"):
            name = f"{where}.{parts[2][:-2]}.{tail}"  # downsample.conv / upsample.conv
        else:
            raise _unknown("VAE", key)
    elif parts[:2] == ["mid_block", "resnets"]:
        name = f"mid.block_{int(parts[2]) + 1}.{'.'.join(parts[3:]).replace('conv_shortcut', 'nin_shortcut')}"
    elif parts[:3] == ["mid_block", "attentions", "0"]:
        module, _, leaf = ".".join(parts[3:]).rpartition(".")
        if module not in _VAE_ATTENTION:
            raise _unknown("VAE", key)
        name = f"mid.attn_1.{_VAE_ATTENTION[module]}.{leaf}"
    else:
        raise _unknown("VAE", key)
    return f"{side}.{name}"


def _vae(vae: Any) -> Iterator[tuple[str, torch.Tensor]]:
    up_blocks = len(vae.decoder.up_blocks)
    for key, tensor in vae.state_dict().items():
        name = _vae_name(key, up_blocks)
        if ".mid.attn_1." in name and name.endswith(".weight") and tensor.ndim == 2:
            tensor = tensor.reshape(*tensor.shape, 1, 1)  # the original's 1x1 convs: a view, no copy
        yield VAE + name, tensor


def _text_state(encoder: Any) -> dict[str, torch.Tensor]:
    """The encoder's state with HF's ``text_model.`` prefix dropped: transformers >= 5.6 flattened
    CLIPTextModel (no ``text_model``), CLIPTextModelWithProjection still wraps it."""
    return {key.removeprefix("text_model."): tensor for key, tensor in encoder.state_dict().items()}


def _clip(encoder: Any, prefix: str) -> Iterator[tuple[str, torch.Tensor]]:
    for key, tensor in _text_state(encoder).items():
        yield prefix + (key if key.startswith("text_projection.") else "text_model." + key), tensor


def _open_clip(encoder: Any, prefix: str) -> Iterator[tuple[str, torch.Tensor]]:
    state = _text_state(encoder)
    for key, tensor in state.items():
        if key in _OPEN_CLIP_TOP:
            yield prefix + _OPEN_CLIP_TOP[key], tensor
        elif key.startswith("encoder.layers."):
            (_, _, layer), rest = _split(key, 3)
            module, _, leaf = rest.rpartition(".")
            if module in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"):
                if module == "self_attn.q_proj":  # OpenCLIP's nn.MultiheadAttention: q, k, v in one tensor
                    parts = [state[f"encoder.layers.{layer}.self_attn.{p}_proj.{leaf}"] for p in "qkv"]
                    yield f"{prefix}transformer.resblocks.{layer}.attn.in_proj_{leaf}", torch.cat(parts)
            elif module in _OPEN_CLIP_LAYER:
                yield f"{prefix}transformer.resblocks.{layer}.{_OPEN_CLIP_LAYER[module]}.{leaf}", tensor
            else:
                raise _unknown("text encoder", key)
        elif key != "text_projection.weight":
            raise _unknown("text encoder", key)
    projection = state.get("text_projection.weight")
    if projection is None:
        # SD2 (CLIPTextModel, no projection): OpenCLIP's module has one, which SD2 never applies (it
        # conditions on the penultimate layer); the identity stands for "none" and gives the matrix
        # loaders expect. diffusers skips it, reading only its size.
        width = state["final_layer_norm.weight"]
        yield prefix + "text_projection", torch.eye(width.shape[0], dtype=width.dtype)
    else:
        yield prefix + "text_projection", projection.T.contiguous()  # x @ P, where HF's Linear does x @ W.T


def _original_tensors(pipe: Any, text: TextLayout) -> Iterator[tuple[str, torch.Tensor]]:
    yield from _unet(pipe.unet)  # the families whose single_file_text says a layout have a UNet
    yield from _vae(pipe.vae)
    for attribute, prefix, open_clip in text:
        yield from (_open_clip if open_clip else _clip)(getattr(pipe, attribute), prefix)
    scheduler = getattr(pipe, "scheduler", None)
    config = getattr(scheduler, "config", {})
    if config.get("prediction_type") == "v_prediction":
        # ComfyUI takes an SDXL file with this key for v-prediction (SD2's it infers from the weights;
        # diffusers ignores it); "ztsnr" marks a zero-terminal-SNR schedule the same way
        yield "v_pred", torch.tensor([])
        if config.get("rescale_betas_zero_snr"):
            yield "ztsnr", torch.tensor([])


def original_state_dict(pipe: Any, text: TextLayout) -> dict[str, torch.Tensor]:
    """The UNet's, the VAE's and the text encoder(s)' state under the original layout's names.

    ``text``: where the text encoders go (``Family.single_file_text(pipe)``). The tensors are views
    of the model's own except the concatenated q/k/v and the transposed (or identity) projections."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in _original_tensors(pipe, text):
        if name in out:  # two weights under one name: one would silently be lost
            raise ValueError(f"two weights map to {name!r}")
        out[name] = tensor
    return out


def save_single_file(pipe: Any, text: TextLayout, path: Path, dtype: torch.dtype | None = None,
                     metadata: dict[str, str] | None = None) -> Path:
    """Write ``pipe`` (its UNet, VAE and text encoders) to ``path`` as one original-layout safetensors
    file, atomically; ``dtype`` (bf16, fp32: --save-precision) casts floating-point tensors, None keeps
    each as it is; ``metadata`` goes into the header (string values).

    Loading it back in diffusers: ``StableDiffusionPipeline`` / ``StableDiffusionXLPipeline
    .from_single_file(path)`` infers the architecture from the weights and fetches that config from the
    Hub: SD1.x, SDXL base, and SD2 as SD2.1-768 (1024-wide cross-attention), whose scheduler predicts v.
    That is right for SD1.x, SD2.x-768-v and SDXL (epsilon). Pass ``config=`` the base model's diffusers
    folder or Hub id (which also gives the scheduler, hence the prediction type) for anything else: an
    SD2 base (epsilon) model (e.g. ``config="stabilityai/stable-diffusion-2-base"``), an SDXL v-prediction
    model, a model of other dimensions, or offline (nothing is fetched then). A1111 and ComfyUI read the
    file as it is (ComfyUI takes the SDXL ``v_pred`` marker written for a v-prediction scheduler)."""
    tensors: dict[str, torch.Tensor] = {}
    for name, tensor in _original_tensors(pipe, text):
        if dtype is not None and tensor.is_floating_point() and tensor.dtype != dtype:
            tensor = tensor.to(dtype)  # one tensor at a time: a concatenation made above is let go here
        if not tensor.is_contiguous():  # e.g. a channels_last conv weight: safetensors wants dense rows
            tensor = tensor.contiguous()
        if name in tensors:
            raise ValueError(f"two weights map to {name!r}")
        tensors[name] = tensor
    from safetensors.torch import save_file

    with atomic_path(path, durable=True) as tmp:
        save_file(tensors, str(tmp), metadata=metadata)
    return Path(path)
