"""SD3 and SD3.5: an MMDiT transformer, three text encoders (CLIP-L and CLIP-G with projections, T5-XXL),
flow matching (``FlowMatchEulerDiscreteScheduler``), a 16-channel VAE with a latent shift.

As diffusers' ``train_dreambooth_lora_sd3.py`` trains it: a timestep's index drawn from the weighting
scheme's density (--weighting-scheme, logit-normal by default), the latents noised along the straight line
to the noise at sigma, the prediction preconditioned to the clean latents (--precondition-outputs) or
compared with the velocity (noise - latents), the loss weighted by the scheme (sigma_sqrt, cosmap)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

from xeontune.errors import UserError
from xeontune.train.families import Encoder, Family

# Measured (docs/performance.md, "SD3.5 Medium-arch and Flux.1-arch LoRA"): a LoRA step's activations grow
# with the transformer's tokens, the image's ((side / 16) squared) and the text's. sd35m-arch in bf16, steps
# sampled every 0.2 s, less the runtime's 0.8 GB: 1.78 GB over 1,178 tokens at 512 px, 7.69 GB over 4,250 at
# 1024 px (attention adds a little more than linear); the larger figure per token is kept. fp32: twice (not
# measured: the 24 GB machine has bf16).
ACTIVATION_BYTES_PER_TOKEN = {"bf16": 1.81e6, "fp32": 3.62e6}


class StableDiffusion3(Family):
    name = "sd3"
    summary = "SD3, SD3.5"
    pipeline_class = "StableDiffusion3Pipeline"
    denoiser = "transformer"
    denoiser_class = "SD3Transformer2DModel"
    denoiser_title = "transformer"
    scheduler_class = "FlowMatchEulerDiscreteScheduler"
    encoders: ClassVar[tuple[Encoder, ...]] = (
        Encoder("tokenizer", "text_encoder", "CLIPTextModelWithProjection", linear_share=85 / 124,
                default_bytes=495e6, embedding_key="clip_l", kohya_prefix="lora_te1_"),
        Encoder("tokenizer_2", "text_encoder_2", "CLIPTextModelWithProjection", linear_share=631 / 695,
                default_bytes=2780e6, embedding_key="clip_g", kohya_prefix="lora_te2_"),
        # T5-XXL's encoder: 4.76 B parameters, its 77 tokens as the example's --max_sequence_length
        Encoder("tokenizer_3", "text_encoder_3", "T5EncoderModel", linear_share=0.97, default_bytes=19.0e9,
                embedding_key="t5", kohya_prefix="lora_te3_", tokenizer_class="T5TokenizerFast", max_length=77,
                trainable=False),
    )
    denoiser_params = 2.24e9  # SD3.5 Medium's transformer as its config builds it (2,243 M)
    vae_bytes = 335e6
    adafactor_shares: ClassVar[Mapping[str, float]] = {"transformer": 0.001, "text_encoder": 0.003, "text_encoder_2": 0.002}
    # the example's defaults: the MMDiT's attention, both streams
    lora_targets = ("attn.add_k_proj", "attn.add_q_proj", "attn.add_v_proj", "attn.to_add_out",
                    "attn.to_k", "attn.to_out.0", "attn.to_q", "attn.to_v")
    # ComfyUI reads SD3 LoRAs in diffusers' layout and in this one (OneTrainer's): the module path with "_"
    kohya_denoiser_prefix = "lora_transformer_"
    activation_per_token: ClassVar[Mapping[str, float]] = ACTIVATION_BYTES_PER_TOKEN
    text_tokens = 77 + 77  # the CLIP encoders' states, then T5's 77 (the example's --max_sequence_length)
    weighting = "logit_normal"  # --weighting-scheme's default: train_dreambooth_lora_sd3.py's
    precondition = True  # --precondition-outputs' default: the example's (``for_run`` sets the run's)
    # train_dreambooth_lora_sd3.py encodes the instance prompt once when the text encoders are frozen (the SD
    # LoRA script encodes it every step; so does the Flux one in practice: flux.py)
    bench_baseline: ClassVar[Mapping[str, Mapping[str, Any]]] = {"lora": {"cache_text": True}}
    refuses: ClassVar[Mapping[str, str]] = {
        "textual_inversion": "its prompts reach the transformer through T5 as well, which a CLIP token does not "
                             "teach; train a LoRA (--method lora)"}

    @classmethod
    def recognizes(cls, model_index: Mapping[str, Any]) -> bool:
        return cls.denoiser in model_index and "text_encoder_3" in model_index and (
            "StableDiffusion3" in str(model_index.get("_class_name", "")) or "tokenizer_3" in model_index)

    single_file = False  # its full fine-tune is the pipeline folder alone

    def check_options(self, opts: Any) -> None:
        # the transformer takes 2x2 patches of latents (SD3's patch size, Flux's packing): image sides are
        # multiples of 16 pixels
        if opts.resolution % 16:
            raise UserError(f"--resolution {opts.resolution}: {self.summary} takes image sides in multiples of 16 "
                            f"pixels (its transformer reads 2x2 patches of latents); try {opts.resolution // 16 * 16}")
        if opts.bucket_step % 16:
            raise UserError(f"--bucket-step {opts.bucket_step}: {self.summary} takes image sides in multiples of 16 "
                            "pixels (its transformer reads 2x2 patches of latents)")
        if opts.placeholder_token and opts.method != "textual_inversion":  # (textual inversion: ``refuses``)
            raise UserError(f"--placeholder-token: pivotal tuning trains a CLIP token, which does not apply to "
                            f"{self.summary} (its prompts reach the transformer through T5 as well); train the "
                            "LoRA alone")
        if opts.snr_gamma is not None:
            raise UserError(f"--snr-gamma weighs DDPM timesteps; {self.summary} trains by flow matching: weigh them "
                            "with --weighting-scheme (sigma_sqrt, cosmap, logit_normal, mode)")

    # --- prompts ----------------------------------------------------------------------------------

    def encoder_output(self, index: int, encoder: Any, input_ids: Any) -> Any:
        """A CLIP encoder's penultimate hidden states and pooled projection; T5's last hidden states."""
        if index < 2:
            out = encoder(input_ids, output_hidden_states=True)
            return out.hidden_states[-2], out.text_embeds
        return encoder(input_ids)[0]

    def join(self, outputs: list[Any]) -> tuple[Any, Any]:
        """The CLIP encoders' penultimate hidden states side by side, zero-padded to T5's width, then T5's
        tokens after them; the CLIP encoders' pooled projections side by side."""
        import torch
        import torch.nn.functional as F

        clip, pooled = [hidden for hidden, _ in outputs[:2]], [p for _, p in outputs[:2]]
        t5 = outputs[2]
        joined = torch.cat(clip, dim=-1)
        joined = F.pad(joined, (0, t5.shape[-1] - joined.shape[-1]))
        return torch.cat([joined, t5.to(joined.dtype)], dim=-2), torch.cat(pooled, dim=-1)

    def conditions(self, pooled: Any, sizes: Any) -> dict[str, Any] | None:
        return {"pooled_projections": pooled}

    # --- flow matching ----------------------------------------------------------------------------

    def timestep_density(self, opts: Any) -> Any:
        """diffusers' own density of the scheme (compute_density_for_timestep_sampling), one draw per sample
        from its own stream."""
        from diffusers.training_utils import compute_density_for_timestep_sampling

        scheme = opts.weighting_scheme or self.weighting

        def density(gen: Any) -> float:
            return float(compute_density_for_timestep_sampling(
                scheme, 1, logit_mean=opts.logit_mean, logit_std=opts.logit_std, mode_scale=opts.mode_scale,
                generator=gen)[0])

        return density

    @staticmethod
    def sigmas(scheduler: Any, timesteps: Any, like: Any) -> Any:
        """Each sample's sigma (timestep index into the training schedule), shaped to broadcast over ``like``."""
        sigma = scheduler.sigmas[timesteps].to(like.dtype)
        return sigma.reshape(-1, *([1] * (like.dim() - 1)))

    def noisy(self, scheduler: Any, latents: Any, noise: Any, timesteps: Any) -> Any:
        sigma = self.sigmas(scheduler, timesteps, latents)
        return (1 - sigma) * latents + sigma * noise

    def predict(self, scheduler: Any, denoiser: Any, noisy: Any, timesteps: Any, hidden: Any,
                conditions: dict[str, Any] | None) -> Any:
        pred = denoiser(hidden_states=noisy, timestep=scheduler.timesteps[timesteps], encoder_hidden_states=hidden,
                        return_dict=False, **(conditions or {}))[0]
        if self.precondition:
            return pred * -self.sigmas(scheduler, timesteps, pred) + noisy
        return pred

    def target(self, scheduler: Any, latents: Any, noise: Any, timesteps: Any) -> Any:
        return latents if self.precondition else noise - latents

    def loss_weights(self, scheduler: Any, timesteps: Any, opts: Any) -> Any:
        """diffusers' weighting of the scheme (compute_loss_weighting_for_sd3); None where it is one."""
        scheme = opts.weighting_scheme or self.weighting
        if scheme not in ("sigma_sqrt", "cosmap"):
            return None
        from diffusers.training_utils import compute_loss_weighting_for_sd3

        return compute_loss_weighting_for_sd3(scheme, scheduler.sigmas[timesteps].float())

    def for_run(self, opts: Any) -> StableDiffusion3:
        import copy

        mine = copy.copy(self)
        if opts.precondition_outputs is not None:
            mine.precondition = opts.precondition_outputs
        mine.guidance_scale = opts.guidance_scale
        return mine

    # --- files ------------------------------------------------------------------------------------

    def kohya_version(self, unet_config: Any, scheduler_config: Any) -> str:
        return "sd3"

    def activation_bytes(self, resolution: int, precision: str) -> float:
        tokens = (resolution // 16) ** 2 + self.text_tokens  # latents at 1/8, patches (or packed pairs) of 2
        return self.activation_per_token["bf16" if precision == "bf16" else "fp32"] * tokens

    def example_bf16(self, method: str) -> tuple[str, ...]:
        # the SD3 and Flux LoRA scripts cast every frozen model (the VAE too) to the weight dtype
        return ("denoiser", "vae", *self.encoder_names) if method == "lora" else ()


FAMILY = StableDiffusion3()
