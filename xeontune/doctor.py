"""`xeontune doctor`: what this machine offers for training, one row each, with advice where a row
is not ideal. The facts come from ``hardware`` (CPU, precision, IPEX, allocators, launch
environment) plus torch's build, MPI and the collectives probed here.
"""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
import subprocess
from dataclasses import dataclass, field

from xeontune.hardware import (
    CpuInfo,
    IpexInfo,
    Libraries,
    ccl_available,
    choose_precision,
    cpu_info,
    find_mpirun,
    ipex_info,
    launch_env,
    libraries,
)


@dataclass
class TorchInfo:
    version: str
    onednn: bool  # oneDNN (mkldnn) built in and enabled: the CPU conv/matmul kernels
    onednn_version: str | None
    cpu_capability: str  # the widest ISA torch's own kernels dispatch to (e.g. AVX2, AVX512)
    threads: int


@dataclass
class PackingInfo:
    used: bool  # what --pack-weights auto does with this CPU's precision
    reason: str


def packing_info(precision: str) -> PackingInfo:
    """What `--pack-weights auto` does here: pack the frozen UNet's weights for oneDNN (xeontune/train/packed.py)."""
    from xeontune.train import packed

    used, why = packed.auto_choice(precision)
    if not used:
        return PackingInfo(False, why)
    return PackingInfo(True, f"yes, in {precision}: the frozen UNet's weights are reordered for oneDNN once "
                       "(--ipex auto then leaves IPEX out; docs/performance.md)")


def torch_info() -> TorchInfo:
    import torch

    match = re.search(r"(?:oneDNN|MKL-DNN) v([\w.]+)", torch.__config__.show())
    return TorchInfo(
        version=torch.__version__,
        onednn=bool(torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled),
        onednn_version=match.group(1) if match else None,
        cpu_capability=torch.backends.cpu.get_cpu_capability(),
        threads=torch.get_num_threads(),
    )


@dataclass
class MpiInfo:
    path: str | None
    on_path: bool  # False when only the venv's bin/ has it (the venv is not activated)
    flavour: str | None  # "Intel MPI", "MPICH", "Open MPI", or "unknown"
    version: str | None


def mpi_flavour(version_text: str) -> str:
    text = version_text.lower()
    if "intel(r) mpi" in text or "intel mpi" in text:
        return "Intel MPI"
    if "open mpi" in text or "openrte" in text:
        return "Open MPI"
    if "mpich" in text or "hydra" in text:
        return "MPICH"
    return "unknown"


def mpi_info() -> MpiInfo:
    path = find_mpirun()
    if path is None:
        return MpiInfo(None, False, None, None)
    text = ""
    for flag in ("--version", "-version"):
        try:
            done = subprocess.run([path, flag], capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            continue
        text = (done.stdout + done.stderr).strip()
        if text:
            break
    match = re.search(r"Version:?\s+([\w.]+)", text) or re.search(r"\b(\d+\.\d+[\w.]*)", text)
    return MpiInfo(
        path, shutil.which("mpirun") == path, mpi_flavour(text) if text else "unknown", match.group(1) if match else None
    )


@dataclass
class CollectivesInfo:
    gloo: bool
    ccl: bool  # oneccl_bindings_for_pytorch imports and matches torch (end-of-life; not on PyPI)


def collectives_info() -> CollectivesInfo:
    import torch.distributed as dist

    gloo = bool(dist.is_available() and dist.is_gloo_available())
    return CollectivesInfo(gloo=gloo, ccl=ccl_available()[0])


@dataclass
class Check:
    """One row of the doctor table: `advice` is set when the row is not ideal."""

    item: str
    value: str
    ok: bool = True
    advice: str = ""


@dataclass
class HardwareReport:
    cpu: CpuInfo
    torch: TorchInfo
    precision: str
    precision_reason: str
    ipex: IpexInfo
    packing: PackingInfo
    libraries: Libraries
    mpi: MpiInfo
    collectives: CollectivesInfo
    launch_env: dict[str, str]
    checks: list[Check] = field(default_factory=list)


def collect() -> HardwareReport:
    cpu = cpu_info()
    torch = torch_info()
    precision, reason = choose_precision("auto")
    report = HardwareReport(
        cpu=cpu,
        torch=torch,
        precision=precision,
        precision_reason=reason,
        ipex=ipex_info(torch.version),
        packing=packing_info(precision),
        libraries=libraries(),
        mpi=mpi_info(),
        collectives=collectives_info(),
        launch_env=launch_env(1, physical_cores=min(cpu.physical_cores, cpu.usable_cpus)),
    )
    report.checks = checks(report)
    return report


def checks(r: HardwareReport) -> list[Check]:
    """The table rows, each with what to do when it is not ideal."""
    c = r.cpu
    flags_on = [f for f, on in c.flags.items() if on]
    onednn = ("v" + r.torch.onednn_version if r.torch.onednn_version else "on") if r.torch.onednn else "OFF"
    rows = [
        Check("CPU", c.model),
        Check("sockets / physical cores / logical CPUs", f"{c.sockets} / {c.physical_cores} / {c.logical_cpus}"),
        Check(
            "CPUs usable by this process", str(c.usable_cpus), c.usable_cpus >= c.physical_cores,
            "fewer CPUs than physical cores: check taskset/cgroup limits",
        ),
        Check(
            "NUMA nodes", str(c.numa_nodes), c.numa_nodes == 1,
            "run one rank per NUMA node (xeontune launch --ppn) so each rank uses local memory",
        ),
        Check("ISA flags", " ".join(flags_on) or "none of interest"),
        Check(
            "native bf16 (amx_bf16 / avx512_bf16)", "yes" if r.precision == "bf16" else "no",
            r.precision == "bf16",
            "training runs in fp32; a Xeon with AMX (Sapphire Rapids or later) trains in bf16 several times faster",
        ),
        Check(
            "torch", f"{r.torch.version}, oneDNN {onednn}, kernels {r.torch.cpu_capability}, "
            f"{r.torch.threads} threads",
            r.torch.onednn, "oneDNN is off: install the PyPI CPU build of torch",
        ),
        Check("precision (--mixed-precision auto)", f"{r.precision}: {r.precision_reason}"),
        Check(
            "IPEX", f"{r.ipex.installed}: {r.ipex.reason}" if r.ipex.installed else r.ipex.reason,
            r.ipex.usable or r.ipex.installed is None,
            "uninstall it or use `make test-ipex`'s venv (torch 2.8 + IPEX 2.8); stock torch is used meanwhile",
        ),
        Check(
            "packed weights (--pack-weights auto)", r.packing.reason, r.packing.used,
            "stock torch reorders every weight at every call: a torch build with oneDNN packs them once",
        ),
        Check(
            "allocator", r.libraries.tcmalloc or r.libraries.jemalloc or "none found", bool(r.libraries.tcmalloc),
            "apt-get install libgoogle-perftools4 (tcmalloc): training steps 1.2-1.3x faster here, "
            "preloaded by the launch environment and `xeontune bench`",
        ),
        Check("Intel OpenMP (libiomp5)", r.libraries.iomp or "not found (torch uses GNU OpenMP; fine)"),
        Check(
            "mpirun", f"{r.mpi.flavour} {r.mpi.version or ''} at {r.mpi.path}" if r.mpi.path else "not found",
            r.mpi.path is not None and r.mpi.on_path,
            "pip install mpich (or impi-rt) into this venv; needed for `xeontune launch`" if r.mpi.path is None
            else "not on PATH: activate the venv (or call mpirun by this path)",
        ),
        Check(
            "collectives", f"gloo {'yes' if r.collectives.gloo else 'no'}, ccl {'yes' if r.collectives.ccl else 'no'}",
            r.collectives.gloo, "this torch lacks gloo: install the PyPI CPU build of torch",
        ),
        Check("launch environment", " ".join(f"{k}={v}" for k, v in r.launch_env.items())),
        *fits_rows(r.precision),
    ]
    return rows


# The models people fine-tune whose size decides the node (LoRA, batch 1, 1024 px, this CPU's precision).
# (family, name, where its figure comes from: the activations per token measured in bf16 and scaled)
REFERENCE_MODELS = (("sd3", "SD3.5 Medium", "measured on its sizes"),
                    ("flux", "Flux.1-dev", "scaled from its 6-block measure"))


def fits_rows(precision: str) -> list[Check]:
    """Whether this machine's available memory holds a LoRA run of each reference model, by the rank plan's
    figures (the family modules say how they were measured)."""
    from xeontune.placement import available_memory_bytes
    from xeontune.train.ranks import reference_lora_bytes

    have = available_memory_bytes()
    rows = []
    for family, name, source in REFERENCE_MODELS:
        need = reference_lora_bytes(family, precision, 1024)
        rows.append(Check(
            f"{name} LoRA, 1024 px ({precision})", f"needs about {need / 1e9:.0f} GB ({source}); "
            f"{have / 1e9:.0f} GB available", need <= have,
            "more memory (a larger node), or bf16 on a CPU with AMX or AVX512-BF16, which halves the frozen weights"))
    return rows


def render_table(report: HardwareReport) -> str:
    width = max(len(c.item) for c in report.checks)
    lines = []
    for c in report.checks:
        mark = "ok  " if c.ok else "warn"
        lines.append(f"{mark} {c.item:<{width}}  {c.value}")
        if not c.ok and c.advice:
            lines.append(f"     {'':<{width}}  -> {c.advice}")
    return "\n".join(lines)


def render_json(report: HardwareReport) -> str:
    return json.dumps(dataclasses.asdict(report), indent=2)
