"""`xeontune run`: from this machine to a learned embedding in one command.

1. everything checkable is checked before anything bills (job/spec.py: the training options as a
   rank reads them, --ppn, --dist-backend, --env, --config, a local --model, --data-dir,
   --resume-from-checkpoint; the destination; the --data-dir folder's images, captions and masks with a
   rank's rules, from the images' headers (train/data_check.check_training_data), where the provider says so:
   not on this machine's own clusters, whose ranks start at once);
2. a cluster: created (`cluster up`), or the one named with --name when it exists (reused);
3. its data: `cluster up` syncs --data-dir to every node of a remote cluster (a reused one gets
   it synced again); the ranks are pointed at that copy. A --dataset is first exported here, before
   the cluster, into a folder (train/hf_dataset.py) that then is the --data-dir;
4. the job: job/start.py's one ``start`` (the same as `xeontune launch`), with the job's
   --output-dir on the head under ``<work_dir>/runs/<id>``. Where the head is reached by SSH the
   job runs detached there (``launch --detach``'s runner) and `run` follows its log over SFTP: a
   lost connection loses nothing, it is tried again for ``$XEONTUNE_RECONNECT_S`` (600 s) and the
   log goes on where it stopped; on localhost the job is attached;
5. the outputs: `xeontune fetch` into the local --output-dir (with the job's latest checkpoint);
   if it refuses (it holds another run, it cannot be written), into a fresh folder beside it.
   Whatever the job's end: a job that failed (a rank killed during the final validation, after
   the embedding was written) or was stopped by a signal gets what it wrote fetched all the same,
   before anything is deleted; `run` then exits with the job's status (128 + N for signal N).

Then a cluster this command created is torn down, unless --keep; a reused one never is. Teardown
also runs when training fails, and on Ctrl-C, SIGTERM or SIGHUP during the job (the job is first
stopped on every rank through the runner on the head, or ``process.run_attached`` here; a second
signal stops it hard), each time after that fetch; a signal does not interrupt the teardown. The
cluster is kept, and the last line says how to fetch and tear down, whenever the outputs may
still be only on the head: from the job's start until a fetch brought them here (or found that
the job wrote nothing), so a fetch that failed or was interrupted, a signal just as the job
ended, or a connection to the head that did not come back all keep it. Otherwise the last line
says what was deleted.

On the localhost provider nothing is copied: the ranks write straight into --output-dir.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import posixpath
import signal
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

from xeontune.cluster import manage, providers, state
from xeontune.cluster.manage import interrupt_status, signal_name, signals_interrupt
from xeontune.cluster.state import ClusterRecord
from xeontune.errors import UserError

if TYPE_CHECKING:
    from xeontune.job.fetch import FetchReport
    from xeontune.job.record import JobInfo
    from xeontune.train.options import TrainOptions


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
    ssh_cidr: str | None = None
    autostop: int | None = None  # minutes idle; None: DEFAULT_AUTOSTOP_MIN where the provider can stop itself
    env: list[str] = field(default_factory=list)  # KEY=VALUE for every rank, as `launch --env`
    provider_options: dict[str, str | bool] = field(default_factory=dict)  # the provider's own (Provider.options)
    train_args: list[str] = field(default_factory=list)


# A safety net for a laptop that goes away mid-run: `run` normally tears down itself. The job and
# `run`'s own SSH sessions keep the head busy, so this only counts once both are gone.
DEFAULT_AUTOSTOP_MIN = 30


def autostop_minutes(opts: RunOptions) -> int:
    provider = providers.get(opts.provider)
    if opts.autostop is not None:
        return opts.autostop
    return DEFAULT_AUTOSTOP_MIN if provider.remote and provider.autostop_action else 0


def _say(text: str) -> None:
    with contextlib.suppress(OSError):  # a hung-up terminal must not stop the teardown
        print(text, flush=True)


@contextlib.contextmanager
def teardown_signals(name: str) -> Iterator[None]:
    """For the teardown: a first Ctrl-C (SIGTERM, SIGHUP) does not leave half a cluster billing, it
    says how to abandon the teardown; a second one does (KeyboardInterrupt), and the last line
    then says how to finish it."""
    sigs = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    seen: list[int] = []

    def once_more(sig: int, _frame: object) -> None:
        seen.append(sig)
        if len(seen) == 1:
            _say(f"the teardown of cluster {name!r} goes on (half a cluster would bill on); "
                 f"{signal.Signals(sig).name} again to abandon it")
            return
        raise KeyboardInterrupt(signal.Signals(sig).name)

    previous = {sig: signal.signal(sig, once_more) for sig in sigs}
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
    """Copy --data-dir to every node of a reused remote cluster, where `cluster up` puts it, leaving
    nothing of an older sync (``bootstrap.sync_data``); return that path. A failure or Ctrl-C does
    not wait for the other nodes."""
    from xeontune.cluster import bootstrap, ssh

    return ssh.on_every_node(record.nodes, lambda node: bootstrap.sync_data(record, node, data_dir))[0]


def remote_data_dir(record: ClusterRecord, data_dir: str) -> str:
    from xeontune.cluster import bootstrap

    return bootstrap.data_target(record, data_dir)  # as `cluster up`'s bootstrap put it


def class_data_target(record: ClusterRecord, class_dir: str | None) -> str | None:
    """Prior preservation's --class-data-dir on a remote cluster: a folder here (your own class photos,
    or images an earlier run generated) is copied to every node as --data-dir is; a path that does not
    exist here is left to the nodes, where the ranks generate the class images (relative to the
    cluster's work dir, so a reused cluster finds them)."""
    if not class_dir or not Path(class_dir).expanduser().is_dir():
        return None
    _say(f"[2/4] syncing the class images of {class_dir} to {len(record.nodes)} node(s)")
    return sync_data(record, class_dir)


def read_data_here(options: TrainOptions) -> None:
    """The --data-dir folder checked on this machine with a rank's rules, from the images' headers: its
    mistakes are one-line errors before a cluster exists, and a file that is no image (which a rank
    skips) is a warning here, as every other warning of the CLI is. A file whose header reads but
    whose pixels do not is found by the rank that decodes it (skipped, with a warning in its log)."""
    from xeontune.train.data_check import check_training_data

    logger = logging.getLogger("xeontune.train")
    said = logging.StreamHandler(sys.stderr)
    said.setFormatter(logging.Formatter("warning: %(message)s"))
    said.setLevel(logging.WARNING)
    level = logger.level  # warnings reach the handler whatever an earlier caller set (bench quiets it)
    logger.setLevel(logging.WARNING)
    logger.addHandler(said)
    try:
        check_training_data(options)
    finally:
        logger.removeHandler(said)
        logger.setLevel(level)


def run(opts: RunOptions) -> int:
    from xeontune.job import fetch, start
    from xeontune.job.spec import launch_spec, read_request

    provider = providers.get(opts.provider)
    if opts.nodes < 1:
        raise UserError("-n must be at least 1")
    name = state.validate_name(opts.name) if opts.name else new_cluster_name()
    reused = state.exists(name)
    if reused:
        existing = state.load(name)
        if existing.provider != opts.provider:
            raise UserError(f"cluster {name!r} exists on provider {existing.provider}, not {opts.provider}; "
                            "pick another --name")
    # Everything the user can get wrong is checked before a cluster costs anything.
    # a new cluster's head holds no checkpoint (on localhost the ranks write --output-dir here, so it may)
    request = read_request(list(opts.train_args), opts.ppn, opts.dist_backend, opts.env, remote=provider.remote,
                           fresh_cluster=not reused and provider.uses_ssh)
    if request.options.fused_backward_pass and (opts.nodes > 1 or request.ppn != "1"):
        raise UserError("--fused-backward-pass runs in one process: -n 1 --ppn 1 (across ranks --shard saves memory)")
    resume_in = resume_dir(name, provider, request.options.resume_from_checkpoint) if reused else None
    dest = request.local_output_dir
    fetch.check_destination(dest, request.options.overwrite)
    if request.options.dataset:  # exported here, once: the ranks get the folder as --data-dir, synced as one
        from xeontune.train.hf_dataset import for_the_ranks

        for_the_ranks(request.options, request.given)
    data_dir = request.options.data_dir
    data_here = Path(data_dir).expanduser() if data_dir else None
    if provider.remote and data_here and not data_here.is_dir():  # run copies it from here
        raise UserError(f"--data-dir {data_dir} is not a directory on this machine (run copies it to the nodes)")
    spec_args = None if reused else manage.spec_from_args(_spec_args(opts, name, data_dir))  # checks --autostop, ...
    if provider.reads_data_first and data_here and data_here.is_dir():  # as the ranks read it
        class_dir = request.options.class_data_dir
        read_data_here(replace(request.options, data_dir=str(data_here),
                               class_data_dir=class_dir and str(Path(class_dir).expanduser())))

    outcome = Outcome(name=name, provider=opts.provider, region=opts.region, keep=opts.keep, reused=reused)
    try:
        with signals_interrupt():
            if reused:
                record = state.load(name)
                _say(f"[1/4] reusing cluster {name!r} ({record.provider}, {len(record.nodes)} node(s))")
            else:
                _say(f"[1/4] creating cluster {name!r} ({opts.provider}, -n {opts.nodes})")
                # `up` rolls back what it made when it fails; only a cluster it made is ours to delete
                # (a `run --name X` racing this one fails here, and must not delete the other's X)
                record, _ = manage.up(spec_args, opts.provider, attempt=outcome.up)
                outcome.created = True
            target = None
            if provider.remote and data_dir:
                if reused:
                    _say(f"[2/4] syncing {data_dir} to {len(record.nodes)} node(s)")
                    target = sync_data(record, data_dir)
                else:
                    target = remote_data_dir(record, data_dir)
                    _say(f"[2/4] data synced to {target} at bootstrap")
            else:
                _say("[2/4] the nodes read --data-dir from this disk" if not provider.remote else "[2/4] no --data-dir")
            class_target = class_data_target(record, request.options.class_data_dir) if provider.remote else None
            run_id = new_run_id()
            # resuming: in the output dir of the cluster's last job, where its checkpoints are
            head_out = resume_in or (posixpath.join(record.work_dir, "runs", run_id) if provider.uses_ssh else None)
            spec = launch_spec(record, request, data_dir=target, output_dir=head_out, class_data_dir=class_target)
            _say(f"[3/4] training: {spec.ranks} rank(s) on cluster {name!r}")
            stopped_by: str | None = None  # the signal that stopped the job, if one did
            lost = False
            if provider.uses_ssh:  # detached on the head: a lost connection here loses nothing there
                job, _ = start.start(record, spec, detached=True, local_output_dir=dest, say=_say, hold_for_fetch=True)
                # From now until a fetch brought them here, the outputs may be only on the head: any
                # way out (a signal as the job ends, a failed fetch) keeps the cluster.
                outcome.keep_because = ON_HEAD
                _say(f"the job runs detached on {record.head.name} (job {job.id}); following its log")
                try:
                    followed = follow_detached(record, job)
                except KeyboardInterrupt as exc:  # the job was stopped: what it wrote is fetched below
                    stopped_by, followed = signal_name(exc), interrupt_status(exc)
                lost = followed is None
                if lost:
                    outcome.keep_because = (f"the connection to {record.head.name} was lost and did not come back; "
                                            f"the job goes on there (follow it: xeontune logs --name {name} -f)")
                rc = 1 if followed is None else followed
            else:
                job, rc = start.start(record, spec, detached=False, local_output_dir=dest, say=_say)
            outcome.rc = rc
            if lost:
                pass
            elif rc == 0 and stopped_by is None:
                _say(f"[4/4] fetching outputs into {dest}")
                outcome.keep_because = ON_HEAD  # until the fetch succeeds
                try:
                    report = fetch_or_beside(record, job, dest, request.options.overwrite)
                except UserError:
                    raise
                except Exception as exc:  # whatever it is, the cluster holds the only copy: say it, keep it
                    raise UserError(f"the final fetch failed: {type(exc).__name__}: {exc}") from None
                fetch.print_report(record, report)
                outcome.keep_because = None
            else:
                why = f"interrupted ({stopped_by})" if stopped_by else f"training failed (exit {rc})"
                outcome.keep_because = fetch_after_failure(record, job, dest, request.options.overwrite, why, outcome)
    except UserError as exc:  # said here, so that the teardown's line stays the last one
        with contextlib.suppress(OSError):
            print(f"error: {exc}", file=sys.stderr, flush=True)
        outcome.rc = exc.exit_code
    except KeyboardInterrupt as exc:
        _say(f"interrupted ({signal_name(exc)})")
        outcome.rc = interrupt_status(exc)
    except BaseException:
        outcome.rc = 1
        if outcome.keep_because is None and outcome.created:
            outcome.keep_because = "xeontune failed unexpectedly (the traceback follows)"
        finish(outcome)
        raise
    return finish(outcome)


RECONNECT_ENV = "XEONTUNE_RECONNECT_S"  # how long `run` tries to get a lost connection back (default 600)
ON_HEAD = "the outputs may still be only on the head"


def fetch_after_failure(record: ClusterRecord, job: JobInfo, dest: Path, overwrite: bool, why: str,
                        outcome: Outcome) -> str | None:
    """What a failed or stopped job wrote (its embedding if it got that far, the step copies, the
    latest checkpoint), fetched before anything is deleted. Returns why the cluster must stay (the
    fetch failed), or None. ``outcome.rc`` stays the job's status; a signal during this fetch keeps
    the cluster (``outcome.keep_because`` says why meanwhile)."""
    from xeontune.job import fetch, start

    _say(f"{why}: fetching what the job wrote into {dest} before anything is deleted")
    outcome.keep_because = f"{why} and what the job wrote may be only on the head"
    try:
        report = fetch_or_beside(record, job, dest, overwrite)
    except fetch.NoOutputs:
        _say(f"{why}; the job wrote no outputs: nothing to fetch")
        start.forget_mark(record, job, ended_only=True)  # a reused cluster's autostop need not wait for it
        return None
    except Exception as exc:  # UserErrors included: the exit status stays the job's, the cluster stays
        reason = str(exc) if isinstance(exc, UserError) else f"{type(exc).__name__}: {exc}"
        with contextlib.suppress(OSError):
            print(f"error: fetching what the job wrote failed: {reason}", file=sys.stderr, flush=True)
        return f"{why} and what the job wrote could not be fetched"
    if report.moved_from is not None:
        _say(f"{report.moved_from} refused the outputs; they went to {report.dest} instead")
    if report.already_here:  # the ranks wrote into --output-dir themselves (localhost, Slurm)
        held = fetch.holds_a_run(report.dest)
        _say(f"{why}; what the job wrote is in {report.dest}: {', '.join(held[:4])}" if held
             else f"{why}; the job wrote no outputs")
    else:
        _say(f"{why}; fetched what it wrote into {report.dest}: {fetch.highlights(report.files)}")
    return None


def follow_detached(record: ClusterRecord, job: JobInfo) -> int | None:
    """Follow the job's log until it ends (``fetch.follow_job``); its exit status, or None when the
    connection was lost for good. Ctrl-C, SIGTERM or SIGHUP stop the job on every rank first (a
    second one: hard), then come out as KeyboardInterrupt, once the job has ended: `run` fetches
    what it wrote, then tears the cluster down."""
    from xeontune.job import fetch

    reconnect_s = float(os.environ.get(RECONNECT_ENV) or 600)
    first: KeyboardInterrupt | None = None
    shown = [0]  # how much of the log was printed: after a signal it goes on from there
    while True:
        try:
            rc = fetch.follow_job(record, job, reconnect_s, _say, pos=shown)
        except KeyboardInterrupt as exc:
            what = exc.args[0] if exc.args else "SIGINT"
            _say(f"interrupted ({what}): stopping the job on every rank" if first is None
                 else f"interrupted again ({what}): stopping the job hard")
            first = first or exc
            try:
                fetch.stop_job(record, job)
            except UserError as err:
                _say(f"{err}; the teardown stops it")
                raise first from None
            continue
        if first is not None:
            raise first
        return rc


def resume_dir(name: str, provider: providers.Provider, resume: str | None) -> str | None:
    """Where a `run --resume-from-checkpoint` on reused cluster ``name`` trains: its last job's output
    dir on the head, which holds the checkpoints (None: no resume, or the ranks write here)."""
    if not resume or not provider.uses_ssh:
        return None
    from xeontune.job import record

    return record.load_job(name).output_dir


def fetch_or_beside(record: ClusterRecord, job: JobInfo, dest: Path, overwrite: bool) -> FetchReport:
    """The final fetch, with the job's latest checkpoint (the cluster goes next): into ``dest``, or,
    when ``dest`` refuses, into a fresh folder beside it. A lost connection is tried again as
    following the job does (a fetch of the same job again refreshes the files it landed; the head
    keeps them meanwhile)."""
    from xeontune.job import fetch

    reconnect_s = float(os.environ.get(RECONNECT_ENV) or 600)
    lost_since: float | None = None
    while True:
        try:
            return _fetch_or_beside(record, job, dest, overwrite)
        except fetch.ConnectionLost as exc:
            now = time.monotonic()
            if lost_since is None:
                lost_since = now
                _say(f"{exc}; trying again for up to {reconnect_s:.0f} s (the outputs stay on the head)")
            if now - lost_since >= reconnect_s:
                raise
            time.sleep(fetch.RECONNECT_INTERVAL_S)


def _fetch_or_beside(record: ClusterRecord, job: JobInfo, dest: Path, overwrite: bool) -> FetchReport:
    from xeontune.job import fetch

    try:
        return fetch.fetch(record, job, dest, overwrite=overwrite, checkpoint=True)
    except fetch.DestinationError as exc:
        other = fetch.beside(dest, job.id)
        _say(f"{exc}; fetching into {other} instead")
        report = fetch.fetch(record, job, other, checkpoint=True)
        report.moved_from = dest
        return report


def new_run_id() -> str:
    return f"{time.strftime('%Y%m%d-%H%M%S')}-{os.urandom(3).hex()}"


@dataclass
class Outcome:
    """What `run` did and must do at the end."""

    name: str
    provider: str
    region: str | None
    keep: bool
    reused: bool
    created: bool = False  # only once `up` returned: this run made the cluster
    # this run's `up` made a record, so what is left under the name if it failed is this run's
    up: manage.UpAttempt = field(default_factory=manage.UpAttempt)
    rc: int = 1
    keep_because: str | None = None  # why the cluster must stay although this run made it


def _spec_args(opts: RunOptions, name: str, data_dir: str | None) -> argparse.Namespace:
    return argparse.Namespace(name=name, nodes=opts.nodes, provider=opts.provider, region=opts.region,
                              instance_type=opts.instance_type, ssh_cidr=opts.ssh_cidr, skip_bootstrap=False,
                              data_dir=data_dir, autostop=autostop_minutes(opts),
                              **providers.option_args(opts.provider_options))


def finish(o: Outcome) -> int:
    """``_finish`` under ``teardown_signals``: only a second signal abandons the teardown."""
    try:
        with teardown_signals(o.name):
            rc = _finish(o)
    except KeyboardInterrupt:
        _say(f"abandoned the teardown of cluster {o.name!r}: what is left may bill; "
             f"run: xeontune teardown --name {o.name}")
        rc = o.rc or 130
    manage.drop_broken_stdio()  # a hung-up terminal must not turn the exit status into 120
    return rc


def _finish(o: Outcome) -> int:
    """Tear down what this run created (unless --keep, or the outputs may still be only on the
    head); the last line says what happened, or how to fetch and tear down."""
    name, rc = o.name, o.rc
    if not o.created:
        if o.reused:
            _say(f"cluster {name!r} was there before this run and is kept; delete it with: "
                 f"xeontune teardown --name {name}")
        elif o.up.recorded and state.exists(name):  # this run's `up` failed and its rollback did not finish
            billing = " and billing" if providers.get(o.provider).remote else ""
            _say(f"cluster {name!r} was not fully created, nor deleted again; what may be left{billing}: "
                 f"{manage.what_is_left(name)}; delete it with: xeontune teardown --name {name}")
            return rc or 1
        elif state.exists(name):
            _say(f"cluster {name!r} was not created by this run and is kept")
        return rc
    if not state.exists(name):  # the autostop watcher, or another command, removed it
        _say(f"nothing of cluster {name!r} is left: nothing to delete")
        return rc
    if o.keep_because:
        _say(f"kept cluster {name!r}: {o.keep_because}. Fetch the outputs with: xeontune fetch --name {name}; "
             f"then delete it with: xeontune teardown --name {name}")
        return rc or 1
    if o.keep:
        _say(f"kept cluster {name!r} (--keep); delete it with: xeontune teardown --name {name}")
        return rc
    _say(f"tearing down cluster {name!r} ...")
    try:
        report = manage.teardown(name, o.provider, o.region)
    except Exception as exc:  # the one thing that must be said, whatever went wrong
        _say(f"could not tear down cluster {name!r}: {type(exc).__name__}: {exc}; run: xeontune teardown --name {name}")
        return rc or 1
    for item in report.failed:
        _say(f"could not delete {item}")
    if not report.ok:
        _say(f"cluster {name!r} is not fully torn down; run: xeontune teardown --name {name}")
        return rc or 1
    what = ", ".join(report.deleted) if report.deleted else "nothing outside the state dir"
    _say(f"deleted cluster {name!r} ({o.provider}): {what}")
    return rc


def main(args: argparse.Namespace) -> int:
    opts = RunOptions(
        provider=args.provider, nodes=args.nodes, ppn=str(args.ppn), name=args.name, keep=args.keep,
        dist_backend=args.dist_backend, region=args.region, instance_type=args.instance_type,
        ssh_cidr=args.ssh_cidr, autostop=args.autostop, env=list(args.env or []), train_args=list(args.train_args),
        provider_options=providers.options_from(args, args.provider),
    )
    return run(opts)


if __name__ == "__main__":  # pragma: no cover
    sys.exit("use `xeontune run`")
