"""Times an unmodified training script from outside: put this folder on PYTHONPATH and set STEP_TIMES=1,
and every optimizer step prints "STEP <seconds since the last step>" to stderr. The same hook for the
example scripts and for xeontune, so both are timed alike (scripts/example-figures.sh)."""

import os
import sys
import time

if os.environ.get("STEP_TIMES"):
    from torch.optim.optimizer import register_optimizer_step_post_hook

    _last = [time.perf_counter()]

    def _print_step_time(optimizer, args, kwargs) -> None:
        now = time.perf_counter()
        print(f"STEP {now - _last[0]:.3f}", file=sys.stderr, flush=True)
        _last[0] = now

    register_optimizer_step_post_hook(_print_step_time)
