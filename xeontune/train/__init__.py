"""The textual-inversion trainer. Entry points: `xeontune train` and `python -m xeontune.train`."""
