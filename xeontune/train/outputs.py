"""The names of what a run writes in --output-dir: one home for the trainer, which writes and clears
them, and `fetch`, which copies them (torch-free, so `fetch` and `logs` start fast).

Each training method writes its learned files under the stems its declaration names (train/methods/,
``Declaration.files``); the step copies of a file are ``<stem>-steps-N.safetensors``."""

from __future__ import annotations

import re

import xeontune.train.methods.declaration as methods

RUN_CONFIG = "train_config.json"  # written first by every run: it marks a dir as a run's output dir
METRICS = "metrics.jsonl"
RUN_LOCK = ".xeontune-run.lock"  # held by a running run's rank 0 (train/lock.py); gone when it ends

# Per method: the stems of its learned files, the first one being its result (what `fetch` reports).
METHOD_FILES = {method.name: method.files for method in methods.declarations()}
RESULT_FILES = {method: f"{stems[0]}.safetensors" for method, stems in METHOD_FILES.items()}


def learned_file(stem: str, step: int | None = None) -> str:
    """A learned file's name: the final one, or the copy written at ``step``."""
    return f"{stem}.safetensors" if step is None else f"{stem}-steps-{step}.safetensors"


_STEMS = "|".join(sorted({re.escape(s) for stems in METHOD_FILES.values() for s in stems}, key=len, reverse=True))
# groups: the stem, and the step of a step copy (None for a final file)
LEARNED_FILE_RE = re.compile(rf"^({_STEMS})(?:-steps-(\d+))?\.safetensors$")
# The files a run writes at the top of --output-dir (its dirs: checkpoint-N, validation, pipeline, logs).
RUN_FILE_RE = re.compile(rf"^(({_STEMS})(-steps-\d+)?\.safetensors|metrics\.jsonl|train_config\.json)$")
# checkpoint-N dirs (train/checkpoint.py); complete.json is written last into one: without it, none to resume from
CHECKPOINT_RE = re.compile(r"^checkpoint-(\d+)$")
CHECKPOINT_COMPLETE = "complete.json"
VALIDATION_IMAGE_RE = re.compile(r"^step-\d{6,}-\d+\.png$")  # validation.save_images's names
TFEVENTS_RE = re.compile(r"^events\.out\.tfevents\.")  # tensorboard's files in --logging-dir
