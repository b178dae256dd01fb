"""CPU facts and the policy built on them: precision, IPEX, threads, allocator, mpirun, ccl.

`choose_precision()` is the one precision decision (the trainer's, on each rank's own CPU);
`launch_env()` is what the launcher passes to every rank; `reexec_with_allocator()` preloads
tcmalloc at process start; `find_mpirun()` and `ccl_available()` answer for both `launch` and
`doctor` (which renders all of this, in `xeontune.doctor`). Nothing here imports IPEX or any
optional package at module level: each probe imports inside its function and reports failure.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import re
import shutil
import sys
import sysconfig
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

BF16_FLAGS = ("amx_bf16", "avx512_bf16")
# The ISA flags that decide which kernels oneDNN / IPEX can use, in the order doctor prints them.
ISA_FLAGS = (
    "avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512dq",
    "avx512_bf16", "amx_bf16", "amx_tile", "avx_ne_convert",
)
# IPEX prepacks weights only with these (its kernels' target ISA). bf16 prepack asserts with less
# ("needs avx_ne_convert or avx512bw/vl/dq"), and on this project's AVX2-only EPYC fp32-prepacked
# convolutions made the SD1.5 UNet forward 12x slower than stock torch (docs/performance.md).
IPEX_PREPACK_FLAGS = ("avx512bw", "avx512vl", "avx512dq")



# --- CPU ---------------------------------------------------------------------------------------


@lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


def choose_precision(requested: str) -> tuple[str, str]:
    """Return ("bf16" | "fp32", reason). bf16 only where the CPU has native bf16 matmul."""
    native = [f for f in BF16_FLAGS if f in cpu_flags()]
    if requested == "fp32":
        return "fp32", "requested"
    if requested == "bf16":
        if native:
            return "bf16", f"requested; CPU has {native[0]}"
        return "bf16", "requested, but this CPU has neither amx_bf16 nor avx512_bf16: bf16 will be far slower than fp32"
    if native:
        return "bf16", f"auto: CPU has {native[0]}"
    return "fp32", "auto: CPU has neither amx_bf16 nor avx512_bf16, so bf16 would be emulated and slow"


def ipex_prepack_supported(flags: Iterable[str] | None = None) -> bool:
    """Whether IPEX's weight prepacking is worth using (and, for bf16, possible) on this CPU."""
    return has_avx512(flags)


def has_avx512(flags: Iterable[str] | None = None) -> bool:
    """AVX-512 BW/VL/DQ: where oneDNN's blocked-weight kernels were measured to pay off in fp32."""
    have = set(cpu_flags() if flags is None else flags)
    return all(f in have for f in IPEX_PREPACK_FLAGS)


@dataclass
class CpuInfo:
    model: str
    sockets: int
    physical_cores: int
    logical_cpus: int
    usable_cpus: int  # what this process may run on (cgroups/affinity), which can be fewer
    numa_nodes: int
    flags: dict[str, bool]


def parse_cpuinfo(text: str) -> tuple[str, int, int, int]:
    """Return (model, sockets, physical cores, logical cpus) from /proc/cpuinfo text."""
    model = ""
    sockets: set[str] = set()
    cores: set[tuple[str, str]] = set()
    logical = 0
    phys = core = ""
    for line in [*text.splitlines(), ""]:
        key, _, value = (s.strip() for s in line.partition(":"))
        if key == "processor":
            logical += 1
        elif key == "model name" and not model:
            model = value
        elif key == "physical id":
            phys = value
        elif key == "core id":
            core = value
        elif not key:  # a blank line ends one processor's block
            if phys or core:
                sockets.add(phys)
                cores.add((phys, core))
            phys = core = ""
    # Some VMs omit topology lines: fall back to one socket and one core per logical CPU.
    return model or "unknown", max(len(sockets), 1), len(cores) or logical, logical


def _numa_nodes() -> int:
    nodes = list(Path("/sys/devices/system/node").glob("node[0-9]*"))
    return max(len(nodes), 1)


def cpu_info() -> CpuInfo:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        text = ""
    model, sockets, physical, logical = parse_cpuinfo(text)
    logical = logical or (os.cpu_count() or 1)
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else logical
    flags = cpu_flags()
    return CpuInfo(
        model=model,
        sockets=sockets,
        physical_cores=physical or logical,
        logical_cpus=logical,
        usable_cpus=usable,
        numa_nodes=_numa_nodes(),
        flags={f: f in flags for f in ISA_FLAGS},
    )


# --- libraries: allocators, OpenMP ---------------------------------------------------------------

# Preferred first: tcmalloc made steps 1.2-1.3x faster here (docs/performance.md); jemalloc gave
# nothing in the brief's measurement.
ALLOCATOR_NAMES: dict[str, tuple[str, ...]] = {
    "tcmalloc": ("libtcmalloc.so", "libtcmalloc.so.4", "libtcmalloc_minimal.so", "libtcmalloc_minimal.so.4"),
    "jemalloc": ("libjemalloc.so", "libjemalloc.so.2"),
}
IOMP_NAMES = ("libiomp5.so",)


def library_dirs(env: Mapping[str, str] | None = None) -> list[Path]:
    """Where to look for preloadable libraries: the venv/conda prefix, LD_LIBRARY_PATH, and the
    system dirs including Debian's multiarch one (torch's own launcher misses that one)."""
    env = os.environ if env is None else env
    multiarch = sysconfig.get_config_var("MULTIARCH") or "x86_64-linux-gnu"
    dirs: list[str] = [f"{sys.prefix}/lib"]
    if env.get("CONDA_PREFIX"):
        dirs.append(f"{env['CONDA_PREFIX']}/lib")
    dirs += [d for d in env.get("LD_LIBRARY_PATH", "").split(":") if d]
    dirs += [
        f"/usr/lib/{multiarch}", f"/lib/{multiarch}", f"/usr/local/lib/{multiarch}",
        "/usr/local/lib", "/usr/lib64", "/usr/lib", "/lib64", "/lib",
    ]
    seen: list[Path] = []
    for d in dirs:
        p = Path(d)
        if p not in seen:
            seen.append(p)
    return seen


def find_library(names: Iterable[str], dirs: Iterable[Path] | None = None) -> str | None:
    """First existing file among `names` in `dirs` (each dir tried with every name, in order)."""
    names = tuple(names)
    for d in library_dirs() if dirs is None else dirs:
        for name in names:
            path = d / name
            if path.is_file():
                return str(path)
    return None


@dataclass
class Libraries:
    tcmalloc: str | None
    jemalloc: str | None
    iomp: str | None
    preloaded: list[str]  # what LD_PRELOAD holds for this process


def libraries(dirs: Iterable[Path] | None = None) -> Libraries:
    dirs = list(library_dirs() if dirs is None else dirs)
    return Libraries(
        tcmalloc=find_library(ALLOCATOR_NAMES["tcmalloc"], dirs),
        jemalloc=find_library(ALLOCATOR_NAMES["jemalloc"], dirs),
        iomp=find_library(IOMP_NAMES, dirs),
        preloaded=[p for p in re.split(r"[:\s]+", os.environ.get("LD_PRELOAD", "")) if p],
    )


# --- the launch environment ----------------------------------------------------------------------


def launch_env(
    ranks_per_host: int = 1,
    *,
    physical_cores: int | None = None,
    allocator: str = "auto",
    intel_openmp: bool = False,
    dirs: Iterable[Path] | None = None,
) -> dict[str, str]:
    """The environment variables to set for every rank on a host (mpirun -genv, or os.environ).

    - OMP_NUM_THREADS = physical cores // ranks_per_host (at least 1): more threads than cores
      only adds contention. `ranks_per_host` counts ranks sharing one *physical* machine, so the
      network-namespace cluster passes its total rank count.
    - LD_PRELOAD = tcmalloc (else jemalloc) when found, incl. /usr/lib/<multiarch>; `allocator`
      is "auto", "tcmalloc", "jemalloc" or "none". Paths are this machine's: a cluster of the same
      image has them at the same place, and a missing preload only makes ld.so print a warning.
    - intel_openmp: also preload Intel OpenMP (libiomp5) with KMP_BLOCKTIME=1 and compact
      affinity, when found. Off by default: torch's PyPI wheels use GNU OpenMP and we have no
      measurement here showing a gain from swapping it.
    Any LD_PRELOAD already in the environment is kept after ours.
    """
    if ranks_per_host < 1:
        raise ValueError("ranks_per_host must be at least 1")
    if allocator not in ("auto", "tcmalloc", "jemalloc", "none"):
        raise ValueError(f"unknown allocator {allocator!r}")
    if physical_cores is None:
        info = cpu_info()
        physical_cores = min(info.physical_cores, info.usable_cpus)  # a cgroup/affinity limit counts
    env = {"OMP_NUM_THREADS": str(max(physical_cores // ranks_per_host, 1))}
    dirs = list(library_dirs() if dirs is None else dirs)
    preload: list[str] = []
    if allocator != "none":
        order = ("tcmalloc", "jemalloc") if allocator == "auto" else (allocator,)
        for name in order:
            lib = find_library(ALLOCATOR_NAMES[name], dirs)
            if lib:
                preload.append(lib)
                break
    if intel_openmp:
        iomp = find_library(IOMP_NAMES, dirs)
        if iomp:
            preload.append(iomp)
            # Threads spin only 1 ms after a parallel region: ranks share cores with the comm thread.
            env["KMP_BLOCKTIME"] = "1"
            env["KMP_AFFINITY"] = "granularity=fine,compact,1,0"
    existing = [p for p in re.split(r"[:\s]+", os.environ.get("LD_PRELOAD", "")) if p]
    preload += [p for p in existing if p not in preload]
    if preload:
        env["LD_PRELOAD"] = ":".join(preload)
    return env


PRELOAD_MARKER = "XEONTUNE_ALLOCATOR_PRELOADED"


def reexec_with_allocator(python_args: list[str], allocator: str | None = None) -> bool:
    """Re-execute this Python process with tcmalloc/jemalloc preloaded, once.

    For `xeontune train` / `python -m xeontune.train` and `xeontune bench`: an allocator only takes
    effect when preloaded at process start. ``allocator`` None reads XEONTUNE_ALLOCATOR
    (auto | tcmalloc | jemalloc | none; default auto); one the caller names (`bench --allocator`)
    must exist, else UserError.
    `python_args` is what follows the interpreter, e.g. ["-m", "xeontune.bench", *argv]. Returns
    False (and carries on in this process) when nothing is found, it is already preloaded, or this
    process is already the re-executed one; otherwise it does not return.
    """
    named = allocator
    allocator = allocator or os.environ.get("XEONTUNE_ALLOCATOR", "auto")
    if allocator == "none" or os.environ.get(PRELOAD_MARKER):
        return False
    preload = launch_env(1, allocator=allocator).get("LD_PRELOAD")
    if named not in (None, "auto") and not preload:
        from xeontune.errors import UserError

        raise UserError(f"--allocator {named}: library not found (see `xeontune doctor`)")
    if not preload or preload == os.environ.get("LD_PRELOAD"):
        return False
    # OMP_NUM_THREADS is left alone: torch's default is the physical cores, right for one process.
    env = {**os.environ, "LD_PRELOAD": preload, PRELOAD_MARKER: "1"}
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *python_args], env)
    return True  # not reached


# A rank's start imports torch, diffusers, transformers and peft and loads the models: millions of objects
# that live as long as the process, which the cyclic GC's passes walk again and again and never free.
_STARTUP_GC_THRESHOLD = (100_000, 50, 1000)
_gc_threshold_before: tuple[int, int, int] | None = None


def defer_gc() -> None:
    """Rare GC passes until ``resume_gc``: a rank's start ran about 1.2 s (13 %) faster on the tiny model
    (docs/performance.md). For a process's entry point only: a caller importing the trainer keeps its GC."""
    import gc

    global _gc_threshold_before
    if _gc_threshold_before is None:
        _gc_threshold_before = gc.get_threshold()
        gc.set_threshold(*_STARTUP_GC_THRESHOLD)


def resume_gc() -> None:
    """Once started: the usual GC again, minus what startup made and kept (collected first, so no
    garbage is kept; frozen, so later passes skip it). Nothing when ``defer_gc`` was not called."""
    import gc

    global _gc_threshold_before
    if _gc_threshold_before is not None:
        gc.collect()
        gc.freeze()
        gc.set_threshold(*_gc_threshold_before)
        _gc_threshold_before = None


def release_freed_memory() -> None:
    """Hand memory that Python and torch have freed back to the OS. tcmalloc keeps freed pages
    (gigabytes after a UNet's weights go) resident for reuse, so without this, memory this process no
    longer uses still looks taken to anything sizing itself by MemAvailable: the packing fit check of
    other ranks, `--nproc-per-node auto`, the ranks that `bench` starts after its own steps."""
    import ctypes
    import gc

    gc.collect()
    process = ctypes.CDLL(None)
    release = getattr(process, "MallocExtension_ReleaseFreeMemory", None)  # tcmalloc, when preloaded
    if release is not None:
        release()
    trim = getattr(process, "malloc_trim", None)  # glibc: what its own heap keeps
    if trim is not None:
        trim(0)


def rank_threads(physical_cores: int | None = None) -> int:
    """Threads for this rank: OMP_NUM_THREADS if the launcher set it, else physical cores divided
    by the ranks on this host, as accelerate reads them from the MPI environment (Hydra's
    MPI_LOCALNRANKS, Open MPI's and MVAPICH's names, LOCAL_WORLD_SIZE)."""
    from accelerate.utils import get_cpu_distributed_information

    threads = os.environ.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0:
        return int(threads)
    info = cpu_info()
    cores = physical_cores or min(info.physical_cores, info.usable_cpus)
    return max(cores // max(get_cpu_distributed_information().local_world_size, 1), 1)


MPIRUN_ENV = "XEONTUNE_MPIRUN"  # an mpirun to use instead of the one found (also on a cluster's head)


def find_mpirun() -> str | None:
    """The mpirun that `xeontune launch` runs on this machine and `doctor` reports: $XEONTUNE_MPIRUN,
    else the one the mpich / impi-rt wheels put into this venv (Hydra needs the same path on every
    host), else the first on PATH."""
    if os.environ.get(MPIRUN_ENV):
        return os.environ[MPIRUN_ENV]
    beside = Path(sys.prefix) / "bin" / "mpirun"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    return shutil.which("mpirun")


def ccl_available() -> tuple[bool, str]:
    """Whether the ccl backend can be used here: oneCCL's torch bindings import and were built
    for this torch's major.minor. (ok, why not)."""
    try:
        import oneccl_bindings_for_pytorch as ccl  # type: ignore[import-not-found]
        import torch
    except Exception as exc:  # absent or broken against this torch: either way not usable
        return False, f"it does not import ({type(exc).__name__}: {exc})"
    version = getattr(ccl, "__version__", "")
    if version and _major_minor(version) != _major_minor(torch.__version__):
        return False, f"it is {version}, built for another torch than {torch.__version__}"
    return True, "ok"


# --- IPEX ------------------------------------------------------------------------------------------


@dataclass
class IpexInfo:
    installed: str | None  # the installed version, or None
    usable: bool  # installed, matching torch's major.minor, and imports
    prepack: bool  # the CPU has AVX-512 (bw/vl/dq), where IPEX's prepacked kernels pay off
    reason: str

    @property
    def auto(self) -> bool:
        """What --ipex auto does: use IPEX only where it can beat stock torch. Without prepacking
        it computes the same as stock torch at the same speed (measured), so it is skipped."""
        return self.usable and self.prepack


def _major_minor(version: str) -> tuple[str, ...]:
    return tuple(version.split("+")[0].split(".")[:2])


IPEX_NOT_INSTALLED = "not installed; optional, its last release needs torch 2.8"


def ipex_version() -> str | None:
    """The installed IPEX's version, from its metadata (without importing it), or None."""
    try:
        return importlib.metadata.version("intel-extension-for-pytorch")
    except importlib.metadata.PackageNotFoundError:
        return None


def ipex_info(torch_version: str | None = None) -> IpexInfo:
    """Whether IPEX can be used with the torch in this environment, and why not if not.

    The version check comes first so a mismatched IPEX is never imported (its import prints
    errors or fails against another torch)."""
    if torch_version is None:
        import torch

        torch_version = torch.__version__
    prepack = ipex_prepack_supported()
    version = ipex_version()
    if version is None:
        return IpexInfo(None, False, prepack, IPEX_NOT_INSTALLED)
    if _major_minor(version) != _major_minor(torch_version):
        return IpexInfo(
            version, False, prepack, f"IPEX {version} needs torch {'.'.join(_major_minor(version))}.*, not {torch_version}"
        )
    try:
        import intel_extension_for_pytorch  # noqa: F401
    except Exception as exc:  # any import failure means "not usable"; say which
        return IpexInfo(version, False, prepack, f"import failed: {type(exc).__name__}: {exc}".splitlines()[0])
    if not prepack:
        return IpexInfo(
            version, True, prepack,
            "imports and matches torch, but this CPU lacks AVX-512: IPEX's prepacked kernels ran slower "
            "than stock torch here, so --ipex auto skips it",
        )
    return IpexInfo(version, True, prepack, "imports and matches torch; CPU has AVX-512")
