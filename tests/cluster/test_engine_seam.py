"""An engine is one module plus one registration: a fake one, kept under tests/, runs `launch
--dry-run`, `launch`, `launch --detach`, `logs` and `teardown` through the CLI, on a provider whose
``engine`` names it, without any other file knowing it. Had the job wing reached past the contract
(mpirun's command, Hydra's options), these would run mpirun instead."""

from __future__ import annotations

import os
import shlex
import sys
import time
from pathlib import Path

import pytest

from tests.cluster import fake_engine
from xeontune.cli import main
from xeontune.cluster.providers import localhost
from xeontune.job import engines

pytestmark = pytest.mark.solo  # launches on localhost: refused while another test trains on this machine


@pytest.fixture
def fake(xeontune_home, monkeypatch):
    engines.register("fake", fake_engine.__name__)
    monkeypatch.setattr(localhost.Localhost, "engine", "fake")
    fake_engine.CALLS.clear()
    yield fake_engine.CALLS
    engines.unregister("fake")


def _job(tmp_path: Path, tiny: Path) -> list[str]:
    return ["--model", str(tiny), "--data-dir", str(tmp_path), "--placeholder-token", "<t>",
            "--initializer-token", "toy", "--output-dir", str(tmp_path / "out")]


def test_a_registered_engine_runs_launch_logs_and_teardown(fake, capsys, tmp_path, tiny_model):
    assert main(["cluster", "up", "--provider", "localhost", "-n", "3", "--name", "eng"]) == 0
    capsys.readouterr()

    assert main(["launch", "-n", "3", "--name", "eng", "--dry-run", "--", *_job(tmp_path, tiny_model)]) == 0
    argv = shlex.split(capsys.readouterr().out)
    assert argv[:2] == [sys.executable, "-c"] and argv[3:] == ["3", str(tmp_path / "out")]  # the plan, no mpirun
    assert fake == [("plan", 3)]

    assert main(["launch", "-n", "3", "--name", "eng", "--", *_job(tmp_path, tiny_model)]) == 0
    captured = capsys.readouterr()
    assert "(localhost, fake, backend gloo, OMP_NUM_THREADS=3)" in captured.err
    assert fake[-2:] == [("plan", 3), ("preflight", 3)]
    assert (tmp_path / "out" / "result.txt").read_text() == "3 ranks\n"

    os.environ["FAKE_ENGINE_RC"] = "7"  # its exit status is the job's
    try:
        assert main(["launch", "-n", "2", "--name", "eng", "--", *_job(tmp_path, tiny_model)]) == 7
    finally:
        del os.environ["FAKE_ENGINE_RC"]


def test_a_detached_job_of_a_registered_engine_is_followed_and_stopped(fake, capsys, tmp_path, tiny_model,
                                                                        monkeypatch):
    from xeontune.job import record

    assert main(["cluster", "up", "--provider", "localhost", "-n", "2", "--name", "engd"]) == 0
    monkeypatch.setenv("FAKE_ENGINE_HOLD", "1")
    assert main(["launch", "-n", "2", "--name", "engd", "--detach", "--", *_job(tmp_path, tiny_model)]) == 0
    job = record.load_job("engd")
    deadline = time.monotonic() + 30
    while "holding" not in (Path(job.log_path).read_text() if Path(job.log_path).exists() else ""):
        assert time.monotonic() < deadline, "the detached job never started"
        time.sleep(0.1)
    capsys.readouterr()
    assert main(["logs", "--name", "engd"]) == 0
    assert "[1] fake rank 1 of 2" in capsys.readouterr().out
    assert Path(f"/proc/{job.pid}").exists()

    assert main(["teardown", "--name", "engd"]) == 0  # stops the job first (SIGINT to its runner)
    assert f"stopping job {job.id}, still running" in capsys.readouterr().err
    assert not Path(f"/proc/{job.pid}").exists()


@pytest.mark.parametrize("scheduled", [False, True], ids=["process-job", "scheduler-job"])
def test_the_engines_preflight_refuses_before_anything_is_recorded(fake, capsys, tmp_path, tiny_model, monkeypatch,
                                                                    scheduled):
    from xeontune.job import record

    monkeypatch.setattr(fake_engine.FakeEngine, "scheduled", scheduled)
    assert main(["cluster", "up", "--provider", "localhost", "-n", "1", "--name", "engp"]) == 0
    monkeypatch.setenv("FAKE_ENGINE_REFUSE", "no launcher on the head")
    assert main(["launch", "-n", "1", "--name", "engp", "--", *_job(tmp_path, tiny_model)]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == "error: fake engine: no launcher on the head"
    assert fake == [("plan", 1), ("preflight", 1)]  # never submitted, never started
    assert not record.record_path("engp").exists()


def test_an_unknown_engine_is_a_one_line_error(xeontune_home, monkeypatch, capsys, tmp_path, tiny_model):
    monkeypatch.setattr(localhost.Localhost, "engine", "warp")
    assert main(["cluster", "up", "--provider", "localhost", "-n", "1", "--name", "engw"]) == 0
    assert main(["launch", "-n", "1", "--name", "engw", "--dry-run", "--", *_job(tmp_path, tiny_model)]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith("error: unknown engine 'warp'")
