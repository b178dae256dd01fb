"""`--attention`: a run through xeontune's attention kernel trains as one through torch's SDPA, and a machine
without a compiler says so in one line and trains on torch's (issue 51). The kernel's accuracy gate is
test_attention.py's."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest

from tests.checks import MOVED_MIN, assert_same_vectors, run_moved_from_initializer
from tests.trainlib import OFFLINE, train_in_process

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_run_through_the_kernel_trains_as_one_through_torchs_sdpa(base_args, tmp_path, precision, caplog):
    """Textual inversion on the tiny model, 3 steps: the vectors learn through the UNet's cross-attention
    (its keys and values), so the kernel's forward and backward both decide them. fp32: within 1e-5 of torch's
    run; bf16 (the path of every CPU, emulated where it has no bf16 instructions): within a tenth of what the
    steps moved them."""
    caplog.set_level(logging.INFO, logger="xeontune.train")
    runs = {}
    for choice in ("torch", "xeontune"):
        runs[choice] = tmp_path / choice
        train_in_process([*base_args, "--output-dir", str(runs[choice]), "--mixed-precision", precision,
                          "--attention", choice])
    assert "attention: xeontune's kernel for every call it handles (--attention xeontune)" in caplog.text
    assert "attention: torch's SDPA (--attention torch)" in caplog.text
    moved = run_moved_from_initializer(runs["torch"])
    assert moved > MOVED_MIN
    assert_same_vectors(runs["xeontune"], runs["torch"], atol=1e-5 if precision == "fp32" else moved / 10)


def test_without_a_compiler_the_run_says_so_once_and_trains_on_torchs_sdpa(base_args, tmp_path):
    """`--attention xeontune` where nothing can compile (CC and CXX are `false`, an empty cache): one warning
    line, the run's note says torch's SDPA ran, and the vectors are those of an `--attention torch` run (fp32;
    within 1e-6, not bit for bit: under xdist this process and the child may run other thread counts)."""
    out, reference = tmp_path / "no-compiler", tmp_path / "torch"
    env = {**os.environ, **OFFLINE, "CC": "false", "CXX": "false", "XEONTUNE_CACHE": str(tmp_path / "cache")}
    done = subprocess.run([sys.executable, "-m", "xeontune.cli", "train", *base_args, "--output-dir", str(out),
                           "--mixed-precision", "fp32", "--attention", "xeontune"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    said = done.stdout + done.stderr
    assert done.returncode == 0, said[-3000:]
    warned = [line for line in said.splitlines() if "attention kernel could not be built" in line]
    assert len(warned) == 1 and "Traceback" not in said, said[-3000:]
    assert "attention: torch's SDPA (the kernel could not be built" in said
    train_in_process([*base_args, "--output-dir", str(reference), "--mixed-precision", "fp32", "--attention", "torch"])
    assert_same_vectors(out, reference, atol=1e-6)
