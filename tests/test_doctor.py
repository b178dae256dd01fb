"""`xeontune doctor`: the table and the JSON object."""

from __future__ import annotations

import json

from xeontune import hardware
from xeontune.cli import main


def test_doctor_table(capsys, fake_cpu):
    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    native = next(line for line in out.splitlines() if "native bf16" in line)
    assert native.startswith("ok") if fake_cpu == "amx-xeon" else native.startswith("warn")
    for item in ("CPU", "ISA flags", "precision", "IPEX", "packed weights", "allocator", "mpirun", "collectives"):
        assert item in out
    packing = next(line for line in out.splitlines() if "packed weights" in line)
    if fake_cpu == "avx2-only":  # fp32: packed on every CPU whose oneDNN runs the kernels (all x86 ones)
        assert packing.startswith("ok") and "yes, in fp32" in packing
    else:  # bf16: packed where oneDNN has bf16 kernels (the real CPU's, whatever the faked flags say)
        import torch

        from xeontune.train.packed import available

        assert ("yes, in bf16" in packing) == available(torch.bfloat16)[0]
        assert available(torch.bfloat16)[0] or not torch.ops.mkldnn._is_mkldnn_bf16_supported()
    # every row that is not ideal says what to do
    lines = out.splitlines()
    for i, line in enumerate(lines):
        if line.startswith("warn"):
            assert lines[i + 1].strip().startswith("->")


def test_doctor_json(capsys, fake_cpu):
    assert main(["doctor", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["precision"] == {"amx-xeon": "bf16", "avx2-only": "fp32"}[fake_cpu]
    assert report["cpu"]["flags"]["amx_bf16"] == (fake_cpu == "amx-xeon")
    assert set(report["cpu"]["flags"]) == set(hardware.ISA_FLAGS)
    for key in ("sockets", "physical_cores", "numa_nodes", "model"):
        assert key in report["cpu"]
    for key in ("tcmalloc", "jemalloc", "iomp"):
        assert key in report["libraries"]
    assert {"path", "flavour"} <= set(report["mpi"])
    assert {"gloo", "ccl"} == set(report["collectives"])
    assert report["torch"]["version"] and "usable" in report["ipex"]
    import torch

    from xeontune.train.packed import available

    assert report["packing"]["used"] == (fake_cpu == "avx2-only" or available(torch.bfloat16)[0])
    assert int(report["launch_env"]["OMP_NUM_THREADS"]) >= 1


def test_doctor_says_whether_a_flux_or_sd35_lora_fits_this_machine(monkeypatch):
    """By the rank plan's figures for the families' reference models: Flux.1-dev's transformer alone is
    47.6 GB in fp32, half that as bf16 frozen weights; the row turns to a warning with advice below it."""
    from xeontune import doctor, placement
    from xeontune.train.ranks import reference_lora_bytes

    fp32, bf16 = reference_lora_bytes("flux", "fp32", 1024), reference_lora_bytes("flux", "bf16", 1024)
    assert fp32 > 11.9e9 * 4 and fp32 > bf16 > 11.9e9 * 2
    assert reference_lora_bytes("sd3", "bf16", 1024) < bf16
    monkeypatch.setattr(placement, "available_memory_bytes", lambda: bf16 + 1)
    fits = {row.item: row for row in doctor.fits_rows("bf16")}["Flux.1-dev LoRA, 1024 px (bf16)"]
    short = {row.item: row for row in doctor.fits_rows("fp32")}["Flux.1-dev LoRA, 1024 px (fp32)"]
    assert fits.ok and not short.ok and short.advice and f"{fp32 / 1e9:.0f} GB" in short.value
    # the activations as measured per token (flux-arch's, scaled to Flux.1-dev's blocks): 512 and 1024 px
    # in bf16 need about 34 and 55 GB, the weights 23.8 GB of each
    from xeontune.train.families import get

    assert 30e9 < reference_lora_bytes("flux", "bf16", 512) < 40e9 < 50e9 < bf16 < 60e9
    assert get("flux").activation_bytes(1024, "bf16") == 6.7e6 * (64 ** 2 + 512)
