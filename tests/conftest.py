"""Fixtures shared by every test package (kept small: package-specific ones live beside their tests)."""

from __future__ import annotations

import atexit
import importlib.util
import os
import shutil
import signal
import tempfile

import pytest

# No test may reach a model hub; huggingface_hub reads this once, at import.
os.environ["HF_HUB_OFFLINE"] = "1"
# bf16 runs write a bf16 copy of the UNet (components.bf16_copy_dir): not into the user's ~/.cache,
# and not left behind in /tmp either (removed by the process that made it, when it exits).
if "XEONTUNE_CACHE" not in os.environ:
    os.environ["XEONTUNE_CACHE"] = tempfile.mkdtemp(prefix="xeontune-test-cache-")
    atexit.register(shutil.rmtree, os.environ["XEONTUNE_CACHE"], ignore_errors=True)

# tests/ipex needs torch 2.8 + IPEX: `make test-ipex` (part of `make test`) runs it in .venv-ipex.
if importlib.util.find_spec("intel_extension_for_pytorch") is None:
    collect_ignore = ["ipex"]


# A suite started in the background by a script (`pytest &`, nohup) inherits SIGINT ignored, and so
# would every process a test starts: Python then never raises KeyboardInterrupt there, and the tests of
# Ctrl-C to `run` or `cluster up` wait for an exit that never comes. Ctrl-C acts as in a terminal.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

_HANDLED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


@pytest.fixture(autouse=True)
def signal_handlers_restored():
    """Every test leaves this process's SIGINT, SIGTERM and SIGHUP handlers as it found them. A SIGINT
    left ignored is inherited by every later subprocess, and Python then never raises KeyboardInterrupt
    there: a later test's Ctrl-C to `run` went unheard (seen: three tests timed out, far from the cause)."""
    before = {sig: signal.getsignal(sig) for sig in _HANDLED}
    yield
    changed = [signal.Signals(sig).name for sig, handler in before.items() if signal.getsignal(sig) != handler]
    for sig, handler in before.items():
        signal.signal(sig, handler)
    assert not changed, f"the test left the handler of {', '.join(changed)} changed (restored now)"


# `make test` runs the suite on two pytest-xdist workers (--dist loadgroup): a test's group is its
# module, so a module's fixtures (a Slurm, a Ray or a namespace cluster) are made once, on one worker.
# Every test that starts a Slurm or a Ray is in one group: two Slurms at once give their first jobs the
# same job id, and so the same rank port (train/world.py), and Ray's workers listen on ports from 10002
# up, where those rank ports are. Tests marked `solo` run afterwards, alone: a localhost job refuses to
# start while another test trains on this machine, and uses the fixed rendezvous port.
OWN_PORTS_GROUP = "slurm-and-ray"
OWN_PORTS_FIXTURES = frozenset({"slurm", "on_slurm", "on_preemptible_slurm", "ray_cluster"})


def pytest_itemcollected(item: pytest.Item) -> None:
    """Each test's group, as it is collected: before xdist reads the groups (collection_modifyitems)."""
    if item.config.pluginmanager.hasplugin("xdist") and item.get_closest_marker("xdist_group") is None:
        group = OWN_PORTS_GROUP if OWN_PORTS_FIXTURES & set(getattr(item, "fixturenames", ())) else item.module.__name__
        item.add_marker(pytest.mark.xdist_group(group))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The Slurm-and-Ray group first: xdist hands groups to the workers in this order as they come free,
    and this one, run on one worker from start to end (over ten minutes on 2 cores), must not be the last
    to start, with the other worker idle at the end."""
    if config.pluginmanager.hasplugin("xdist"):
        items.sort(key=lambda item: not any(m.args == (OWN_PORTS_GROUP,) for m in item.iter_markers("xdist_group")))


@pytest.fixture(scope="session", autouse=True)
def libraries_out_of_the_gcs_way():
    """torch, diffusers, transformers and peft: millions of objects that live as long as this process.
    Frozen, the GC's passes skip them (the in-process training tests ran about 20 % faster), as
    ``hardware.defer_gc`` does for a rank. On one of two workers, one thread: both cores stay busy."""
    import gc

    import accelerate  # noqa: F401
    import diffusers.models  # noqa: F401
    import peft  # noqa: F401
    import torch
    import transformers.models.clip  # noqa: F401

    if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1:
        torch.set_num_threads(1)
    gc.collect()
    gc.freeze()
    yield


# The two kinds of CPU the project meets, as /proc/cpuinfo flags: tests of a decision that depends on
# the CPU fake these, so both outcomes are asserted on every machine.
AMX_XEON_FLAGS = frozenset({"avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16",
                            "amx_bf16", "amx_tile", "avx_ne_convert"})
AVX2_ONLY_FLAGS = frozenset({"avx2", "fma"})
CPU_KINDS = {"amx-xeon": AMX_XEON_FLAGS, "avx2-only": AVX2_ONLY_FLAGS}


@pytest.fixture(params=sorted(CPU_KINDS))
def fake_cpu(request, monkeypatch):
    """Runs the test once as on an AMX Xeon and once as on an AVX2-only CPU; yields the kind's name."""
    from xeontune import hardware

    monkeypatch.setattr(hardware, "cpu_flags", lambda: CPU_KINDS[request.param])
    return request.param


@pytest.fixture
def xeontune_home(tmp_path, monkeypatch):
    """A private state dir, so tests never read or write the user's ~/.xeontune."""
    home = tmp_path / "xeontune-home"
    monkeypatch.setenv("XEONTUNE_HOME", str(home))
    return home


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """The embedded tiny Stable Diffusion pipeline, built once per test session."""
    from xeontune import models

    return models.build_pipeline("tiny", tmp_path_factory.mktemp("models") / "tiny")


@pytest.fixture(scope="session")
def sdxl_model(tmp_path_factory):
    """The tiny SDXL-shaped pipeline (two text encoders), built once per test session."""
    from xeontune import models

    return models.build_pipeline("sdxl-tiny", tmp_path_factory.mktemp("models") / "sdxl-tiny")


@pytest.fixture(scope="session")
def sd2_model(tmp_path_factory):
    """The tiny SD2-shaped pipeline (v-prediction, a GELU text encoder), built once per test session."""
    from xeontune import models

    return models.build_pipeline("sd2-tiny", tmp_path_factory.mktemp("models") / "sd2-tiny")


@pytest.fixture(scope="session")
def sd3_model(tmp_path_factory):
    """The tiny SD3.5-shaped pipeline (an MMDiT, CLIP-L, CLIP-G and T5, flow matching), built once per session."""
    from xeontune import models

    return models.build_pipeline("sd3-tiny", tmp_path_factory.mktemp("models") / "sd3-tiny")


@pytest.fixture(scope="session")
def flux_model(tmp_path_factory):
    """The tiny Flux.1-dev-shaped pipeline (packed latents, CLIP-L and T5, a guidance embedding), built once."""
    from xeontune import models

    return models.build_pipeline("flux-tiny", tmp_path_factory.mktemp("models") / "flux-tiny")


@pytest.fixture(scope="session")
def sample_images(tmp_path_factory):
    """The project's deterministic sample concept images (6 PNGs, 64 px)."""
    from xeontune import models

    out = tmp_path_factory.mktemp("data") / "sample"
    models.write_sample_data(out, count=6, size=64)
    return out
