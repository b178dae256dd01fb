"""What an engine costs a training step against mpirun, on the same ranks.

The same job (R ranks of one thread each, the same options) is started by each engine in turn, for
--rounds rounds (the machine is shared and noisy: alternating spreads its noise over all of them):

- mpirun: Hydra's fork launcher on a `localhost` cluster;
- srun: a real Slurm of R one-CPU nodes on this machine (tests/cluster/slurmlib.py; root);
- ray: Ray Train's workers on a local Ray cluster of R one-CPU nodes (`ray start`).

It prints each engine's median step time (``step_time_s`` of metrics.jsonl, the first step of each
run left out) and its ratio to mpirun's. Usage (docs/performance.md, "Engines"):

    .venv/bin/python scripts/engine_cost.py --model models/sd15-arch --resolution 128 --steps 8
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
BIN = Path(sys.executable).parent


def xeontune(*args: str, env: dict[str, str]) -> None:
    done = subprocess.run([str(BIN / "xeontune"), *args], env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"xeontune {' '.join(args[:3])} failed: {(done.stderr or done.stdout)[-2000:]}")


def step_times(out: Path) -> list[float]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [row["step_time_s"] for row in rows if row["step"] > 1]


@contextlib.contextmanager
def ray_cluster(ranks: int, env: dict[str, str]) -> Iterator[str]:
    """R one-CPU Ray nodes on this machine (a head and R-1 workers); yields the address."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{s.getsockname()[1]}"
    temp = tempfile.mkdtemp(prefix="xec-", dir="/tmp")  # short: Ray's socket paths must fit 107 bytes
    procs = []
    common = ["--num-cpus", "1", "--node-ip-address", "127.0.0.1", "--disable-usage-stats", "--block"]
    try:
        for i in range(ranks):
            first = ["--head", "--port", address.rsplit(":", 1)[1], "--include-dashboard", "false"] if i == 0 \
                else ["--address", address]
            procs.append(subprocess.Popen([str(BIN / "ray"), "start", *first, *common, "--temp-dir", f"{temp}/n{i}"],
                                          env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                          start_new_session=True))
            time.sleep(8 if i == 0 else 2)
        wait = ("import ray, sys, time\nray.init(address=sys.argv[1], logging_level='WARNING')\n"
                "while sum(n['Alive'] for n in ray.nodes()) < int(sys.argv[2]): time.sleep(0.5)\n")
        subprocess.run([sys.executable, "-c", wait, address, str(ranks)], env=env, check=True, timeout=300)
        yield address
    finally:
        for proc in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=60)
        shutil.rmtree(temp, ignore_errors=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="models/tiny")
    parser.add_argument("--data-dir", default="data/sample")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--resolution", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--engines", default="mpirun,srun,ray",
                        help="any of mpirun, srun, ray and ray-quiet (Ray with --quiet-env set for its driver)")
    parser.add_argument("--quiet-env", action="append", default=[], metavar="KEY=VALUE",
                        help="ray-quiet's variables, e.g. RAY_TRAIN_HEALTH_CHECK_INTERVAL_S=10")
    args = parser.parse_args()
    engines = args.engines.split(",")
    work = Path(tempfile.mkdtemp(prefix="engine-cost-"))
    env = {**os.environ, "XEONTUNE_HOME": str(work / "home"), "HF_HUB_OFFLINE": "1", "RAY_USAGE_STATS_ENABLED": "0",
           "PATH": f"{BIN}:{os.environ.get('PATH', '/usr/bin:/bin')}"}
    env.pop("OMP_NUM_THREADS", None)
    job = ["--model", str(Path(args.model).resolve()), "--data-dir", str(Path(args.data_dir).resolve()),
           "--placeholder-token", "<cost>", "--initializer-token", "toy", "--resolution", str(args.resolution),
           "--max-train-steps", str(args.steps), "--checkpointing-steps", "0", "--save-steps", "0",
           "--mixed-precision", "fp32", "--no-random-flip"]
    times: dict[str, list[float]] = {engine: [] for engine in engines}
    with contextlib.ExitStack() as stack:
        xeontune("cluster", "up", "--provider", "localhost", "-n", str(args.ranks), "--name", "ec-mpirun", env=env)
        if "srun" in engines:
            from tests.cluster import slurmlib

            slurm = slurmlib.start(work / "slurm", nodes=args.ranks, cpus_per_node=1)
            stack.callback(slurmlib.stop, slurm)
            slurm_env = {**env, "SLURM_CONF": slurm.env["SLURM_CONF"]}
            xeontune("cluster", "up", "--provider", "slurm", "-n", str(args.ranks), "--name", "ec-srun", env=slurm_env)
        if "ray" in engines or "ray-quiet" in engines:
            address = stack.enter_context(ray_cluster(args.ranks, env))
            xeontune("cluster", "up", "--provider", "ray", "--address", address, "-n", str(args.ranks), "--name",
                     "ec-ray", env=env)
        for round_ in range(args.rounds):
            for engine in engines:
                out = work / f"{engine}-{round_}"
                run_env = slurm_env if engine == "srun" else env
                if engine == "ray-quiet":
                    run_env = {**env, **dict(kv.split("=", 1) for kv in args.quiet_env)}
                started = time.monotonic()
                xeontune("launch", "-n", str(args.ranks), "--name", f"ec-{engine.split('-')[0]}", "--", *job,
                         "--output-dir", str(out), env=run_env)
                times[engine] += step_times(out)
                print(f"round {round_ + 1} {engine}: median {statistics.median(step_times(out)):.3f} s/step "
                      f"({time.monotonic() - started:.0f} s in all)", flush=True)
    base = statistics.median(times["mpirun"]) if times.get("mpirun") else None
    print(f"{args.ranks} ranks x 1 thread, {args.model} at {args.resolution} px, {args.steps} steps x {args.rounds} "
          "rounds (first step of each run left out):")
    for engine, values in times.items():
        median = statistics.median(values)
        ratio = f", {median / base:.3f}x mpirun's" if base else ""
        print(f"  {engine:7s} median {median:.3f} s/step over {len(values)} steps{ratio}")
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
