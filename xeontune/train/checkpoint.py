"""Exact save/resume: what the method learned, optimizer, scheduler, RNG states and the data position.

The data path is a function of (seed, sample position), and each micro-batch seeds torch's global
RNG from its position (LoRA's dropout), so with the same batch, ranks and accumulation the step
number is the whole data position (a resume with others is warned: it draws other images). Rank 0's
RNG states are saved as well, for anything else drawing random numbers.

- Durable: ``state.pt`` and then ``complete.json`` (its size and SHA-256) are fsynced inside a
  temporary dir, which is renamed to ``checkpoint-N`` and the rename fsynced. A dir without a
  matching marker is incomplete: ``latest`` skips it (with a warning), pruning never counts it.
- Safe to load: only tensors and plain data (RNG states included) are stored, and loading uses
  ``torch.load(weights_only=True)``, which refuses anything that would run code.
- Streamed: the state is serialized straight into its file and loaded memory-mapped, never held as
  bytes beside itself (a full fine-tuning's weights and optimizer state are gigabytes).
- Rank 0 reads; the other ranks receive the file by broadcast, in chunks, into a temporary file, so
  a cluster without a shared filesystem resumes the same way.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import pickle
import random
import shutil
import tempfile
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import numpy as np
import torch

from xeontune.errors import UserError
from xeontune.io import atomic_dir
from xeontune.train.outputs import CHECKPOINT_COMPLETE, CHECKPOINT_RE

log = logging.getLogger(__name__)

STATE_FILE = "state.pt"
COMPLETE_FILE = CHECKPOINT_COMPLETE
CHUNK = 64 << 20  # what is read, hashed or broadcast at a time


@dataclass
class TrainState:
    step: int
    optimizer: dict[str, Any]
    lr_scheduler: dict[str, Any]
    rng: dict[str, Any]
    method: str = "textual_inversion"  # what trained (train/methods); its fields below
    vectors: torch.Tensor | None = None  # textual inversion
    placeholder_tokens: list[str] | None = None
    learned: dict[str, Any] | None = None  # other methods: their own tensors and settings
    samples_per_step: int | None = None  # batch x ranks x accumulation: the data position is step x this
    model: dict[str, str] | None = None  # components.model_identity: what it trained on (None: written before)


def rng_state() -> dict[str, Any]:
    """The RNG states as tensors and plain values (what ``weights_only`` loading accepts)."""
    _, keys, pos, has_gauss, cached_gaussian = np.random.get_state()
    version, internal, gauss = random.getstate()
    return {
        "torch": torch.get_rng_state(),
        "numpy": {"keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos), "has_gauss": int(has_gauss),
                  "cached_gaussian": float(cached_gaussian)},
        "python": {"version": version, "state": list(internal), "gauss": gauss},
    }


def restore_rng(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    n = state["numpy"]
    np.random.set_state(("MT19937", n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"],
                         n["cached_gaussian"]))
    p = state["python"]
    random.setstate((p["version"], tuple(p["state"]), p["gauss"]))


def _all_checkpoint_dirs(output_dir: Path) -> list[tuple[int, Path]]:
    if not output_dir.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in output_dir.iterdir()
             if (m := CHECKPOINT_RE.match(p.name)) and p.is_dir()]
    return sorted(found)


def is_complete(path: Path) -> bool:
    return (path / COMPLETE_FILE).is_file() and (path / STATE_FILE).is_file()


def list_checkpoints(output_dir: Path) -> list[tuple[int, Path]]:
    """Complete checkpoints (marker written), oldest first."""
    return [(step, p) for step, p in _all_checkpoint_dirs(output_dir) if is_complete(p)]


def save(output_dir: Path, state: TrainState, total_limit: int | None) -> Path:
    """``checkpoint-<step>``, serialized straight into its file (no copy of the state in memory: a full
    fine-tuning's weights and optimizer state are gigabytes), then hashed from the file."""
    target = output_dir / f"checkpoint-{state.step}"
    with atomic_dir(target, durable=True) as tmp:
        # into an open file, not a path: torch's zip writer then raises the OS's error (a full disk is
        # ENOSPC, said in one line), where with a path it raises "unexpected pos"
        with open(tmp / STATE_FILE, "wb") as out:
            torch.save({f.name: getattr(state, f.name) for f in fields(state)}, out)  # asdict would copy
        size, digest = _file_digest(tmp / STATE_FILE)
        marker = {"step": state.step, "bytes": size, "sha256": digest}
        (tmp / COMPLETE_FILE).write_text(json.dumps(marker) + "\n")
    # Only now, with the new checkpoint complete on disk, may older ones go.
    if total_limit is not None:
        prune(output_dir, total_limit, keep=target)
    return target


def _file_digest(path: Path) -> tuple[int, str]:
    h, size = hashlib.sha256(), 0
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
            size += len(chunk)
    return size, h.hexdigest()


def prune(output_dir: Path, total_limit: int, keep: Path) -> None:
    """Keep ``keep`` and the newest complete others up to ``total_limit``; drop incomplete dirs older
    than ``keep`` (leftovers of an interrupted write)."""
    keep_step = int(CHECKPOINT_RE.match(keep.name).group(1))  # type: ignore[union-attr]
    others = [p for _, p in list_checkpoints(output_dir) if p != keep]
    doomed = others[: max(0, len(others) - (total_limit - 1))]
    doomed += [p for step, p in _all_checkpoint_dirs(output_dir) if step < keep_step and not is_complete(p)]
    for old in doomed:
        shutil.rmtree(old, ignore_errors=True)


def verify(path: Path) -> Path:
    """``path``'s state file, once it is known complete and intact (its marker's size and SHA-256); a
    one-line UserError otherwise."""
    if not (path / COMPLETE_FILE).is_file():
        raise UserError(f"checkpoint {path} is incomplete (no {COMPLETE_FILE}): its run stopped while writing it, "
                        "or a xeontune older than that marker wrote it")
    try:
        marker = json.loads((path / COMPLETE_FILE).read_text())
        size, digest = _file_digest(path / STATE_FILE)
    except (OSError, ValueError) as exc:
        raise UserError(f"cannot read checkpoint {path}: {type(exc).__name__}: {exc}") from None
    if not isinstance(marker, dict) or marker.get("bytes") != size or marker.get("sha256") != digest:
        raise UserError(f"checkpoint {path} is damaged: {STATE_FILE} ({size} bytes) does not match "
                        f"its {COMPLETE_FILE}")
    return path / STATE_FILE


def load(path: Path) -> TrainState:
    """A complete, intact, safely loadable checkpoint's state (memory-mapped); a one-line UserError otherwise."""
    return decode(verify(path), path)  # so that a bad one fails here, on rank 0, before anything starts


def decode(state_file: Path, where: Path | str) -> TrainState:
    try:
        # mmap: the tensors are the file's pages, read as they are copied in, not a second copy of the state
        raw = torch.load(state_file, map_location="cpu", weights_only=True, mmap=True)
    except pickle.UnpicklingError:  # weights_only met something other than tensors and plain data
        raise UserError(f"checkpoint {where} holds objects other than tensors and plain data; refusing to "
                        "load it (unpickling them could run code)") from None
    except Exception as exc:  # truncated or not a torch file at all
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise UserError(f"cannot read checkpoint {where}: {type(exc).__name__}: {first}") from None
    try:
        return TrainState(**raw)
    except TypeError:
        raise UserError(f"checkpoint {where} is not a xeontune checkpoint (unexpected contents)") from None


def resolve(resume_from: str, output_dir: Path) -> tuple[Path, TrainState]:
    """The checkpoint to resume from and its state. ``latest``: the newest one that is complete
    and readable, with a warning for every newer one skipped."""
    if resume_from != "latest":
        path = Path(resume_from)
        if not path.is_dir():
            raise UserError(f"--resume-from-checkpoint: {path} is not a checkpoint dir")
        inside = _all_checkpoint_dirs(path)
        if inside:  # a run's output dir given for one of its checkpoints
            raise UserError(f"--resume-from-checkpoint: {path} is a run's output dir, not a checkpoint: give "
                            f"{path / inside[-1][1].name}, or latest with --output-dir {path}")
        return path, load(path)
    found = _all_checkpoint_dirs(output_dir)
    if not found:
        raise UserError(f"--resume-from-checkpoint latest: no checkpoint in {output_dir}")
    skipped = []
    for _, path in reversed(found):
        try:
            state = load(path)
        except UserError as exc:
            log.warning("--resume-from-checkpoint latest: skipping %s: %s", path.name, exc)
            skipped.append(path.name)
            continue
        if skipped:
            log.warning("--resume-from-checkpoint latest: resuming from %s, the newest complete checkpoint "
                        "(skipped %s)", path.name, ", ".join(skipped))
        return path, state
    raise UserError(f"--resume-from-checkpoint latest: no complete, readable checkpoint in {output_dir} "
                    f"(skipped {', '.join(skipped)})")


def check_model(state: TrainState, identity: dict[str, str] | None, given: str, where: Path | str) -> None:
    """A checkpoint resumes only on the model it trained on (same family and configs), said before it loads."""
    recorded = state.model
    if not recorded or not identity:
        return
    if (recorded.get("family"), recorded.get("config")) != (identity["family"], identity["config"]):
        raise UserError(f"--resume-from-checkpoint: {where} was trained on {recorded.get('model')} "
                        f"({recorded.get('family')}), and --model {given} is another model "
                        f"({identity['family']}, other configs): resume it with --model {recorded.get('model')}")
    if recorded.get("model") != given:
        log.info("--resume-from-checkpoint: %s was trained on %s; --model %s has the same configs", where,
                 recorded.get("model"), given)


def share(state_file: Path | None, is_main: bool, group: Any) -> Path:
    """Rank 0's checkpoint state file on every rank: rank 0 (``state_file``) sends it in chunks, each
    other rank writes them to a temporary file and returns its path (the caller decodes it, then deletes
    it). ``group``: the process group to broadcast on; rank 0 returns ``state_file``."""
    size = torch.tensor([state_file.stat().st_size if is_main and state_file is not None else 0], dtype=torch.int64)
    torch.distributed.broadcast(size, src=0, group=group)
    total = int(size)
    if is_main:
        assert state_file is not None
        with open(state_file, "rb") as f:
            for start in range(0, total, CHUNK):
                chunk = torch.frombuffer(bytearray(f.read(min(CHUNK, total - start))), dtype=torch.uint8)
                torch.distributed.broadcast(chunk, src=0, group=group)
        return state_file
    fd, name = tempfile.mkstemp(prefix="xeontune-checkpoint-", suffix=".pt")
    with os.fdopen(fd, "wb") as f:
        for start in range(0, total, CHUNK):
            chunk = torch.empty(min(CHUNK, total - start), dtype=torch.uint8)
            torch.distributed.broadcast(chunk, src=0, group=group)
            f.write(chunk.numpy().tobytes())
    return Path(name)
