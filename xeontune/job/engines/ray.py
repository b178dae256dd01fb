"""The ray engine: the ranks as Ray Train workers (``TorchTrainer``, CPU, gloo) on an existing Ray cluster.

``plan`` gives the job's one command, a driver that runs on this machine (attached, or under the
detached runner like mpirun): ``python -m xeontune.job.engines.ray --address A ... -- <rank args>``.
The driver (``main``) connects with ``ray.init``, refuses in one line what cannot work (too few CPUs;
a node that does not see the storage path, --output-dir or the data: Ray's nodes must share this
machine's filesystem, as Slurm's do), then runs ``TorchTrainer`` with one worker per rank
(``ScalingConfig(num_workers=N, use_gpu=False, resources_per_worker={"CPU": c})``), its outputs under
the run's storage path in the job's dir, and ``FailureConfig(max_failures=K)``.

Each worker runs the real trainer as a child process, ``python -m xeontune.train <rank args>``, rather
than training inside the worker:

- it is the program every other engine starts, with the same rank environment (``every_rank_env``),
  its own process group and its own signal handling (Ctrl-C and SIGTERM stop a rank through its main
  thread; Ray runs the train function in a thread of a long-lived actor, where they cannot);
- threads: Ray sets ``OMP_NUM_THREADS`` to the worker's CPUs (1 when none are given) and the worker
  has imported torch under it. The child starts with ``OMP_NUM_THREADS`` = the worker's CPUs before
  torch sizes its thread pool;
- rank 0's worker picks a free port on its node for the ranks' own rendezvous (not Ray's store port)
  and the resume arguments, and shares both through the process group Ray has already initialised;
- a child is started with the parent-death signal set (SIGTERM, the trainer's Ctrl-C path), so a
  worker that dies takes its rank along; a child that exits non-zero makes its worker raise, and Ray
  restarts the whole group (``FailureConfig``). A restarted group's ranks resume from the newest
  complete checkpoint this job wrote (none yet: the same run again, with --overwrite where this job
  wrote its config), as a requeued Slurm job does, so the result equals a straight run's;
- a one-line user error (exit 2 on any rank) is not retried: the workers agree on their children's
  exit codes, and only a crash or a kill raises.

Each rank's output goes to ``<job dir>/ranks/rank-K.log`` (on the shared filesystem); the driver prints
those lines prefixed ``[K] ``, as mpirun's ``-prepend-rank`` does. The driver exits 0 only when every
rank's trainer did; SIGINT, SIGTERM or SIGHUP to it (Ctrl-C, or `teardown`, which SIGINTs a detached
job's runner) abort the run through Ray Train's controller, as Ray's own Ctrl-C does (``Stop``): the
workers are killed, their children get their parent-death signal, and nothing of the run is left on
the cluster; the driver then exits 128 + the signal. A second signal ends the driver at once (Ray kills
the actors a driver owned).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import secrets
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from xeontune.cluster.providers import ray as ray_provider
from xeontune.errors import UserError
from xeontune.io import atomic_write_text
from xeontune.job.engines import Engine, Plan
from xeontune.job.engines.env import LOCAL_PATH_ENV, PASSTHROUGH_ENV, every_rank_env, rank_pythonpath
from xeontune.job.spec import head_output_dir, looks_local
from xeontune.train.outputs import CHECKPOINT_COMPLETE, CHECKPOINT_RE, RUN_CONFIG

if TYPE_CHECKING:
    from xeontune.cluster.state import ClusterRecord
    from xeontune.job.record import JobInfo
    from xeontune.job.spec import LaunchSpec

GROUP_START_TIMEOUT_S = 600
LOOK_TIMEOUT_S = 120  # for the check task on each node (a new Ray worker process: python and xeontune start)
MAX_FAILURES = 3  # group restarts before the run fails (each resumes from the newest checkpoint)
USER_ERROR = 2  # a rank's exit status for a UserError (xeontune.errors): the same again on a restart
STARTED = "started"  # in the job's dir: written once before the first attempt; newer checkpoints are this job's
ATTEMPTS = "attempts"  # in the job's dir: one line per start of the worker group
RESULT = "result"  # in the job's dir: the ranks' agreed exit status, written by rank 0's worker
RANKS_DIR = "ranks"  # in the job's dir: rank-K.log, each rank's output over every attempt
STORAGE_DIR = "ray"  # in the job's dir: the run's storage path (RunConfig.storage_path)
# Sets the parent-death signal, checks the parent is still there, then becomes the trainer (the setting
# survives exec). argv: parent pid, then the command.
PDEATHSIG_EXEC = ("import ctypes, os, signal, sys\n"
                  "ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM))  # PR_SET_PDEATHSIG\n"
                  "if os.getppid() != int(sys.argv[1]):\n"
                  "    sys.exit(143)\n"
                  "os.execv(sys.argv[2], sys.argv[2:])\n")


class RayEngine(Engine):
    name = "ray"
    scheduled = False

    def plan(self, record: ClusterRecord, spec: LaunchSpec, job: JobInfo) -> Plan:
        address = ray_provider.address_of(record)
        cpus = ray_provider.layout(record, spec.ranks, spec.ppn)
        env = {**every_rank_env(spec.backend), "OMP_NUM_THREADS": str(cpus)}
        if pythonpath := rank_pythonpath():  # xeontune from a checkout, not installed in the venv
            env["PYTHONPATH"] = pythonpath
        for key in (*PASSTHROUGH_ENV, *LOCAL_PATH_ENV, "XEONTUNE_CACHE"):
            if key in os.environ:
                env[key] = os.environ[key]
        wdir = os.getcwd()  # as mpirun's -wdir: a relative --output-dir is relative to where the job started
        options = spec.request.options
        # what every node must see: read (the data, a local model) or written (the outputs, the storage path)
        reads = [p for p in (spec.data_dir, options.class_data_dir if options.class_data_dir and
                             Path(options.class_data_dir).is_dir() else None,
                             str(options.model) if looks_local(str(options.model)) else None) if p]
        argv = [sys.executable, "-m", "xeontune.job.engines.ray", "--address", address, "--workers", str(spec.ranks),
                "--cpus-per-worker", str(cpus), "--max-failures", str(MAX_FAILURES), "--job-dir", job.job_dir,
                "--output-dir", head_output_dir(spec, wdir), "--wdir", wdir]
        for path in reads:
            argv += ["--reads", os.path.abspath(os.path.join(wdir, os.path.expanduser(path)))]
        for key, value in env.items():
            argv += ["--rank-env", f"{key}={value}"]
        if spec.env:  # --env values wait in a 0600 file (the job wing writes it), never in argv
            argv += ["--env-file", os.path.join(job.job_dir, "env")]
        argv += ["--", *spec.rank_args]
        return Plan(argv=argv, world_size=spec.ranks, backend=spec.backend, env=env, program=sys.executable,
                    inner=argv, wdir=wdir)

    def preflight(self, record: ClusterRecord, plan: Plan) -> None:
        ray_provider.import_ray()
        ray_provider.address_of(record)


ENGINE = RayEngine()


# --- in every worker -----------------------------------------------------------------------------


def newest_checkpoint(output_dir: str, since_ns: int) -> tuple[str, int] | None:
    """The newest complete checkpoint-N in ``output_dir`` written after ``since_ns`` (this job's), as
    (path, step)."""
    best: tuple[str, int] | None = None
    with contextlib.suppress(OSError):
        for entry in os.scandir(output_dir):
            match = CHECKPOINT_RE.match(entry.name)
            if not match or not entry.is_dir() or not os.path.isfile(os.path.join(entry.path, CHECKPOINT_COMPLETE)):
                continue
            if entry.stat().st_mtime_ns > since_ns and (best is None or int(match[1]) > best[1]):
                best = (entry.path, int(match[1]))
    return best


def resume_args(output_dir: str, started: str, rank_args: list[str]) -> tuple[list[str], str]:
    """What a (re)started group's ranks add to their arguments, and the line that says so. A restart
    resumes from the newest complete checkpoint this job wrote; one before its first checkpoint starts
    over (--overwrite), but only where this job wrote the run and no checkpoint was named."""
    since = os.stat(started).st_mtime_ns
    found = newest_checkpoint(output_dir, since)
    if found:
        return ["--resume-from-checkpoint", found[0]], f"resuming from {os.path.basename(found[0])}"
    explicit = any(a == "--resume-from-checkpoint" or a.startswith("--resume-from-checkpoint=") for a in rank_args)
    config = os.path.join(output_dir, RUN_CONFIG)
    if not explicit and os.path.isfile(config) and os.stat(config).st_mtime_ns > since:
        return ["--overwrite"], "no checkpoint yet: starting over"
    return [], "starting as first given"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


def iface_of(ip: str) -> str | None:
    """The network interface that holds ``ip`` (gloo's GLOO_SOCKET_IFNAME), if one here does."""
    import psutil

    for name, addrs in psutil.net_if_addrs().items():
        if any(a.address == ip for a in addrs):
            return name
    return None


def train_loop_per_worker(config: dict[str, Any]) -> None:
    """One rank: agree on the rendezvous and resume arguments, run the trainer as a child, agree on the
    exit codes. Raises (Ray then restarts the group) when a rank crashed or was killed."""
    import ray
    import torch.distributed as dist

    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    job_dir = config["job_dir"]
    rank_args = list(config["rank_args"])
    shared: list[Any] = [None, None, None]
    if rank == 0:
        extra, how = resume_args(config["output_dir"], os.path.join(job_dir, STARTED), rank_args)
        with open(os.path.join(job_dir, ATTEMPTS), "a") as f:
            f.write(f"{time.time():.0f}\n")
        attempt = len(Path(job_dir, ATTEMPTS).read_text().splitlines())
        if attempt > 1:
            with open(os.path.join(job_dir, RANKS_DIR, "rank-0.log"), "a") as log:
                log.write(f"xeontune: Ray restarted the worker group (start {attempt} of at most "
                          f"{config['max_failures'] + 1}): {how}\n")
        shared = [ray.util.get_node_ip_address(), free_port(), extra]
    dist.broadcast_object_list(shared, src=0)
    master, port, extra = shared
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHELASTIC_")}
    env.update(config["env"])
    env.update(read_env_file(config["env_file"]))  # --env last: it overrides the rank environment
    env.update({"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(ctx.get_local_rank()),
                "LOCAL_WORLD_SIZE": str(ctx.get_local_world_size()), "NODE_RANK": str(ctx.get_node_rank()),
                "MASTER_ADDR": str(master), "MASTER_PORT": str(port)})
    if "GLOO_SOCKET_IFNAME" not in config["env"]:
        iface = iface_of(ray.util.get_node_ip_address())
        if iface:
            env["GLOO_SOCKET_IFNAME"] = iface
        else:
            env.pop("GLOO_SOCKET_IFNAME", None)
    python = sys.executable
    command = [python, "-c", PDEATHSIG_EXEC, str(os.getpid()), python, "-m", "xeontune.train", *rank_args, *extra]
    with open(os.path.join(job_dir, RANKS_DIR, f"rank-{rank}.log"), "ab") as log:
        proc = subprocess.Popen(command, cwd=config["wdir"], env=env, stdin=subprocess.DEVNULL, stdout=log,
                                stderr=subprocess.STDOUT)
        rc = proc.wait()
        if rc < 0:  # a rank killed by a signal says nothing itself
            log.write(f"xeontune: rank {rank}'s trainer was killed ({signal.Signals(-rc).name})\n".encode())
    codes: list[Any] = [None] * world
    dist.all_gather_object(codes, rc)
    agreed = job_status(codes)
    if agreed is None:
        raise RuntimeError(f"rank {rank}'s trainer exited with status {rc} (ranks' statuses: {codes})")
    if rank == 0:
        atomic_write_text(Path(job_dir, RESULT), f"{agreed}\n")


def job_status(codes: list[int]) -> int | None:
    """The job's exit status from every rank's: 0 when all trained; a user error (exit 2 on a rank: the
    others then stop as their peer left) is the job's, not retried; None (Ray restarts the group) for
    anything else: a rank killed, crashed, or stopped by a signal."""
    if all(c == 0 for c in codes):
        return 0
    return USER_ERROR if USER_ERROR in codes else None


def look(marks: dict[str, str], reads: list[str]) -> str | None:
    """On one node: the first path it does not see as the driver wrote it, or None."""
    for path, token in marks.items():
        try:
            if Path(path).read_text() != token:
                return path
        except OSError:
            return path
    for path in reads:
        if not os.path.exists(path):
            return path
    return None


def unshared(seen: dict[str, str | None], what: dict[str, str]) -> str | None:
    """The one-line error for the first node (id -> what it did not see, or None) that misses a path."""
    for node, missing in seen.items():
        if missing is not None:
            return (f"the Ray node {node} does not see {missing} ({what.get(missing, 'a path of the job')}): with "
                    "--provider ray every node must share this machine's filesystem (NFS, or one machine) for the "
                    "storage path, --output-dir, --data-dir and a local --model")
    return None


# --- the driver: `python -m xeontune.job.engines.ray` ----------------------------------------------


class RankLogs:
    """Prints each rank's new whole lines as ``[K] line`` (mpirun's -prepend-rank), from its log file."""

    def __init__(self, folder: Path, world: int) -> None:
        self.paths = [folder / f"rank-{k}.log" for k in range(world)]
        self.offsets = [0] * world
        self.partial = [b""] * world

    def pump(self, final: bool = False) -> None:
        for k, path in enumerate(self.paths):
            try:
                with open(path, "rb") as f:
                    f.seek(self.offsets[k])
                    data = f.read()
            except OSError:
                continue
            self.offsets[k] += len(data)
            data = self.partial[k] + data
            lines = data.split(b"\n")
            self.partial[k] = b"" if final else lines.pop()
            for line in lines:
                if line or not final:
                    sys.stdout.write(f"[{k}] {line.decode(errors='replace')}\n")
        sys.stdout.flush()

    def follow(self, done: threading.Event) -> None:
        while not done.wait(0.2):
            self.pump()
        self.pump(final=True)


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m xeontune.job.engines.ray",
                                description="xeontune's Ray driver: one TorchTrainer run of `python -m xeontune.train`")
    p.add_argument("--address", required=True)
    p.add_argument("--workers", type=int, required=True)
    p.add_argument("--cpus-per-worker", type=int, default=1)
    p.add_argument("--max-failures", type=int, default=MAX_FAILURES)
    p.add_argument("--job-dir", required=True)
    p.add_argument("--output-dir", required=True)
    p.add_argument("--wdir", default=os.getcwd())
    p.add_argument("--reads", action="append", default=[], help="a path every node must see")
    p.add_argument("--rank-env", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--env-file", help="--env values (KEY=quoted value lines), read by every rank's worker at each "
                   "start, deleted once the run is over")
    p.add_argument("rank_args", nargs=argparse.REMAINDER)
    args = p.parse_args(argv)
    args.rank_args = args.rank_args[1:] if args.rank_args[:1] == ["--"] else args.rank_args
    return args


def read_env_file(path: str | None) -> dict[str, str]:
    """The job wing's --env file (``KEY=<shell-quoted value>`` lines, ``write_secret_env``; 0600 on the
    shared filesystem).
    Each worker reads it at each start of the group, so that the values never travel in Ray's config
    (which Ray may keep or show); the driver deletes it once the run is over, as Slurm's script does."""
    if not path or not os.path.isfile(path):
        return {}
    # The whole file at once, as sh sources it (mpirun's and srun's ranks do): a quoted value may span
    # lines (a PEM key), so splitting into lines first would cut it; newline="" keeps a value's \r.
    with open(path, encoding="utf-8", newline="") as f:
        text = f.read()
    env = {}
    for word in shlex.split(text):
        key, _, value = word.partition("=")
        env[key] = value
    return env


def check_capacity(ray: Any, workers: int, cpus: int, address: str) -> list[str]:
    """The alive nodes that can host a worker (ids); UserError when the workers do not fit."""
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    hosts = [n["NodeID"] for n in nodes if n["Resources"].get("CPU", 0) >= cpus]
    fits = sum(int(n["Resources"].get("CPU", 0) // cpus) for n in nodes)
    if workers > fits:
        raise UserError(f"the Ray cluster at {address} has room for {fits} worker(s) of {cpus} CPU(s), not "
                        f"{workers} ({len(nodes)} alive node(s)); bring nodes up, or launch fewer ranks")
    return hosts


def check_shared(ray: Any, hosts: list[str], storage: Path, output_dir: Path, reads: list[str],
                 engine: Any) -> None:
    """Every node that may host a worker sees what this one wrote into the storage path and --output-dir,
    and the paths the ranks read; else one UserError line."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    token = secrets.token_hex(8)
    marks: dict[str, str] = {}
    what = {str(storage): "the run's storage path", str(output_dir): "--output-dir"}
    made = [] if output_dir.exists() else [output_dir]  # removed again when the check refuses
    for folder in (storage, output_dir):
        folder.mkdir(parents=True, exist_ok=True)
        mark = folder / f".xeontune-shared-{token}"
        mark.write_text(token)
        marks[str(mark)] = token
        what[str(mark)] = what[str(folder)]
    what.update({p: "a path the ranks read" for p in reads})
    remote_look = ray.remote(num_cpus=0)(engine.look)
    passed = False
    try:
        refs = {node: remote_look.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False))
                .remote(marks, reads) for node in hosts}
        seen = {}
        for node, ref in refs.items():
            try:
                seen[node] = ray.get(ref, timeout=LOOK_TIMEOUT_S)
            except Exception as exc:  # xeontune not importable there, the node gone, no worker in time
                last = (str(exc).strip().splitlines() or [type(exc).__name__])[-1][:200]
                raise UserError(f"the Ray node {node} could not run xeontune's check ({last}): every node needs "
                                "this machine's venv (xeontune importable) and filesystem") from None
        if (error := unshared(seen, what)) is not None:
            raise UserError(error)
        passed = True
    finally:
        for mark in marks:
            with contextlib.suppress(OSError):
                os.remove(mark)
        for folder in [] if passed else made:  # the job does not start: no empty --output-dir left behind
            with contextlib.suppress(OSError):
                folder.rmdir()


@dataclass
class Stop:
    """The driver's signals: the first aborts the run through Ray Train's controller (as Ray's own Ctrl-C
    does: its workers, then their ranks, stop, and the controller stops the placement-group cleaner it
    started, which a driver that just died would leave polling behind); a second one ends the driver."""

    sig: int = 0
    controller: Any = None

    def on_signal(self, sig: int, _frame: object) -> None:
        if self.sig:
            os._exit(128 + self.sig)  # Ray kills the actors this driver owns once it is gone
        self.sig = sig
        if self.controller is None:  # before the run started: nothing of it on the cluster yet
            raise KeyboardInterrupt(signal.Signals(sig).name)
        sys.stdout.write(f"xeontune: {signal.Signals(sig).name}: stopping the Ray Train run (its workers and "
                         "their ranks)\n")
        sys.stdout.flush()
        self.controller.abort.remote()

    def install(self) -> None:
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, self.on_signal)


def trainer_class(stop: Stop) -> Any:
    """TorchTrainer that hands its controller to ``stop`` instead of registering Ray's SIGINT handler
    (which covers neither SIGTERM nor SIGHUP and exits 0 on a third Ctrl-C)."""
    from ray.train.torch import TorchTrainer

    class Trainer(TorchTrainer):
        def _register_sigint_handler(self, controller: Any) -> None:
            stop.controller = controller
            stop.install()

    return Trainer


def main(argv: list[str] | None = None) -> int:
    args = _parse(list(sys.argv[1:] if argv is None else argv))
    stop = Stop()
    stop.install()
    try:
        return drive(args, stop)
    except UserError as exc:
        sys.stderr.write(f"error: {exc}\n")
        return exc.exit_code
    except KeyboardInterrupt:
        sys.stdout.write(f"xeontune: {signal.Signals(stop.sig or signal.SIGINT).name} before the Ray Train run "
                         "started: stopped\n")
        return 128 + (stop.sig or signal.SIGINT)


def drive(args: argparse.Namespace, stop: Stop) -> int:
    ray = ray_provider.import_ray()
    # the functions Ray runs on the nodes must be this module's, not __main__'s (which no worker can import)
    engine = importlib.import_module("xeontune.job.engines.ray")
    job_dir = Path(args.job_dir)
    (job_dir / RANKS_DIR).mkdir(parents=True, exist_ok=True)
    env = dict(kv.partition("=")[::2] for kv in args.rank_env)
    runtime_env = {"env_vars": {"PYTHONPATH": env["PYTHONPATH"]}} if env.get("PYTHONPATH") else None
    ray_provider.check_reachable(args.address)  # a cluster gone since `up`: one line, not minutes of retries
    try:
        ray.init(address=args.address, log_to_driver=False, logging_level="WARNING", runtime_env=runtime_env)
    except Exception as exc:
        raise UserError(f"cannot reach the Ray cluster at {args.address}: {' '.join(str(exc).split())[:300]}") from None
    hosts = check_capacity(ray, args.workers, args.cpus_per_worker, args.address)
    storage = job_dir / STORAGE_DIR
    check_shared(ray, hosts, storage, Path(args.output_dir), list(args.reads), engine)
    for name in (ATTEMPTS, RESULT):
        with contextlib.suppress(FileNotFoundError):
            (job_dir / name).unlink()
    atomic_write_text(job_dir / STARTED, f"{time.time():.0f}\n")
    # a loaded cluster may take longer than Ray's 60 s to start the workers (each imports torch); the
    # controller reads this from the driver's environment
    os.environ.setdefault("RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S", str(GROUP_START_TIMEOUT_S))

    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig

    trainer = trainer_class(stop)(
        engine.train_loop_per_worker,
        train_loop_config={"job_dir": str(job_dir), "output_dir": args.output_dir, "wdir": args.wdir, "env": env,
                           "env_file": args.env_file,
                           "rank_args": list(args.rank_args), "max_failures": args.max_failures},
        scaling_config=ScalingConfig(num_workers=args.workers, use_gpu=False,
                                     resources_per_worker={"CPU": args.cpus_per_worker}),
        run_config=RunConfig(name=f"xeontune-{job_dir.name}", storage_path=str(storage),
                             failure_config=FailureConfig(max_failures=args.max_failures)),
        torch_config=TorchConfig(backend="gloo"),
    )
    print(f"xeontune: Ray Train run of {args.workers} worker(s), {args.cpus_per_worker} CPU(s) each, on the Ray "
          f"cluster at {args.address} (restarts: up to {args.max_failures})", flush=True)
    logs = RankLogs(job_dir / RANKS_DIR, args.workers)
    done = threading.Event()
    follower = threading.Thread(target=logs.follow, args=(done,), daemon=True)
    follower.start()
    error: BaseException | None = None
    try:
        trainer.fit()  # in the main thread: the controller reaches ``stop`` (trainer_class)
    except Exception as exc:  # TrainingFailedError once the restarts are spent; RayActorError after an abort
        error = exc
    finally:
        done.set()
        follower.join()
        if args.env_file:  # over for good: the --env values go
            with contextlib.suppress(FileNotFoundError):
                os.remove(args.env_file)
    if stop.sig:
        print(f"xeontune: the job got {signal.Signals(stop.sig).name}: the Ray Train run was aborted", flush=True)
        return 128 + stop.sig
    result = (job_dir / RESULT).read_text().strip() if (job_dir / RESULT).is_file() else ""
    if error is None and result == "0":
        return 0
    if result == str(USER_ERROR):
        return USER_ERROR  # the rank's own one-line error is above
    words = " ".join(str(error).split())[:300] if error is not None else "no result"
    print(f"xeontune: the Ray Train run failed ({type(error).__name__ if error else 'ended'}): {words}",
          file=sys.stderr, flush=True)
    return 1


if __name__ == "__main__":
    sys.exit(main())
