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
