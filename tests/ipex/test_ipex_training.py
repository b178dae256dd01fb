"""A few training steps with IPEX match the stock-PyTorch path (both in the IPEX venv), in fp32 and bf16.

Each run is its own process: the stock run must never import IPEX, which replaces some CPU kernels
at import time. Both runs of a pair use the same precision, pinned (never `auto`).

- fp32: only the summation order of IPEX's prepacked convolutions differs. The learned vectors
  differ by at most 0.1 % of the distance they moved from their initial value (max abs over all
  elements; measured: 3e-6 of it on an AVX2 EPYC and 3.7e-6 on an AMX Xeon), the final losses by at most 1e-3 relative.
- bf16: IPEX's bf16 kernels round differently from stock torch's, and Adam's first steps move each
  element by about +-lr whatever its gradient's size, so near-zero gradients can flip. Compared as
  norms: vectors within 20 % of the distance moved (measured on an AMX Xeon: 1.3 %), final
  losses within 2**-8 relative, bf16's unit roundoff (measured: 2.4e-4).
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
# fp32: max abs difference / max abs distance moved; bf16: norm of the difference / norm of the distance
VECTOR_TOLERANCE = {"fp32": 1e-3, "bf16": 0.2}
LOSS_RTOL = {"fp32": 1e-3, "bf16": 2.0**-8}
# The stock run must have trained, or the tolerances above (fractions of the distance moved) say nothing.
# Adam moves an element about lr a step: 5 steps at 5e-3 moved the vectors by 0.0249 (max abs, fp32) and
# 0.0912 (norm, bf16), measured for the stock run's command in the project venv (torch 2.13, no IPEX). The
# floors are half that: far above fp32 rounding of the row (its values are below 0.05: an ulp under 1e-8)
# and over 100x bf16's rounding of it (2**-8 of its norm, 0.091: 3.5e-4).
MOVED_MIN = {"fp32": 0.0125, "bf16": 0.045}


def _train(model, data, out, ipex: str, precision: str, prepack: bool, *extra: str) -> tuple[torch.Tensor, float]:
    """One run in its own process. ``prepack``: forced on in fp32 (as on AVX-512 CPUs), so the
    Linear-gradient trap would show if it came back; in bf16 only where IPEX's kernels allow it."""
    argv = [
        "--model", str(model), "--data-dir", str(data), "--placeholder-token", "<toy-bot>",
        "--initializer-token", "toy", "--resolution", "64", "--max-train-steps", str(STEPS),
        "--learning-rate", "5e-3", "--output-dir", str(out), "--ipex", ipex, "--report-to", "none",
        "--mixed-precision", precision, "--pack-weights", "off", *extra,  # stock layers, as IPEX found them
    ]
    env = {**os.environ, backends.PREPACK_ENV: "on" if prepack else "off"}
    done = subprocess.run(
        [sys.executable, "-m", "xeontune.train", *argv], capture_output=True, text=True, timeout=600, env=env
    )
    assert done.returncode == 0, done.stderr[-3000:]
    log = done.stderr + done.stdout
    assert ("convolutions prepacked" in log) == (ipex == "on" and prepack), log[-2000:]
    assert f"precision {precision}" in log, log[-2000:]
    _, vectors = load_learned_embeds(out / "learned_embeds.safetensors")
    loss = float(log.rsplit("(loss ", 1)[1].split()[0])
    return vectors, loss


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_training_steps_with_ipex_match_stock(tiny_model, tmp_path, precision, ipex_can_prepack_bf16):
    from diffusers import StableDiffusionPipeline
    from transformers import CLIPTextModel, CLIPTokenizer

    from xeontune import models

    data = tmp_path / "data"
    models.write_sample_data(data, count=3, size=64)
    prepack = precision == "fp32" or ipex_can_prepack_bf16
    stock, stock_loss = _train(tiny_model, data, tmp_path / "stock", "off", precision, prepack)
    ipexed, ipex_loss = _train(tiny_model, data, tmp_path / "ipex", "on", precision, prepack, "--save-as-full-pipeline")

    tokenizer = CLIPTokenizer.from_pretrained(tiny_model, subfolder="tokenizer")
    table = CLIPTextModel.from_pretrained(tiny_model, subfolder="text_encoder").get_input_embeddings().weight
    initial = table[tokenizer.convert_tokens_to_ids("toy</w>")].detach()
    if precision == "fp32":
        moved, diff = (stock - initial).abs().max(), (ipexed - stock).abs().max()
    else:
        moved, diff = (stock - initial).norm(), (ipexed - stock).norm()
    assert moved >= MOVED_MIN[precision], f"the vectors moved by {float(moved):.3g}, less than {MOVED_MIN[precision]:g}"
    loss_rel = abs(ipex_loss - stock_loss) / abs(stock_loss)
    print(f"{precision}: IPEX vs stock vectors {float(diff / moved):.2e} of the distance moved ({float(moved):.3g}), "
          f"loss {loss_rel:.2e}")
    assert diff <= VECTOR_TOLERANCE[precision] * moved
    assert loss_rel <= LOSS_RTOL[precision]
    # A pipeline saved from IPEX-optimized models loads back as an ordinary one.
    StableDiffusionPipeline.from_pretrained(tmp_path / "ipex" / "pipeline", safety_checker=None)


def test_bench_baseline_runs_without_ipex_while_the_trainer_uses_it(tiny_model, capsys):
    """Importing IPEX swaps CPU autocast kernels for the whole process, so the example-script baseline
    runs in a worker process that never imports it, while the optimized variant does use it."""
    import json

    from xeontune.cli import main

    assert main(["bench", "--model", str(tiny_model), "--resolution", "64", "--steps", "1", "--warmup", "0",
                 "--allocator", "none", "--matmul-size", "256", "--ranks-per-node", "none", "--no-rss",
                 "--ipex", "on", "--mixed-precision", "fp32", "--json"]) == 0
    notes = json.loads(capsys.readouterr().out)["config"]["backend_notes"]
    assert any(n.startswith("IPEX") for n in notes), notes
    assert "baseline: own process, stock torch" in notes, notes
    assert "intel_extension_for_pytorch" in sys.modules
