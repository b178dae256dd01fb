"""Exact save/resume: vectors, optimizer, scheduler, RNG states and the data position.

The data path is a function of (seed, sample position), so the step number is the whole data
position; RNG states are saved as well so that anything else drawing random numbers (validation)
also continues where it was. Rank 0 writes and reads; other ranks receive the state by broadcast,
so a cluster without a shared filesystem resumes the same way.
"""

from __future__ import annotations

import random
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from xeontune.errors import UserError
from xeontune.io import atomic_dir

CHECKPOINT_RE = re.compile(r"^checkpoint-(\d+)$")
STATE_FILE = "state.pt"


@dataclass
class TrainState:
    step: int
    vectors: torch.Tensor
    optimizer: dict[str, Any]
    lr_scheduler: dict[str, Any]
    placeholder_tokens: list[str]
    rng: dict[str, Any]


def rng_state() -> dict[str, Any]:
    return {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}


def restore_rng(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])


def list_checkpoints(output_dir: Path) -> list[tuple[int, Path]]:
    if not output_dir.is_dir():
        return []
    found = []
    for p in output_dir.iterdir():
        m = CHECKPOINT_RE.match(p.name)
        if m and (p / STATE_FILE).is_file():
            found.append((int(m.group(1)), p))
    return sorted(found)


def save(output_dir: Path, state: TrainState, total_limit: int | None) -> Path:
    target = output_dir / f"checkpoint-{state.step}"
    with atomic_dir(target) as tmp:
        torch.save(state.__dict__, tmp / STATE_FILE)
    if total_limit is not None:
        for _, old in list_checkpoints(output_dir)[:-total_limit]:
            shutil.rmtree(old, ignore_errors=True)
    return target


def resolve(resume_from: str, output_dir: Path) -> Path:
    if resume_from == "latest":
        found = list_checkpoints(output_dir)
        if not found:
            raise UserError(f"--resume-from-checkpoint latest: no checkpoint in {output_dir}")
        return found[-1][1]
    path = Path(resume_from)
    if not (path / STATE_FILE).is_file():
        raise UserError(f"--resume-from-checkpoint: {path} is not a checkpoint dir (no {STATE_FILE})")
    return path


def load(path: Path) -> TrainState:
    data = torch.load(path / STATE_FILE, map_location="cpu", weights_only=False)
    return TrainState(**data)


def load_everywhere(path: Path | None, is_main: bool, distributed: bool) -> TrainState | None:
    """Rank 0 reads the checkpoint; the others get it by broadcast (a few KB with spliced vectors)."""
    state = load(path) if (is_main and path is not None) else None
    if distributed:
        box = [state]
        torch.distributed.broadcast_object_list(box, src=0)
        state = box[0]
    return state
