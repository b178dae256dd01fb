"""The frozen-model backends without IPEX (the IPEX path is tested in tests/ipex/, its own venv)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from xeontune import hardware
from xeontune.errors import UserError
from xeontune.train import backends


def _models() -> tuple[nn.Module, nn.Module]:
    return nn.Sequential(nn.Conv2d(4, 4, 3, padding=1)), nn.Sequential(nn.Conv2d(3, 4, 1))


def _no_ipex(monkeypatch):
    monkeypatch.setattr(
        hardware, "ipex_info", lambda *a: hardware.IpexInfo(None, False, False, "not installed")
    )


def test_ipex_off_and_unavailable_leave_models_alone(monkeypatch):
    _no_ipex(monkeypatch)
    unet, vae = _models()
    out_unet, out_vae, notes = backends.prepare_frozen_models(unet, vae, precision="fp32", ipex="off", pack="off")
    assert out_unet is unet and out_vae is vae and notes == ["IPEX: off (--ipex off)"]
    _, _, notes = backends.prepare_frozen_models(unet, vae, precision="fp32", ipex="auto", pack="off")
    assert notes == ["IPEX: not used (not installed)"] and not backends.ipex_applied(notes)


def test_ipex_on_without_ipex_is_a_user_error(monkeypatch):
    _no_ipex(monkeypatch)
    with pytest.raises(UserError, match="not installed"):
        backends.prepare_frozen_models(*_models(), precision="fp32", ipex="on")
    with pytest.raises(UserError):
        backends.prepare_frozen_models(*_models(), precision="fp32", ipex="yes")


def test_auto_skips_ipex_without_avx512_and_never_imports_it(monkeypatch):
    monkeypatch.setattr(
        hardware, "ipex_info", lambda *a: hardware.IpexInfo("2.8.0", True, False, "no AVX-512 here")
    )
    unet, vae = _models()
    out_unet, out_vae, notes = backends.prepare_frozen_models(unet, vae, precision="fp32", ipex="auto", pack="off")
    assert out_unet is unet and out_vae is vae and notes == ["IPEX: not used (no AVX-512 here)"]


def test_bad_prepack_override_is_a_user_error(monkeypatch):
    monkeypatch.setenv(backends.PREPACK_ENV, "maybe")
    with pytest.raises(UserError, match=backends.PREPACK_ENV):
        backends._prepack_choice(hardware.IpexInfo("2.8.0", True, False, ""))
    monkeypatch.setenv(backends.PREPACK_ENV, "on")
    assert backends._prepack_choice(hardware.IpexInfo("2.8.0", True, False, ""))
    monkeypatch.delenv(backends.PREPACK_ENV)
    assert not backends._prepack_choice(hardware.IpexInfo("2.8.0", True, False, ""))


def test_compile_wraps_the_unet_only(monkeypatch):
    _no_ipex(monkeypatch)
    unet, vae = _models()
    out_unet, out_vae, notes = backends.prepare_frozen_models(unet, vae, precision="fp32", ipex="off", compile=True)
    assert out_vae is vae and out_unet is not unet
    assert getattr(out_unet, "_orig_mod", None) is unet  # not called here: compiling takes minutes
    assert any("torch.compile" in n for n in notes)


def test_hidden_linear_forwards_but_is_not_a_child():
    linear = nn.Linear(3, 2)
    hidden = backends._HiddenLinear(linear)
    x = torch.randn(4, 3)
    assert torch.equal(hidden(x), linear(x))
    assert list(hidden.modules()) == [hidden]
