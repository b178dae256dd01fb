"""Fixtures for the IPEX suite (run in .venv-ipex by `make test-ipex`)."""

from __future__ import annotations

import pytest


@pytest.fixture
def ipex_can_prepack_bf16() -> bool:
    """IPEX 2.8's own rule for the real CPU: "BF16 weight prepack needs avx_ne_convert or avx512bw/vl/dq"."""
    from xeontune import hardware

    return hardware.ipex_prepack_supported() or "avx_ne_convert" in hardware.cpu_flags()
