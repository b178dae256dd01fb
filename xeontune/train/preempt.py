"""A checkpoint in the grace time. Two signals reach every rank of a Slurm job before it is stopped:
- SIGUSR1: Slurm's ``--signal=USR1@120`` (its time limit near), or a preemption notice where the
  cluster sends one (``PreemptParameters=send_user_signal``). The ranks checkpoint, exit with
  ``EXIT_CODE`` and leave the mark; the batch script (job/engines/srun.py) then requeues the job.
- SIGTERM: a preemption (``PreemptMode=REQUEUE``, its ``GraceTime``), ``scontrol requeue``, ``scancel``
  or the time limit itself. The ranks checkpoint and exit 143, with no mark. A preemption signals
  the steps only: the batch script, still running, sees Slurm's PreemptTime and requeues the job
  (Slurm would not: the job ends before its GraceTime). The others end the script too; a
  cancelled job can still be resumed from that checkpoint by hand.
Either way the ranks agree at the end of a step, rank 0 writes the checkpoint, and a requeued job
resumes from it by itself. Slurm's SIGKILL after ``KillWait``/``GraceTime`` bounds the wait.

SIGTERM is deferred only while steps run (``defer_term``); before, it stops a rank as Ctrl-C does.
Only where the launcher asks for it (``ENV``): agreeing costs one small all-reduce a step.
"""

from __future__ import annotations

import os
import signal

ENV = "XEONTUNE_CHECKPOINT_ON_SIGNAL"  # "1": USR1 and TERM mean checkpoint and stop
MARK_ENV = "XEONTUNE_PREEMPT_MARK"  # a file the ranks create once stopped on USR1 (the batch script then requeues)
EXIT_CODE = 75  # EX_TEMPFAIL: stopped on purpose, to be requeued and resumed

_asked: list[int] = []  # the signals received, in order
_deferring = [False]  # SIGTERM waits for the end of the step (only while steps run)


class Preempted(Exception):
    """Raised on every rank after the checkpoint of ``step`` was written."""

    def __init__(self, step: int, signum: int) -> None:
        super().__init__(step, signum)
        self.step = step
        self.signum = signum

    @property
    def exit_code(self) -> int:
        return EXIT_CODE if self.signum == signal.SIGUSR1 else 128 + self.signum

    @property
    def signal_name(self) -> str:
        return signal.Signals(self.signum).name


def armed() -> bool:
    return os.environ.get(ENV) == "1"


def install() -> None:
    """Arm SIGUSR1 and SIGTERM (main thread only), where ``ENV`` asks for it."""
    if not armed():
        return

    def on_term(sig: int, _frame: object) -> None:
        if not _deferring[0]:
            raise KeyboardInterrupt(signal.Signals(sig).name)  # as train/__main__.py's own handler
        _asked.append(sig)

    signal.signal(signal.SIGUSR1, lambda sig, _frame: _asked.append(sig))
    signal.signal(signal.SIGTERM, on_term)


def defer_term(steps_running: bool) -> None:
    """While training steps run, SIGTERM asks for a checkpoint instead of stopping at once."""
    _deferring[0] = steps_running


def requested(world: int) -> int | None:
    """The signal that asks to stop, if any rank received one; every rank gets the same answer (one
    all-reduce when armed). A SIGUSR1 anywhere wins: its job is then requeued by its own script."""
    if not armed():
        return None
    mine = max((_code(s) for s in _asked), default=0)
    if world > 1:
        import torch

        flag = torch.tensor([float(mine)])
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
        mine = int(flag.item())
    return {1: signal.SIGTERM, 2: signal.SIGUSR1}.get(mine)


def _code(sig: int) -> int:
    return 2 if sig == signal.SIGUSR1 else 1


def mark() -> None:
    """Say so to the batch script: srun's own status may be a killed rank's (--kill-on-bad-exit)."""
    path = os.environ.get(MARK_ENV)
    if path:
        with open(path, "a"):
            pass
