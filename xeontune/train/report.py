"""Where a run's metrics go besides metrics.jsonl (--report-to): tensorboard, or Weights & Biases.

Both are driven through the tensorboard writer's calls (``add_scalar``, ``add_images``, ``close``), so
the loop names neither. A run's id (train_config.json's ``run_id``) names what it writes in a place it
may share with other runs: tensorboard's event files carry it as their suffix, wandb's run is that id
(offline with WANDB_MODE=offline, its files under --logging-dir/wandb/)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from xeontune.errors import UserError

INSTALL = {"tensorboard": "pip install 'xeontune[tensorboard]'", "wandb": "pip install 'xeontune[wandb]'"}


def check(report_to: str) -> None:
    """Fail now, in one line, not after the first outputs are written."""
    if report_to not in INSTALL:
        return
    try:
        if report_to == "tensorboard":
            from torch.utils.tensorboard import SummaryWriter  # noqa: F401
        else:
            import wandb  # noqa: F401
    except ImportError:
        raise UserError(f"--report-to {report_to} needs {report_to}: {INSTALL[report_to]}") from None


class WandbWriter:
    """The tensorboard writer's calls onto a wandb run."""

    def __init__(self, log_dir: Path, run_id: str, config: dict[str, Any]) -> None:
        import wandb

        self.wandb = wandb
        log_dir.mkdir(parents=True, exist_ok=True)
        # resume="allow": a resumed run (same id) goes on logging into the run it continues
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "xeontune"), id=run_id, resume="allow",
                              dir=str(log_dir), config=config)

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        self.run.log({tag: value}, step=step)

    def add_images(self, tag: str, images: Any, step: int, dataformats: str = "NHWC") -> None:
        assert dataformats == "NHWC"
        self.run.log({tag: [self.wandb.Image(image) for image in images]}, step=step)

    def close(self) -> None:
        self.run.finish()


def open_writer(report_to: str, log_dir: Path, run_id: str, config: dict[str, Any]) -> Any:
    """The writer of --report-to, or None (jsonl, none)."""
    if report_to == "tensorboard":
        from torch.utils.tensorboard import SummaryWriter

        return SummaryWriter(log_dir=str(log_dir), filename_suffix=f".{run_id}")
    if report_to == "wandb":
        return WandbWriter(log_dir, run_id, config)
    return None


def own_files(log_dir: Path, run_id: str | None, inside: bool) -> list[Path]:
    """What a run of this id wrote in ``log_dir`` (--overwrite clears them): its tensorboard event files
    and its wandb run folder. A run of old, without an id: every event file, and only in its own dir."""
    from xeontune.train.outputs import TFEVENTS_RE

    found = []
    for p in log_dir.iterdir() if log_dir.is_dir() else ():
        if TFEVENTS_RE.match(p.name) and p.is_file() and (p.name.endswith(f".{run_id}") if run_id else inside):
            found.append(p)
    wandb_dir = log_dir / "wandb"
    if run_id and wandb_dir.is_dir():
        found += [p for p in wandb_dir.iterdir() if p.is_dir() and p.name.endswith(f"-{run_id}")]
    return found
