"""The trainer, its methods as plug-ins (train/methods/). Entry points: `xeontune train` and
`python -m xeontune.train` (what every engine starts on each rank)."""
