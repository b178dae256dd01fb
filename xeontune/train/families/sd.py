"""SD1.x and SD2.x: one CLIP text encoder (OpenAI's for SD1, OpenCLIP's for SD2), a UNet, DDPM noise with an
epsilon or (SD2-768) v-prediction target."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

from xeontune.errors import UserError
from xeontune.train.families import Encoder, Family

# Measured (docs/performance.md): the peak RSS of a step on the SD1.5-architecture model minus its weights,
# 256 px, batch 1; it grows with the pixels.
ACTIVATION_BYTES_256PX = 1.0e9


class StableDiffusion(Family):
    name = "sd"
    summary = "SD1.x, SD2.x"
    pipeline_class = "StableDiffusionPipeline"
    pipeline_options: ClassVar[Mapping[str, Any]] = {
        "safety_checker": None, "feature_extractor": None, "requires_safety_checker": False}
    # SD1.5's text encoder: 123 M parameters, 85 M of them in Linear layers
    encoders: ClassVar[tuple[Encoder, ...]] = (
        Encoder("tokenizer", "text_encoder", "CLIPTextModel", linear_share=85 / 123, default_bytes=492e6),)
    denoiser_params = 860e6  # SD1.5's UNet
    vae_bytes = 335e6  # its VAE, 84 M parameters in fp32
    adafactor_shares: ClassVar[Mapping[str, float]] = {"unet": 0.532, "text_encoder": 0.003}

    @classmethod
    def recognizes(cls, model_index: Mapping[str, Any]) -> bool:
        name = str(model_index.get("_class_name", ""))
        return ("XL" not in name and cls.denoiser in model_index and "text_encoder" in model_index
                and "text_encoder_2" not in model_index)

    def check_options(self, opts: Any) -> None:
        if opts.weighting_scheme is not None:
            raise UserError(f"--weighting-scheme is flow matching's (SD3); {self.summary} trains on DDPM timesteps: "
                            "weigh them with --snr-gamma")

    def encoder_output(self, index: int, encoder: Any, input_ids: Any) -> Any:
        # the last hidden states (SD2's config already drops its encoder's last layer)
        return encoder(input_ids)[0]

    def join(self, outputs: list[Any]) -> tuple[Any, Any]:
        return outputs[0], None

    def noisy(self, scheduler: Any, latents: Any, noise: Any, timesteps: Any) -> Any:
        return scheduler.add_noise(latents, noise, timesteps)

    def predict(self, scheduler: Any, denoiser: Any, noisy: Any, timesteps: Any, hidden: Any,
                conditions: dict[str, Any] | None) -> Any:
        return denoiser(noisy, timesteps, hidden, added_cond_kwargs=conditions).sample

    def target(self, scheduler: Any, latents: Any, noise: Any, timesteps: Any) -> Any:
        if scheduler.config.prediction_type == "v_prediction":
            return scheduler.get_velocity(latents, noise, timesteps)
        return noise

    def loss_weights(self, scheduler: Any, timesteps: Any, opts: Any) -> Any:
        """Min-SNR-gamma's (--snr-gamma), as the examples weigh it."""
        if opts.snr_gamma is None:
            return None
        from xeontune.train.data import min_snr_weights

        return min_snr_weights(scheduler, timesteps, opts.snr_gamma)

    def sampling_scheduler(self, training: Any) -> Any:
        from diffusers import DPMSolverMultistepScheduler  # DPM-Solver++: few steps

        return DPMSolverMultistepScheduler.from_config(training.config)

    def lora_layout(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """The UNet's adapters in diffusers' layout, ``<module>.lora.down.weight`` / ``.lora.up.weight``, for
        every module. convert_state_dict_to_diffusers renames only attention's (to_q/k/v, to_out.0) and leaves
        proj_in's, conv1's, ff's ... as peft's ``lora_A``/``lora_B``; load_lora_adapter decides from the first
        key alone whether to rename the file back to peft's names, so one of the two kinds went missing on
        load (and from the saved pipeline's merge), a warning the only sign. For attention the names are
        those diffusers' examples write."""
        return {key.replace(".lora_A.", ".lora.down.").replace(".lora_B.", ".lora.up."): value
                for key, value in state_dict.items()}

    def single_file_text(self, pipe: Any) -> list[tuple[str, str, bool]]:
        # SD2's encoder is OpenCLIP's, whose GELU (OpenAI CLIP's is QuickGELU) is what the OpenCLIP layout
        # tells every loader to build: the activation decides, not the widths
        if pipe.text_encoder.config.hidden_act == "gelu":
            return [("text_encoder", "cond_stage_model.model.", True)]
        return [("text_encoder", "cond_stage_model.transformer.", False)]

    def kohya_version(self, unet_config: Any, scheduler_config: Any) -> str:
        # SD2's UNet projects attention with Linear layers, SD1's with 1x1 convolutions; a v-prediction SD2
        # (768 px) takes ``_v``, as kohya's sd-scripts write it
        if not getattr(unet_config, "use_linear_projection", False):
            return "sd_v1"
        return "sd_v2_v" if getattr(scheduler_config, "prediction_type", "epsilon") == "v_prediction" else "sd_v2"

    def activation_bytes(self, resolution: int, precision: str) -> float:
        return ACTIVATION_BYTES_256PX * (resolution / 256) ** 2

    def example_bf16(self, method: str) -> tuple[str, ...]:
        return {"textual_inversion": ("denoiser", "vae"),  # it keeps the text encoder (which trains) in fp32
                "lora": ("denoiser", "vae", "text_encoder"),
                # train_text_to_image.py trains its UNet in fp32 under autocast and casts the frozen models
                "full": ("vae", "text_encoder")}.get(method, ())


FAMILY = StableDiffusion()
