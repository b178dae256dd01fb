"""Where library chatter is silenced (model config notes, deprecation warnings, optional image
backends, per-part progress bars): noise on a terminal and in every rank's log. Real errors still show.
Three narrow filters stay beside what they concern: the torch elastic agent's logger
(job/engines/elastic.py), one IPEX warning (train/backends.py) and azure-identity's logger
(cluster/providers/azure.py)."""

from __future__ import annotations

import logging
import os
import warnings

LIBRARIES = ("diffusers", "transformers", "accelerate", "huggingface_hub")


def quiet_libraries(*also: str) -> None:
    """Errors only from the libraries (and the loggers named in ``also``); no FutureWarnings, no
    UserWarnings from torch. Env vars reach transformers and diffusers even before they are imported."""
    for name in (*LIBRARIES, *also):
        logging.getLogger(name).setLevel(logging.ERROR)
    # paramiko's transport logs a dropped connection ("Socket exception: ...") from its own thread;
    # xeontune says it once, in its own line, with what it does about it (job/fetch.py's HeadError)
    logging.getLogger("paramiko").setLevel(logging.CRITICAL)
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=UserWarning, module="torch")
    # diffusers' config loader still passes an argument huggingface_hub deprecated (and ignores)
    warnings.filterwarnings("ignore", message="The `local_dir_use_symlinks` argument is deprecated")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("DIFFUSERS_VERBOSITY", "error")


def quiet_progress_bars() -> None:
    """No progress bar per loaded or saved part ("Loading weights", "Writing model shards"): xeontune
    draws its own bars. Imports the libraries, so call it where they are imported anyway."""
    import diffusers
    import transformers

    transformers.utils.logging.disable_progress_bar()
    diffusers.utils.logging.disable_progress_bar()
