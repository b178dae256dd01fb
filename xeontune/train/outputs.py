"""The names of what a run writes in --output-dir: one home for the trainer, which writes and clears
them, and `fetch`, which copies them (torch-free, so `fetch` and `logs` start fast)."""

from __future__ import annotations

import re

RUN_CONFIG = "train_config.json"  # written first by every run: it marks a dir as a run's output dir
METRICS = "metrics.jsonl"
# The files a run writes at the top of --output-dir (its dirs: checkpoint-N, validation, pipeline, logs).
RUN_FILE_RE = re.compile(r"^(learned_embeds(-steps-\d+)?\.safetensors|metrics\.jsonl|train_config\.json)$")
VALIDATION_IMAGE_RE = re.compile(r"^step-\d{6,}-\d+\.png$")  # validation.save_images's names
TFEVENTS_RE = re.compile(r"^events\.out\.tfevents\.")  # tensorboard's files in --logging-dir
