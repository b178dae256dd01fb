from __future__ import annotations

import pytest


@pytest.fixture
def base_args(tiny_model, sample_images, tmp_path):
    """Flags for a short, fast run of the tiny model; tests add or override flags."""
    return [
        "--model", str(tiny_model), "--data-dir", str(sample_images), "--placeholder-token", "<toy-bot>",
        "--initializer-token", "toy", "--resolution", "64", "--max-train-steps", "3",
        "--output-dir", str(tmp_path / "out"),
    ]
