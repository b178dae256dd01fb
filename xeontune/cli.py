"""The `xeontune` command: a thin shell over the library.

Each subcommand parses its flags, calls one library function, and maps UserError to a one-line
message and exit code 2. Heavy imports (torch, cloud SDKs) happen inside the handlers so that
`xeontune --help` stays fast.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from xeontune import __version__, models
from xeontune.cluster import state
from xeontune.errors import UserError, exit_status
from xeontune.quiet import quiet_libraries

KUBERNETES = "kubernetes"  # not a provider: the cluster is the user's, the engine's manifests are the job

DESCRIPTION = """\
Fine-tune Stable Diffusion (textual inversion or LoRA) on Xeon CPUs, on one machine or a small cluster.

  xeontune model tiny models/tiny          build the embedded tiny pipeline (offline)
  xeontune sample-data data/sample         write the sample concept images
  xeontune train --model ... --data-dir ... --placeholder-token '<cat-toy>' --initializer-token toy
  xeontune train --method lora --model ... --data-dir ... --instance-prompt 'a photo of sks toy'
  xeontune run --provider aws -n 3 -- <train options>   up, train, fetch the results, tear down
  xeontune cluster up --provider local -n 3
  xeontune launch -n 3 -- <train options>
  xeontune teardown
"""


# --- models and data ---------------------------------------------------------------------------


def _cmd_model(args: argparse.Namespace) -> int:
    from xeontune import models

    path = models.build_pipeline(args.kind, args.dir, seed=args.seed)
    print(f"wrote {args.kind} pipeline to {path}" + (f" ({models.NOTES[args.kind]})" if args.kind in models.NOTES else ""))
    return 0


def _cmd_sample_data(args: argparse.Namespace) -> int:
    from xeontune import models

    files = models.write_sample_data(args.dir, count=args.count, size=args.size, seed=args.seed)
    print(f"wrote {len(files)} images to {args.dir}")
    return 0


# --- training, hardware, benchmark -------------------------------------------------------------


def _cmd_train(args: argparse.Namespace) -> int:
    from xeontune.train.__main__ import main as train_main

    return train_main(args.train_args)


def _cmd_doctor(args: argparse.Namespace) -> int:
    from xeontune import doctor

    report = doctor.collect()
    print(doctor.render_json(report) if args.json else doctor.render_table(report))
    return 0


def _cmd_bench(args: argparse.Namespace) -> int:
    from xeontune import bench

    return bench.main(args.bench_args)


# --- clusters ----------------------------------------------------------------------------------


def _cmd_cluster(args: argparse.Namespace) -> int:
    from xeontune.cluster import manage

    return manage.run_cluster_command(args)


def _cmd_launch(args: argparse.Namespace) -> int:
    if args.provider == KUBERNETES:  # the cluster is the user's: no record, the manifests are the job
        from xeontune.job.engines import kubernetes

        return kubernetes.launch_command(args)
    _refuse_kubernetes_flags(args)
    from xeontune.job import start

    return start.launch_command(args)


def _cmd_run(args: argparse.Namespace) -> int:
    if args.provider == KUBERNETES:
        from xeontune.job.engines import kubernetes

        return kubernetes.run_command(args)
    _refuse_kubernetes_flags(args)
    if args.dry_run:
        raise UserError("run --dry-run prints the manifests of --provider kubernetes; for a cluster's command, "
                        "use `xeontune launch --dry-run --name CLUSTER`")
    from xeontune.job import run

    return run.main(args)


def _refuse_kubernetes_flags(args: argparse.Namespace) -> None:
    for dest, value in vars(args).items():
        if dest.startswith("k8s_") and value is not None and dest != "k8s_mount_path":
            flag = "--" + dest[len("k8s_"):].replace("_", "-")
            raise UserError(f"{flag} is an option of --provider kubernetes, not of {args.provider or 'a cluster'}")


def _cmd_fetch(args: argparse.Namespace) -> int:
    from xeontune.job import fetch

    return fetch.fetch_command(args.name, args.output_dir, args.overwrite)


def _cmd_logs(args: argparse.Namespace) -> int:
    from xeontune.job import fetch

    return fetch.logs_command(args.name, args.follow)


def _cmd_teardown(args: argparse.Namespace) -> int:
    from xeontune.cluster import manage

    return manage.teardown_command(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="xeontune", description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--version", action="version", version=f"xeontune {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    p = sub.add_parser("model", help="build an offline Stable Diffusion pipeline with random weights")
    p.add_argument("kind", choices=list(models.KINDS),
                   help="tiny, sd2-tiny, sdxl-tiny, sd3-tiny, flux-tiny: seconds to train; sd15-arch, sd2-arch, sdxl-arch, "
                   "sd35m-arch: real sizes (GBs); flux-arch: Flux.1-dev's widths at reduced depth")
    p.add_argument("dir", help="directory to write the pipeline to (save_pretrained layout)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights (default 0)")
    p.set_defaults(func=_cmd_model)

    p = sub.add_parser("sample-data", help="write a deterministic set of concept images",
                       description="Write a deterministic set of toy concept images (PNG) to train on: "
                                   "for trying the tool and for benchmarks, offline.")
    p.add_argument("dir", help="directory to write the images to (created if missing)")
    p.add_argument("--count", type=int, default=6, help="number of images (default 6)")
    p.add_argument("--size", type=int, default=128, help="image side in pixels (default 128)")
    p.add_argument("--seed", type=int, default=0, help="seed of the images (default 0)")
    p.set_defaults(func=_cmd_sample_data)

    p = sub.add_parser(
        "train", help="train a textual-inversion embedding or a LoRA (see `xeontune train --help`)", add_help=False
    )
    p.add_argument("train_args", nargs=argparse.REMAINDER)
    p.set_defaults(func=_cmd_train)

    p = sub.add_parser("doctor", help="report CPU features, precision, accelerators, allocators and MPI")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=_cmd_doctor)

    p = sub.add_parser("bench", help="optimized vs baseline training speed (see `xeontune bench --help`)", add_help=False)
    p.add_argument("bench_args", nargs=argparse.REMAINDER)
    p.set_defaults(func=_cmd_bench)

    _add_cluster_parsers(sub)
    return parser


def _add_cloud_options(p: argparse.ArgumentParser) -> None:
    """Where and what a new cluster is: shared by `cluster up` and `run`. The clouds' common flags,
    then each provider's own (``Provider.options``), which reach only that provider."""
    from xeontune.cluster import providers

    p.add_argument("--region", help="cloud region (aws: e.g. us-east-1; azure: e.g. eastus)")
    p.add_argument("--instance-type", help="aws instance type / azure VM size")
    p.add_argument("--ssh-cidr", help="CIDR allowed to SSH in (default: your public address /32)")
    providers.add_options(p)


def _add_cluster_parsers(sub: argparse._SubParsersAction) -> None:
    from xeontune.cluster import providers  # the registry only: provider modules load on use
    from xeontune.job.engines import kubernetes

    cluster = sub.add_parser("cluster", help="create, inspect and log into clusters")
    csub = cluster.add_subparsers(dest="cluster_command", metavar="ACTION", required=True)

    p = csub.add_parser("up", help="create a cluster and write its hosts and SSH files")
    p.add_argument("--provider", required=True, choices=providers.names())
    p.add_argument("-n", "--nodes", type=int, default=2, help="number of nodes (default 2)")
    p.add_argument("--name", default=state.DEFAULT_CLUSTER, help=f"cluster name (default: {state.DEFAULT_CLUSTER})")
    _add_cloud_options(p)
    p.add_argument("--data-dir", help="training data to sync to every node")
    p.add_argument("--skip-bootstrap", action="store_true", help="stop once the nodes and files exist")
    p.add_argument("--autostop", type=int, metavar="MINUTES", default=0,
                   help="the head stops the cluster by itself after MINUTES without training or SSH sessions "
                   "(local: removed; aws: instances terminated; not on azure) (default 0 = off)")
    p.add_argument("--keep-on-failure", action="store_true",
                   help="if `up` fails, keep what it created (and pays for) to inspect it; default: delete it")
    p.set_defaults(func=_cmd_cluster)

    p = csub.add_parser("status", help="list clusters, their nodes and what they cost")
    p.add_argument("--name", help="only this cluster")
    p.set_defaults(func=_cmd_cluster)

    p = csub.add_parser("ssh", help="open a shell (or run a command) on a node")
    p.add_argument("node", help="node name, e.g. node0")
    p.add_argument("--name", default=state.DEFAULT_CLUSTER, help="cluster name")
    p.add_argument("remote_command", nargs=argparse.REMAINDER, help="-- then a command to run instead of a shell")
    p.set_defaults(func=_cmd_cluster)

    p = sub.add_parser("launch", help="run distributed training on a cluster (or on Kubernetes: --provider kubernetes)")
    p.add_argument("-n", "--num-processes", type=int,
                   help="total ranks (default: every slot, i.e. nodes x --ppn); the global batch is the "
                   "per-rank --train-batch-size x ranks")
    p.add_argument("--ppn", default="1", help="ranks per node, each pinned to its own physical cores: a number, or "
                   "auto (the rule of `xeontune train --nproc-per-node auto`: one rank per 2 cores from 4 cores "
                   "up, as memory allows; docs/performance.md) (default 1)")
    p.add_argument("--name", default=state.DEFAULT_CLUSTER, help="cluster name")
    p.add_argument("--provider", choices=[KUBERNETES],
                   help="kubernetes: no cluster record; an Indexed Job on your kubeconfig's cluster (see below)")
    p.add_argument("--dist-backend", choices=["auto", "gloo", "ccl"], default="auto")
    p.add_argument("--dry-run", action="store_true",
                   help="print the exact command (Slurm: and its batch script; kubernetes: the manifests) and exit")
    p.add_argument("--detach", action="store_true",
                   help="start the job on the head in its own session (it survives this terminal and the SSH "
                   "login) with its log in the cluster's work dir, and return at once; follow it with "
                   "`xeontune logs -f`, copy its outputs with `xeontune fetch`")
    p.add_argument("--env", action="append", metavar="KEY[=VALUE]",
                   help="extra variable for every rank (repeatable); KEY alone takes its value from this environment, "
                   "so that a secret is on no command line (values travel in a 0600 file, never in arguments)")
    kubernetes.add_arguments(p)
    p.add_argument("train_args", nargs=argparse.REMAINDER, help="-- followed by `xeontune train` options")
    p.set_defaults(func=_cmd_launch)

    _add_run_parsers(sub)

    p = sub.add_parser("teardown", help="delete a cluster and everything it created")
    p.add_argument("--name", default=state.DEFAULT_CLUSTER, help="cluster name")
    p.add_argument("--provider", choices=providers.names(),
                   help="needed only when the state file is lost (find leftovers by tag)")
    p.add_argument("--region", help="cloud region, when the state file is lost")
    p.set_defaults(func=_cmd_teardown)


RUN_EPILOG = """\
example (the embedding lands in ./out; the cluster is deleted afterwards):
  xeontune run --provider aws -n 3 -- --model stable-diffusion-v1-5/stable-diffusion-v1-5 \\
      --data-dir ./my-concept --placeholder-token '<my-concept>' --initializer-token toy --output-dir ./out

Everything checkable (the train options, as a rank reads them with --config; --ppn, --env, ccl, a
local --model, --resume-from-checkpoint, the destination) is checked before anything bills.
--data-dir is copied to every node of a cloud cluster and the ranks read that copy; the job runs
detached on the head (a lost connection here loses nothing: run reconnects and follows its log)
and its outputs (learned_embeds*.safetensors or a LoRA's pytorch_lora_weights*.safetensors,
metrics.jsonl, validation images, the pipeline if
saved) are copied into --output-dir, which must not hold another run (train's --overwrite allows
it), or, if it refuses at the end, into a fresh folder beside it. The cluster is torn down when
training ends and its outputs are here, when it fails, and on Ctrl-C, SIGTERM or SIGHUP; it is
kept when the outputs may be only on the head (a failed fetch, a connection that did not come
back), and the last line then says how to fetch and tear down. Exit code: the job's.
"""


def _add_run_parsers(sub: argparse._SubParsersAction) -> None:
    from xeontune.cluster import providers
    from xeontune.job.engines import kubernetes

    p = sub.add_parser("run", help="cluster up, train, fetch the outputs, tear down: one command",
                       description="Bring a cluster up (or reuse the one named with --name), sync the data, "
                       "train on every node with mpirun, copy the outputs into --output-dir, and tear the "
                       "cluster down (unless --keep; a reused cluster is kept).",
                       epilog=RUN_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--provider", required=True, choices=[*providers.names(), KUBERNETES],
                   help="where: a provider's new (or --name's) cluster, or kubernetes (an Indexed Job on your "
                   "kubeconfig's cluster: no cluster up, see docs/kubernetes.md)")
    p.add_argument("-n", "--nodes", type=int, default=2,
                   help="nodes of a new cluster (localhost, slurm, ray, kubernetes: ranks) (default 2)")
    p.add_argument("--dry-run", action="store_true", help="kubernetes: print the manifests and exit")
    p.add_argument("--ppn", default="1", help="ranks per node: a number or auto, as in `xeontune launch` (default 1)")
    p.add_argument("--name", help="use this cluster if it exists (it is then kept), else create it under this "
                   "name (default: a new cluster named run-XXXXXX)")
    p.add_argument("--keep", action="store_true", help="keep the cluster afterwards (the last line says how to delete it)")
    p.add_argument("--dist-backend", choices=["auto", "gloo", "ccl"], default="auto")
    _add_cloud_options(p)
    p.add_argument("--autostop", type=int, metavar="MINUTES",
                   help="the head stops the cluster by itself after this long idle, even if this machine "
                   "goes away (default on aws: 30; 0 = off; see `cluster up --autostop`)")
    p.add_argument("--env", action="append", metavar="KEY[=VALUE]",
                   help="extra variable for every rank (repeatable); KEY alone takes its value from this environment, "
                   "so that a secret is on no command line (values travel in a 0600 file, never in arguments)")
    kubernetes.add_arguments(p)
    p.add_argument("train_args", nargs=argparse.REMAINDER, help="-- followed by `xeontune train` options")
    p.set_defaults(func=_cmd_run)

    p = sub.add_parser("fetch", help="copy a job's outputs from the cluster's head (also while it runs)",
                       description="Copy the last job's learned files (learned_embeds*.safetensors, "
                       "pytorch_lora_weights*.safetensors), metrics.jsonl, "
                       "train_config.json, validation images and saved pipeline from the head by SFTP. Each "
                       "file lands under a temporary name and is renamed when whole.")
    p.add_argument("--name", default=state.DEFAULT_CLUSTER, help="cluster name")
    p.add_argument("--output-dir", help="where to put them (default: the job's --output-dir, on this machine)")
    p.add_argument("--overwrite", action="store_true", help="replace a run already in --output-dir")
    p.set_defaults(func=_cmd_fetch)

    p = sub.add_parser("logs", help="print (or follow) the log of a job started with `launch --detach`")
    p.add_argument("--name", default=state.DEFAULT_CLUSTER, help="cluster name")
    p.add_argument("-f", "--follow", action="store_true",
                   help="keep printing until the job ends, then exit with its exit status")
    p.set_defaults(func=_cmd_logs)


def main(argv: Sequence[str] | None = None) -> int:
    quiet_libraries()
    from_command_line = argv is None
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    if from_command_line and argv[:1] == ["train"]:
        from xeontune.hardware import defer_gc, reexec_with_allocator

        reexec_with_allocator(["-m", "xeontune.cli", *argv])
        defer_gc()  # as a rank's entry point: until the models are loaded
    if argv and argv[0] in ("train", "bench"):
        # These own their (long) flag lists; argparse.REMAINDER would not pass leading --flags through.
        args = argparse.Namespace(func=_cmd_train if argv[0] == "train" else _cmd_bench,
                                  train_args=argv[1:], bench_args=argv[1:])
    else:
        args = parser.parse_args(argv)
    return exit_status(lambda: args.func(args))


if __name__ == "__main__":
    sys.exit(main())
