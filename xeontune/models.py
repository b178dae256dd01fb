"""Offline Stable Diffusion pipelines with random weights, and the sample concept images.

Nothing here downloads anything: the tokenizer's vocab and merges are written by this module, the
weights are random, and ``save_pretrained`` gives the same folder layout as a hub model, so the
trainer loads both the same way.

* ``tiny``: a few MB, trains a step in well under a second; for tests and `make single-node-test`.
* ``sd15-arch``: Stable Diffusion 1.5 dimensions (860M-parameter UNet, 49,408-token CLIP vocab,
  3.9 GB on disk); realistic for benchmarks, useless for images.
* ``sd2-tiny``: SD2's shape at tiny size: a GELU text encoder (OpenCLIP's activation), linear
  projections in the UNet's transformers and a v-prediction scheduler.
* ``sd2-arch``: Stable Diffusion 2 base dimensions (865M-parameter UNet with linear projections and heads of
  64, OpenCLIP ViT-H's 23-layer text encoder as SD2 uses it, epsilon prediction; about 5.2 GB on disk), the
  model of MosaicML's diffusion benchmark; for benchmarks only.
* ``sdxl-tiny``: SDXL's shape at tiny size: two text encoders (the second with a projection, whose
  pooled output the UNet takes as ``text_embeds``), two tokenizers, a UNet conditioned on both
  encoders' hidden states concatenated plus six size/crop ``time_ids``.
* ``sdxl-arch``: SDXL-base dimensions (2,567 M-parameter UNet, 695 M-parameter second text encoder,
  about 14 GB in fp32); for benchmarks only.
* ``sd3-tiny``: SD3.5's shape at tiny size: an MMDiT transformer (patches of 2, RMS-normed queries and
  keys, a dual-attention block then a context-only last block), CLIP-L and CLIP-G with projections, a T5
  encoder (its tokenizer a Unigram one over the project's words), a 16-channel VAE with a latent shift, a
  flow-matching scheduler with SD3's shift of 3.
* ``sd35m-arch``: SD3.5 Medium's dimensions (its 2.5 B-parameter MMDiT-X, CLIP-L, OpenCLIP bigG, T5-XXL's
  4.76 B-parameter encoder), made and saved in bf16 one part at a time, as the hub's half-precision files
  (about 17 GB; 34 GB in fp32 would not fit a 24 GB machine while it is made); for benchmarks only.
* ``flux-arch``: Flux.1-dev's widths at reduced depth (2 of 19 dual-stream, 4 of 38 single-stream blocks),
  with its full-size CLIP-L and T5-XXL, in bf16 as sd35m-arch; for benchmarks only, and it says so when built.
* ``flux-tiny``: Flux.1-dev's shape at tiny size: a transformer over 2x2-packed 16-channel latents (dual-
  and single-stream blocks, rotary position ids, a guidance embedding), CLIP-L's pooled output and a T5
  encoder, the dynamically shifted flow-matching scheduler.
"""

from __future__ import annotations

import json
import random
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from xeontune.errors import UserError
from xeontune.io import atomic_dir, atomic_path, file_in_the_way
from xeontune.quiet import quiet_progress_bars

SPECIAL_TOKENS = ("<|startoftext|>", "<|endoftext|>")
# Words the tiny tokenizer knows as single tokens: the prompt templates' words and a few usable
# initializer tokens. Anything else still tokenizes, letter by letter.
EXTRA_WORDS = ["toy", "robot", "cat", "dog", "sculpture", "object", "thing", "style", "painting", "art", "drawing", "picture", "image", "red", "blue", "green", "orange", "small", "big"]


@dataclass(frozen=True)
class PipelineDims:
    text_hidden: int
    text_layers: int
    text_heads: int
    text_intermediate: int
    text_act: str
    vocab_size: int | None  # None: just the words we know; else padded to this size
    unet_channels: tuple[int, ...]
    unet_layers: int
    unet_head_dim: int
    vae_channels: tuple[int, ...]
    vae_layers: int
    vae_groups: int
    sample_size: int  # default image side in pixels
    family: str = "sd"  # "sd" (StableDiffusionPipeline) or "sdxl" (StableDiffusionXLPipeline)
    prediction_type: str = "epsilon"  # SD2-768 and later: "v_prediction"
    linear_projection: bool = False  # SD2 and SDXL: Linear instead of 1x1 conv around attention
    plain_block: str = "last"  # which UNet down block has no cross-attention: SD1/2 the last, SDXL the first
    transformer_layers: tuple[int, ...] | None = None  # per down block (SDXL: 1, 2, 10); None: one each
    head_dims: tuple[int, ...] | None = None  # heads per block (diffusers' attention_head_dim); None: unet_head_dim
    # SDXL's second text encoder (CLIPTextModelWithProjection) and the UNet's "text_time" embedding
    text2_hidden: int = 0
    text2_layers: int = 0
    text2_heads: int = 0
    text2_intermediate: int = 0
    time_embed_dim: int = 0  # addition_time_embed_dim: each of the six time_ids is embedded to this width
    vae_scaling: float = 0.18215


DIMS = {
    "tiny": PipelineDims(
        text_hidden=32, text_layers=2, text_heads=4, text_intermediate=64, text_act="quick_gelu",
        vocab_size=None, unet_channels=(32, 64), unet_layers=1, unet_head_dim=8,
        vae_channels=(16, 16, 32, 32), vae_layers=1, vae_groups=8, sample_size=64,
    ),
    "sd15-arch": PipelineDims(
        text_hidden=768, text_layers=12, text_heads=12, text_intermediate=3072, text_act="quick_gelu",
        vocab_size=49408, unet_channels=(320, 640, 1280, 1280), unet_layers=2, unet_head_dim=8,
        vae_channels=(128, 256, 512, 512), vae_layers=2, vae_groups=32, sample_size=512,
    ),
    "sd2-tiny": PipelineDims(
        text_hidden=32, text_layers=2, text_heads=4, text_intermediate=64, text_act="gelu",
        vocab_size=None, unet_channels=(32, 64), unet_layers=1, unet_head_dim=8,
        vae_channels=(16, 16, 32, 32), vae_layers=1, vae_groups=8, sample_size=64,
        prediction_type="v_prediction", linear_projection=True, head_dims=(2, 4),
    ),
    "sd2-arch": PipelineDims(
        text_hidden=1024, text_layers=23, text_heads=16, text_intermediate=4096, text_act="gelu",
        vocab_size=49408, unet_channels=(320, 640, 1280, 1280), unet_layers=2, unet_head_dim=64,
        vae_channels=(128, 256, 512, 512), vae_layers=2, vae_groups=32, sample_size=512,
        linear_projection=True, head_dims=(5, 10, 20, 20),
    ),
    "sdxl-tiny": PipelineDims(
        text_hidden=32, text_layers=2, text_heads=4, text_intermediate=64, text_act="quick_gelu",
        vocab_size=None, unet_channels=(32, 64), unet_layers=1, unet_head_dim=8,
        vae_channels=(16, 16, 32, 32), vae_layers=1, vae_groups=8, sample_size=64,
        family="sdxl", linear_projection=True, plain_block="first", transformer_layers=(1, 2), head_dims=(2, 4),
        text2_hidden=64, text2_layers=2, text2_heads=4, text2_intermediate=128, time_embed_dim=8,
        vae_scaling=0.13025,
    ),
    "sdxl-arch": PipelineDims(
        text_hidden=768, text_layers=12, text_heads=12, text_intermediate=3072, text_act="quick_gelu",
        vocab_size=49408, unet_channels=(320, 640, 1280), unet_layers=2, unet_head_dim=64,
        vae_channels=(128, 256, 512, 512), vae_layers=2, vae_groups=32, sample_size=1024,
        family="sdxl", linear_projection=True, plain_block="first", transformer_layers=(1, 2, 10),
        head_dims=(5, 10, 20), text2_hidden=1280, text2_layers=32, text2_heads=20, text2_intermediate=5120,
        time_embed_dim=256, vae_scaling=0.13025,
    ),
}


@dataclass(frozen=True)
class MMDiTDims:
    """SD3's parts: the transformer's, the three text encoders' and the VAE's sizes."""

    layers: int
    heads: int
    head_dim: int
    clip_l: tuple[int, int, int, int]  # hidden, layers, heads, intermediate (CLIP-L, quick GELU)
    clip_g: tuple[int, int, int, int]  # the same (CLIP-G, GELU)
    t5: tuple[int, int, int, int, int]  # d_model, layers, heads, d_kv, d_ff
    vae_channels: tuple[int, ...]
    vae_layers: int
    vae_groups: int
    sample_size: int  # default image side in pixels
    dual_attention_layers: tuple[int, ...] = ()  # SD3.5: the blocks with a second self-attention
    family: str = "sd3"
    single_layers: int = 0  # Flux: its single-stream blocks after the dual-stream ones
    rope_axes: tuple[int, ...] = ()  # Flux: the rotary embedding's dims per position axis (they sum to head_dim)
    vocab_size: int | None = None  # the CLIP tokenizers' (None: the project's words; else padded to this size)
    half: bool = False  # built and saved in bf16, as the hub's SD3.5/Flux files are half precision (and so that
    # a 4.76 B-parameter T5 never sits in memory in fp32: 19 GB)
    t5_vocab: int | None = None  # likewise T5's
    pos_embed_max: int = 0  # SD3's position-embedding grid (0: the latent side)


SD3_DIMS = {
    "sd3-tiny": MMDiTDims(
        layers=2, heads=4, head_dim=16, clip_l=(32, 2, 4, 64), clip_g=(64, 2, 4, 128), t5=(128, 2, 4, 16, 256),
        vae_channels=(16, 16, 32, 32), vae_layers=1, vae_groups=8, sample_size=64, dual_attention_layers=(0,),
    ),
    "flux-tiny": MMDiTDims(
        layers=1, heads=2, head_dim=16, clip_l=(32, 2, 4, 64), clip_g=(0, 0, 0, 0), t5=(128, 2, 4, 16, 256),
        vae_channels=(16, 16, 32, 32), vae_layers=1, vae_groups=8, sample_size=64, family="flux",
        single_layers=2, rope_axes=(4, 6, 6),
    ),
    # stabilityai/stable-diffusion-3.5-medium's configs: an MMDiT-X of 24 blocks (the first 13 with a second
    # self-attention), CLIP-L, OpenCLIP bigG, T5-XXL's encoder (4.76 B parameters, 19 GB in fp32)
    "sd35m-arch": MMDiTDims(
        layers=24, heads=24, head_dim=64, clip_l=(768, 12, 12, 3072), clip_g=(1280, 32, 20, 5120),
        t5=(4096, 24, 64, 64, 10240), vae_channels=(128, 256, 512, 512), vae_layers=2, vae_groups=32,
        sample_size=1024, dual_attention_layers=tuple(range(13)), vocab_size=49408, t5_vocab=32128, pos_embed_max=384,
        half=True,
    ),
    # black-forest-labs/FLUX.1-dev's widths at reduced depth: 2 of its 19 dual-stream and 4 of its 38
    # single-stream blocks (1.4 B of 11.9 B parameters), so that a step's per-block cost is measured at real
    # width on a node that would not hold the whole model beside the example's copy of it
    "flux-arch": MMDiTDims(
        layers=2, heads=24, head_dim=128, clip_l=(768, 12, 12, 3072), clip_g=(0, 0, 0, 0),
        t5=(4096, 24, 64, 64, 10240), vae_channels=(128, 256, 512, 512), vae_layers=2, vae_groups=32,
        sample_size=1024, family="flux", single_layers=4, rope_axes=(16, 56, 56), vocab_size=49408, t5_vocab=32128,
        half=True,
    ),
}
KINDS = (*DIMS, *SD3_DIMS)
# what a kind's build says beside the path (a model that is not the real one's shape whole)
NOTES = {"flux-arch": "Flux.1-dev's widths at reduced depth: 2 of its 19 dual-stream and 4 of its 38 single-stream "
                      "blocks (1.3 B of its 11.9 B transformer parameters); CLIP-L and T5-XXL at full size"}


def _byte_to_unicode() -> dict[int, str]:
    """CLIP's byte-level alphabet: printable bytes stand for themselves, the rest map above 255."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def tokenizer_files(words: list[str], vocab_size: int | None) -> tuple[dict[str, int], list[str]]:
    """A CLIP-style BPE vocab and merge list in which every word of ``words`` is one token."""
    alphabet = list(_byte_to_unicode().values())
    vocab: list[str] = alphabet + [c + "</w>" for c in alphabet]
    merges: list[str] = []
    seen = set(vocab)
    for word in sorted(set(words)):
        # Merge left to right: "t o", "to y</w>" makes "toy</w>" one token.
        pieces = list(word[:-1]) + [word[-1] + "</w>"]
        current = pieces[0]
        for piece in pieces[1:]:
            merged = current + piece
            if merged not in seen:
                merges.append(f"{current} {piece}")
                vocab.append(merged)
                seen.add(merged)
            current = merged
    if vocab_size is not None:
        filler = 0
        while len(vocab) + len(SPECIAL_TOKENS) < vocab_size:
            vocab.append(f"xtfill{filler}</w>")  # unreachable rows that give the table its real size
            filler += 1
    vocab.extend(SPECIAL_TOKENS)
    return {tok: i for i, tok in enumerate(vocab)}, merges


def _template_words() -> list[str]:
    from xeontune.train.data import OBJECT_TEMPLATES, STYLE_TEMPLATES

    words: list[str] = []
    for template in (*OBJECT_TEMPLATES, *STYLE_TEMPLATES):
        words.extend(w for w in template.replace("{}", " ").replace(",", " ").split() if w.isalpha())
    return words + list(EXTRA_WORDS)


def build_tokenizer(dims: PipelineDims | MMDiTDims, pad_token: str | None = None):
    """A CLIPTokenizer over the project's own vocab (``pad_token``: SDXL's second tokenizer pads with "!")."""
    from transformers import CLIPTokenizer

    vocab, merges = tokenizer_files(_template_words(), dims.vocab_size)
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "vocab.json").write_text(json.dumps(vocab))
        (Path(tmp) / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n")
        extra = {"pad_token": pad_token} if pad_token else {}
        return CLIPTokenizer(vocab=str(Path(tmp) / "vocab.json"), merges=str(Path(tmp) / "merges.txt"),
                             model_max_length=77, **extra)


def build_modules(dims: PipelineDims, tokenizer) -> dict:
    """The pipeline's models with random weights, as keyword arguments of its diffusers class.

    Everything is made under the current default device, so ``with torch.device("meta")`` sizes the
    real-dimension models without allocating them."""
    from diffusers import AutoencoderKL, DDPMScheduler, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    vocab = tokenizer.get_vocab()
    ids = {"bos_token_id": vocab["<|startoftext|>"], "eos_token_id": vocab["<|endoftext|>"],
           "pad_token_id": vocab["<|endoftext|>"]}

    def text_config(hidden: int, layers: int, heads: int, intermediate: int, act: str) -> CLIPTextConfig:
        return CLIPTextConfig(
            vocab_size=len(vocab), hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
            num_attention_heads=heads, max_position_embeddings=77, hidden_act=act, projection_dim=hidden, **ids)

    modules: dict = {"tokenizer": tokenizer, "text_encoder": CLIPTextModel(text_config(
        dims.text_hidden, dims.text_layers, dims.text_heads, dims.text_intermediate, dims.text_act))}
    cross_dim, unet_extra = dims.text_hidden, {}
    if dims.family == "sdxl":
        # SDXL's second encoder is OpenCLIP bigG: GELU, and a projection whose output is the pooled text_embeds.
        modules["text_encoder_2"] = CLIPTextModelWithProjection(text_config(
            dims.text2_hidden, dims.text2_layers, dims.text2_heads, dims.text2_intermediate, "gelu"))
        cross_dim = dims.text_hidden + dims.text2_hidden  # both encoders' hidden states, concatenated
        unet_extra = {
            "addition_embed_type": "text_time", "addition_time_embed_dim": dims.time_embed_dim,
            # six time_ids of time_embed_dim each, then the pooled text embedding
            "projection_class_embeddings_input_dim": 6 * dims.time_embed_dim + dims.text2_hidden,
        }
    n_blocks = len(dims.unet_channels)
    plain = {"first": 0, "last": n_blocks - 1}[dims.plain_block] if n_blocks > 2 or dims.family == "sdxl" else -1
    down = tuple("DownBlock2D" if i == plain else "CrossAttnDownBlock2D" for i in range(n_blocks))
    up = tuple("UpBlock2D" if i == plain else "CrossAttnUpBlock2D" for i in reversed(range(n_blocks)))
    modules["unet"] = UNet2DConditionModel(
        sample_size=dims.sample_size // 8, in_channels=4, out_channels=4,
        layers_per_block=dims.unet_layers, block_out_channels=dims.unet_channels,
        down_block_types=down, up_block_types=up, cross_attention_dim=cross_dim,
        attention_head_dim=dims.head_dims or dims.unet_head_dim, use_linear_projection=dims.linear_projection,
        transformer_layers_per_block=dims.transformer_layers or 1, **unet_extra,
    )
    modules["vae"] = AutoencoderKL(
        in_channels=3, out_channels=3, latent_channels=4,
        down_block_types=("DownEncoderBlock2D",) * len(dims.vae_channels),
        up_block_types=("UpDecoderBlock2D",) * len(dims.vae_channels),
        block_out_channels=dims.vae_channels, layers_per_block=dims.vae_layers,
        norm_num_groups=dims.vae_groups, sample_size=dims.sample_size, scaling_factor=dims.vae_scaling,
    )
    modules["scheduler"] = DDPMScheduler(
        beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear", num_train_timesteps=1000,
        clip_sample=False, steps_offset=1, prediction_type=dims.prediction_type,
    )
    return modules


def build_t5_tokenizer(max_length: int = 77, vocab_size: int | None = None):
    """A T5 tokenizer (SentencePiece's Unigram model, as T5's) whose vocabulary is the project's words, each
    one piece, and its letters (padded to ``vocab_size`` with unreachable pieces); built offline."""
    import string

    from transformers import T5TokenizerFast

    words = sorted(set(_template_words()))
    vocab = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -2.0)]
    vocab += [("\u2581" + w, -3.0) for w in words] + [(c, -8.0) for c in string.ascii_letters + string.digits]
    vocab += [(f"\u2581xtfill{i}", -20.0) for i in range((vocab_size or 0) - len(vocab))]
    return T5TokenizerFast(vocab=vocab, extra_ids=0, model_max_length=max_length)


def _t5(dims: MMDiTDims, tokenizer: Any) -> Any:
    """T5's encoder (T5 v1.1's gated GELU) at ``dims.t5``'s sizes, for ``tokenizer``."""
    from transformers import T5Config, T5EncoderModel

    d_model, layers, heads, d_kv, d_ff = dims.t5
    return T5EncoderModel(T5Config(
        vocab_size=len(tokenizer), d_model=d_model, d_kv=d_kv, d_ff=d_ff, num_layers=layers, num_heads=heads,
        feed_forward_proj="gated-gelu", pad_token_id=0, eos_token_id=1, decoder_start_token_id=0))


def _flow_vae(dims: MMDiTDims, scaling: float, shift: float):
    """SD3's and Flux's VAE: 16 latent channels, no quant convs, a latent scale and shift."""
    from diffusers import AutoencoderKL

    return AutoencoderKL(
        in_channels=3, out_channels=3, latent_channels=16,
        down_block_types=("DownEncoderBlock2D",) * len(dims.vae_channels),
        up_block_types=("UpDecoderBlock2D",) * len(dims.vae_channels),
        block_out_channels=dims.vae_channels, layers_per_block=dims.vae_layers, norm_num_groups=dims.vae_groups,
        sample_size=dims.sample_size, scaling_factor=scaling, shift_factor=shift,
        use_quant_conv=False, use_post_quant_conv=False)


def build_sd3_modules(dims: MMDiTDims) -> dict:
    """SD3's pipeline parts with random weights, as keyword arguments of StableDiffusion3Pipeline."""
    return {name: make() for name, make in sd3_parts(dims).items()}


def sd3_parts(dims: MMDiTDims) -> dict[str, Callable[[], Any]]:
    """SD3's pipeline parts, each made when called (so that a large one can be saved and freed before the next)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection

    tokenizer, tokenizer_2 = build_tokenizer(dims), build_tokenizer(dims, pad_token="!")
    vocab = tokenizer.get_vocab()
    ids = {"bos_token_id": vocab["<|startoftext|>"], "eos_token_id": vocab["<|endoftext|>"],
           "pad_token_id": vocab["<|endoftext|>"]}

    def clip(sizes: tuple[int, int, int, int], act: str) -> CLIPTextModelWithProjection:
        hidden, layers, heads, intermediate = sizes
        return CLIPTextModelWithProjection(CLIPTextConfig(
            vocab_size=len(vocab), hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
            num_attention_heads=heads, max_position_embeddings=77, hidden_act=act, projection_dim=hidden, **ids))

    tokenizer_3 = build_t5_tokenizer(77, dims.t5_vocab)
    d_model, latent_channels = dims.t5[0], 16
    return {
        "tokenizer": lambda: tokenizer, "text_encoder": lambda: clip(dims.clip_l, "quick_gelu"),
        "tokenizer_2": lambda: tokenizer_2, "text_encoder_2": lambda: clip(dims.clip_g, "gelu"),
        "tokenizer_3": lambda: tokenizer_3, "text_encoder_3": lambda: _t5(dims, tokenizer_3),
        "transformer": lambda: SD3Transformer2DModel(
            sample_size=dims.sample_size // 8, patch_size=2, in_channels=latent_channels, out_channels=latent_channels,
            num_layers=dims.layers, attention_head_dim=dims.head_dim, num_attention_heads=dims.heads,
            joint_attention_dim=d_model, caption_projection_dim=dims.heads * dims.head_dim,
            pooled_projection_dim=dims.clip_l[0] + dims.clip_g[0], qk_norm="rms_norm",
            dual_attention_layers=dims.dual_attention_layers,
            pos_embed_max_size=dims.pos_embed_max or dims.sample_size // 8),
        "vae": lambda: _flow_vae(dims, scaling=1.5305, shift=0.0609),
        "scheduler": lambda: FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0),
    }


def build_flux_modules(dims: MMDiTDims) -> dict:
    """Flux.1-dev's pipeline parts with random weights, as keyword arguments of FluxPipeline."""
    return {name: make() for name, make in flux_parts(dims).items()}


def flux_parts(dims: MMDiTDims) -> dict[str, Callable[[], Any]]:
    """Flux.1-dev's pipeline parts, each made when called (as ``sd3_parts``)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxTransformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel

    tokenizer = build_tokenizer(dims)
    vocab = tokenizer.get_vocab()
    hidden, layers, heads, intermediate = dims.clip_l
    tokenizer_2 = build_t5_tokenizer(512, dims.t5_vocab)
    d_model, latent_channels = dims.t5[0], 16
    return {
        "tokenizer": lambda: tokenizer,
        "text_encoder": lambda: CLIPTextModel(CLIPTextConfig(
            vocab_size=len(vocab), hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
            num_attention_heads=heads, max_position_embeddings=77, hidden_act="quick_gelu", projection_dim=hidden,
            bos_token_id=vocab["<|startoftext|>"], eos_token_id=vocab["<|endoftext|>"],
            pad_token_id=vocab["<|endoftext|>"])),
        "tokenizer_2": lambda: tokenizer_2, "text_encoder_2": lambda: _t5(dims, tokenizer_2),
        "transformer": lambda: FluxTransformer2DModel(
            patch_size=1, in_channels=latent_channels * 4, num_layers=dims.layers, num_single_layers=dims.single_layers,
            attention_head_dim=dims.head_dim, num_attention_heads=dims.heads, joint_attention_dim=d_model,
            pooled_projection_dim=hidden, guidance_embeds=True, axes_dims_rope=dims.rope_axes),
        "vae": lambda: _flow_vae(dims, scaling=0.3611, shift=0.1159),
        "scheduler": lambda: FlowMatchEulerDiscreteScheduler(
            num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
            base_image_seq_len=256, max_image_seq_len=4096),
    }


def _no_file_in_the_way(folder: Path) -> None:
    """A one-line error when ``folder`` or a folder above it is a file (mkdir failed on it, exit 1)."""
    blocker = file_in_the_way(folder)
    if blocker == folder:
        raise UserError(f"{folder} is a file, not a folder")
    if blocker is not None:
        raise UserError(f"{folder}: {blocker} is a file, not a folder")


def build_pipeline(kind: str, out_dir: str | Path, seed: int = 0, dims: PipelineDims | None = None) -> Path:
    """Write a Stable Diffusion (or SDXL) pipeline with random weights to ``out_dir`` (atomically).

    ``dims`` overrides the kind's sizes (tests use a tiny UNet with SD1.5's 768-wide text encoder).
    """
    import torch
    from diffusers import (
        FluxPipeline,
        StableDiffusion3Pipeline,
        StableDiffusionPipeline,
        StableDiffusionXLPipeline,
    )
    from tqdm.auto import tqdm

    quiet_progress_bars()
    if kind not in KINDS:
        raise UserError(f"unknown model kind {kind!r} (choose from: {', '.join(KINDS)})")
    out = Path(out_dir)
    if out.name in ("", ".", ".."):
        raise UserError(f"model folder {str(out_dir)!r}: name a new folder, e.g. models/{kind}")
    _no_file_in_the_way(out)
    if out.exists() and any(out.iterdir()):  # the pipeline would replace it whole
        raise UserError(f"{out} already exists and is not empty: name a new or empty folder")
    torch.manual_seed(seed)
    if kind in SD3_DIMS:
        dims3 = SD3_DIMS[kind]
        flux = dims3.family == "flux"
        cls, parts = (FluxPipeline, flux_parts(dims3)) if flux else (StableDiffusion3Pipeline, sd3_parts(dims3))
        with atomic_dir(out) as tmp:
            if not dims3.half:
                cls(**{name: make() for name, make in parts.items()}).save_pretrained(tmp)
                return out
            with torch.device("meta"):  # the pipeline's model_index.json, no weights
                cls(**{name: make() for name, make in parts.items()}).save_config(tmp)
            default = torch.get_default_dtype()
            for name, make in tqdm(parts.items(), desc=kind, unit="part", disable=not sys.stderr.isatty()):
                torch.set_default_dtype(torch.bfloat16)  # made in bf16: never all of T5 in fp32
                try:
                    part = make()
                finally:
                    torch.set_default_dtype(default)
                if isinstance(part, torch.nn.Module):  # the buffers made from numpy (SD3's position table) too
                    part.to(torch.bfloat16)
                part.save_pretrained(Path(tmp) / name)
                del part  # saved and freed before the next is made
        return out
    dims = dims or DIMS[kind]
    modules = build_modules(dims, build_tokenizer(dims))
    if dims.family == "sdxl":
        modules["tokenizer_2"] = build_tokenizer(dims, pad_token="!")
        pipe = StableDiffusionXLPipeline(**modules, force_zeros_for_empty_prompt=True, add_watermarker=False)
    else:
        pipe = StableDiffusionPipeline(**modules, safety_checker=None, feature_extractor=None,
                                       requires_safety_checker=False)
    with atomic_dir(out) as tmp:
        pipe.save_pretrained(tmp)
    return out


# --- sample concept images ---------------------------------------------------------------------


def write_sample_data(out_dir: str | Path, count: int = 6, size: int = 128, seed: int = 0) -> list[Path]:
    """Draw one synthetic object (a small orange robot toy) in varied poses and backgrounds."""
    from PIL import Image, ImageDraw, ImageFilter

    if count < 1:
        raise UserError("--count must be at least 1")
    if size < 32:
        raise UserError("--size must be at least 32 pixels")
    out = Path(out_dir)
    _no_file_in_the_way(out)
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    files = []
    for i in range(count):
        scale = 4  # draw large, then downsample: smooth edges
        s = size * scale
        hue = rng.random()
        top, bottom = _hsv(hue, 0.35, 0.95), _hsv((hue + 0.15) % 1, 0.5, 0.55)
        bg = Image.new("RGB", (s, s))
        draw = ImageDraw.Draw(bg)
        for y in range(s):
            t = y / (s - 1)
            draw.line([(0, y), (s, y)], fill=tuple(int(a + (b - a) * t) for a, b in zip(top, bottom, strict=True)))
        for _ in range(rng.randint(2, 5)):  # background clutter
            x0, y0 = rng.randrange(s), rng.randrange(s)
            r = rng.randint(s // 20, s // 6)
            draw.ellipse([x0 - r, y0 - r, x0 + r, y0 + r], fill=_hsv(rng.random(), 0.3, 0.8))
        toy = _draw_toy(s, rng)
        angle = rng.uniform(-35, 35)
        toy = toy.rotate(angle, resample=Image.BICUBIC, expand=False)
        zoom = rng.uniform(0.55, 0.9)
        toy = toy.resize((int(s * zoom), int(s * zoom)), Image.LANCZOS)
        if rng.random() < 0.5:
            toy = toy.transpose(Image.FLIP_LEFT_RIGHT)
        ox = rng.randint(0, s - toy.width)
        oy = rng.randint(0, s - toy.height)
        shadow = Image.new("RGBA", toy.size, (0, 0, 0, 0))
        shadow.putalpha(toy.getchannel("A").point(lambda a: a // 3))
        bg.paste(shadow.filter(ImageFilter.GaussianBlur(s // 60)), (ox + s // 40, oy + s // 40), shadow)
        bg.paste(toy, (ox, oy), toy)
        img = bg.resize((size, size), Image.LANCZOS)
        path = out / f"toy_{i:02d}.png"
        with atomic_path(path) as tmp:
            img.save(tmp, format="PNG")
        files.append(path)
    return files


def write_synthetic_data(out_dir: str | Path, count: int, size: int, seed: int = 0) -> list[Path]:
    """``count`` images of random pixels, each with a caption of its own (random words, in metadata.jsonl):
    what a throughput benchmark trains on when the data must not matter (MosaicML's synthetic data). Each
    caption differs, so the text encoder encodes a prompt per sample, as on a real captioned dataset."""
    import numpy as np
    from PIL import Image

    if count < 1 or size < 32:
        raise UserError("synthetic data needs at least 1 image of at least 32 pixels")
    out = Path(out_dir)
    _no_file_in_the_way(out)
    out.mkdir(parents=True, exist_ok=True)
    rng, words = np.random.default_rng(seed), _template_words()
    files, rows = [], []
    for i in range(count):
        path = out / f"synthetic_{i:05d}.png"
        with atomic_path(path) as tmp:
            Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8)).save(tmp, format="PNG")
        caption = " ".join(words[j] for j in rng.integers(0, len(words), 12))
        rows.append(json.dumps({"file_name": path.name, "text": f"{caption} {i}"}))
        files.append(path)
    with atomic_path(out / "metadata.jsonl") as tmp:
        Path(tmp).write_text("\n".join(rows) + "\n")
    return files


def _hsv(h: float, s: float, v: float) -> tuple[int, int, int]:
    import colorsys

    r, g, b = colorsys.hsv_to_rgb(h, s, v)
    return int(r * 255), int(g * 255), int(b * 255)


def _draw_toy(s: int, rng: random.Random):
    """The concept: an orange robot with a teal visor, round head, antenna and stubby arms."""
    from PIL import Image, ImageDraw

    img = Image.new("RGBA", (s, s), (0, 0, 0, 0))
    d = ImageDraw.Draw(img)
    orange, teal, dark = (235, 120, 30, 255), (40, 190, 180, 255), (40, 40, 50, 255)
    cx = s // 2
    # body
    d.rounded_rectangle([cx - s * 0.2, s * 0.45, cx + s * 0.2, s * 0.85], radius=int(s * 0.06), fill=orange)
    d.rectangle([cx - s * 0.08, s * 0.55, cx + s * 0.08, s * 0.68], fill=teal)
    # head and visor
    d.ellipse([cx - s * 0.17, s * 0.16, cx + s * 0.17, s * 0.48], fill=orange)
    d.rounded_rectangle([cx - s * 0.12, s * 0.26, cx + s * 0.12, s * 0.36], radius=int(s * 0.04), fill=teal)
    eye = s * 0.025
    for ex in (cx - s * 0.06, cx + s * 0.06):
        d.ellipse([ex - eye, s * 0.31 - eye, ex + eye, s * 0.31 + eye], fill=dark)
    # antenna
    d.line([cx, s * 0.16, cx, s * 0.08], fill=dark, width=max(2, s // 80))
    d.ellipse([cx - s * 0.025, s * 0.055, cx + s * 0.025, s * 0.105], fill=teal)
    # arms, at a random wave
    wave = rng.uniform(-0.12, 0.12)
    for side in (-1, 1):
        x0 = cx + side * s * 0.2
        x1 = cx + side * s * 0.3
        d.line([x0, s * 0.52, x1, s * (0.62 + side * wave)], fill=orange, width=max(3, s // 25))
    # feet
    for side in (-1, 1):
        fx = cx + side * s * 0.1
        d.rounded_rectangle([fx - s * 0.06, s * 0.84, fx + s * 0.06, s * 0.9], radius=int(s * 0.02), fill=dark)
    return img
