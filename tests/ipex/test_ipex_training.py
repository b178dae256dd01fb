"""A few training steps with IPEX match the stock-PyTorch path (both in the IPEX venv).

Each run is its own process: the stock run must never import IPEX, which replaces some CPU kernels
at import time. Tolerance: the learned vectors of the two runs differ by at most 0.1 % of the
distance they moved from their initial value (max abs over all elements; measured here: 3e-6 of
it), and the final losses by at most 1e-3 relative. Both are fp32; only the summation order of
IPEX's prepacked convolutions differs, so the runs are close but not bit-identical.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("intel_extension_for_pytorch", reason="IPEX is not installed here; run `make test-ipex`")

from xeontune.train import backends  # noqa: E402
from xeontune.train.tokens import load_learned_embeds  # noqa: E402

STEPS = 5
VECTOR_TOLERANCE = 1e-3  # of the distance moved from the initializer (measured: 3e-6)
LOSS_RTOL = 1e-3


def _train(model, data, out, ipex: str, *extra: str) -> tuple[torch.Tensor, float]:
    argv = [
        "--model", str(model), "--data-dir", str(data), "--placeholder-token", "<toy-bot>",
        "--initializer-token", "toy", "--resolution", "64", "--max-train-steps", str(STEPS),
        "--learning-rate", "5e-3", "--output-dir", str(out), "--ipex", ipex, "--report-to", "none", *extra,
    ]
    # Prepacking forced on (as on AVX-512 CPUs), so the Linear-gradient trap would show if it came back.
    env = {**os.environ, backends.PREPACK_ENV: "on"}
    done = subprocess.run(
        [sys.executable, "-m", "xeontune.train", *argv], capture_output=True, text=True, timeout=600, env=env
    )
    assert done.returncode == 0, done.stderr[-3000:]
    log = done.stderr + done.stdout
    assert ("convolutions prepacked" in log) == (ipex == "on"), log[-2000:]
    _, vectors = load_learned_embeds(out / "learned_embeds.safetensors")
    loss = float(log.rsplit("(loss ", 1)[1].split()[0])
    return vectors, loss


def test_training_steps_with_ipex_match_stock(tiny_model, tmp_path):
    from diffusers import StableDiffusionPipeline
    from transformers import CLIPTextModel, CLIPTokenizer

    from xeontune import models

    data = tmp_path / "data"
    models.write_sample_data(data, count=3, size=64)
    stock, stock_loss = _train(tiny_model, data, tmp_path / "stock", "off")
    ipexed, ipex_loss = _train(tiny_model, data, tmp_path / "ipex", "on", "--save-as-full-pipeline")

    tokenizer = CLIPTokenizer.from_pretrained(tiny_model, subfolder="tokenizer")
    table = CLIPTextModel.from_pretrained(tiny_model, subfolder="text_encoder").get_input_embeddings().weight
    initial = table[tokenizer.convert_tokens_to_ids("toy</w>")].detach()
    moved = (stock - initial).abs().max()
    assert moved > 0, "the vectors did not train"
    assert (ipexed - stock).abs().max() <= VECTOR_TOLERANCE * moved
    assert abs(ipex_loss - stock_loss) <= LOSS_RTOL * abs(stock_loss)
    # A pipeline saved from IPEX-optimized models loads back as an ordinary one.
    StableDiffusionPipeline.from_pretrained(tmp_path / "ipex" / "pipeline", safety_checker=None)
