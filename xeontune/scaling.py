"""`xeontune bench --nodes 1,2 --link-rate RATE`: data-parallel scaling measured on an emulated cluster,
and a cost model fitted to it that carries the result to clusters this machine cannot hold (issue 49).

Each count is a real `xeontune run --provider local -n COUNT` (network namespaces, one rank a node, its
link shaped with tc): the same training options, the same threads a node, so that only the exchange
differs between counts. From each run's metrics.jsonl (rank 0's steps after the warm-up): images/s,
the step's time, and the time it waited beyond the one-node step (``wait``: the communication that the
backward did not hide).

The cost model: a step takes ``compute + max(0, ring(n) - hidden)``, where ``ring(n)`` is a ring
all-reduce of the step's bytes on the wire, ``2 (n-1)/n x bytes / rate`` plus ``2 (n-1)`` link delays,
and ``hidden`` the share of it that the backward overlaps (fitted: the one parameter). ``--check-rate``
measures the largest count again at a second link rate, which the model did not see, to check it.
Predictions for a real node divide the compute and the hidden time by ``--node-speedup`` (how many
times faster a real node computes the step than a node here), at ``--predict-rate``. With
``--real-node-step SECONDS`` (a real node's step, where one is known) the speedup is measured (the
one-node step here over it), and the shaped links are the given real rates slowed as much: the
exchange keeps the share of the step it has on a real cluster.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from xeontune.cluster.providers.local import rate_bps
from xeontune.errors import UserError


@dataclass
class Point:
    """One measured (or modelled) count of nodes."""

    nodes: int
    link_bps: float | None  # None: the links were not shaped
    s_per_step: float
    images_per_s: float
    bytes_per_step: int  # what rank 0 handed the process group a step
    efficiency: float  # images/s per node over one node's
    wait_s: float  # the step beyond the one-node step
    measured: bool = True
    fitted: bool = True  # a measured point the model was fitted to (False: kept to check it)


@dataclass
class CostModel:
    compute_s: float  # one node's step
    bytes_per_step: int
    hidden_s: float  # the ring's time that the backward overlaps
    delay_s: float = 0.0  # one-way link delay

    def ring_s(self, nodes: int, link_bps: float) -> float:
        if nodes <= 1:
            return 0.0
        return 2 * (nodes - 1) / nodes * self.bytes_per_step * 8 / link_bps + 2 * (nodes - 1) * self.delay_s

    def step_s(self, nodes: int, link_bps: float, speedup: float = 1.0) -> float:
        """A step on ``nodes`` nodes ``speedup`` times faster at computing than the measured ones."""
        return self.compute_s / speedup + max(0.0, self.ring_s(nodes, link_bps) - self.hidden_s / speedup)

    @classmethod
    def fit(cls, one: Point, others: list[Point], delay_s: float = 0.0) -> CostModel:
        """``hidden`` from the shaped multi-node points: the mean of what each says it is (never below 0)."""
        model = cls(one.s_per_step, max(p.bytes_per_step for p in others), 0.0, delay_s)
        said = [model.ring_s(p.nodes, p.link_bps) - p.wait_s for p in others if p.link_bps]
        model.hidden_s = max(0.0, statistics.fmean(said)) if said else 0.0
        return model


def parse_nodes(spec: str) -> list[int]:
    try:
        counts = sorted({int(item) for item in spec.split(",")})
    except ValueError:
        raise UserError(f"--nodes {spec!r}: give node counts, e.g. 1,2") from None
    if counts[0] < 1 or 1 not in counts or len(counts) < 2:
        raise UserError(f"--nodes {spec!r}: give 1 (the reference) and at least one more count, e.g. 1,2")
    return counts


def warmup_steps(args: argparse.Namespace) -> int:
    """The steps each count leaves out of its figures: --warmup's, and at least 2 under DDP with accumulation,
    whose second step all-reduces one micro-step more, once (loop.Run.accumulating); also for --shard auto,
    which may choose DDP."""
    ddp = args.shard not in ("gradients", "full")
    return max(args.warmup, 2) if args.accumulation > 1 and ddp else args.warmup


def train_argv(args: argparse.Namespace, model: Path, data: Path, out: Path) -> list[str]:
    """The training options every count runs (`xeontune train`'s flags)."""
    argv = ["--method", args.method, "--model", str(model), "--data-dir", str(data), "--output-dir", str(out),
            "--resolution", str(args.resolution), "--train-batch-size", str(args.batch_size),
            "--max-train-steps", str(warmup_steps(args) + args.steps), "--checkpointing-steps", "0", "--save-steps", "0",
            "--mixed-precision", args.mixed_precision, "--gradient-accumulation-steps", str(args.accumulation),
            "--report-to", "none"]
    if args.method != "textual_inversion":
        argv += ["--instance-prompt", "a photo of sks toy"]
    else:
        argv += ["--placeholder-token", "<bench>", "--initializer-token", "toy"]
    if args.method == "full":
        argv += ["--grad-compression", args.grad_compression, "--shard", args.shard, "--optimizer", args.optimizer]
        if args.use_ema:
            argv.append("--use-ema")
    if args.gradient_checkpointing:
        argv.append("--gradient-checkpointing")
    return argv


def failure_line(stderr: str) -> str:
    """What says why a command failed: its last error line (a rank's, before mpirun's and `launch`'s own
    lines about the job's end), else its last line."""
    said = stderr.strip().splitlines() or ["?"]
    return next((line for line in reversed(said) if "error:" in line), said[-1])


def measure(args: argparse.Namespace, model: Path, data: Path, tmp: Path, nodes: int, link: str | None,
            threads: int, log) -> Point:
    """One `run --provider local -n nodes` and what its metrics say (``wait`` filled in later)."""
    out = tmp / f"n{nodes}-{link or 'unshaped'}"
    shape = [*(["--link-rate", link] if link else []), *(["--link-delay", args.link_delay] if args.link_delay else [])]
    name = f"bench{os.getpid() % 100000}"
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "HF_HUB_OFFLINE": os.environ.get("HF_HUB_OFFLINE", "1")}
    cli = [sys.executable, "-m", "xeontune.cli"]
    skip = warmup_steps(args)
    log(f"{nodes} node(s), {threads} thread(s) each, link {link or 'unshaped'}: {skip + args.steps} steps, the "
        f"first {skip} left out")
    # `cluster up` and `launch`, not `run`: the nodes share this disk, and `run` would copy the outputs (a full
    # fine-tuning's gigabytes) back over SSH before the next count
    steps = [[*cli, "cluster", "up", "--provider", "local", "-n", str(nodes), "--name", name, *shape],
             [*cli, "launch", "--name", name, "--ppn", "1", "--", *train_argv(args, model, data, out)]]
    try:
        for cmd in steps:
            done = subprocess.run(cmd, capture_output=True, text=True, env=env)
            if done.returncode != 0:
                raise UserError(f"the {nodes}-node run failed at `{cmd[3]}` (exit {done.returncode}): "
                                f"{failure_line(done.stderr)}")
    finally:
        subprocess.run([*cli, "teardown", "--name", name], capture_output=True, text=True, env=env)
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()][skip:]
    shutil.rmtree(out, ignore_errors=True)  # a full fine-tuning's outputs are gigabytes a count
    step = statistics.median(m["step_time_s"] for m in lines)
    rate = rate_bps(link) if link else None
    images = args.batch_size * args.accumulation * nodes / step
    sent = int(statistics.median(m["allreduce_bytes"] for m in lines))
    return Point(nodes, rate, step, images, sent, efficiency=0.0, wait_s=0.0)


def sweep(args: argparse.Namespace, model: Path, log=print) -> dict[str, Any]:
    """Measure each count (and --check-rate's point) on ``model``, fit the model, predict; the bench's JSON."""
    from xeontune import models, placement
    from xeontune.cluster.providers.local import DELAY_RE, DELAY_UNITS

    counts = parse_nodes(args.nodes)
    threads = args.threads_per_node or max(1, len(placement.physical_cores()) // counts[-1])
    delay = 0.0
    if args.link_delay and (found := DELAY_RE.fullmatch(args.link_delay)):
        delay = float(found[1]) * DELAY_UNITS[found[2]]
    with tempfile.TemporaryDirectory(prefix="xeontune-nodes-") as name:
        tmp = Path(name)
        data = tmp / "data"
        if getattr(args, "synthetic_data", False):  # a caption per sample that the largest count trains on
            samples = args.batch_size * args.accumulation * counts[-1] * (warmup_steps(args) + args.steps)
            models.write_synthetic_data(data, count=max(4, samples), size=args.resolution)
        else:
            models.write_sample_data(data, count=max(4, args.batch_size * counts[-1]), size=args.resolution)
        one = measure(args, model, data, tmp, 1, None, threads, log)
        # --real-node-step: the links are the real ones slowed as much as a node here is slower than a real
        # node at the step, so that the exchange keeps its share of the step
        scale = args.real_node_step / one.s_per_step if args.real_node_step else 1.0
        speedup = 1 / scale if args.real_node_step else args.node_speedup
        link, check_link = (None if r is None else f"{rate_bps(r) * scale / 1e3:.0f}kbit"
                            for r in (args.link_rate, args.check_rate))
        if args.real_node_step:
            log(f"one node here: {one.s_per_step:.2f} s a step, {speedup:.2f}x a real node's {args.real_node_step:g} s: "
                f"links {args.link_rate} -> {link}" + (f", {args.check_rate} -> {check_link}" if check_link else ""))
        points = [one] + [measure(args, model, data, tmp, n, link, threads, log) for n in counts[1:]]
        check = [measure(args, model, data, tmp, counts[-1], check_link, threads, log)] if check_link else []
    for p in points + check:
        p.efficiency = one.s_per_step / p.s_per_step
        p.wait_s = p.s_per_step - one.s_per_step
    for p in check:
        p.fitted = False
    cost = CostModel.fit(one, points[1:], delay)
    checked = [{"nodes": p.nodes, "link_bps": p.link_bps, "measured_s": p.s_per_step,
                "modelled_s": cost.step_s(p.nodes, p.link_bps or float("inf"))} for p in check]
    predict_bps = None
    predicted: list[Point] = []
    if args.predict_rate:
        predict_bps = rate_bps(args.predict_rate)
        base = cost.step_s(1, predict_bps, speedup)
        for n in parse_nodes("1," + args.predict_nodes):
            step = cost.step_s(n, predict_bps, speedup)
            predicted.append(Point(n, predict_bps, step, args.batch_size * args.accumulation * n / step,
                                   cost.bytes_per_step, base / step, step - base, measured=False, fitted=False))
    return {"config": {"model": str(model), "method": args.method, "resolution": args.resolution,
                       "batch_size": args.batch_size, "accumulation": args.accumulation, "threads_per_node": threads,
                       "link_rate": args.link_rate, "link_delay": args.link_delay, "check_rate": args.check_rate,
                       "grad_compression": args.grad_compression, "shard": args.shard, "optimizer": args.optimizer,
                       "mixed_precision": args.mixed_precision, "node_speedup": speedup,
                       "real_node_step_s": args.real_node_step, "links_here": [link, check_link],
                       "predict_rate": args.predict_rate},
            "measured": [asdict(p) for p in points + check], "model": asdict(cost), "checked": checked,
            "predicted": [asdict(p) for p in predicted]}


def render(result: dict[str, Any]) -> str:
    c = result["config"]
    lines = [f"data-parallel scaling, --method {c['method']} at {c['resolution']} px, batch {c['batch_size']} x "
             f"{c['accumulation']} accumulated a node, {c['threads_per_node']} thread(s) a node, gradients "
             f"{'bf16' if c['grad_compression'] == 'bf16' else 'fp32'} on the wire",
             *([f"a node here takes {result['measured'][0]['s_per_step']:.2f} s a step, {c['node_speedup']:.2f}x a real "
                f"node's {c['real_node_step_s']:g} s: the real links ({c['link_rate']}, check {c['check_rate']}) are "
                f"shaped here as {', '.join(str(x) for x in c['links_here'] if x)}"] if c["real_node_step_s"] else []),
             "", "| nodes | link | images/s | efficiency | s/step | waited beyond one node | MB a step | |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for p in result["measured"] + result["predicted"]:
        link = "unshaped" if not p["link_bps"] else f"{p['link_bps'] / 1e9:g} Gbit/s"
        kind = ("measured" if p["fitted"] else "measured, not fitted (checks the model)") if p["measured"] \
            else f"modelled (a node {c['node_speedup']:g}x faster)"
        lines.append(f"| {p['nodes']} | {link} | {p['images_per_s']:.4f} | {p['efficiency']:.3f} | "
                     f"{p['s_per_step']:.2f} | {p['wait_s']:.2f} s | {p['bytes_per_step'] / 1e6:.0f} | {kind} |")
    m = result["model"]
    lines += ["", f"cost model: step = {m['compute_s']:.2f} s + max(0, ring - {m['hidden_s']:.2f} s hidden by the "
              f"backward); ring = 2(n-1)/n x {m['bytes_per_step'] / 1e6:.0f} MB / rate + 2(n-1) x {m['delay_s']:g} s"]
    for c in result["checked"]:
        lines.append(f"check: {c['nodes']} nodes at {c['link_bps'] / 1e9:g} Gbit/s measured {c['measured_s']:.2f} "
                     f"s/step, modelled {c['modelled_s']:.2f} ({c['modelled_s'] / c['measured_s'] - 1:+.1%})")
    return "\n".join(lines)
