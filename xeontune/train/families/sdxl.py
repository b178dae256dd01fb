"""SDXL: two text encoders (OpenAI's CLIP-L and OpenCLIP's bigG with a projection) whose penultimate hidden
states are joined, the second's pooled projection and each image's size/crop conditions as added
conditions, a UNet, DDPM noise."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

from xeontune.train.families import Encoder
from xeontune.train.families.sd import StableDiffusion

# Measured (docs/performance.md, "SDXL"): the peak RSS of a training step less the frozen weights, batch 1,
# bf16, was about 1.0 GB at 512 px and 5.1 GB at 1024 px (2-core AMD EPYC with avx512_bf16, 2026-11-24). The
# estimate grows the 1024 px figure, with some margin, by the pixels (so 512 px is over-counted, never
# under), and doubles it for fp32's 4-byte activations.
ACTIVATION_BYTES_1024PX = {"bf16": 5.5e9, "fp32": 11.0e9}


class StableDiffusionXL(StableDiffusion):
    name = "sdxl"
    summary = "SDXL"
    pipeline_class = "StableDiffusionXLPipeline"
    pipeline_options: ClassVar[Mapping[str, Any]] = {"add_watermarker": False}
    encoders: ClassVar[tuple[Encoder, ...]] = (
        Encoder("tokenizer", "text_encoder", "CLIPTextModel", linear_share=85 / 123, default_bytes=492e6,
                embedding_key="clip_l", kohya_prefix="lora_te1_"),
        # 695 M parameters: nearly all Linear layers (its token table, 63 M, and norms stay fp32)
        Encoder("tokenizer_2", "text_encoder_2", "CLIPTextModelWithProjection", linear_share=631 / 695,
                default_bytes=2780e6, embedding_key="clip_g", kohya_prefix="lora_te2_"),
    )
    denoiser_params = 2567e6  # SDXL-base's UNet
    adafactor_shares: ClassVar[Mapping[str, float]] = {"unet": 0.095, "text_encoder": 0.003, "text_encoder_2": 0.002}
    # issue 17's for textual inversion (512 px): >= 2.0x the example's steps/s, peak RSS <= 0.6x in bf16 and
    # 0.9x in fp32 (the fp32 UNet alone is 10.3 GB)
    bench_targets: ClassVar[Mapping[str, Mapping[str, Any]]] = {
        "textual_inversion": {"speedup_min": 2.0, "rss_ratio_max": {"bf16": 0.6, "fp32": 0.9}}}

    @classmethod
    def recognizes(cls, model_index: Mapping[str, Any]) -> bool:
        name = str(model_index.get("_class_name", ""))
        return cls.denoiser in model_index and ("XL" in name or "text_encoder_2" in model_index) \
            and "text_encoder_3" not in model_index

    def encoder_output(self, index: int, encoder: Any, input_ids: Any) -> Any:
        """Its penultimate hidden states, and (the second's) the pooled projection."""
        out = encoder(input_ids, output_hidden_states=True)
        return out.hidden_states[-2], (out.text_embeds if index == 1 else None)

    def join(self, outputs: list[Any]) -> tuple[Any, Any]:
        """Both encoders' penultimate hidden states side by side (768 + 1280), and the second's pooled
        projection."""
        import torch

        (first, _), (second, pooled) = outputs
        return torch.cat([first, second.to(first.dtype)], dim=-1), pooled

    def conditions(self, pooled: Any, sizes: Any) -> dict[str, Any] | None:
        return {"text_embeds": pooled, "time_ids": sizes}

    def single_file_text(self, pipe: Any) -> list[tuple[str, str, bool]]:
        return [("text_encoder", "conditioner.embedders.0.transformer.", False),
                ("text_encoder_2", "conditioner.embedders.1.model.", True)]

    def kohya_version(self, unet_config: Any, scheduler_config: Any) -> str:
        return "sdxl_base_v1-0"

    def activation_bytes(self, resolution: int, precision: str) -> float:
        return ACTIVATION_BYTES_1024PX["bf16" if precision == "bf16" else "fp32"] * (resolution / 1024) ** 2

    def packing_refusal(self, precision: str, amx: bool) -> str:
        if precision == "bf16" and not amx:
            # its large layers amortize oneDNN's per-call reorder; packing costs one UNet more in memory
            return "SDXL in bf16 without AMX was no faster packed: 10.10 against 10.11 s/step at 512 px, for 5.1 GB more"
        return ""

    def example_bf16(self, method: str) -> tuple[str, ...]:
        # textual_inversion_sdxl.py casts its second encoder whole; the LoRA script keeps its VAE in fp32
        # ("to avoid NaN losses")
        return {"textual_inversion": ("denoiser", "vae", "text_encoder_2"),
                "lora": ("denoiser", "text_encoder", "text_encoder_2"),
                "full": ("vae", "text_encoder", "text_encoder_2")}.get(method, ())


FAMILY = StableDiffusionXL()
