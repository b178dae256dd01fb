"""The launch spec: what a job is, read once, checked before anything bills (it creates nothing; it
may read the hub's model_index.json to size ranks).

``read_request`` reads the ``--`` training options exactly as a rank will (command line, then
``--config``, then defaults: ``train.options.read_options``, the trainer's own parser) and checks
everything that can be checked on this machine: --ppn, --dist-backend ccl, --env, the --config
file, a local --model path, --data-dir, --resume-from-checkpoint. ``launch_spec`` then adds the
cluster: ranks, --ppn (auto: the trainer's rule, sized with the precision the ranks will use),
where the data and outputs are on the head. The ranks get the merged options as explicit flags
(``rank_args``), so a --config file on this machine needs no copy on the nodes.
"""

from __future__ import annotations

import dataclasses
import os
import posixpath
from dataclasses import dataclass, field
from pathlib import Path

from xeontune import hardware, placement
from xeontune.cluster import providers
from xeontune.cluster.state import ClusterRecord
from xeontune.errors import UserError
from xeontune.train.options import TrainOptions, read_options


@dataclass
class JobRequest:
    """The user's job before a cluster is chosen: options read as a rank reads them, all checked."""

    options: TrainOptions
    given: set[str]  # options set on the command line or in --config (the rest: defaults)
    ppn: str  # "auto" or a positive number
    backend: str  # "gloo" or "ccl": decided here, where the bindings are checked
    env: dict[str, str] = field(default_factory=dict)  # --env KEY=VALUE for every rank

    @property
    def local_output_dir(self) -> Path:
        return Path(self.options.output_dir).expanduser().absolute()


@dataclass
class LaunchSpec:
    """One job on one cluster: everything `launch`, `launch --detach` and `run` start from."""

    request: JobRequest
    cluster: str
    provider: str
    ranks: int
    ppn: int
    data_dir: str | None  # as the ranks read it (a remote copy on a cloud node)
    output_dir: str  # as the ranks write it (relative paths: to mpirun's -wdir)
    rank_args: list[str] = field(default_factory=list)

    @property
    def backend(self) -> str:
        return self.request.backend

    @property
    def env(self) -> dict[str, str]:
        return self.request.env


def strip_dashes(train_args: list[str]) -> list[str]:
    return train_args[1:] if train_args[:1] == ["--"] else list(train_args)


def parse_env(pairs: list[str]) -> dict[str, str]:
    """--env KEY=VALUE, or --env KEY: the value KEY has in this environment (so that a secret such as
    HF_TOKEN need not be on any command line). Errors never show a value."""
    env = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not key or not key.replace("_", "a").isalnum() or key[0].isdigit():
            raise UserError(f"--env takes KEY=VALUE or KEY, got {key!r}{'=...' if sep else ''}")
        if not sep:
            if key not in os.environ:
                raise UserError(f"--env {key} takes its value from this environment, where {key} is not set; "
                                "give KEY=VALUE, or export it")
            value = os.environ[key]
        env[key] = value
    return env


def choose_backend(requested: str) -> str:
    """auto -> ccl when oneCCL's torch bindings import here and match torch, else gloo."""
    if requested == "gloo":
        return "gloo"
    ok, why = hardware.ccl_available()
    if requested == "ccl" and not ok:
        raise UserError(f"--dist-backend ccl needs oneccl_bindings_for_pytorch: {why}; use --dist-backend gloo")
    return "ccl" if ok else "gloo"


def check_ppn(spec: str) -> str:
    spec = str(spec).strip().lower()
    if spec != "auto" and (not spec.isdigit() or int(spec) < 1):
        raise UserError(f"--ppn must be a positive number or auto, got {spec!r}")
    return spec


def looks_local(model: str) -> bool:
    """A --model that names a path on this machine rather than a hub id (``org/name``)."""
    return model.startswith(("/", "./", "../", "~")) or model in (".", "..") or os.path.exists(model)


def read_request(train_args: list[str], ppn: str = "1", backend: str = "auto", env: list[str] | None = None,
                 remote: bool = False, fresh_cluster: bool = False) -> JobRequest:
    """Read and check a job's options (module docstring). ``remote``: the ranks run on other
    machines (a local --model must then be synced by the user: refused here); ``fresh_cluster``:
    `run` on a cluster it creates, where no checkpoint can exist yet."""
    env_vars = parse_env(list(env or []))
    ppn = check_ppn(ppn)
    args = strip_dashes(list(train_args))
    options, given = read_options(args)
    model = str(options.model)
    if looks_local(model) and not remote and not Path(model).expanduser().is_dir():
        raise UserError(f"--model {model} is not a directory (a local pipeline folder, or a hub id like org/name)")
    if looks_local(model) and remote and fresh_cluster:
        raise UserError(f"--model {model} is a path, which the new cluster's nodes do not have; "
                        "use a hub id (org/name), or a cluster whose nodes hold it (`launch`)")
    if options.data_dir and not remote and not Path(options.data_dir).expanduser().is_dir():
        raise UserError(f"--data-dir {options.data_dir} is not a directory")
    if options.resume_from_checkpoint and fresh_cluster:
        raise UserError("--resume-from-checkpoint: a new cluster holds no checkpoint; resume on the cluster that "
                        "wrote it (`xeontune run --name <it>` or `xeontune launch`)")
    if "dist_backend" in given:  # given after --: the launch's backend, checked here like launch's own flag
        if backend not in ("auto", options.dist_backend):
            raise UserError(f"--dist-backend {backend} and, after --, --dist-backend {options.dist_backend}: "
                            "give one")
        backend = options.dist_backend
    return JobRequest(options=options, given=given, ppn=ppn, backend=choose_backend(backend), env=env_vars)


def rank_args(options: TrainOptions, given: set[str]) -> list[str]:
    """The merged options a rank gets: every option the user set (command line or --config), as flags."""
    out: list[str] = []
    for f in dataclasses.fields(TrainOptions):
        if f.name not in given or f.name == "config":
            continue
        value = getattr(options, f.name)
        flag = "--" + f.name.replace("_", "-")
        if isinstance(value, bool):
            out.append(flag if value else "--no-" + f.name.replace("_", "-"))
        elif isinstance(value, list):  # a repeatable option (--validation-prompt): the flag once per value
            for item in value:
                out += [flag, str(item)]
        elif value is not None:
            out += [flag, str(value)]
    return out


def ranks_precision(options: TrainOptions, remote: bool) -> str:
    """The precision the ranks will train in, by the trainer's rule (``hardware.choose_precision``).
    ``remote``: the nodes are other machines (a cloud's, a Slurm partition's, whose CPU need not be the
    login node's), whose CPU is not known here: auto is sized as the larger, fp32."""
    if remote:
        return "bf16" if options.mixed_precision == "bf16" else "fp32"
    return hardware.choose_precision(options.mixed_precision)[0]


def resolve_ppn(record: ClusterRecord, request: JobRequest) -> int:
    """--ppn as a number: given, or `auto` by the rule `xeontune train --nproc-per-node auto` uses
    (placement.auto_ranks) applied to one node: its physical cores, and its memory where known."""
    if request.ppn != "auto":
        return int(request.ppn)
    from xeontune.train.ranks import rank_memory

    options = request.options
    provider = providers.get(record.provider)
    here = not provider.remote and not record.cores_per_node  # the ranks run on this machine's CPU
    precision = ranks_precision(options, remote=not here)
    if here:
        cores = len(placement.physical_cores())
        hosts = len(record.nodes) if provider.hosts_share_cores else 1  # namespaces share this machine
        cores, memory = max(cores // hosts, 1), placement.available_memory_bytes() // hosts
    else:
        # a node's hyperthreads are vCPUs: the provider records physical cores, and RAM where the API
        # (or Slurm's sinfo) says
        cores, memory = record.cores_per_node or 1, record.memory_per_node or 0
    # SDXL's second text encoder, activations, checkpointing; packing as auto decides on this CPU where the
    # nodes are this machine (namespaces, localhost), counted where they are not (clouds, Slurm's nodes)
    per_rank = rank_memory(options, precision, here=here)
    unknown = 2**62  # no memory recorded (localhost, or a record from before it was): cores decide
    return placement.auto_ranks(cores, 1, memory or unknown, per_rank).ranks


def launch_spec(record: ClusterRecord, request: JobRequest, num_processes: int | None = None,
                data_dir: str | None = None, output_dir: str | None = None,
                class_data_dir: str | None = None) -> LaunchSpec:
    """The job on ``record``: ``data_dir`` / ``output_dir`` / ``class_data_dir`` replace the options'
    (where `run` put the data on the nodes, and where the head writes its outputs)."""
    provider = providers.get(record.provider)
    ppn = resolve_ppn(record, request)
    ranks = provider.slots(record, ppn) if num_processes is None else num_processes
    if request.options.fused_backward_pass and ranks > 1:
        raise UserError(f"--fused-backward-pass runs in one process, not {ranks} ranks (across ranks --shard saves memory)")
    options = dataclasses.replace(request.options)
    given = set(request.given)
    for name, value in (("data_dir", data_dir), ("output_dir", output_dir), ("class_data_dir", class_data_dir)):
        if value is not None:
            setattr(options, name, value)
            given.add(name)
    return LaunchSpec(request=request, cluster=record.name, provider=record.provider, ranks=ranks, ppn=ppn,
                      data_dir=options.data_dir, output_dir=options.output_dir,
                      rank_args=rank_args(options, given))


def head_output_dir(spec: LaunchSpec, wdir: str) -> str:
    return posixpath.normpath(posixpath.join(wdir or os.getcwd(), spec.output_dir))
