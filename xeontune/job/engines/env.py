"""What every rank gets, whichever engine starts it: the shared part of the engines.

The rank environment (``every_rank_env``), the source tree for ranks that run from a checkout
(``rank_pythonpath``), the python a rank runs, and the cores a rank may use (``threads_per_rank``).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from xeontune import hardware
from xeontune.cluster.providers import Provider
from xeontune.cluster.state import ClusterRecord
from xeontune.train.options import LAUNCH_DEFAULTS_ENV

# The caller's variables that ranks inherit when set: switches, on every provider ...
PASSTHROUGH_ENV = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE")
# ... and paths on this machine, only to ranks that run on it (never to a remote node).
LOCAL_PATH_ENV = ("HF_HOME", "HF_HUB_CACHE", "LD_PRELOAD")
DEFAULT_DIST_TIMEOUT_S = 30


def every_rank_env(backend: str) -> dict[str, str]:
    """What every rank gets, however it is started (mpirun, a scheduler's srun, Ray's workers, a pod)."""
    return {
        # c10d warns on every rank that namespaces share a hostname; real errors still show.
        "TORCH_CPP_LOG_LEVEL": "ERROR",
        # Ranks train on CPU only. A GPU they can see makes accelerate's barrier pick
        # cuda:<local rank> ("invalid device ordinal" on ranks 1..N); --env may still override it.
        "CUDA_VISIBLE_DEVICES": "",
        # Launch's choices reach the ranks as defaults, below --config and the command line: appended
        # flags would override a value given in --config or in another spelling (--dist_timeout).
        LAUNCH_DEFAULTS_ENV["dist_backend"]: backend,
        LAUNCH_DEFAULTS_ENV["dist_timeout"]: str(DEFAULT_DIST_TIMEOUT_S),
    }


def rank_pythonpath() -> str | None:
    """The source tree, when xeontune runs from a checkout rather than an installed package."""
    pkg_parent = Path(__file__).resolve().parents[3]  # xeontune/job/engines/env.py -> the checkout
    if Path(sys.prefix).resolve() in pkg_parent.parents:
        return None
    return str(pkg_parent)


def python_path(record: ClusterRecord, provider: Provider) -> str:
    """The python a rank runs: the nodes' venv on other machines, this one's here."""
    return f"{record.venv or sys.prefix}/bin/python" if provider.remote else sys.executable


def threads_per_rank(record: ClusterRecord, provider: Provider, world_size: int, ppn: int) -> int | None:
    """Cores a rank may use. Ranks of a provider that is not remote all share this machine's cores;
    on a remote node it is the node's cores (``record.cores_per_node``, set by the provider) over
    ``--ppn``. None when unknown: torch then uses the node's own core count."""
    if "OMP_NUM_THREADS" in os.environ:
        return max(1, int(os.environ["OMP_NUM_THREADS"]))
    if not provider.remote:
        return int(hardware.launch_env(world_size, allocator="none")["OMP_NUM_THREADS"])
    cores = record.cores_per_node or 0
    return max(1, cores // ppn) if cores else None
