"""Time and cost left in a run: rank 0 says it after the first measured steps, then every ~5 %.

The trainer itself prints it (rather than `xeontune launch` parsing progress from the stream):
it knows the steps done, the total and the clock, and `launch` only has to hand it the cluster's
price, in ``XEONTUNE_COST_PER_HOUR`` (the provider's ``cost_per_hour``, cluster/pricing.py). With
no price (local clusters, one machine) the line gives the time alone.

Seconds per step are wall-clock seconds since the end of this process's first step (that one
warms up: allocations, first kernels) over the steps since, so checkpoints and validation
between steps are counted too.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

COST_ENV = "XEONTUNE_COST_PER_HOUR"
MEASURED_STEPS = 2  # steps measured before the first forecast


def usd_per_hour_from_env() -> float | None:
    try:
        value = float(os.environ.get(COST_ENV, ""))
    except ValueError:
        return None
    return value if value > 0 else None


def duration_text(seconds: float) -> str:
    if seconds < 90:
        return f"{max(1, round(seconds))} s"
    minutes = round(seconds / 60)
    if minutes < 90:
        return f"{minutes} min"
    return f"{minutes // 60} h {minutes % 60:02d} min"


@dataclass
class Forecast:
    max_steps: int
    usd_per_hour: float | None = None
    every: int = 1  # steps between forecasts after the first
    _t0: float | None = None  # the clock when this process's first step ended
    _step0: int = 0
    _next_at: int = 0

    @classmethod
    def for_run(cls, max_steps: int) -> Forecast:
        return cls(max_steps, usd_per_hour_from_env(), every=max(1, max_steps // 20))

    def update(self, done: int, now: float) -> str | None:
        """After each step (``done`` steps so far, ``now`` = time.perf_counter()): the line to
        print when one is due, else None."""
        if self._t0 is None:
            self._t0, self._step0, self._next_at = now, done, done + MEASURED_STEPS
            return None
        if done < self._next_at or done >= self.max_steps:
            return None
        self._next_at = done + self.every
        s_per_step = (now - self._t0) / (done - self._step0)
        return self.text(done, s_per_step)

    def text(self, done: int, s_per_step: float) -> str:
        left_s = (self.max_steps - done) * s_per_step
        line = (f"forecast: step {done}/{self.max_steps}, about {duration_text(left_s)} left "
                f"({s_per_step:.2f} s/step)")
        if self.usd_per_hour is not None:
            line += f", about ${left_s / 3600 * self.usd_per_hour:.2f} more at ${self.usd_per_hour:.2f}/h"
        return line
