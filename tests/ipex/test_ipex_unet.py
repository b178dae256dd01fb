"""A real forward and backward through an IPEX-optimized UNet (IPEX 2.8 + torch 2.8 venv), in fp32 and bf16.

IPEX's own kernels check the real CPU (bf16 weight prepacking needs AVX-512 bw/vl/dq or
avx_ne_convert), so the tests of IPEX's behaviour branch on the real flags; the test of the project's
`--ipex auto` decision fakes both kinds of CPU instead.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from torch import nn

pytest.importorskip("intel_extension_for_pytorch", reason="IPEX is not installed here; run `make test-ipex`")

from xeontune import hardware  # noqa: E402
from xeontune.train import backends  # noqa: E402


def _load(path):
    from diffusers import AutoencoderKL, UNet2DConditionModel

    unet = UNet2DConditionModel.from_pretrained(path, subfolder="unet").eval().requires_grad_(False)
    vae = AutoencoderKL.from_pretrained(path, subfolder="vae").eval().requires_grad_(False)
    return unet, vae


def _inputs(unet, seed=0):
    g = torch.Generator().manual_seed(seed)
    size = unet.config.sample_size
    latents = torch.randn(2, 4, size, size, generator=g)
    hidden = torch.randn(2, 77, unet.config.cross_attention_dim, generator=g)
    return latents, torch.tensor([10, 500]), hidden


def test_ipex_is_usable_here():
    info = hardware.ipex_info()
    assert info.usable, info.reason


def test_the_trap_prepacked_frozen_linear_gives_its_input_no_gradient_in_fp32():
    """Why backends.py hides Linear layers from ipex.optimize: this is IPEX 2.8's behaviour in fp32
    (measured on an AVX2 EPYC and on an AMX Xeon alike)."""
    import intel_extension_for_pytorch as ipex

    model = nn.Sequential(nn.Linear(8, 4)).eval().requires_grad_(False)  # a child: a root is not swapped
    packed = ipex.optimize(model, dtype=torch.float32, weights_prepack=True)
    assert any("IPEX" in type(m).__name__ for m in packed.modules())  # it really was prepacked
    x = torch.randn(3, 8, requires_grad=True)
    packed(x).sum().backward()
    assert x.grad is None


def test_bf16_prepacked_frozen_linear_gives_the_right_gradient(ipex_can_prepack_bf16):
    """In bf16 (eval mode, frozen weight) a prepacked Linear passes its input the right gradient.

    Measured on an AMX Xeon: 0.29 % from the exact fp32 gradient, the same as stock torch's bf16
    autocast. The bound, 1 %, is a few bf16 roundings (2**-8 each) of inputs and weights. Where IPEX
    cannot prepack bf16 weights (AVX2 only), it refuses, and that is asserted instead."""
    import intel_extension_for_pytorch as ipex

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 32)).eval().requires_grad_(False)
    weight = model[0].weight.detach().clone()
    if not ipex_can_prepack_bf16:
        with pytest.raises((AssertionError, RuntimeError)):
            ipex.optimize(model, dtype=torch.bfloat16, weights_prepack=True)
        pytest.skip("IPEX cannot prepack bf16 weights on this CPU (its refusal checked): no gradient to compare")
    packed = ipex.optimize(model, dtype=torch.bfloat16, weights_prepack=True)
    assert any("IPEX" in type(m).__name__ and "Linear" in type(m).__name__ for m in packed.modules())
    x = torch.randn(5, 64, requires_grad=True)
    r = torch.randn(5, 32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = packed(x)
    (out.float() * r).sum().backward()
    exact = r @ weight  # d/dx of sum(r * (x W^T + b)), in fp32
    assert x.grad is not None
    assert float((x.grad - exact).norm() / exact.norm()) <= 0.01


STOCK_REFERENCE = """
import sys, torch
from diffusers import UNet2DConditionModel
assert "intel_extension_for_pytorch" not in sys.modules
unet = UNet2DConditionModel.from_pretrained(sys.argv[1], subfolder="unet").eval().requires_grad_(False)
latents, t, hidden = torch.load(sys.argv[2])
h = hidden.clone().requires_grad_(True)
with torch.autocast("cpu", dtype=torch.bfloat16, enabled=sys.argv[4] == "bf16"):
    out = unet(latents, t, encoder_hidden_states=h).sample
(out.float() ** 2).mean().backward()
torch.save((out.detach().float(), h.grad), sys.argv[3])
"""


def _stock_reference(tiny_model, tmp_path, precision: str) -> tuple[tuple, torch.Tensor, torch.Tensor]:
    """(inputs, output, gradient of the text states) from stock torch, in a process that never imports
    IPEX: importing it replaces some kernels."""
    inputs = _inputs(_load(tiny_model)[0])
    torch.save(inputs, tmp_path / "inputs.pt")
    subprocess.run([sys.executable, "-c", STOCK_REFERENCE, str(tiny_model), str(tmp_path / "inputs.pt"),
                    str(tmp_path / "ref.pt"), precision], check=True)
    ref_out, ref_grad = torch.load(tmp_path / "ref.pt")
    return inputs, ref_out, ref_grad


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach().float() - b.detach().float()).norm() / b.detach().float().norm())


def _ipex_modules(model: nn.Module) -> set[str]:
    return {type(m).__name__ for m in model.modules() if "IPEX" in type(m).__name__}


def test_auto_uses_ipex_only_on_a_cpu_with_avx512(tiny_model, fake_cpu):
    unet, vae = _load(tiny_model)
    out_unet, _, notes = backends.prepare_frozen_models(unet, vae, precision="fp32", ipex="auto", pack="off")
    if fake_cpu == "amx-xeon":
        # ipex.optimize(inplace=True) changes the model in place: look for its prepacked modules
        assert notes[0].startswith("IPEX ") and "optimized" in notes[0] and "convolutions prepacked" in notes[0]
        assert backends.ipex_applied(notes)  # what makes a broken gradient's message name IPEX
        assert any("Conv" in k for k in _ipex_modules(out_unet))
    else:  # AVX2 only: IPEX's prepacked convolutions were 12-14x slower there (docs/performance.md)
        assert out_unet is unet and notes[0].startswith("IPEX: not used") and "AVX-512" in notes[0]
        assert not backends.ipex_applied(notes)
        assert not _ipex_modules(out_unet)


def test_auto_leaves_ipex_out_in_bf16_where_packed_weights_run(tiny_model, fake_cpu, monkeypatch):
    """Stock torch with packed weights beat IPEX 2.8 (docs/performance.md): in bf16 `--ipex auto`
    packs instead, on every CPU that runs oneDNN's bf16 kernels, whatever IPEX could do there; on one that
    does not (AVX2 only), auto falls back to IPEX's own rule for the CPU kind."""
    from xeontune.train import packed

    unet, vae = _load(tiny_model)
    unet.to(torch.bfloat16)
    if not packed.available(torch.bfloat16)[0]:  # no oneDNN bf16 kernels on this CPU: no packing either
        assert not torch.ops.mkldnn._is_mkldnn_bf16_supported()
        # auto goes on to IPEX's own rule (prepacking off: the real CPU cannot prepack bf16 whatever the flags say)
        monkeypatch.setenv(backends.PREPACK_ENV, "off")
        out_unet, _, notes = backends.prepare_frozen_models(unet, vae, precision="bf16", ipex="auto")
        assert not any(type(m) is packed.PackedConv2d for m in out_unet.modules())
        if fake_cpu == "amx-xeon":
            assert notes[0].startswith("IPEX ") and "optimized in bf16" in notes[0], notes
        else:
            assert out_unet is unet and notes[0].startswith("IPEX: not used") and "AVX-512" in notes[0], notes
        return
    out_unet, _, notes = backends.prepare_frozen_models(unet, vae, precision="bf16", ipex="auto")
    assert out_unet is unet and notes[0].startswith("IPEX: not used (stock torch with packed weights") and not _ipex_modules(unet)
    assert any(type(m) is packed.PackedConv2d for m in unet.modules())


def test_optimized_unet_forward_and_backward_match_stock_fp32(tiny_model, tmp_path, monkeypatch):
    # Prepacking forced on, as --ipex auto does on AVX-512 CPUs: the path where the Linear trap lives.
    monkeypatch.setenv(backends.PREPACK_ENV, "on")
    (latents, t, hidden), ref_out, ref_grad = _stock_reference(tiny_model, tmp_path, "fp32")

    unet, vae = _load(tiny_model)
    opt_unet, _, notes = backends.prepare_frozen_models(unet, vae, precision="fp32", ipex="on")
    assert any(n.startswith("IPEX 2.8") and "convolutions prepacked" in n for n in notes), notes
    assert backends.ipex_applied(notes)
    kinds = {type(m).__name__ for m in opt_unet.modules()}
    assert any("IPEX" in k and "Conv" in k for k in kinds), kinds  # convolutions did get prepacked
    assert all(type(m) is nn.Linear for m in opt_unet.modules() if isinstance(m, nn.Linear))

    h = hidden.clone().requires_grad_(True)
    out = opt_unet(latents, t, encoder_hidden_states=h).sample
    (out**2).mean().backward()
    assert h.grad is not None and torch.isfinite(h.grad).all() and h.grad.abs().sum() > 0
    # fp32 throughout; only the summation order of the prepacked convolutions differs
    torch.testing.assert_close(out, ref_out, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(h.grad, ref_grad, rtol=1e-3, atol=1e-8)


def test_optimized_unet_bf16_matches_stock_bf16(tiny_model, tmp_path):
    (latents, t, hidden), ref_out, ref_grad = _stock_reference(tiny_model, tmp_path, "bf16")
    unet, vae = _load(tiny_model)
    opt_unet, opt_vae, notes = backends.prepare_frozen_models(unet, vae, precision="bf16", ipex="on")
    # conv and linear weights in bf16 (IPEX keeps the norm layers' affine parameters in fp32)
    weights = [m.weight for m in opt_unet.modules() if isinstance(m, (nn.Linear, nn.Conv2d))]
    assert weights and {w.dtype for w in weights} == {torch.bfloat16}
    if not hardware.ipex_prepack_supported():
        assert "no weight prepacking" in notes[0]
    assert opt_vae is vae and "VAE left to stock torch" in notes[0]  # it runs in and outside autocast
    assert {p.dtype for p in opt_vae.parameters()} == {torch.float32}
    h = hidden.clone().requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = opt_unet(latents, t, encoder_hidden_states=h).sample
        encoded = opt_vae.encode(torch.randn(1, 3, 64, 64)).latent_dist.mean
    (out.float() ** 2).mean().backward()
    assert h.grad is not None and torch.isfinite(h.grad).all() and h.grad.abs().sum() > 0
    assert torch.isfinite(encoded).all()
    # Measured on an AMX Xeon: IPEX bf16 vs stock bf16 differ by 0.94 % (output) and 2.3 % (gradient),
    # norm-wise; stock bf16 itself is 1.5 % and 3.8 % from stock fp32. The bounds are twice bf16's own
    # distance from fp32: different bf16 kernels, not a different computation.
    print(f"IPEX bf16 vs stock bf16: output {_rel(out, ref_out):.2e}, gradient {_rel(h.grad, ref_grad):.2e}")
    assert _rel(out, ref_out) <= 0.03
    assert _rel(h.grad, ref_grad) <= 0.08
