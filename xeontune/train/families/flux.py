"""Flux.1: a transformer over 2x2-packed latents with rotary position ids, CLIP-L's pooled output and T5's
tokens as its text, a guidance embedding (Flux.1-dev), flow matching on unshifted sigmas.

As diffusers' ``train_dreambooth_lora_flux.py`` trains it: the timestep's index drawn uniformly
(--weighting-scheme none, its default), the latents noised along the straight line to the noise, packed
into 2x2 patches for the transformer (``FluxPipeline._pack_latents``, image and text position ids), the
timestep given as a fraction, the guidance embedding given --guidance-scale, the prediction unpacked and
compared with the velocity (noise - latents)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

from xeontune.train.families import Encoder
from xeontune.train.families.sd3 import StableDiffusion3

# Measured on flux-arch (Flux.1-dev's widths, 6 of its 57 blocks; docs/performance.md), bf16, less the runtime's
# 0.8 GB: 1.13 GB over 1,536 tokens at 512 px and 3.39 GB over 4,608 at 1024 px, 0.74 MB a token at both;
# Flux.1-dev's blocks and parameters are 9.1-9.5x the reduced model's: 6.7 MB a token. fp32: twice (not measured).
ACTIVATION_BYTES_PER_TOKEN = {"bf16": 6.7e6, "fp32": 13.4e6}


class Flux(StableDiffusion3):
    name = "flux"
    summary = "Flux.1"
    pipeline_class = "FluxPipeline"
    denoiser_class = "FluxTransformer2DModel"
    encoders: ClassVar[tuple[Encoder, ...]] = (
        Encoder("tokenizer", "text_encoder", "CLIPTextModel", linear_share=85 / 123, default_bytes=492e6,
                embedding_key="clip_l", kohya_prefix="lora_te1_"),
        # T5-XXL's encoder, its 512 tokens as the example's --max_sequence_length
        Encoder("tokenizer_2", "text_encoder_2", "T5EncoderModel", linear_share=0.97, default_bytes=19.0e9,
                embedding_key="t5", kohya_prefix="lora_te2_", tokenizer_class="T5TokenizerFast", max_length=512,
                trainable=False),
    )
    denoiser_params = 11.9e9  # Flux.1's transformer
    vae_bytes = 335e6
    adafactor_shares: ClassVar[Mapping[str, float]] = {"transformer": 0.001, "text_encoder": 0.003}
    # the example's defaults: both streams' attention and feed-forward layers
    lora_targets = (*StableDiffusion3.lora_targets, "ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj",
                    "ff_context.net.2")
    activation_per_token: ClassVar[Mapping[str, float]] = ACTIVATION_BYTES_PER_TOKEN
    text_tokens = 512  # T5's (the example's --max_sequence_length)
    weighting = "none"
    precondition = False
    guidance_scale = 3.5
    packed_channels = 4  # a 2x2 patch of latents is one token
    # train_dreambooth_lora_flux.py (diffusers 58eb52c) encodes the instance prompt once, as SD3's does, but its
    # loop encodes the batch's prompts again at every step (the list it passes keeps the encoders alive):
    # T5-XXL over 512 tokens a step (docs/performance.md, flux-arch against the script)
    bench_baseline: ClassVar[Mapping[str, Mapping[str, Any]]] = {"lora": {"cache_text": False}}

    @classmethod
    def recognizes(cls, model_index: Mapping[str, Any]) -> bool:
        return cls.denoiser in model_index and "Flux" in str(model_index.get("_class_name", "")) \
            and "text_encoder_3" not in model_index

    def denoiser_channels(self, latent_channels: int) -> int:
        return latent_channels * self.packed_channels

    def encoder_output(self, index: int, encoder: Any, input_ids: Any) -> Any:
        """CLIP's pooled output; T5's tokens."""
        out = encoder(input_ids, output_hidden_states=False)
        return out.pooler_output if index == 0 else out[0]

    def join(self, outputs: list[Any]) -> tuple[Any, Any]:
        """T5's tokens as the hidden states, CLIP's pooled output (as FluxPipeline.encode_prompt)."""
        pooled, hidden = outputs
        return hidden.to(pooled.dtype) if hidden.dtype != pooled.dtype else hidden, pooled

    def predict(self, scheduler: Any, denoiser: Any, noisy: Any, timesteps: Any, hidden: Any,
                conditions: dict[str, Any] | None) -> Any:
        import torch
        from diffusers import FluxPipeline

        b, c, h, w = noisy.shape
        config = getattr(denoiser, "module", denoiser).config  # DDP wraps the trained one
        guidance = torch.full((b,), float(self.guidance_scale)) if config.guidance_embeds else None
        pred = denoiser(
            hidden_states=FluxPipeline._pack_latents(noisy, b, c, h, w),
            timestep=scheduler.timesteps[timesteps] / 1000, guidance=guidance, encoder_hidden_states=hidden,
            txt_ids=torch.zeros(hidden.shape[1], 3, dtype=noisy.dtype),
            img_ids=FluxPipeline._prepare_latent_image_ids(b, h // 2, w // 2, noisy.device, noisy.dtype),
            return_dict=False, **(conditions or {}))[0]
        pred = FluxPipeline._unpack_latents(pred, h, w, 1)  # the latents' own size: a scale factor of 1
        if self.precondition:
            return pred * -self.sigmas(scheduler, timesteps, pred) + noisy
        return pred

    def kohya_version(self, unet_config: Any, scheduler_config: Any) -> str:
        return "flux1"


FAMILY = Flux()
