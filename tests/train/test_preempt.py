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


def _signal_mid_run(args: list[str], out: Path, signum: int, env: dict[str, str],
                    after: int) -> subprocess.CompletedProcess:
    """``signum`` to the run once metrics.jsonl holds ``after`` steps."""
    proc = subprocess.Popen([sys.executable, "-m", "xeontune.train", *args], cwd=REPO, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    wait_for_lines(out / "metrics.jsonl", after, timeout_s=240, poll_s=0.05, until=lambda: proc.poll() is not None)
    proc.send_signal(signum)
    stdout, stderr = proc.communicate(timeout=120)
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


@pytest.mark.slow
def test_sigusr1_then_sigterm_mid_run_each_checkpoint_and_stop_and_the_resumed_run_equals_a_straight_one(
        tiny_model, sample_images, tmp_path):
    """SIGUSR1 (Slurm's --signal notice) after step 3: a checkpoint, status 75 and the batch script's
    mark; the resumed run gets SIGTERM (a preemption) 3 steps on: a checkpoint, status 143 and no mark
    (Slurm requeues, not the batch script); resumed again, the run ends with a straight run's vectors.
    (One run for both signals: each run's start costs this 2-core machine ~10 s.)"""
    steps, out, mark = STEPS, tmp_path / "out", tmp_path / "preempted"
    args = [*_args(tiny_model, sample_images, steps), "--output-dir", str(out)]
    env = {**os.environ, preempt.ENV: "1", preempt.MARK_ENV: str(mark)}
    resume = ["--resume-from-checkpoint", "latest"]
    done = 0
    for signum, status, resuming in ((signal.SIGUSR1, 75, []), (signal.SIGTERM, 143, resume)):
        stopped = _signal_mid_run([*args, *resuming], out, signum, env, after=done + 3)
        assert stopped.returncode == status, stopped.stderr[-3000:]
        before, done = done, len(lines(out / "metrics.jsonl"))
        assert before + 3 <= done < steps
        name = signal.Signals(signum).name
        assert f"checkpoint-{done} written on {name}: stopped, to resume from it" in stopped.stderr
        assert (out / f"checkpoint-{done}").is_dir() and not (out / EMBEDS).exists()
        assert mark.exists() == (signum == signal.SIGUSR1)  # on SIGTERM Slurm requeues, not the batch script
        mark.unlink(missing_ok=True)

    resumed = subprocess.run([sys.executable, "-m", "xeontune.train", *args, *resume], cwd=REPO, env=env,
                             capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    straight = References(tmp_path).train([sys.executable, "-m", "xeontune.train",
                                           *_args(tiny_model, sample_images, steps)], cwd=REPO)
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
