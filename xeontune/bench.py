"""`xeontune bench`: this trainer's step against the common example script's, side by side.

Both variants are built by the trainer's own ``setup`` and stepped by its own ``train_step``:

* optimized: latents cached once per image, only the new rows trainable (the trainer's default);
* baseline: VAE encode every step, the whole token table trainable, the original rows copied back
  after every optimizer step, and with bf16 the frozen UNet and VAE cast to bf16 once (what the
  common example script does with `--mixed_precision bf16`). For SDXL it is what diffusers'
  `textual_inversion_sdxl.py` does: both encoders' whole tables trainable, and with bf16 the second
  text encoder cast to bf16 whole as well (its token table included), the first kept in fp32.

The optimized variant is the trainer exactly as `xeontune train` runs it, IPEX or torch.compile
included. The baseline runs in its own worker process, as the example script does: stock torch,
its own frozen models, and never an IPEX import (importing IPEX swaps CPU autocast kernels for the
whole process, which would speed up the "example" too). The two step alternately, one step each
per round, the order rotated every round, so that a noisy, shared machine slows both alike and
the ratio holds. A third entry in each round times the pure model compute: text encoder and UNet
forward and backward of one step, nothing else. Each variant's peak RSS comes from a short run of
that variant alone in a child process.

Step times are reported by ``--statistic``: ``best`` (default) takes each entry's fastest measured
step, because on a shared machine interference only ever adds time; ``median`` suits a quiet,
dedicated machine. Both are always in the JSON.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from xeontune import hardware
from xeontune.errors import UserError
from xeontune.quiet import quiet_libraries

VARIANTS = ("optimized", "baseline")
# Built once into --models-dir and reused (models.DIMS): sizes on disk, for the first build's note.
BUILT_IN = {"tiny": "", "sd15-arch": "3.9 GB", "sd2-tiny": "", "sd2-arch": "about 5.2 GB", "sdxl-tiny": "",
            "sdxl-arch": "about 13 GB"}

# Every method's targets are its declaration's (train/methods/: Declaration.bench); these hold for all.
# Issue 9's: the `auto` ranks per node >= 1.8x the example's images/s (3.0x at 512 px on a 16-core AMX
# host), the step within 5 % of the model's own compute.
SHARED_TARGETS = {"auto_ranks_speedup_min": 1.8, "overhead_max": 1.05}
CLASS_PROMPT = "a photo of a toy"


def child_flags(args: argparse.Namespace) -> list[str]:
    """The options a bench's child process (the baseline worker, a peak-RSS run) takes over as they are."""
    return [*(["--with-prior-preservation"] if getattr(args, "with_prior_preservation", False) else []),
            *(["--synthetic-data"] if getattr(args, "synthetic_data", False) else []),
            *(["--use-ema"] if getattr(args, "use_ema", False) else []),
            "--optimizer", getattr(args, "optimizer", "adamw")]


def targets_for(family: str, precision: str, method: str = "textual_inversion") -> dict[str, float]:
    """The targets this run is judged against: the shared ones and the method's, the model family's where it
    declares its own for the method (``Family.bench_targets``), each for this precision where it differs by it."""
    import xeontune.train.methods.declaration as methods
    from xeontune.train import families

    declared = methods.get(method).bench
    assert declared is not None, f"--method {method} declares no bench baseline"
    chosen = dict(declared.targets)
    chosen.update(families.get(family).bench_targets.get(method, {}))
    return {**SHARED_TARGETS, **{k: float(v[precision] if isinstance(v, dict) else v) for k, v in chosen.items()}}


@dataclass
class VariantResult:
    s_per_step: float  # by --statistic: the best (default) or the median of the measured steps
    images_per_s: float
    peak_rss_mb: float | None  # the whole process, loading included (what an OOM killer sees)
    phases: dict[str, float]  # seconds: the chosen step's own (best) or per-phase medians (median)
    median_s_per_step: float = 0.0
    best_s_per_step: float = 0.0
    warmup_s: list[float] = field(default_factory=list)  # unmeasured first steps (compile time shows here)
    steps_peak_rss_mb: float | None = None  # peak during the training steps alone
    step_times_s: list[float] = field(default_factory=list)


@dataclass
class RanksResult:
    """`xeontune train --nproc-per-node ranks` on this node, timed from its own metrics."""

    ranks: int
    images_per_s: float  # the whole node, by --statistic over the measured steps
    s_per_step: float
    peak_pss_mb: float  # the node's peak, summed over launcher and ranks (shared pages counted once)
    vs_example: float | None  # images/s over the example script's (one process, all cores)
    mfu: float
    auto: bool = False  # what --nproc-per-node auto picks here


@dataclass
class BenchResult:
    optimized: VariantResult
    baseline: VariantResult | None
    speedup: float | None  # optimized over baseline, in steps per second
    model_compute_s_per_step: float
    model_gflop_per_step: float
    achieved_gflops: float  # model FLOPs per optimized step / optimized s_per_step
    machine_peak_gflops: float
    overhead_ratio: float  # optimized s_per_step / model_compute_s_per_step
    rss_ratio: float | None  # optimized peak RSS / baseline peak RSS (whole process)
    steps_rss_ratio: float | None  # the same for the peaks during the training steps
    config: dict[str, Any]
    model_compute_times_s: list[float] = field(default_factory=list)
    core_peak_gflops: float = 0.0  # one core alone; MFU divides by this x physical cores
    physical_cores: int = 1
    mfu: float = 0.0  # optimized, one process: achieved / (core peak x cores)
    ranks_per_node: list[RanksResult] = field(default_factory=list)


# --- arguments ---------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="xeontune bench",
        description="Time this trainer's optimized step against the example script's approach (baseline), "
        "(in its own process) alternating step by step, with per-phase times, FLOPs, MFU and ranks per node.",
    )
    import xeontune.train.methods.declaration as methods

    p.add_argument("--method", default="textual_inversion", choices=methods.names(),
                   help="what trains (default textual_inversion); lora's baseline is diffusers' "
                   "train_dreambooth_lora(_sdxl).py: instance prompt, rank --rank, VAE and text encoder every step; "
                   "full's is train_text_to_image(_sdxl).py: the UNet in fp32 under autocast, the VAE and the "
                   "text encoder (in bf16 with bf16) every step")
    p.add_argument("--rank", type=int, default=4, help="--method lora: the adapters' rank (default 4)")
    p.add_argument("--class-images", type=int, default=0, metavar="N",
                   help="instead of training steps: time generating N prior-preservation class images as the "
                   "trainer does (one rank) against diffusers' pipeline as train_dreambooth_lora.py calls it "
                   "(batches of 4), both at --resolution and --class-inference-steps")
    p.add_argument("--class-inference-steps", type=int, default=25, help="denoising steps per class image (25)")
    p.add_argument("--sample-batch-size", type=int, default=4,
                   help="--class-images: the trainer's class images per pipeline call (default 4, as the example)")
    p.add_argument("--with-prior-preservation", action="store_true",
                   help="--method lora: DreamBooth's prior preservation, a class sample beside each instance sample "
                   "(the bench's images serve as the class images), against the example's --with_prior_preservation")
    p.add_argument("--model", default="tiny", help=f"{', '.join(BUILT_IN)} (built once and cached), "
                   "or a pipeline path (SD1.x, SD2 or SDXL)")
    p.add_argument("--synthetic-data", action="store_true",
                   help="train on images of random pixels, each with its own random caption, as MosaicML's "
                   "diffusion benchmark does, instead of the concept images and one instance prompt (the trainer "
                   "still encodes each image and caption once, where that benchmark encodes them every step)")
    p.add_argument("--models-dir", default="models", help="where the built-in models are cached (default: models)")
    p.add_argument("--resolution", type=int, default=256, help="image side in pixels (default 256)")
    p.add_argument("--batch-size", type=int, default=1, help="images per step (default 1)")
    p.add_argument("--steps", type=int, default=5, help="measured steps per variant (default 5)")
    p.add_argument("--warmup", type=int, default=1, help="unmeasured steps per variant first (default 1)")
    p.add_argument("--mixed-precision", default="auto", choices=("auto", "bf16", "fp32"))
    p.add_argument("--ipex", default="auto", choices=("auto", "on", "off"))
    p.add_argument("--pack-weights", default="auto", choices=("auto", "on", "off"),
                   help="the optimized variant's --pack-weights (the baseline never packs; default auto)")
    p.add_argument("--gradient-checkpointing", action="store_true",
                   help="the optimized variant's --gradient-checkpointing (the UNet recomputes its activations: "
                   "less memory, more time; the baseline never does)")
    p.add_argument("--compile", action="store_true", help="torch.compile the UNet (first step compiles: minutes)")
    p.add_argument("--allocator", default="auto", choices=("auto", "tcmalloc", "jemalloc", "none"),
                   help="allocator to preload by re-executing the bench (default auto: tcmalloc, else jemalloc)")
    p.add_argument("--no-baseline", action="store_true", help="time only the optimized step")
    p.add_argument("--one-at-a-time", action="store_true",
                   help="step the baseline after the optimized variant, each process alone, instead of alternating "
                   "with both loaded: for a model whose two copies do not fit in memory together (sdxl-arch in fp32 "
                   "on 24 GB); a busy machine then slows one more than the other")
    p.add_argument("--no-rss", action="store_true", help="skip the child runs that measure peak RSS")
    p.add_argument("--statistic", default="best", choices=("best", "median"),
                   help="which step time counts (default best: on a shared machine noise only ever adds time)")
    p.add_argument("--ranks-per-node", default="powers", metavar="LIST",
                   help="after the side-by-side steps, run `xeontune train --nproc-per-node R` for each R and "
                   "report the node's images/s, peak memory and MFU: comma-separated counts and/or auto, "
                   "'powers' (1, 2, 4, ... up to the physical cores, and auto's pick; the default) or none")
    nodes = p.add_argument_group(
        "scaling across nodes (--nodes; root: network-namespace hosts on this machine, docs/cluster.md)")
    nodes.add_argument("--nodes", metavar="LIST", help="node counts to run, 1 first, e.g. 1,2: each a real `xeontune "
                       "run --provider local` with one rank a node; prints images/s, scaling efficiency and the time "
                       "each step waited beyond one node's, and fits a cost model to them")
    nodes.add_argument("--link-rate", metavar="RATE", help="each node's link, shaped with tc (e.g. 320mbit)")
    nodes.add_argument("--link-delay", metavar="DELAY", help="each node's one-way link delay (e.g. 100us; netem)")
    nodes.add_argument("--check-rate", metavar="RATE", help="measure the largest count again at this link rate, "
                       "which the cost model is not fitted to: its check")
    nodes.add_argument("--threads-per-node", type=int, default=0, metavar="N",
                       help="threads each node's rank runs (default: this machine's cores / the largest count)")
    nodes.add_argument("--accumulation", type=int, default=1, metavar="N", help="--gradient-accumulation-steps")
    nodes.add_argument("--grad-compression", default="none", choices=("none", "bf16"), help="--method full's")
    nodes.add_argument("--shard", default="none", choices=("none", "optimizer", "gradients", "full", "auto"), help="--method full's")
    nodes.add_argument("--optimizer", default="adamw", choices=("adamw", "adafactor"))
    nodes.add_argument("--use-ema", action="store_true", help="--method full: keep an EMA of the UNet")
    nodes.add_argument("--node-speedup", type=float, default=1.0, metavar="X",
                       help="for the predictions: how many times faster a real node computes the step than a node here")
    nodes.add_argument("--real-node-step", type=float, default=0.0, metavar="SECONDS",
                       help="a real node's step (same options, its own resolution and precision): the node speedup "
                       "is measured against it, and --link-rate/--check-rate are that real node's links, shaped "
                       "here as much slower as a node here is (docs/cluster.md)")
    nodes.add_argument("--predict-rate", metavar="RATE", help="predict clusters whose links run at RATE (e.g. 25gbit)")
    nodes.add_argument("--predict-nodes", default="8,16,32,64", metavar="LIST", help="their node counts (8,16,32,64)")
    attention = p.add_argument_group("attention (--attention): xeontune's kernel against torch's SDPA")
    attention.add_argument("--attention", action="store_true",
                           help="time the attention alone, forward and backward, at SD1.5's and SDXL's shapes "
                           "(in --mixed-precision: fp32 where auto finds no bf16 instructions)")
    attention.add_argument("--threads", default="1,2,all", metavar="LIST",
                           help="thread counts to time at (default 1,2,all: all = the physical cores)")
    attention.add_argument("--repeats", type=int, default=3, help="timed calls per measurement; the best counts (3)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.add_argument("--json-out", metavar="FILE", help="also write the JSON object to FILE")
    p.add_argument("--matmul-size", type=int, default=2048, help=argparse.SUPPRESS)
    p.add_argument("--rss-child", choices=VARIANTS, help=argparse.SUPPRESS)
    p.add_argument("--baseline-worker", action="store_true", help=argparse.SUPPRESS)
    return p


def _check(args: argparse.Namespace) -> None:
    if args.class_images < 0 or args.class_inference_steps < 1 or args.sample_batch_size < 1:
        raise UserError("--class-images must be >= 0, --class-inference-steps and --sample-batch-size at least 1")
    for name in ("steps", "batch_size", "matmul_size", "rank"):
        if getattr(args, name) < 1:
            raise UserError(f"--{name.replace('_', '-')} must be at least 1")
    if args.warmup < 0:
        raise UserError("--warmup must be at least 0")
    if args.resolution < 32 or args.resolution % 8:
        raise UserError(f"--resolution must be a multiple of 8 and at least 32, got {args.resolution}")
    rank_counts(args.ranks_per_node, physical_cores())  # fails now on a bad list, not after minutes of steps
    if args.attention:
        from xeontune.attention_bench import thread_counts

        if args.repeats < 1:
            raise UserError("--repeats must be at least 1")
        try:
            thread_counts(args.threads, physical_cores())
        except ValueError:
            raise UserError(f"--threads {args.threads}: a comma-separated list of thread counts and 'all'") from None
    _check_nodes(args)


def _check_nodes(args: argparse.Namespace) -> None:
    """--nodes and its options: one line for a mistake, before any node starts."""
    from xeontune import scaling

    given = [flag for flag, value in (("--link-rate", args.link_rate), ("--link-delay", args.link_delay),
                                      ("--check-rate", args.check_rate), ("--predict-rate", args.predict_rate))
             if value]
    if not args.nodes:
        if given:
            raise UserError(f"{given[0]} belongs to --nodes (scaling across nodes)")
        return
    scaling.parse_nodes(args.nodes)
    if args.predict_rate:
        scaling.parse_nodes("1," + args.predict_nodes)
    if args.accumulation < 1 or args.threads_per_node < 0 or args.node_speedup <= 0 or args.real_node_step < 0:
        raise UserError("--accumulation must be at least 1, --threads-per-node and --real-node-step at least 0, "
                        "--node-speedup above 0")
    from xeontune.cluster.providers import ClusterSpec
    from xeontune.cluster.providers.local import RATE_RE, link_shape

    link_shape(ClusterSpec("check", 1, options={"link_rate": args.link_rate, "link_delay": args.link_delay}))
    for flag, rate in (("--check-rate", args.check_rate), ("--predict-rate", args.predict_rate)):
        if rate and not RATE_RE.fullmatch(rate):
            raise UserError(f"{flag} {rate!r}: give a rate as tc writes it, e.g. 25gbit, 320mbit")
    if args.method != "full" and (args.grad_compression != "none" or args.shard != "none"):
        raise UserError("--grad-compression and --shard are --method full's")


def rank_counts(spec: str, physical: int) -> list[int | str]:
    """--ranks-per-node as a list of counts and 'auto'."""
    if spec == "none":
        return []
    if spec == "powers":
        return [*(2**i for i in range(physical.bit_length()) if 2**i <= physical), "auto"]
    counts: list[int | str] = []
    for item in spec.split(","):
        item = item.strip()
        if item == "auto" or (item.isdigit() and int(item) >= 1):
            counts.append(item if item == "auto" else int(item))
        else:
            raise UserError(f"--ranks-per-node: {item!r} is not a positive count, auto, powers or none")
    too_many = [c for c in counts if c != "auto" and int(c) > physical]
    if too_many:  # as `train --nproc-per-node` would refuse each of them, minutes later
        raise UserError(f"--ranks-per-node: {', '.join(map(str, too_many))} more than this machine's {physical} "
                        "physical cores (each rank needs a core of its own)")
    return counts


# --- environment ----------------------------------------------------------------------------------


def loaded_allocator() -> str:
    """Which malloc this process really uses (read from its memory map)."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return "unknown"
    for name in ("tcmalloc", "jemalloc"):
        if f"lib{name}" in maps:
            return name
    return "glibc malloc"


def peak_rss_mb() -> float:
    """This process's peak RSS. VmHWM, not ru_maxrss: Linux carries the parent's peak into a
    child's ru_maxrss across fork and exec, so a child of the (large) bench would report its parent's."""
    hwm = _status_mb("VmHWM")
    return hwm if hwm is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _status_mb(key: str) -> float | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def reset_peak_rss() -> bool:
    """Start a new peak-RSS window (VmHWM), after handing freed memory back to the OS."""
    hardware.release_freed_memory()
    try:
        Path("/proc/self/clear_refs").write_text("5")  # Linux >= 4.0: resets VmHWM to the current RSS
    except OSError:
        return False
    return True


# --- model and data --------------------------------------------------------------------------------


def resolve_model(model: str, models_dir: str) -> Path:
    """A built-in kind is built into MODELS_DIR/KIND once (sd15-arch: minutes, 3.9 GB; sdxl-arch: about
    13 GB) and reused."""
    from xeontune import models

    if model not in BUILT_IN:
        path = Path(model).expanduser()
        if not (path / "model_index.json").is_file():
            raise UserError(f"--model {model}: not one of {', '.join(BUILT_IN)}, or a pipeline folder with "
                            "model_index.json")
        return path
    path = Path(models_dir) / model
    if not (path / "model_index.json").is_file():
        note = f" (once: a few minutes and {BUILT_IN[model]})" if BUILT_IN[model] else ""
        print(f"building the {model} pipeline in {path}{note}", file=sys.stderr)
        start = time.perf_counter()
        models.build_pipeline(model, path)
        print(f"built {path} in {time.perf_counter() - start:.0f} s", file=sys.stderr)
    return path


def write_bench_data(data: Path, args: argparse.Namespace) -> None:
    """What every variant trains on: the concept images, or --synthetic-data's (a caption for each sample one
    process's steps draw; rank sweeps draw them again)."""
    from xeontune import models

    if getattr(args, "synthetic_data", False):
        samples = args.batch_size * (args.warmup + args.steps) * getattr(args, "accumulation", 1)
        models.write_synthetic_data(data, count=max(4, samples), size=args.resolution)
    else:
        models.write_sample_data(data, count=4, size=args.resolution)


def class_images_beside(data: Path) -> Path:
    """A class folder holding copies of the sample images (the trainer refuses its own data dir as one):
    the timed step is the same with any class images, and none need generating."""
    class_dir = data.with_name(data.name + "-class")
    if not class_dir.is_dir():
        shutil.copytree(data, class_dir)
    return class_dir


def variant_options(model: Path, data: Path, out: Path, args: argparse.Namespace, variant: str):
    """The trainer's options for one variant: the baseline differs only in the benchmark switches (and
    never packs): VAE every step, and textual inversion's whole token table or LoRA's text encoder every step."""
    import xeontune.train.methods.declaration as methods
    from xeontune.train.options import TrainOptions, validate

    method = methods.get(getattr(args, "method", "textual_inversion"))
    assert method.bench is not None, f"--method {method.name} declares no bench baseline"
    own = method.bench.options(variant == "baseline", args)
    if variant == "baseline":  # where the family's example script differs from the method's (SD3's encodes once)
        from xeontune.train.components import pipeline_family

        own |= pipeline_family(str(model)).bench_baseline.get(method.name, {})
    if method.prior_preservation and getattr(args, "with_prior_preservation", False):
        own |= {"with_prior_preservation": True, "class_data_dir": str(class_images_beside(data)),
                "class_prompt": CLASS_PROMPT, "num_class_images": len(list(data.iterdir()))}
    return validate(TrainOptions(
        method=method.name, model=str(model), data_dir=str(data), **own,
        resolution=args.resolution, train_batch_size=args.batch_size, max_train_steps=args.warmup + args.steps,
        output_dir=str(out), mixed_precision=args.mixed_precision, ipex=args.ipex, compile=args.compile,
        pack_weights=args.pack_weights if variant != "baseline" else "off", report_to="none",
        cache_latents=variant != "baseline",
        gradient_checkpointing=getattr(args, "gradient_checkpointing", False) and variant != "baseline",
    ))


def example_components(model: Path, precision: str, method: str = "textual_inversion"):
    """The models as the method's example script holds them (its family's ``example_bf16``): in a bf16
    run, the parts it casts to bf16 once (then run every step in bf16), the rest in fp32. The textual
    inversion scripts keep the text encoder they train in fp32 (SDXL's casts its second encoder whole,
    after handing its token table to the optimizer: that table then trains in bf16, as ``tokens.install``
    copies the table's dtype). The LoRA scripts cast every frozen model, and the adapters they add back to
    fp32 (as the LoRA method does); SDXL's keeps its VAE in fp32 ("to avoid NaN losses"), so its baseline
    encodes each step's images in fp32. train_text_to_image.py trains its UNet in fp32 under autocast."""
    import torch

    import xeontune.train.methods.declaration as methods
    from xeontune.train.components import load

    assert methods.get(method).bench is not None, f"--method {method} declares no bench baseline"
    components = load(str(model))  # as its files hold it, then cast: not from the trainer's bf16 copy
    if precision == "bf16":
        for name in components.family.example_bf16(method):
            part = getattr(components, name)
            if part is not None:
                part.to(torch.bfloat16)
                if name != "vae":
                    setattr(components, f"{name}_cast", True)
    return components


# --- measurements --------------------------------------------------------------------------------


def machine_peak_gflops(precision: str, size: int = 2048, repeats: int = 5) -> float:
    """Best of a few large square matmuls in the training precision: what this CPU can do.

    Measured at start and again once per round; the best counts, since a busy machine only
    ever makes a matmul slower."""
    import torch

    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    a = torch.randn(size, size).to(dtype)
    b = torch.randn(size, size).to(dtype)
    torch.mm(a, b)  # warm-up: oneDNN/MKL picks and caches its kernel
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best / 1e9


def core_peak_gflops(precision: str, size: int = 2048) -> float:
    """The matmul peak of one core (one thread), in the training dtype. MFU is measured against this
    times the physical cores: a sum of per-core peaks, which no single process reaches on a Xeon."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return machine_peak_gflops(precision, size, repeats=3)
    finally:
        torch.set_num_threads(threads)


def _tree_pss_mb(root) -> float:
    """Proportional set size of a process and its descendants: shared pages counted once in all."""
    import psutil

    total = 0
    for proc in [root, *root.children(recursive=True)]:
        with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
            total += proc.memory_full_info().pss
    return total / 2**20


def ranks_run(argv: list[str], ranks: int, out: Path, statistic: str, warmup: int) -> tuple[float, float, float]:
    """Run `xeontune train --nproc-per-node ranks`; (node images/s, s/step, peak PSS MB)."""
    import psutil

    cmd = [sys.executable, "-m", "xeontune.train", *argv, "--output-dir", str(out), "--nproc-per-node", str(ranks)]
    log_path = out.with_suffix(".log")  # a file, not a pipe: nobody reads a pipe while we poll memory
    with log_path.open("w") as log_file:
        proc = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT)
        root, peak = psutil.Process(proc.pid), 0.0
        while proc.poll() is None:
            peak = max(peak, _tree_pss_mb(root))
            time.sleep(0.5)
    if proc.returncode != 0:
        raise RuntimeError(f"--nproc-per-node {ranks} run failed:\n{log_path.read_text()[-3000:]}")
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()][warmup:]
    chosen = pick([m["step_time_s"] for m in metrics], statistic)
    images = next(m["images_per_s"] for m in metrics if m["step_time_s"] == chosen)
    return images, chosen, peak


def compute_pass(run, step: int, *, around: Any = None) -> float:
    """Text encoder and UNet forward and backward for one step's batch, timed alone.

    Inputs (batch, latents, noise, target) are made before the clock starts; the gradients are
    dropped after it stops, so the trainable vectors never change. ``around``: a context manager
    entered for the timed part alone (FLOP counting).
    """
    import torch
    import torch.nn.functional as F

    batch = run.plan.batch(run.positions(step, 0))
    with torch.no_grad():
        latents = run.latents.sample(batch)
        c = run.components
        noisy = c.family.noisy(c.noise_scheduler, latents, batch.noise, batch.timesteps)
        target = run.target(latents, batch.noise, batch.timesteps).float()
    start = time.perf_counter()
    with around or contextlib.nullcontext():
        with run.autocast():
            hidden, added = run.encode_text(batch)
            pred = c.family.predict(c.noise_scheduler, c.denoiser, noisy, batch.timesteps, hidden, added)
        F.mse_loss(pred.float(), target).backward()
    elapsed = time.perf_counter() - start
    run.optimizer.zero_grad(set_to_none=True)
    return elapsed


def count_gflop(run, step: int) -> float:
    """FLOPs of one compute pass (forward and backward) by torch.utils.flop_counter.

    Counted in the baseline worker where there is one: its UNet is stock torch, while compiled
    graphs and IPEX's own kernels are not aten ops the counter sees. Packed layers are counted as
    the stock layers they replace (the same arithmetic)."""
    from torch.utils.flop_counter import FlopCounterMode

    from xeontune.train import packed

    counter = FlopCounterMode(display=False)
    with packed.stock_layers(run.components.denoiser):
        compute_pass(run, step, around=counter)  # the batch's latents (a VAE encode in the baseline) not counted
    return counter.get_total_flops() / 1e9


def pick(times: list[float], statistic: str) -> float:
    return min(times) if statistic == "best" else statistics.median(times)


def _summarize(
    times: list[float], phases: list[dict[str, float]], batch: int, rss: dict[str, float | None],
    warmup: list[float], statistic: str,
) -> VariantResult:
    chosen = pick(times, statistic)
    if statistic == "best":  # the phases of that very step, so they add up to it
        step_phases = phases[times.index(chosen)]
    else:
        step_phases = {n: statistics.median(p[n] for p in phases) for n in phases[0]}
    return VariantResult(
        s_per_step=chosen, images_per_s=batch / chosen, peak_rss_mb=rss.get("peak_rss_mb"), phases=step_phases,
        median_s_per_step=statistics.median(times), best_s_per_step=min(times),
        steps_peak_rss_mb=rss.get("steps_peak_rss_mb"),
        step_times_s=[round(t, 4) for t in times], warmup_s=[round(t, 4) for t in warmup],
    )


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


class BaselineWorker:
    """The example script's step in a process of its own, stepped on request over a pipe.

    Protocol: the worker prints one JSON line when ready ({"gflop", "note"}), then for every step
    number it reads on stdin, one JSON line {"elapsed", "phases"}. It exits at end of input."""

    def __init__(self, args: argparse.Namespace, model: Path, tmp: Path, precision: str) -> None:
        argv = [
            sys.executable, "-m", "xeontune.bench", "--baseline-worker", "--model", str(model),
            "--resolution", str(args.resolution), "--batch-size", str(args.batch_size),
            "--steps", str(args.steps), "--warmup", str(args.warmup),
            # this process's precision, not "auto" again: the same for both variants, decided once
            "--mixed-precision", precision, "--allocator", "none",  # inherits ours via the env
            "--method", args.method, "--rank", str(args.rank), *child_flags(args),
        ]
        self.log_path = tmp / "baseline-worker.log"
        self._log = self.log_path.open("w")
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, text=True)
        self._ready: dict[str, Any] | None = None

    def _reply(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait()
            raise RuntimeError(f"the baseline worker exited ({self.proc.returncode}):\n"
                               f"{self.log_path.read_text()[-3000:]}")
        return json.loads(line)

    @property
    def ready(self) -> dict[str, Any]:
        if self._ready is None:
            self._ready = self._reply()
        return self._ready

    def step(self, step: int) -> tuple[float, dict[str, float]]:
        assert self.proc.stdin is not None
        self.ready  # noqa: B018 -- its models are loaded before the first step is timed
        self.proc.stdin.write(f"{step}\n")
        self.proc.stdin.flush()
        reply = self._reply()
        return reply["elapsed"], reply["phases"]

    def __enter__(self) -> BaselineWorker:
        return self

    def __exit__(self, *exc: object) -> None:
        with contextlib.suppress(OSError):
            if self.proc.stdin:
                self.proc.stdin.close()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._log.close()


def baseline_worker(args: argparse.Namespace) -> int:
    """Worker mode: the example script's models and step (see BaselineWorker), no IPEX, no compile."""
    import os

    from xeontune.hardware import choose_precision
    from xeontune.train import loop

    replies = os.fdopen(os.dup(1), "w")  # our protocol; anything a library prints goes to the log
    os.dup2(2, 1)
    args.ipex, args.compile, args.pack_weights = "off", False, "off"
    model = resolve_model(args.model, args.models_dir)
    with tempfile.TemporaryDirectory(prefix="xeontune-bench-baseline-") as tmp:
        data = Path(tmp) / "data"
        write_bench_data(data, args)
        opts = variant_options(model, data, Path(tmp) / "out", args, "baseline")
        run, _ = loop.setup(opts, loop.make_accelerator(opts),
                            components=example_components(model, choose_precision(opts.mixed_precision)[0],
                                                          opts.method))
        ipex = "intel_extension_for_pytorch" in sys.modules
        note = "own process, stock torch" + (" (IPEX imported: autocast kernels not stock)" if ipex else "")
        replies.write(json.dumps({"gflop": count_gflop(run, 10**6), "note": note}) + "\n")
        replies.flush()
        for line in sys.stdin:
            start = time.perf_counter()
            loop.train_step(run, int(line))
            elapsed = time.perf_counter() - start
            replies.write(json.dumps({"elapsed": elapsed, "phases": run.phases.take()}) + "\n")
            replies.flush()
    return 0


def alternate(
    args: argparse.Namespace, run, worker: BaselineWorker | None, precision: str, log,
) -> tuple[dict[str, list], dict[str, list[float]], dict[str, list[dict[str, float]]]]:
    """Step the optimized run, the baseline worker and the compute pass in turn, one each per round;
    the order rotates so no entry always goes first. Also re-measures the machine's matmul peak
    once per round (returned under times["peaks"])."""
    from xeontune.train import loop

    entries = ["optimized", *(["baseline"] if worker else []), "compute"]
    times: dict[str, list] = {e: [] for e in entries}
    warmups: dict[str, list[float]] = {e: [] for e in entries}
    phases: dict[str, list[dict[str, float]]] = {e: [] for e in entries}
    peaks = []
    for rnd in range(args.warmup + args.steps):
        shift = rnd % len(entries)
        this_round: dict[str, float] = {}
        for entry in entries[shift:] + entries[:shift]:
            step_phases: dict[str, float] = {}
            if entry == "compute":
                elapsed = compute_pass(run, 2 * 10**6 + rnd)
            elif entry == "baseline":
                assert worker is not None
                elapsed, step_phases = worker.step(rnd)
            else:
                start = time.perf_counter()
                loop.train_step(run, rnd)
                elapsed = time.perf_counter() - start
                step_phases = run.phases.take()
            this_round[entry] = elapsed
            if rnd < args.warmup:
                warmups[entry].append(elapsed)
            else:
                times[entry].append(elapsed)
                if entry != "compute":
                    phases[entry].append(step_phases)
        peaks.append(machine_peak_gflops(precision, args.matmul_size, repeats=2))
        label = "warm-up" if rnd < args.warmup else f"step {rnd - args.warmup + 1}/{args.steps}"
        log(f"{label}: " + ", ".join(f"{e} {t:.2f} s" for e, t in this_round.items()))
    times["peaks"] = peaks
    return times, warmups, phases


def bench_class_images(args: argparse.Namespace, log=print) -> dict[str, Any]:
    """Images/s of class-image generation: the trainer's (its prepared frozen models: packed, the bf16
    copy under bf16; DPM-Solver++; --sample-batch-size images a call, each from its own seed) against diffusers' pipeline
    loaded and called as train_dreambooth_lora.py does (its own scheduler, batches of 4), at the same
    size and number of steps. One after the other, each after one warm-up call."""
    import torch

    from xeontune import models
    from xeontune.hardware import choose_precision
    from xeontune.train import loop, prior

    model = resolve_model(args.model, args.models_dir)
    precision = choose_precision(args.mixed_precision)[0]
    count, size, steps = args.class_images, args.resolution, args.class_inference_steps
    with tempfile.TemporaryDirectory(prefix="xeontune-bench-") as tmp:
        data = Path(tmp) / "data"
        models.write_sample_data(data, count=1, size=size)
        args.method, args.with_prior_preservation = "lora", False
        opts = replace(variant_options(model, data, Path(tmp) / "out", args, "optimized"),
                       validation_prompt=["x"], class_prompt=CLASS_PROMPT, class_inference_steps=steps,
                       sample_batch_size=args.sample_batch_size)
        run, _ = loop.setup(opts, loop.make_accelerator(opts))  # the frozen models as training prepares them
        autocast = run.autocast
        warm = replace(opts, class_data_dir=str(Path(tmp) / "warm"), num_class_images=1)
        prior.ensure_class_images(run.components, run.method, warm, run.sync, autocast)
        timed = replace(opts, class_data_dir=str(Path(tmp) / "class"), num_class_images=count)
        start = time.perf_counter()
        prior.ensure_class_images(run.components, run.method, timed, run.sync, autocast)
        ours = time.perf_counter() - start
        log(f"xeontune: {count} class images in {ours:.1f} s")
        del run

        from diffusers import DiffusionPipeline

        dtype = torch.bfloat16 if precision == "bf16" else torch.float32
        pipe = DiffusionPipeline.from_pretrained(str(model), torch_dtype=dtype, safety_checker=None)
        pipe.set_progress_bar_config(disable=True)
        pipe(CLASS_PROMPT, num_inference_steps=steps, height=size, width=size)
        start = time.perf_counter()
        for first in range(0, count, 4):
            pipe([CLASS_PROMPT] * min(4, count - first), num_inference_steps=steps, height=size, width=size)
        example = time.perf_counter() - start
        log(f"diffusers' pipeline as the example calls it: {count} class images in {example:.1f} s")
    return {"images": count, "resolution": size, "steps": steps, "precision": precision,
            "sample_batch_size": args.sample_batch_size,
            "xeontune_images_per_s": count / ours, "example_images_per_s": count / example,
            "speedup": example / ours, "threads": torch.get_num_threads(), "cpu": _cpu_model()}


def run_bench(args: argparse.Namespace, log=print) -> BenchResult:
    import torch

    from xeontune.train import loop
    from xeontune.train.ranks import plan_ranks

    model = resolve_model(args.model, args.models_dir)
    with tempfile.TemporaryDirectory(prefix="xeontune-bench-") as tmp:
        data = Path(tmp) / "data"
        write_bench_data(data, args)
        opts = variant_options(model, data, Path(tmp) / "optimized", args, "optimized")
        precision = hardware.choose_precision(args.mixed_precision)[0]  # as the trainer decides it
        worker = None if args.no_baseline or args.one_at_a_time else BaselineWorker(args, model, Path(tmp), precision)
        with worker or contextlib.nullcontext():
            accelerator = loop.make_accelerator(opts)
            run, _ = loop.setup(opts, accelerator)  # the trainer as `xeontune train` runs it
            precision, family = run.precision, run.components.family.name
            notes = list(run.backend_notes)
            if worker:
                notes.append("baseline: " + worker.ready["note"])
            log(f"precision {precision}; threads {torch.get_num_threads()}; allocator {loaded_allocator()}; "
                + "; ".join(notes))

            peak = machine_peak_gflops(precision, args.matmul_size)
            core_peak = core_peak_gflops(precision, args.matmul_size)
            gflop = worker.ready["gflop"] if worker else count_gflop(run, 10**6)
            log(f"machine peak {peak:.0f} GFLOP/s; model {gflop:.1f} GFLOP per step")
            times, warmups, phases = alternate(args, run, worker, precision, log)
            peak = max(peak, *times.pop("peaks"))
        del run
        # hand the optimized variant's freed memory back: the baseline (--one-at-a-time) loads next, and the
        # ranks below size themselves by what this process leaves free
        reset_peak_rss()
        if args.one_at_a_time and not args.no_baseline:
            with BaselineWorker(args, model, Path(tmp), precision) as worker:
                notes.append(f"baseline: {worker.ready['note']}; stepped after the optimized variant (--one-at-a-time)")
                times["baseline"], warmups["baseline"], phases["baseline"] = [], [], []
                for rnd in range(args.warmup + args.steps):
                    elapsed, step_phases = worker.step(rnd)
                    if rnd < args.warmup:
                        warmups["baseline"].append(elapsed)
                    else:
                        times["baseline"].append(elapsed)
                        phases["baseline"].append(step_phases)
                    log(f"baseline {'warm-up' if rnd < args.warmup else f'step {rnd - args.warmup + 1}'}: "
                        f"{elapsed:.2f} s")
        sweep = []
        counts = rank_counts(args.ranks_per_node, physical_cores())
        if counts:
            # the optimized variant's options, as a config file for the `xeontune train` runs
            config = Path(tmp) / "ranks-config.json"
            optimized = variant_options(model, data, Path(tmp), args, "optimized")
            given = {k: v for k, v in optimized.to_json().items() if k not in ("output_dir", "config")}
            config.write_text(json.dumps(given))
            argv = ["--config", str(config)]
            auto = plan_ranks(replace(optimized, nproc_per_node="auto"), precision).ranks
            for spec in counts:
                ranks = auto if spec == "auto" else int(spec)  # the trainer's own rule decides auto
                sweep.append((ranks, *ranks_run(argv, ranks, Path(tmp) / f"ranks-{spec}", args.statistic,
                                                args.warmup)))
                log(f"--nproc-per-node {spec}: {ranks} rank(s), {sweep[-1][1]:.3f} images/s, "
                    f"peak {sweep[-1][3]:.0f} MB (PSS, whole node)")
        core_peak = max(core_peak, core_peak_gflops(precision, args.matmul_size))  # a busy moment only lowers it

    rss: dict[str, dict[str, float | None]] = {v: {} for v in VARIANTS}
    if not args.no_rss:
        for variant in VARIANTS if not args.no_baseline else ("optimized",):
            rss[variant] = rss_in_child(args, variant, model)
            log(f"peak RSS {variant}: {rss[variant]['peak_rss_mb']:.0f} MB "
                f"(during the steps: {rss[variant]['steps_peak_rss_mb'] or 0:.0f} MB)")

    optimized = _summarize(
        times["optimized"], phases["optimized"], args.batch_size, rss["optimized"], warmups["optimized"],
        args.statistic,
    )
    baseline = (
        _summarize(times["baseline"], phases["baseline"], args.batch_size, rss["baseline"], warmups["baseline"],
                   args.statistic)
        if not args.no_baseline else None
    )
    compute = pick(times["compute"], args.statistic)
    cores = physical_cores()
    node_peak = core_peak * cores

    def mfu(images_per_s: float) -> float:
        return images_per_s * gflop / args.batch_size / node_peak

    ranks_results: dict[int, RanksResult] = {}
    for spec, (count, images, step_s, pss) in zip(counts, sweep, strict=True):
        known = ranks_results.get(count)
        if known is None or images > known.images_per_s:  # auto may pick a count also asked for
            ranks_results[count] = RanksResult(
                ranks=count, images_per_s=images, s_per_step=step_s, peak_pss_mb=pss,
                vs_example=images / baseline.images_per_s if baseline else None, mfu=mfu(images))
        ranks_results[count].auto |= spec == "auto" or bool(known and known.auto)
    return BenchResult(
        optimized=optimized,
        baseline=baseline,
        speedup=baseline.s_per_step / optimized.s_per_step if baseline else None,
        model_compute_s_per_step=compute,
        model_gflop_per_step=gflop,
        achieved_gflops=gflop / optimized.s_per_step,
        machine_peak_gflops=peak,
        overhead_ratio=optimized.s_per_step / compute,
        rss_ratio=_ratio(optimized.peak_rss_mb, baseline.peak_rss_mb) if baseline else None,
        steps_rss_ratio=_ratio(optimized.steps_peak_rss_mb, baseline.steps_peak_rss_mb) if baseline else None,
        config={
            "model": args.model, "model_path": str(model), "resolution": args.resolution,
            "batch_size": args.batch_size, "steps": args.steps, "warmup": args.warmup, "precision": precision,
            "statistic": args.statistic, "one_at_a_time": args.one_at_a_time,
            "ipex": args.ipex, "compile": args.compile, "pack_weights": args.pack_weights,
            "gradient_checkpointing": args.gradient_checkpointing,
            "threads": torch.get_num_threads(),
            "allocator": loaded_allocator(), "torch": torch.__version__, "cpu": _cpu_model(),
            "backend_notes": notes, "family": family, "targets": targets_for(family, precision, args.method),
            "method": args.method, **({"rank": args.rank} if args.method == "lora" else {}),
            "prior_preservation": bool(getattr(args, "with_prior_preservation", False)),
            "synthetic_data": args.synthetic_data,
            **({"use_ema": args.use_ema, "optimizer": args.optimizer} if args.method == "full" else {}),
        },
        model_compute_times_s=[round(t, 4) for t in times["compute"]],
        core_peak_gflops=core_peak,
        physical_cores=cores,
        mfu=mfu(optimized.images_per_s),
        ranks_per_node=[ranks_results[c] for c in sorted(ranks_results)],
    )


def physical_cores() -> int:
    from xeontune import placement

    return len(placement.physical_cores())


def _cpu_model() -> str:
    info = hardware.cpu_info()
    return f"{info.model}, {info.physical_cores} cores, {' '.join(f for f, on in info.flags.items() if on)}"


def rss_in_child(args: argparse.Namespace, variant: str, model: Path) -> dict[str, float | None]:
    """Peak RSS of a fresh process that loads the models and runs warm-up plus two steps of one
    variant: over its whole life, and during the steps alone."""
    argv = [
        sys.executable, "-m", "xeontune.bench", "--rss-child", variant, "--model", str(model),
        "--resolution", str(args.resolution), "--batch-size", str(args.batch_size),
        "--steps", str(min(args.steps, 2)), "--warmup", str(min(args.warmup, 1)),
        "--mixed-precision", args.mixed_precision, "--ipex", args.ipex, "--pack-weights", args.pack_weights,
        "--allocator", "none", "--method", args.method, "--rank", str(args.rank), *child_flags(args),
        *(["--compile"] if args.compile else []),
        *(["--gradient-checkpointing"] if args.gradient_checkpointing else []),
    ]
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"peak-RSS run of {variant} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def rss_child(args: argparse.Namespace) -> int:
    """Child mode: one variant alone (no shared models), then print its peak RSS as JSON."""
    from xeontune.train import loop

    model = resolve_model(args.model, args.models_dir)
    with tempfile.TemporaryDirectory(prefix="xeontune-bench-") as tmp:
        data = Path(tmp) / "data"
        write_bench_data(data, args)
        opts = variant_options(model, data, Path(tmp) / "out", args, args.rss_child)
        accelerator = loop.make_accelerator(opts)
        if args.rss_child == "baseline":  # the example script's models, not the trainer's
            from xeontune.hardware import choose_precision

            example = example_components(model, choose_precision(opts.mixed_precision)[0], opts.method)
            run, _ = loop.setup(opts, accelerator, components=example)
            del example
        else:  # the trainer exactly as `xeontune train` runs it
            run, _ = loop.setup(opts, accelerator)
        setup_peak, after_setup = peak_rss_mb(), _status_mb("VmRSS")
        windowed = reset_peak_rss()
        for step in range(args.warmup + args.steps):
            loop.train_step(run, step)
        steps_peak = peak_rss_mb()
        report = {
            "variant": args.rss_child, "peak_rss_mb": max(setup_peak, steps_peak), "setup_peak_rss_mb": setup_peak,
            "rss_after_setup_mb": after_setup, "steps_peak_rss_mb": steps_peak if windowed else None,
        }
    print(json.dumps(report))
    return 0


# --- output ----------------------------------------------------------------------------------------


def render_table(r: BenchResult) -> str:
    c = r.config
    cols = [("optimized", r.optimized)] + ([("baseline", r.baseline)] if r.baseline else [])
    lines = [
        f"xeontune bench: {c.get('method', 'textual_inversion')}"
        + (f" rank {c['rank']}" if c.get("rank") else "") + f", {c['model']} ({c['family']}), {c['resolution']} px, batch {c['batch_size']}, {c['steps']} steps after "
        f"{c['warmup']} warm-up, {c['precision']}, {c['threads']} threads, {c['allocator']}",
        f"{'':<24}" + "".join(f"{name:>12}" for name, _ in cols),
        f"{'s/step (' + c['statistic'] + ')':<24}" + "".join(f"{v.s_per_step:>12.3f}" for _, v in cols),
        f"{'s/step (median)' if c['statistic'] == 'best' else 's/step (best)':<24}" + "".join(
            f"{v.median_s_per_step if c['statistic'] == 'best' else v.best_s_per_step:>12.3f}" for _, v in cols),
        f"{'images/s':<24}" + "".join(f"{v.images_per_s:>12.3f}" for _, v in cols),
        f"{'images/s per core':<24}" + "".join(f"{v.images_per_s / r.physical_cores:>12.4f}" for _, v in cols),
        f"{'peak RSS (MB)':<24}" + "".join(
            f"{v.peak_rss_mb:>12.0f}" if v.peak_rss_mb else f"{'-':>12}" for _, v in cols),
        f"{'  during steps (MB)':<24}" + "".join(
            f"{v.steps_peak_rss_mb:>12.0f}" if v.steps_peak_rss_mb else f"{'-':>12}" for _, v in cols),
    ]
    for phase in r.optimized.phases:
        lines.append(f"{'  ' + phase + ' (s)':<24}" + "".join(f"{v.phases[phase]:>12.3f}" for _, v in cols))
    t = c["targets"]
    if r.speedup is not None:
        lines.append(f"speedup: {r.speedup:.2f}x (target >= {t['speedup_min']})")
    lines.append(
        f"model compute alone: {r.model_compute_s_per_step:.3f} s/step; optimized step / compute = "
        f"{r.overhead_ratio:.3f} (target <= {t['overhead_max']})"
    )
    if r.rss_ratio is not None:
        steps = f"; during the steps alone {r.steps_rss_ratio:.2f}" if r.steps_rss_ratio else ""
        lines.append(f"peak RSS optimized / baseline: {r.rss_ratio:.2f}{steps} (target <= {t['rss_ratio_max']})")
    lines.append(
        f"FLOPs: {r.model_gflop_per_step:.1f} GFLOP per step; achieved {r.achieved_gflops:.1f} GFLOP/s "
        f"= {100 * r.achieved_gflops / r.machine_peak_gflops:.0f} % of this machine's "
        f"{r.machine_peak_gflops:.0f} GFLOP/s matmul peak"
    )
    lines.append(
        f"MFU: {100 * r.mfu:.1f} % of {r.physical_cores} cores x {r.core_peak_gflops:.0f} GFLOP/s "
        f"(one core's {c['precision']} matmul peak)"
    )
    if r.ranks_per_node:
        lines.append("ranks per node (xeontune train --nproc-per-node R; images/s of the whole node):")
        lines.append(f"{'  R':<6}{'images/s':>10}{'s/step':>9}{'x example':>11}{'MFU':>8}{'peak MB':>10}")
        for x in r.ranks_per_node:
            vs = f"{x.vs_example:>10.2f}x" if x.vs_example else f"{'-':>11}"
            lines.append(f"{'  ' + str(x.ranks):<6}{x.images_per_s:>10.3f}{x.s_per_step:>9.3f}{vs}"
                         f"{100 * x.mfu:>7.1f}%{x.peak_pss_mb:>10.0f}" + ("  <- auto" if x.auto else ""))
        auto = next((x for x in r.ranks_per_node if x.auto and x.vs_example), None)
        if auto:
            lines.append(f"auto ranks per node: {auto.vs_example:.2f}x the example's images/s "
                         f"(target >= {t['auto_ranks_speedup_min']})")
    return "\n".join(lines)


def _write_json_out(args: argparse.Namespace, text: str) -> None:
    if args.json_out:
        from xeontune.io import atomic_write_text

        atomic_write_text(Path(args.json_out), text + "\n")


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    _check(args)
    quiet_libraries("xeontune.train")  # the trainer's per-step log lines would drown the bench's
    if args.rss_child:
        return rss_child(args)
    if args.baseline_worker:
        return baseline_worker(args)

    def log(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    if args.json_out:  # checked before minutes of benchmarking, not after
        target = Path(args.json_out)
        if target.is_dir():
            raise UserError(f"--json-out {target}: cannot write there (a folder)")
        try:
            with tempfile.TemporaryFile(dir=target.parent):  # where atomic_write_text will write
                pass
        except OSError as exc:
            raise UserError(f"--json-out {target}: cannot write there ({exc.strerror})") from None
    if args.nodes:  # the nodes' ranks choose their allocator; this process only starts them (and sshd)
        from xeontune import scaling

        figures = scaling.sweep(args, resolve_model(args.model, args.models_dir), log)
        text = json.dumps(figures, indent=2)
        _write_json_out(args, text)
        print(text if args.json else scaling.render(figures))
        return 0
    hardware.reexec_with_allocator(["-m", "xeontune.bench", *argv], args.allocator)
    if args.attention:
        from xeontune import attention_bench

        precision = hardware.choose_precision(args.mixed_precision)[0]
        try:
            figures = attention_bench.measure(precision, attention_bench.thread_counts(args.threads, physical_cores()),
                                              args.repeats, log,
                                              lambda precision: machine_peak_gflops(precision, args.matmul_size))
        except RuntimeError as exc:
            raise UserError(str(exc)) from None
        text = json.dumps(figures, indent=2)
        _write_json_out(args, text)
        print(text if args.json else attention_bench.render(figures))
        return 0

    if args.class_images:
        figures = bench_class_images(args, log)
        text = json.dumps(figures, indent=2)
        _write_json_out(args, text)
        print(text if args.json else
              f"class images, {figures['images']} at {figures['resolution']} px, {figures['steps']} steps "
              f"({figures['precision']}): xeontune {figures['xeontune_images_per_s']:.3f} images/s, diffusers' "
              f"pipeline as the example calls it {figures['example_images_per_s']:.3f} images/s: "
              f"{figures['speedup']:.2f}x")
        return 0
    result = run_bench(args, log)
    text = json.dumps(asdict(result), indent=2)
    _write_json_out(args, text)
    print(text if args.json else render_table(result))
    return 0


if __name__ == "__main__":  # as `xeontune bench`, without importing the CLI (which imports this module)
    from xeontune.errors import exit_status

    quiet_libraries()
    sys.exit(exit_status(main))
