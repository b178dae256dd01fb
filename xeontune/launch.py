"""`xeontune launch`: one Hydra `mpirun` over SSH that starts `python -m xeontune.train` on every rank.

``build_plan`` is the one place that builds the command; ``--dry-run`` prints exactly what
``run_plan`` executes. Where mpirun runs is the provider's to say (``Provider.wrap_launch`` and
``launcher_args``): on a remote cluster, on the head through ``ssh -F <cluster ssh_config> -tt
node0 ...``; on the local namespace hosts, inside the head's namespace; on localhost, right here
with Hydra's fork launcher.

Every rank gets, with ``-genvnone`` so nothing else leaks in from the caller's shell:
MASTER_ADDR (the head's private address), MASTER_PORT, GLOO_SOCKET_IFNAME (the cluster's
interface), OMP_NUM_THREADS (the cores a rank may use), PATH/HOME as the
node has them, the caller's HF_* offline switches when set, and, only where ranks run on this
machine (a provider that is not ``remote``), its HF_* cache paths and LD_PRELOAD (a path here
means nothing, or something else, on a cloud node), CCL_* for the
ccl backend, launch's backend and step timeout as XEONTUNE_LAUNCH_DIST_* (defaults that the
user's --dist-backend / --dist-timeout override in any spelling or in --config), an empty
CUDA_VISIBLE_DEVICES (ranks train on CPU; a visible GPU trips accelerate's barrier), the cluster's
price as XEONTUNE_COST_PER_HOUR (rank 0's time-and-cost forecast, train/forecast.py), and each
``--env KEY=VALUE`` last, so it overrides any of these. Hydra adds PMI_RANK / PMI_SIZE, which
accelerate reads.
"""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from xeontune import hardware, placement
from xeontune.cluster import files, providers, state
from xeontune.cluster.providers import Provider
from xeontune.cluster.state import ClusterRecord
from xeontune.errors import UserError
from xeontune.train import forecast
from xeontune.train.options import LAUNCH_DEFAULTS_ENV

# The caller's variables that ranks inherit when set: switches, on every provider ...
PASSTHROUGH_ENV = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE")
# ... and paths on this machine, only to ranks that run on it (never to a remote node).
LOCAL_PATH_ENV = ("HF_HOME", "HF_HUB_CACHE", "LD_PRELOAD")
DEFAULT_DIST_TIMEOUT_S = 30
SSH_CHECK_TIMEOUT_S = 15.0
STOP_GRACE_S = 20.0


@dataclass
class LaunchPlan:
    argv: list[str]  # exactly what runs on this machine
    mpirun: str  # mpirun's path on the head
    world_size: int
    backend: str
    env: dict[str, str] = field(default_factory=dict)  # what every rank gets via -genv
    inner: list[str] = field(default_factory=list)  # mpirun's command as the head runs it (argv, unwrapped)
    wdir: str = ""  # mpirun's -wdir: relative train paths (--output-dir) are relative to it


def mpirun_path(record: ClusterRecord, provider: Provider) -> str:
    """mpirun on the head: $XEONTUNE_MPIRUN, else the nodes' venv's (Hydra needs the same path on
    every host), else, where ranks run on this machine, the one ``doctor`` reports."""
    override = os.environ.get("XEONTUNE_MPIRUN")
    if override:
        return override
    if provider.remote:
        return f"{record.venv or sys.prefix}/bin/mpirun"
    return hardware.find_mpirun() or str(Path(sys.prefix) / "bin" / "mpirun")


def python_path(record: ClusterRecord, provider: Provider) -> str:
    return f"{record.venv or sys.prefix}/bin/python" if provider.remote else sys.executable


def choose_backend(requested: str) -> str:
    """auto -> ccl when oneCCL's torch bindings import here and match torch, else gloo."""
    if requested == "gloo":
        return "gloo"
    ok, why = hardware.ccl_available()
    if requested == "ccl" and not ok:
        raise UserError(f"--dist-backend ccl needs oneccl_bindings_for_pytorch: {why}; use --dist-backend gloo")
    return "ccl" if ok else "gloo"


def threads_per_rank(record: ClusterRecord, provider: Provider, world_size: int, ppn: int) -> int | None:
    """Cores a rank may use. Ranks of a provider that is not remote all share this machine's cores;
    on a remote node it is the node's cores (``record.cores_per_node``, set by the provider) over
    ``--ppn``. None when unknown: torch then uses the node's own core count."""
    if "OMP_NUM_THREADS" in os.environ:
        return max(1, int(os.environ["OMP_NUM_THREADS"]))
    if not provider.remote:
        return int(hardware.launch_env(world_size, allocator="none")["OMP_NUM_THREADS"])
    cores = record.cores_per_node or 0
    return max(1, cores // ppn) if cores else None


def resolve_ppn(record: ClusterRecord, spec: str, train_args: list[str]) -> int:
    """--ppn as a number: given, or `auto` by the rule `xeontune train --nproc-per-node auto` uses
    (placement.auto_ranks) applied to one node: its physical cores, and its memory where known."""
    if spec != "auto":
        if not spec.isdigit() or int(spec) < 1:
            raise UserError(f"--ppn must be a positive number or auto, got {spec!r}")
        return int(spec)
    from xeontune import placement
    from xeontune.train.options import TrainOptions, build_parser
    from xeontune.train.ranks import frozen_weight_bytes, packs

    # what sizes a rank, read leniently: the ranks themselves validate the whole command line
    given = vars(build_parser().parse_known_args(_strip_dashes(train_args))[0])
    defaults = TrainOptions()
    model = str(given.get("model") or "")
    resolution = int(given.get("resolution", defaults.resolution))
    batch = int(given.get("train_batch_size", defaults.train_batch_size))
    requested = given.get("mixed_precision", defaults.mixed_precision)
    provider = providers.get(record.provider)
    if not provider.remote:
        cores = len(placement.physical_cores())
        hosts = len(record.nodes) if provider.hosts_share_cores else 1  # namespaces share this machine
        precision = hardware.choose_precision(requested)[0]
        cores, memory = max(cores // hosts, 1), placement.available_memory_bytes() // hosts
    else:
        # a node's hyperthreads are vCPUs: the provider records physical cores, and RAM where the API says
        cores, memory = record.cores_per_node or 1, record.memory_per_node or 0
        precision = "bf16" if requested == "bf16" else "fp32"  # sized for the larger when the node decides
    packed = packs(str(given.get("pack_weights", defaults.pack_weights)))
    per_rank = placement.rank_memory_bytes(frozen_weight_bytes(model, precision, packed), resolution, batch)
    unknown = 2**62  # no memory recorded (localhost, or a record from before it was): cores decide
    return placement.auto_ranks(cores, 1, memory or unknown, per_rank).ranks


def _strip_dashes(train_args: list[str]) -> list[str]:
    return train_args[1:] if train_args and train_args[0] == "--" else list(train_args)


def parse_env(pairs: list[str]) -> dict[str, str]:
    env = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise UserError(f"--env takes KEY=VALUE, got {pair!r}")
        env[key] = value
    return env


def _rank_pythonpath() -> str | None:
    """The source tree, when xeontune runs from a checkout rather than an installed package."""
    pkg_parent = Path(__file__).resolve().parent.parent
    if Path(sys.prefix).resolve() in pkg_parent.parents:
        return None
    return str(pkg_parent)


def build_plan(record: ClusterRecord, num_processes: int, ppn: int, backend: str, train_args: list[str],
               extra_env: dict[str, str] | None = None, workdir: str | None = None,
               module: str = "xeontune.train") -> LaunchPlan:
    """The whole command and environment; no side effects. ``module`` is what each rank runs
    with ``python -m`` (tests launch small probes through the same path)."""
    if num_processes < 1 or ppn < 1:
        raise UserError("-n and --ppn must be at least 1")
    provider = providers.get(record.provider)
    if num_processes > provider.slots(record, ppn):
        raise UserError(f"-n {num_processes} is more ranks than cluster {record.name!r} holds "
                        f"({provider.slots_text(record, ppn)})")
    train_args = _strip_dashes(train_args)
    chosen = choose_backend(backend)
    remote = provider.remote
    iface = provider.iface(record)

    env: dict[str, str] = {
        "MASTER_ADDR": record.head.private_ip,
        "MASTER_PORT": str(files.MASTER_PORT),
        "GLOO_SOCKET_IFNAME": iface,
        # c10d warns on every rank that namespaces share a hostname; real errors still show.
        "TORCH_CPP_LOG_LEVEL": "ERROR",
        # Ranks train on CPU only. A GPU they can see makes accelerate's barrier pick
        # cuda:<local rank> ("invalid device ordinal" on ranks 1..N); --env may still override it.
        "CUDA_VISIBLE_DEVICES": "",
        # No PYTHONUNBUFFERED: unbuffered print() writes text and newline separately, and Hydra's
        # -prepend-rank then glues lines of different ranks together.
    }
    threads = threads_per_rank(record, provider, num_processes, ppn)
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    if not provider.hosts_share_cores:
        # Each rank pins itself to its own slice of its node's physical cores (placement.py). Not
        # for namespace "hosts": they share this machine's cores, and each would pin to the first.
        env[placement.PIN_ENV] = "1"
    if not remote:
        env["PATH"] = os.environ.get("PATH", "/usr/bin:/bin")
        env["HOME"] = os.environ.get("HOME", "/root")
        if "XEONTUNE_CACHE" in os.environ:  # where the bf16 weight copies live (this machine's path)
            env["XEONTUNE_CACHE"] = os.environ["XEONTUNE_CACHE"]
        pythonpath = _rank_pythonpath()
        if pythonpath:
            env["PYTHONPATH"] = pythonpath
    if not remote and "LD_PRELOAD" not in os.environ:
        # tcmalloc (else jemalloc) when this machine has it: 1.2-1.4x faster steps (performance.md).
        # Cloud ranks preload it themselves at start (xeontune.train re-executes with it).
        preload = hardware.launch_env(1).get("LD_PRELOAD")
        if preload:
            env["LD_PRELOAD"] = preload
    for key in PASSTHROUGH_ENV + (() if remote else LOCAL_PATH_ENV):
        if key in os.environ:
            env[key] = os.environ[key]
    if chosen == "ccl":
        env.update({"CCL_ATL_TRANSPORT": "ofi", "CCL_WORKER_COUNT": "1"})
    # Launch's choices reach the ranks as defaults, below --config and the command line: appended
    # flags would override a value given in --config or in another spelling (--dist_timeout).
    env[LAUNCH_DEFAULTS_ENV["dist_backend"]] = chosen
    env[LAUNCH_DEFAULTS_ENV["dist_timeout"]] = str(DEFAULT_DIST_TIMEOUT_S)
    cost = provider.cost_per_hour(record)
    if cost is not None:  # rank 0's forecast turns the time left into money (train/forecast.py)
        env[forecast.COST_ENV] = f"{cost:.4f}"
    env.update(extra_env or {})

    mpirun = mpirun_path(record, provider)
    wdir = workdir or (record.work_dir if remote else os.getcwd())
    argv = [mpirun, "-n", str(num_processes), *provider.launcher_args(record, ppn)]
    argv += ["-iface", iface, "-wdir", wdir, "-prepend-rank", "-genvnone"]
    for key, value in env.items():
        argv += ["-genv", key, value]
    argv += [python_path(record, provider), "-m", module, *train_args]

    if not remote:
        # -genvnone governs only ranks reached over SSH; the head's rank is forked by mpirun and
        # would inherit this shell's whole environment. `env -i` gives it the same clean slate.
        base = [f"{k}={os.environ[k]}" for k in ("PATH", "HOME", "USER", "LOGNAME", "LANG") if k in os.environ]
        argv = ["env", "-i", *base, *argv]
    return LaunchPlan(argv=provider.wrap_launch(record, argv), mpirun=mpirun, world_size=num_processes, backend=chosen,
                      env=env, inner=argv, wdir=wdir)


def preflight(record: ClusterRecord, plan: LaunchPlan) -> None:
    """One-line UserErrors before anything starts: mpirun missing on the head, a node not answering SSH."""
    provider = providers.get(record.provider)
    provider.check_launch(record)
    if not provider.remote and not (os.path.isfile(plan.mpirun) and os.access(plan.mpirun, os.X_OK)):
        raise UserError(f"no mpirun on the head node (looked for {plan.mpirun}); install MPICH's Hydra "
                        "with `pip install mpich` in this venv, or set XEONTUNE_MPIRUN")
    if not provider.uses_ssh:
        return
    from xeontune.cluster import ssh

    with ThreadPoolExecutor(max_workers=min(16, len(record.nodes))) as pool:
        futures = [pool.submit(ssh.wait_for_ssh, record, node, SSH_CHECK_TIMEOUT_S, 0.5) for node in record.nodes]
        for fut in futures:
            fut.result()  # re-raises the UserError that names the node
    if provider.remote:
        rc, _, _ = ssh.run(record, record.head, ["test", "-x", plan.mpirun])
        if rc != 0:
            raise UserError(f"no mpirun on the head node {record.head.name} (looked for {plan.mpirun})")


def run_plan(plan: LaunchPlan) -> int:
    """Run mpirun, stream its (rank-prefixed) output, return the job's exit code.

    Hydra stops every rank when one dies and exits non-zero. SIGINT (Ctrl-C), SIGTERM and SIGHUP
    to this process are passed on so that every rank stops through its own KeyboardInterrupt
    (``jobs.run_attached``: how, and why not simply to the process group); after a grace period,
    or at a second signal, the job is stopped hard.
    """
    from xeontune import jobs

    rc, sig = jobs.run_attached(plan.argv, grace_s=STOP_GRACE_S)
    if sig is not None:
        print(f"interrupted ({signal.Signals(sig).name}): the job was stopped on every rank", file=sys.stderr)
        return 128 + int(sig)  # like a shell's status for a job stopped by that signal
    return rc


def main(args: argparse.Namespace) -> int:
    record = state.load(state.validate_name(args.name))
    ppn = resolve_ppn(record, str(args.ppn), list(args.train_args))
    num_processes = (providers.get(record.provider).slots(record, ppn) if args.num_processes is None
                     else args.num_processes)
    plan = build_plan(record, num_processes, ppn, args.dist_backend, list(args.train_args),
                      parse_env(list(getattr(args, "env", None) or [])))
    if args.dry_run:
        print(shlex.join(plan.argv))
        return 0
    preflight(record, plan)
    from xeontune import jobs

    job = jobs.begin(record, plan, list(args.train_args), detached=bool(getattr(args, "detach", False)))
    if job.detached:
        return jobs.launch_detached(record, plan, job)
    print(f"launching {plan.world_size} rank(s) on cluster {record.name!r} ({record.provider}, "
          f"backend {plan.backend}, OMP_NUM_THREADS={plan.env.get('OMP_NUM_THREADS', 'node default')})", file=sys.stderr, flush=True)
    return run_plan(plan)
