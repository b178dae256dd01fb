"""xeontune: textual-inversion fine-tuning of Stable Diffusion on Xeon CPUs."""

__version__ = "0.1.0"
