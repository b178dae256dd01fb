"""xeontune: fine-tuning Stable Diffusion (textual inversion, LoRA, DreamBooth) on Xeon CPUs, on one
machine or across a cluster."""

__version__ = "0.1.0"
