"""Time and cost left in a run: rank 0 says it after the first measured steps, then every ~5 %.

The trainer itself prints it (rather than `xeontune launch` parsing progress from the stream):
it knows the steps done, the total and the clock, and `launch` only has to hand it the cluster's
price, in ``XEONTUNE_COST_PER_HOUR`` (the provider's ``cost_per_hour``, cluster/pricing.py). With
no price (local clusters, one machine) the line gives the time alone.

Seconds per step are wall-clock seconds since the end of this process's first step (that one
warms up: allocations, first kernels) over the steps since, so checkpoints and validation
between steps are counted too.

A job that was stopped and started again (a Slurm requeue: job/engines/srun.py sets the
``*_ENV`` below) also says the time its restarts lost: the wall time from the job's first start to
this run's start, less what the steps it resumed from took at today's pace. That is the queue wait,
the steps done after the last checkpoint and done again, and the earlier runs' start-ups.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

COST_ENV = "XEONTUNE_COST_PER_HOUR"
JOB_STARTED_ENV = "XEONTUNE_JOB_STARTED"  # epoch seconds: when the job's first run started
RUN_STARTED_ENV = "XEONTUNE_RUN_STARTED"  # epoch seconds: when this run (the job's latest) started
RESTARTS_ENV = "XEONTUNE_RESTARTS"  # how many times the job was started again
MEASURED_STEPS = 2  # steps measured before the first forecast


def usd_per_hour_from_env() -> float | None:
    try:
        value = float(os.environ.get(COST_ENV, ""))
    except ValueError:
        return None
    return value if value > 0 else None


def _env_float(name: str) -> float | None:
    try:
        return float(os.environ.get(name, ""))
    except ValueError:
        return None


@dataclass(frozen=True)
class Restarts:
    """What a restarted job knows of its earlier runs."""

    count: int
    job_started: float  # epoch seconds
    run_started: float
    resumed_step: int  # the step this run resumed from (0: from the start)

    @classmethod
    def from_env(cls, resumed_step: int) -> Restarts | None:
        count, job, run = _env_float(RESTARTS_ENV), _env_float(JOB_STARTED_ENV), _env_float(RUN_STARTED_ENV)
        if not count or count < 1 or job is None or run is None or run < job:
            return None
        return cls(int(count), job, run, resumed_step)

    def lost_s(self, s_per_step: float) -> float:
        return max(0.0, self.run_started - self.job_started - self.resumed_step * s_per_step)


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
    restarts: Restarts | None = None
    _t0: float | None = None  # the clock when this process's first step ended
    _step0: int = 0
    _next_at: int = 0

    @classmethod
    def for_run(cls, max_steps: int, resumed_step: int = 0) -> Forecast:
        return cls(max_steps, usd_per_hour_from_env(), every=max(1, max_steps // 20),
                   restarts=Restarts.from_env(resumed_step))

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
        if self.restarts:
            n = self.restarts.count
            lost_s = self.restarts.lost_s(s_per_step)
            line += (f"; {n} restart{'s' if n > 1 else ''} lost about {duration_text(lost_s)} "
                     "(waiting to start again, and steps done again)")
            if self.usd_per_hour is not None:
                line += f", about ${lost_s / 3600 * self.usd_per_hour:.2f}"
        return line
