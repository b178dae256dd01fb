"""`xeontune doctor`: the table and the JSON object."""

from __future__ import annotations

import json

from xeontune import hardware
from xeontune.cli import main


def test_doctor_table(capsys):
    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    for item in ("CPU", "ISA flags", "precision", "IPEX", "allocator", "mpirun", "collectives"):
        assert item in out
    # every row that is not ideal says what to do
    lines = out.splitlines()
    for i, line in enumerate(lines):
        if line.startswith("warn"):
            assert lines[i + 1].strip().startswith("->")


def test_doctor_json(capsys):
    assert main(["doctor", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["precision"] in ("fp32", "bf16")
    assert report["precision"] == hardware.choose_precision("auto")[0]
    assert set(report["cpu"]["flags"]) == set(hardware.ISA_FLAGS)
    for key in ("sockets", "physical_cores", "numa_nodes", "model"):
        assert key in report["cpu"]
    for key in ("tcmalloc", "jemalloc", "iomp"):
        assert key in report["libraries"]
    assert {"path", "flavour"} <= set(report["mpi"])
    assert {"gloo", "ccl"} == set(report["collectives"])
    assert report["torch"]["version"] and "usable" in report["ipex"]
    assert int(report["launch_env"]["OMP_NUM_THREADS"]) >= 1
