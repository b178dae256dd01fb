"""The elastic engine: `xeontune train --nproc-per-node N` starts N ranks on this machine.

The ranks are the same trainer (`python -m xeontune.train`, same options, same sample plan) started
by torch's own elastic agent (what `torchrun --standalone` runs), which gives each rank RANK,
LOCAL_RANK, WORLD_SIZE and a rendezvous, and stops every rank when one fails or on Ctrl-C. It has
no cluster, provider or job record (the trainer itself starts it, train/__main__.py), so of the
engine contract it has only the start: ``run_ranks``.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import uuid

from xeontune import placement


def run_ranks(argv: list[str], ranks: int) -> int:
    """Run `python -m xeontune.train argv` as ``ranks`` pinned ranks; return the job's exit code."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    os.environ[placement.PIN_ENV] = "1"
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # all ranks are here; don't let gloo guess an interface
    # the elastic agent narrates its every move at INFO/WARNING; a failure is reported below instead
    # (its modules' loggers set their own level at import, so each is quieted, not just the parent)
    for name in [n for n in logging.root.manager.loggerDict if n.startswith("torch.distributed.elastic")]:
        logging.getLogger(name).setLevel(logging.CRITICAL)
    config = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=ranks, run_id=uuid.uuid4().hex, rdzv_backend="c10d",
        rdzv_endpoint="127.0.0.1:0", max_restarts=0, monitor_interval=0.5,
    )
    try:
        elastic_launch(config, entrypoint=sys.executable)("-m", "xeontune.train", *argv)
    except SignalException as exc:  # Ctrl-C, SIGTERM or SIGHUP to the agent: it has stopped every rank
        name = signal.Signals(exc.sigval).name
        print(f"interrupted ({name}): every rank was stopped", file=sys.stderr)
        return 128 + int(exc.sigval)
    except ChildFailedError as exc:
        # A rank's user error (exit 2) is the cause even when another rank, which then found it gone,
        # exited first: that rank printed its one-line error, and 2 is the job's exit code.
        if any(failure.exitcode == 2 for failure in exc.failures.values()):
            return 2
        rank, failure = exc.get_first_failure()
        print(f"error: rank {rank} of {ranks} failed (exit code {failure.exitcode}); "
              "the other ranks were stopped", file=sys.stderr)
        return failure.exitcode if failure.exitcode > 0 else 1  # a signal shows as a negative code
    return 0
