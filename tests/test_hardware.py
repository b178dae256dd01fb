"""CPU facts, the precision decision and the launch environment, on synthetic inputs."""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
from pathlib import Path

import pytest

from xeontune import hardware

TWO_SOCKETS = "\n".join(
    f"processor\t: {i}\nmodel name\t: Intel(R) Xeon(R) Platinum 8480+\nphysical id\t: {i // 4}\n"
    f"core id\t\t: {(i % 4) // 2}\nflags\t\t: avx2 amx_bf16\n"
    for i in range(8)
)


def test_parse_cpuinfo_counts_sockets_and_physical_cores():
    model, sockets, physical, logical = hardware.parse_cpuinfo(TWO_SOCKETS)
    assert (model, sockets, physical, logical) == ("Intel(R) Xeon(R) Platinum 8480+", 2, 4, 8)


def test_parse_cpuinfo_without_topology_counts_logical_cpus():
    text = "processor\t: 0\nmodel name\t: vm\n\nprocessor\t: 1\nmodel name\t: vm\n"
    assert hardware.parse_cpuinfo(text) == ("vm", 1, 2, 2)


@pytest.mark.parametrize(
    ("flags", "requested", "expected"),
    [
        ({"avx2"}, "auto", "fp32"),
        ({"avx2", "avx512_bf16"}, "auto", "bf16"),
        ({"amx_bf16"}, "auto", "bf16"),
        ({"amx_bf16"}, "fp32", "fp32"),
        ({"avx2"}, "bf16", "bf16"),
    ],
)
def test_choose_precision_follows_the_hardware(monkeypatch, flags, requested, expected):
    monkeypatch.setattr(hardware, "cpu_flags", lambda: frozenset(flags))
    precision, reason = hardware.choose_precision(requested)
    assert precision == expected
    if requested == "bf16" and not flags & set(hardware.BF16_FLAGS):
        assert "slower" in reason  # forcing bf16 without native support says why it is a bad idea


def test_ipex_prepacks_only_with_avx512():
    assert not hardware.ipex_prepack_supported({"avx2", "fma", "avx_ne_convert"})
    assert not hardware.ipex_prepack_supported({"avx512bw", "avx512vl"})
    assert hardware.ipex_prepack_supported({"avx512f", "avx512bw", "avx512vl", "avx512dq"})
    assert hardware.IpexInfo("2.8.0", True, True, "").auto
    assert not hardware.IpexInfo("2.8.0", True, False, "").auto  # AVX2: slower than stock torch
    assert not hardware.IpexInfo("2.8.0", False, True, "").auto


def test_library_dirs_include_debian_multiarch():
    dirs = [str(d) for d in hardware.library_dirs({})]
    assert "/usr/lib/x86_64-linux-gnu" in dirs or any("-linux-gnu" in d for d in dirs)


def _lib(dir_: Path, name: str) -> Path:
    dir_.mkdir(parents=True, exist_ok=True)
    (dir_ / name).write_bytes(b"")
    return dir_ / name


def test_launch_env_prefers_tcmalloc_and_divides_cores(tmp_path, monkeypatch):
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    multiarch = tmp_path / "usr/lib/x86_64-linux-gnu"
    tc = _lib(multiarch, "libtcmalloc.so.4")
    je = _lib(tmp_path / "usr/lib", "libjemalloc.so.2")
    dirs = [tmp_path / "usr/lib", multiarch]
    env = hardware.launch_env(3, physical_cores=8, dirs=dirs)
    assert env == {"OMP_NUM_THREADS": "2", "LD_PRELOAD": str(tc)}
    assert hardware.launch_env(1, physical_cores=8, allocator="jemalloc", dirs=dirs)["LD_PRELOAD"] == str(je)
    assert "LD_PRELOAD" not in hardware.launch_env(1, physical_cores=8, allocator="none", dirs=dirs)
    assert hardware.launch_env(16, physical_cores=8, dirs=[])["OMP_NUM_THREADS"] == "1"


def test_launch_env_intel_openmp_and_existing_preload(tmp_path, monkeypatch):
    monkeypatch.setenv("LD_PRELOAD", "/opt/other.so")
    iomp = _lib(tmp_path, "libiomp5.so")
    env = hardware.launch_env(1, physical_cores=2, intel_openmp=True, dirs=[tmp_path])
    assert env["LD_PRELOAD"] == f"{iomp}:/opt/other.so"
    assert env["KMP_BLOCKTIME"] == "1" and "KMP_AFFINITY" in env
    with pytest.raises(ValueError):
        hardware.launch_env(0)


def test_rank_threads_reads_the_mpi_environment(monkeypatch):
    for var in ("OMP_NUM_THREADS", "LOCAL_WORLD_SIZE", "MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE",
                "MV2_COMM_WORLD_LOCAL_SIZE"):
        monkeypatch.delenv(var, raising=False)
    assert hardware.rank_threads(physical_cores=8) == 8
    monkeypatch.setenv("MPI_LOCALNRANKS", "2")  # Hydra's name
    assert hardware.rank_threads(physical_cores=8) == 4
    monkeypatch.delenv("MPI_LOCALNRANKS")
    monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_SIZE", "4")  # Open MPI's
    assert hardware.rank_threads(physical_cores=8) == 2
    monkeypatch.setenv("OMP_NUM_THREADS", "3")  # the launcher's word wins
    assert hardware.rank_threads(physical_cores=8) == 3


def test_find_mpirun_prefers_this_venvs(tmp_path, monkeypatch):
    """`launch` runs and `doctor` reports the same mpirun: this venv's before one on PATH."""
    venv_bin, other = tmp_path / "venv" / "bin", tmp_path / "other"
    for d in (venv_bin, other):
        d.mkdir(parents=True)
        (d / "mpirun").write_text("#!/bin/sh\n")
        (d / "mpirun").chmod(0o755)
    monkeypatch.setenv("PATH", str(other))
    monkeypatch.setattr(hardware.sys, "prefix", str(tmp_path / "venv"))
    assert hardware.find_mpirun() == str(venv_bin / "mpirun")
    (venv_bin / "mpirun").unlink()
    assert hardware.find_mpirun() == str(other / "mpirun")


@pytest.mark.parametrize(
    ("text", "flavour"),
    [
        ("Intel(R) MPI Library for Linux* OS, Version 2021.14 Build", "Intel MPI"),
        ("HYDRA build details:\n    Version: 4.2.0", "MPICH"),
        ("mpirun (Open MPI) 4.1.6", "Open MPI"),
        ("something else", "unknown"),
    ],
)
def test_mpi_flavour(text, flavour):
    from xeontune import doctor

    assert doctor.mpi_flavour(text) == flavour


def test_ipex_for_another_torch_is_not_imported(monkeypatch):
    real = importlib.metadata.version
    monkeypatch.setattr(
        hardware.importlib.metadata, "version",
        lambda name: "2.8.0" if name == "intel-extension-for-pytorch" else real(name),
    )
    info = hardware.ipex_info("2.13.0+cpu")
    assert not info.usable and info.installed == "2.8.0" and "2.8" in info.reason


def test_release_freed_memory_hands_tcmallocs_pages_back():
    """Under tcmalloc (how `train` and `bench` run), 1.6 GiB of freed weight-sized tensors (1-16 MiB,
    as a UNet's layers are) stays resident until released; other ranks size themselves by
    MemAvailable, so it must be handed back."""
    tcmalloc = hardware.libraries().tcmalloc
    if tcmalloc is None:
        if os.geteuid() == 0 or os.environ.get("CI"):
            pytest.fail("scripts/install-test-deps.sh installs tcmalloc (libgoogle-perftools4) for root and CI")
        pytest.skip("tcmalloc is not installed (scripts/install-test-deps.sh, as root)")
    child = (
        "import torch\n"
        "from xeontune import hardware, placement\n"
        "before = placement.anonymous_bytes()\n"
        "weights = [torch.ones(2**18 * (1 + i % 16)) for i in range(200)]\n"  # 1.6 GiB, every page touched
        "del weights\n"
        "held = placement.anonymous_bytes()\n"
        "hardware.release_freed_memory()\n"
        "print(before, held, placement.anonymous_bytes())\n"
    )
    out = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=120, check=True,
                         env={**os.environ, "LD_PRELOAD": tcmalloc})
    before, held, after = map(int, out.stdout.split())
    assert held - before > 2**30, f"tcmalloc handed the freed tensors back by itself: {before=} {held=}"
    assert after - before < 0.2 * 2**30, (before, held, after)


GC_CHECK = """
import gc, weakref
from xeontune import hardware

hardware.resume_gc()  # not deferred: nothing changes
assert gc.get_freeze_count() == 0
usual = gc.get_threshold()
hardware.defer_gc()
assert gc.get_threshold() == hardware._STARTUP_GC_THRESHOLD != usual

class Node:
    pass

cycle = Node()
cycle.me = cycle
gone = weakref.ref(cycle)
del cycle
kept = [Node() for _ in range(1000)]
hardware.resume_gc()
assert gc.get_threshold() == usual
assert gone() is None  # garbage is collected, not frozen with what startup kept
frozen = gc.get_freeze_count()
assert frozen > len(kept)
hardware.resume_gc()  # once only
assert gc.get_freeze_count() == frozen
print("ok")
"""


def test_a_ranks_start_defers_the_gc_then_freezes_what_it_kept_and_frees_its_garbage():
    """In a process of its own: the entry points (`python -m xeontune.train`, `xeontune train`) defer."""
    done = subprocess.run([sys.executable, "-c", GC_CHECK], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]
