"""A checkpoint in the grace time: Slurm's ``--signal=USR1@120`` (its time limit near) or a
preemption notice reaches every rank as SIGUSR1; the ranks agree at the end of a step, rank 0 writes
a checkpoint, and every rank exits with ``EXIT_CODE``. The batch script (cluster/providers/slurm.py)
then requeues the job, which resumes from that checkpoint by itself.

Only where the launcher asks for it (``ENV``): agreeing costs one small all-reduce a step.
"""

from __future__ import annotations

import os
import signal

ENV = "XEONTUNE_CHECKPOINT_ON_SIGNAL"  # "1": USR1 means checkpoint and stop
MARK_ENV = "XEONTUNE_PREEMPT_MARK"  # a file the ranks create once stopped so (the batch script then requeues)
EXIT_CODE = 75  # EX_TEMPFAIL: stopped on purpose, to be resumed

_asked: list[int] = []


class Preempted(Exception):
    """Raised on every rank after the checkpoint of ``step`` was written."""

    def __init__(self, step: int) -> None:
        super().__init__(step)
        self.step = step


def install() -> None:
    """Arm SIGUSR1 (main thread only), where ``ENV`` asks for it."""
    if os.environ.get(ENV) == "1":
        signal.signal(signal.SIGUSR1, lambda sig, _frame: _asked.append(sig))


def requested(world: int) -> bool:
    """Whether any rank was signalled: every rank gets the same answer (one all-reduce when armed)."""
    if os.environ.get(ENV) != "1":
        return False
    if world <= 1:
        return bool(_asked)
    import torch

    flag = torch.tensor([1.0 if _asked else 0.0])
    torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
    return bool(flag.item() > 0)


def mark() -> None:
    """Say so to the batch script: srun's own status may be a killed rank's (--kill-on-bad-exit)."""
    path = os.environ.get(MARK_ENV)
    if path:
        with open(path, "a"):
            pass
