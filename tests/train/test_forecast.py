"""The time-and-cost forecast: when rank 0 says it, and what it says (unit, then a real run)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from xeontune.train import forecast
from xeontune.train.forecast import Forecast

REPO = Path(__file__).resolve().parents[2]


def test_first_after_the_measured_steps_then_every_five_percent():
    f = Forecast(max_steps=100, usd_per_hour=2.45, every=5)
    lines = {}
    for done in range(1, 101):
        # step 1 warms up (10 s); then 3 s a step
        line = f.update(done, 10.0 + 3.0 * (done - 1))
        if line:
            lines[done] = line
    assert sorted(lines) == [3, 8, 13, 18, 23, 28, 33, 38, 43, 48, 53, 58, 63, 68, 73, 78, 83, 88, 93, 98]
    # 97 steps left x 3 s = 291 s; $2.45/h x 291 s = $0.198
    assert lines[3] == "forecast: step 3/100, about 5 min left (3.00 s/step), about $0.20 more at $2.45/h"


def test_without_a_price_only_time():
    f = Forecast(max_steps=4000, usd_per_hour=None, every=200)
    assert f.text(1000, 2.0) == "forecast: step 1000/4000, about 1 h 40 min left (2.00 s/step)"
    assert forecast.duration_text(42.4) == "42 s" and forecast.duration_text(0.2) == "1 s"


def test_price_from_the_environment(monkeypatch):
    monkeypatch.setenv(forecast.COST_ENV, "2.4500")
    assert Forecast.for_run(200).usd_per_hour == 2.45 and Forecast.for_run(200).every == 10
    for bad in ("", "0", "abc", "-1"):
        monkeypatch.setenv(forecast.COST_ENV, bad)
        assert Forecast.for_run(200).usd_per_hour is None


@pytest.mark.slow
def test_a_run_prints_its_forecast(tiny_model, sample_images, tmp_path):
    """The tiny model, 8 steps, with a price as `launch` passes it: one a step from step 3 (5 % of 8 steps is less than one)."""
    args = ["--model", str(tiny_model), "--data-dir", str(sample_images), "--placeholder-token", "<cat-toy>",
            "--initializer-token", "toy", "--resolution", "32", "--max-train-steps", "8", "--output-dir",
            str(tmp_path / "out"), "--checkpointing-steps", "0", "--save-steps", "0", "--mixed-precision", "fp32"]
    proc = subprocess.run([sys.executable, "-m", "xeontune.train", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=300, env={**os.environ, forecast.COST_ENV: "3.6"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [ln for ln in proc.stderr.splitlines() if "forecast:" in ln]
    assert [re.search(r"step (\d+)/8", ln).group(1) for ln in lines] == ["3", "4", "5", "6", "7"]
    assert all(re.search(r"about \d+ (s|min) left \(\d+\.\d\d s/step\), about \$\d+\.\d\d more at \$3\.60/h$", ln)
               for ln in lines), lines


@pytest.mark.slow
@pytest.mark.solo  # a localhost job
def test_launch_prints_the_forecast_of_rank_0(tiny_model, sample_images, tmp_path, xeontune_home):
    """Through `xeontune launch` on a 2-rank localhost cluster: rank 0 forecasts, time only ($0)."""
    env = {**os.environ, "XEONTUNE_HOME": str(xeontune_home), "HF_HUB_OFFLINE": "1"}

    def xt(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "xeontune.cli", *args], cwd=REPO, capture_output=True,
                              text=True, timeout=300, env=env)

    assert xt("cluster", "up", "--provider", "localhost", "-n", "2", "--name", "fc").returncode == 0
    try:
        proc = xt("launch", "-n", "2", "--name", "fc", "--", "--model", str(tiny_model), "--data-dir",
                  str(sample_images), "--placeholder-token", "<cat-toy>", "--initializer-token", "toy",
                  "--resolution", "32", "--max-train-steps", "5", "--output-dir", str(tmp_path / "out"),
                  "--checkpointing-steps", "0", "--save-steps", "0", "--mixed-precision", "fp32")
    finally:
        assert xt("teardown", "--name", "fc").returncode == 0
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    lines = [ln for ln in (proc.stdout + proc.stderr).splitlines() if "forecast:" in ln]
    assert [re.search(r"step (\d)/5", ln).group(1) for ln in lines] == ["3", "4"]
    assert all(ln.startswith("[0] ") and re.search(r"about \d+ s left \(\d+\.\d\d s/step\)$", ln) for ln in lines), lines


def test_a_restarted_job_says_what_its_restarts_lost(monkeypatch):
    """Started at t=1000, restarted at t=1400 from step 100's checkpoint at 2 s a step: 400 s less the
    200 s those steps take is 200 s lost (the wait to start again, the steps done again)."""
    monkeypatch.setenv(forecast.JOB_STARTED_ENV, "1000")
    monkeypatch.setenv(forecast.RUN_STARTED_ENV, "1400")
    monkeypatch.setenv(forecast.RESTARTS_ENV, "1")
    monkeypatch.delenv(forecast.COST_ENV, raising=False)
    f = Forecast.for_run(4000, resumed_step=100)
    assert f.text(1000, 2.0) == ("forecast: step 1000/4000, about 1 h 40 min left (2.00 s/step); "
                                 "1 restart lost about 3 min (waiting to start again, and steps done again)")
    monkeypatch.setenv(forecast.RESTARTS_ENV, "2")
    monkeypatch.setenv(forecast.COST_ENV, "3.6")
    assert Forecast.for_run(4000, resumed_step=100).text(1000, 2.0).endswith(
        "; 2 restarts lost about 3 min (waiting to start again, and steps done again), about $0.20")
    # not restarted, or what the batch script says is unreadable: no such clause
    for key, value in ((forecast.RESTARTS_ENV, "0"), (forecast.RUN_STARTED_ENV, "soon"),
                       (forecast.RUN_STARTED_ENV, "900"), (forecast.JOB_STARTED_ENV, "")):
        with monkeypatch.context() as m:
            m.setenv(key, value)
            assert "restart" not in Forecast.for_run(4000, resumed_step=100).text(1000, 2.0)
