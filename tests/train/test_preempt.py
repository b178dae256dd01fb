"""The checkpoint in a Slurm job's grace time (train/preempt.py), on one process: SIGUSR1 and SIGTERM
mid-run checkpoint and stop with their own status, and the run resumes to the vectors of a straight one.
tests/cluster/test_slurm.py does the same through a real Slurm's requeue."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.checks import EMBEDS, References, assert_same_vectors, lines, wait_for_lines
from xeontune.train import preempt

REPO = Path(__file__).resolve().parents[2]


def _args(tiny_model, sample_images, steps: int) -> list[str]:
    return ["--model", str(tiny_model), "--data-dir", str(sample_images), "--placeholder-token", "<cat-toy>",
            "--initializer-token", "toy", "--resolution", "32", "--max-train-steps", str(steps),
            "--checkpointing-steps", "0", "--save-steps", "0", "--mixed-precision", "fp32"]


# A step takes about 0.05 s here: the signal comes after step 3, the run is stopped a step or two
# later, long before its last step (60 steps: 3 s of steps, a margin for a busy machine's wake-ups).
STEPS = 60


@pytest.fixture(scope="module")
def references(tmp_path_factory) -> References:
    """The straight run, trained once for both signals."""
    return References(tmp_path_factory.mktemp("straight"))


def _signal_mid_run(args: list[str], out: Path, signum: int, env: dict[str, str]) -> subprocess.CompletedProcess:
    proc = subprocess.Popen([sys.executable, "-m", "xeontune.train", *args], cwd=REPO, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    wait_for_lines(out / "metrics.jsonl", 3, timeout_s=240, poll_s=0.05, until=lambda: proc.poll() is not None)
    proc.send_signal(signum)
    stdout, stderr = proc.communicate(timeout=120)
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGUSR1], ids=["SIGTERM", "SIGUSR1"])
def test_a_signal_mid_run_checkpoints_stops_and_the_resumed_run_equals_a_straight_one(
        signum, tiny_model, sample_images, tmp_path, references):
    steps, out, mark = STEPS, tmp_path / "out", tmp_path / "preempted"
    args = _args(tiny_model, sample_images, steps)
    env = {**os.environ, preempt.ENV: "1", preempt.MARK_ENV: str(mark)}
    stopped = _signal_mid_run([*args, "--output-dir", str(out)], out, signum, env)
    assert stopped.returncode == (75 if signum == signal.SIGUSR1 else 143), stopped.stderr[-3000:]
    done = len(lines(out / "metrics.jsonl"))
    assert 3 <= done < steps
    name = signal.Signals(signum).name
    assert f"checkpoint-{done} written on {name}: stopped, to resume from it" in stopped.stderr
    assert (out / f"checkpoint-{done}").is_dir() and not (out / EMBEDS).exists()
    assert mark.exists() == (signum == signal.SIGUSR1)  # on SIGTERM Slurm requeues, not the batch script

    resumed = subprocess.run([sys.executable, "-m", "xeontune.train", *args, "--output-dir", str(out),
                              "--resume-from-checkpoint", "latest"], cwd=REPO, env=env, capture_output=True,
                             text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    straight = references.train([sys.executable, "-m", "xeontune.train", *args], cwd=REPO)
    assert_same_vectors(out, straight, atol=0.0)


def test_sigterm_waits_for_the_end_of_a_step_only_while_steps_run():
    """Armed: SIGTERM before the steps stops at once (as Ctrl-C); during them it is only noted, and
    SIGUSR1 (the batch script requeues) wins over it. Unarmed: requested() never says stop."""
    script = textwrap.dedent("""
        import os, signal
        from xeontune.train import preempt
        preempt.install()
        assert preempt.requested(1) is None
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            print("not stopped")
        except KeyboardInterrupt as exc:
            print("stopped at once:", exc.args[0])
        preempt.defer_term(True)
        os.kill(os.getpid(), signal.SIGTERM)
        print("deferred:", preempt.requested(1).name)
        os.kill(os.getpid(), signal.SIGUSR1)
        print("then:", preempt.requested(1).name)
    """)
    armed = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=60,
                           env={**os.environ, preempt.ENV: "1"})
    assert armed.returncode == 0, armed.stderr
    assert armed.stdout.splitlines() == ["stopped at once: SIGTERM", "deferred: SIGTERM", "then: SIGUSR1"]
    unarmed = subprocess.run([sys.executable, "-c", "from xeontune.train import preempt\n"
                              "preempt.install(); preempt.defer_term(True); print(preempt.requested(1))"],
                             cwd=REPO, capture_output=True, text=True, timeout=60,
                             env={k: v for k, v in os.environ.items() if k != preempt.ENV})
    assert unarmed.returncode == 0 and unarmed.stdout.strip() == "None", unarmed.stderr
