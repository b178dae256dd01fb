"""`xeontune run`: from this machine to a learned embedding in one command.

1. a cluster: created (`cluster up`), or the one named with --name when it exists (reused);
2. its data: `cluster up` syncs --data-dir to every node of a remote cluster (a reused one gets
   it synced again); the ranks are pointed at that copy;
3. the job: `xeontune launch`'s own plan, preflight and attached run (``launch.build_plan``,
   ``launch.run_plan``), with the job's --output-dir on the head under ``<work_dir>/runs/<id>``;
4. the outputs: `xeontune fetch` into the local --output-dir (checked before anything is created,
   so a run is never lost to a full destination).

Then a cluster this command created is torn down, unless --keep; a reused one never is. Teardown
also runs when training fails, on Ctrl-C, SIGTERM or SIGHUP (during the job they are first passed
on to the ranks, ``jobs.run_attached``) and when the SSH connection to the head is lost; a second
signal does not interrupt the teardown. The last line says what was deleted, or how to delete it.

On the localhost provider nothing is copied: the ranks write straight into --output-dir.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import posixpath
import signal
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from xeontune.cluster import providers, state
from xeontune.cluster.state import ClusterRecord
from xeontune.errors import UserError


@dataclass
class RunOptions:
    provider: str
    nodes: int = 2
    ppn: str = "1"
    name: str | None = None  # None: a new cluster with a generated name
    keep: bool = False
    dist_backend: str = "auto"
    region: str | None = None
    instance_type: str | None = None
    image: str | None = None
    spot: bool = False
    ssh_cidr: str | None = None
    subnet: str | None = None
    autostop: int | None = None  # minutes idle; None: DEFAULT_AUTOSTOP_MIN where the provider can stop itself
    env: list[str] = field(default_factory=list)  # KEY=VALUE for every rank, as `launch --env`
    train_args: list[str] = field(default_factory=list)


# A safety net for a laptop that goes away mid-run: `run` normally tears down itself. The job and
# `run`'s own SSH sessions keep the head busy, so this only counts once both are gone.
DEFAULT_AUTOSTOP_MIN = 30


def autostop_minutes(opts: RunOptions) -> int:
    provider = providers.get(opts.provider)
    if opts.autostop is not None:
        return opts.autostop
    return DEFAULT_AUTOSTOP_MIN if provider.remote and provider.autostop_action else 0


@dataclass
class TrainPaths:
    """What `run` reads from the train options before it starts anything."""

    output_dir: Path  # on this machine, absolute
    data_dir: str | None
    overwrite: bool


def read_train_paths(train_args: list[str]) -> TrainPaths:
    from xeontune import jobs
    from xeontune.train.options import build_parser

    given = vars(build_parser().parse_known_args(train_args)[0])
    return TrainPaths(output_dir=Path(jobs.train_output_dir(train_args)).expanduser().absolute(),
                      data_dir=given.get("data_dir"), overwrite=bool(given.get("overwrite")))


def _say(text: str) -> None:
    with contextlib.suppress(OSError):  # a hung-up terminal must not stop the teardown
        print(text, flush=True)


@contextlib.contextmanager
def signals_interrupt() -> Iterator[None]:
    """SIGTERM and SIGHUP act as Ctrl-C (KeyboardInterrupt) outside the job; during the job
    ``jobs.run_attached`` has its own handlers, which forward them to the ranks."""
    def interrupt(sig: int, _frame: object) -> None:
        raise KeyboardInterrupt(signal.Signals(sig).name)

    previous = {sig: signal.signal(sig, interrupt) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


@contextlib.contextmanager
def signals_ignored() -> Iterator[None]:
    """For the teardown: a second Ctrl-C must not leave half a cluster billing."""
    sigs = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in sigs}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def new_cluster_name() -> str:
    for _ in range(20):
        name = f"run-{os.urandom(3).hex()}"
        if not state.exists(name):
            return name
    raise UserError("could not pick a free cluster name; pass --name")


def sync_data(record: ClusterRecord, data_dir: str) -> str:
    """Copy --data-dir to every node of a reused remote cluster, where `cluster up` puts it; return that path."""
    from concurrent.futures import ThreadPoolExecutor

    from xeontune.cluster import ssh

    target = remote_data_dir(record, data_dir)
    with ThreadPoolExecutor(max_workers=min(8, len(record.nodes))) as pool:
        for future in [pool.submit(ssh.put_tree, record, node, data_dir, target) for node in record.nodes]:
            future.result()
    return target


def remote_data_dir(record: ClusterRecord, data_dir: str) -> str:
    return posixpath.join(record.work_dir, "data", Path(data_dir).resolve().name)  # as bootstrap.run puts it


def run(opts: RunOptions) -> int:
    from xeontune import fetch, jobs, launch
    from xeontune.cluster import manage

    train_args = list(opts.train_args[1:] if opts.train_args[:1] == ["--"] else opts.train_args)
    provider = providers.get(opts.provider)
    paths = read_train_paths(train_args)
    # Everything the user can get wrong is checked before a cluster costs anything.
    fetch.check_destination(paths.output_dir, paths.overwrite)
    if paths.data_dir and not Path(paths.data_dir).is_dir():
        raise UserError(f"--data-dir {paths.data_dir} is not a directory")
    if opts.nodes < 1:
        raise UserError("-n must be at least 1")
    launch.parse_env(opts.env)  # its errors, before anything is created
    name = state.validate_name(opts.name) if opts.name else new_cluster_name()
    reused = state.exists(name)
    if reused:
        existing = state.load(name)
        if existing.provider != opts.provider:
            raise UserError(f"cluster {name!r} exists on provider {existing.provider}, not {opts.provider}; "
                            "pick another --name")

    created = False
    rc = 1
    try:
        with signals_interrupt():
            if reused:
                record = state.load(name)
                _say(f"[1/4] reusing cluster {name!r} ({record.provider}, {len(record.nodes)} node(s))")
            else:
                _say(f"[1/4] creating cluster {name!r} ({opts.provider}, -n {opts.nodes})")
                spec = manage.spec_from_args(_spec_args(opts, name, paths.data_dir))
                created = True  # from here on, whatever `up` made is torn down
                record, _ = manage.up(spec, opts.provider)
            job_args = list(train_args)
            if provider.remote and paths.data_dir:
                if reused:
                    _say(f"[2/4] syncing {paths.data_dir} to {len(record.nodes)} node(s)")
                    target = sync_data(record, paths.data_dir)
                else:
                    target = remote_data_dir(record, paths.data_dir)
                    _say(f"[2/4] data synced to {target} at bootstrap")
                job_args += ["--data-dir", target]
            else:
                _say("[2/4] the nodes read --data-dir from this disk" if not provider.remote else "[2/4] no --data-dir")
            run_id = jobs.new_job_id()
            if provider.uses_ssh:  # the head writes under its work dir; step 4 copies from there
                job_args += ["--output-dir", posixpath.join(record.work_dir, "runs", run_id)]

            ppn = launch.resolve_ppn(record, opts.ppn, job_args)
            plan = launch.build_plan(record, provider.slots(record, ppn), ppn, opts.dist_backend, job_args,
                                     launch.parse_env(opts.env))
            launch.preflight(record, plan)
            job = jobs.begin(record, plan, job_args, detached=False)
            job.local_output_dir = str(paths.output_dir)
            jobs.save_job(job)
            _say(f"[3/4] training: {plan.world_size} rank(s) on cluster {name!r}")
            rc = launch.run_plan(plan)
            if rc == 255 and jobs.via_pty(plan.argv):
                _say("the SSH connection to the head was lost (ssh exited 255): the job ended with it")
            if rc != 0:
                _say(f"training failed (exit {rc})")
            else:
                _say(f"[4/4] fetching outputs into {paths.output_dir}")
                fetch.print_report(record, fetch.fetch(record, job, paths.output_dir, overwrite=paths.overwrite))
    except UserError as exc:  # said here, so that the teardown's line stays the last one
        with contextlib.suppress(OSError):
            print(f"error: {exc}", file=sys.stderr, flush=True)
        rc = exc.exit_code
    except KeyboardInterrupt as exc:
        _say(f"interrupted ({exc.args[0] if exc.args else 'SIGINT'})")
        rc = 130 if not exc.args else 128 + int(getattr(signal, str(exc.args[0]), signal.SIGINT))
    finally:
        with signals_ignored():
            rc = _finish(name, opts, created, reused, rc)
    return rc


def _spec_args(opts: RunOptions, name: str, data_dir: str | None) -> argparse.Namespace:
    return argparse.Namespace(name=name, nodes=opts.nodes, region=opts.region, instance_type=opts.instance_type,
                              image=opts.image, spot=opts.spot, ssh_cidr=opts.ssh_cidr, subnet=opts.subnet,
                              skip_bootstrap=False, data_dir=data_dir, autostop=autostop_minutes(opts))


def _finish(name: str, opts: RunOptions, created: bool, reused: bool, rc: int) -> int:
    """Tear down what this run created (unless --keep); the last line says what happened."""
    from xeontune.cluster import manage

    if not created:
        if reused:
            _say(f"cluster {name!r} was there before this run and is kept; delete it with: "
                 f"xeontune teardown --name {name}")
        return rc
    if not state.exists(name):  # providers save the record before they create anything; a failed `up` rolls back
        _say(f"nothing of cluster {name!r} is left: nothing to delete")
        return rc
    if opts.keep:
        _say(f"kept cluster {name!r} (--keep); delete it with: xeontune teardown --name {name}")
        return rc
    _say(f"tearing down cluster {name!r} ...")
    try:
        report = manage.teardown(name, opts.provider, opts.region)
    except Exception as exc:  # the one thing that must be said, whatever went wrong
        _say(f"could not tear down cluster {name!r}: {type(exc).__name__}: {exc}; run: xeontune teardown --name {name}")
        return rc or 1
    for item in report.failed:
        _say(f"could not delete {item}")
    if not report.ok:
        _say(f"cluster {name!r} is not fully torn down; run: xeontune teardown --name {name}")
        return rc or 1
    what = ", ".join(report.deleted) if report.deleted else "nothing outside the state dir"
    _say(f"deleted cluster {name!r} ({opts.provider}): {what}")
    return rc


def main(args: argparse.Namespace) -> int:
    opts = RunOptions(
        provider=args.provider, nodes=args.nodes, ppn=str(args.ppn), name=args.name, keep=args.keep,
        dist_backend=args.dist_backend, region=args.region, instance_type=args.instance_type, image=args.image,
        spot=args.spot, ssh_cidr=args.ssh_cidr, subnet=args.subnet, autostop=args.autostop,
        env=list(args.env or []), train_args=list(args.train_args),
    )
    return run(opts)


if __name__ == "__main__":  # pragma: no cover
    sys.exit("use `xeontune run`")
