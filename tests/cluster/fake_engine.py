"""An engine that lives outside the package: what a new engine needs, and nothing more.

A process job (``scheduled`` False) whose plan is one small python program standing in for the
ranks: each "rank" prints a line, rank 0 writes a result file into the output dir, and the program
then waits for a stop signal when ``FAKE_ENGINE_HOLD`` is set (a long job, for `logs` and
`teardown`). Registering it (``engines.register("fake", __name__)``) and a provider whose
``engine`` is "fake" is all it takes for `launch`, `launch --detach`, `logs` and `teardown` to run
through it. Every call is logged in ``CALLS``. ``FAKE_ENGINE_REFUSE`` makes its preflight refuse.
"""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING

from xeontune.errors import UserError
from xeontune.job.engines import Engine, Plan

if TYPE_CHECKING:
    from xeontune.cluster.state import ClusterRecord
    from xeontune.job.record import JobInfo
    from xeontune.job.spec import LaunchSpec

CALLS: list[tuple[str, object]] = []

RANKS = """
import os, pathlib, signal, sys, time
ranks, out = int(sys.argv[1]), pathlib.Path(sys.argv[2])
for rank in range(ranks):
    print(f"[{rank}] fake rank {rank} of {ranks}, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}", flush=True)
out.mkdir(parents=True, exist_ok=True)
(out / "result.txt").write_text(f"{ranks} ranks\\n")
if os.environ.get("FAKE_ENGINE_HOLD"):
    signal.signal(signal.SIGINT, lambda *_: sys.exit(130))
    print("holding", flush=True)
    while True:
        time.sleep(0.1)
sys.exit(int(os.environ.get("FAKE_ENGINE_RC", "0")))
"""


class FakeEngine(Engine):
    name = "fake"

    def plan(self, record: ClusterRecord, spec: LaunchSpec, job: JobInfo) -> Plan:
        CALLS.append(("plan", spec.ranks))
        return Plan(argv=[sys.executable, "-c", RANKS, str(spec.ranks), job.output_dir], world_size=spec.ranks,
                    backend=spec.backend, env={"OMP_NUM_THREADS": "3"}, program=sys.executable, wdir="/")

    def preflight(self, record: ClusterRecord, plan: Plan) -> None:
        CALLS.append(("preflight", plan.world_size))
        if os.environ.get("FAKE_ENGINE_REFUSE"):
            raise UserError(f"fake engine: {os.environ['FAKE_ENGINE_REFUSE']}")

    def submit(self, record: ClusterRecord, plan: Plan, job: JobInfo) -> None:  # a scheduler's job
        CALLS.append(("submit", plan.world_size))


ENGINE = FakeEngine()
