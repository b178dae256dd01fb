"""`xeontune cluster up | status | ssh` and `xeontune teardown`: the provider-independent flow.

``up``: provider.up (the record is saved as resources appear), provider.wait (every node answers
SSH), then the hosts and ssh files are written and their paths printed, then the nodes of a
provider that needs it are bootstrapped. When any of it fails (Ctrl-C included), what this ``up``
recorded is deleted again, unless ``--keep-on-failure``. SIGTERM and SIGHUP (a closed terminal) act as
Ctrl-C there: the rollback runs, and the exit status is 128 + the signal's number.
``teardown``: provider.terminate from the record (or by name when the record is lost), then the
state dir entry is removed. Both are safe to re-run, and both hold the cluster's lock
(``state.locked``) throughout, so two of them on one name fail fast instead of interleaving.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from xeontune.cluster import files, providers, state
from xeontune.cluster.providers import ClusterSpec
from xeontune.cluster.state import ClusterRecord
from xeontune.errors import UserError


def run_cluster_command(args: argparse.Namespace) -> int:
    action = args.cluster_command
    if action == "up":
        return up_command(args)
    if action == "status":
        return status_command(args)
    if action == "ssh":
        return ssh_command(args)
    raise UserError(f"unknown cluster action {action!r}")


def spec_from_args(args: argparse.Namespace) -> ClusterSpec:
    if args.nodes < 1:
        raise UserError("-n must be at least 1")
    return ClusterSpec(
        name=state.validate_name(args.name),
        num_nodes=args.nodes,
        region=getattr(args, "region", None),
        instance_type=getattr(args, "instance_type", None),
        ssh_cidr=getattr(args, "ssh_cidr", None),
        skip_bootstrap=bool(getattr(args, "skip_bootstrap", False)),
        data_dir=getattr(args, "data_dir", None),
        autostop_minutes=_autostop_minutes(getattr(args, "autostop", None)),
        options=providers.options_from(args, args.provider),
    )


def _autostop_minutes(value: int | None) -> int:
    if value is not None and value < 0:
        raise UserError(f"--autostop takes minutes of idle time (0 = off), got {value}")
    return value or 0


@dataclass
class UpAttempt:
    """What a caller of ``up`` learns even when it fails: ``recorded`` once its record exists, so
    what is left under the name then is this ``up``'s (not another command's that raced it)."""

    recorded: bool = False


def signal_name(exc: KeyboardInterrupt) -> str:
    """The signal a KeyboardInterrupt stands for (``signals_interrupt`` names SIGTERM and SIGHUP)."""
    return str(exc.args[0]) if exc.args and str(exc.args[0]).startswith("SIG") else "SIGINT"


def interrupt_status(exc: KeyboardInterrupt) -> int:
    """The exit status for a stop by that signal: 128 + its number, as a shell reports it."""
    return 128 + int(getattr(signal, signal_name(exc), signal.SIGINT))


def _in_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


@contextlib.contextmanager
def signals_interrupt() -> Iterator[None]:
    """SIGTERM and SIGHUP act as Ctrl-C: a KeyboardInterrupt that names the signal. (Python lets only
    the main thread set handlers; elsewhere this changes nothing.)"""
    if not _in_main_thread():
        yield
        return

    def interrupt(sig: int, _frame: object) -> None:
        raise KeyboardInterrupt(signal.Signals(sig).name)

    previous = {sig: signal.signal(sig, interrupt) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


@contextlib.contextmanager
def _hangup_ignored() -> Iterator[None]:
    """During a rollback: Ctrl-C and SIGTERM stop it, SIGHUP does not (a closed terminal asks for
    nothing, and its shell may pass the hang-up on a second time)."""
    if not _in_main_thread():
        yield
        return
    previous = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGHUP, previous)


def _say(text: str, err: bool = False) -> None:
    with contextlib.suppress(OSError):  # a hung-up terminal must not stop a rollback
        print(text, file=sys.stderr if err else sys.stdout, flush=True)


def up(spec: ClusterSpec, provider_name: str, keep_on_failure: bool = False,
       attempt: UpAttempt | None = None) -> tuple[ClusterRecord, dict]:
    """Create the cluster, wait for it, write its files. Returns the record and the files.

    On failure, what this ``up`` created (its record: ids and id tag) is deleted, unless
    ``keep_on_failure``; the error says which happened. SIGTERM and SIGHUP roll back as Ctrl-C does
    (they come out as KeyboardInterrupt naming the signal)."""
    attempt = attempt if attempt is not None else UpAttempt()
    with state.locked(spec.name, "cluster up"), signals_interrupt():
        if state.exists(spec.name):
            raise UserError(
                f"cluster {spec.name!r} already exists; use it, or remove it with `xeontune teardown --name {spec.name}`"
            )
        provider = providers.get(provider_name)
        try:
            record = provider.up(spec)
            skipped = provider.needs_bootstrap and spec.skip_bootstrap
            if not skipped:  # with the bootstrap skipped, the nodes need not answer SSH yet
                provider.wait(record, provider.wait_timeout_s)
            # the hosts file and SSH configs serve mpirun over SSH; localhost and Slurm have no use for them
            written = files.write_cluster_files(record) if provider.uses_ssh else {}
            if provider.needs_bootstrap and not skipped:
                from xeontune.cluster import bootstrap

                bootstrap.run(record, bootstrap.options_for(record, spec.data_dir))
            if spec.autostop_minutes:
                from xeontune.cluster import autostop

                autostop.install(record, spec.autostop_minutes)
        except BaseException as exc:
            if not state.exists(spec.name):  # failed before it created anything
                raise
            attempt.recorded = True
            outcome = _after_failed_up(spec.name, provider, keep_on_failure)
            if isinstance(exc, UserError):
                raise UserError(f"{exc}{outcome}") from None
            # Ctrl-C, SIGTERM, SIGHUP or a bug: keep the original exception (its exit status or its
            # traceback); say what became of the nodes.
            what = f"interrupted ({signal_name(exc)})" if isinstance(exc, KeyboardInterrupt) else "did not finish"
            _say(f"`cluster up` {what}{outcome}", err=True)
            raise
    return record, written


def what_is_left(name: str, limit: int = 8) -> str:
    """What cluster ``name``'s record holds (what `teardown` deletes), for a line that says what may
    be left after an unfinished rollback: ``instance i-1, i-2; security group sg-1; ...``."""
    try:
        record = state.load(name)
    except UserError:
        return "its resources (the record cannot be read)"
    kinds: dict[str, list[str]] = {}
    for res in record.resources:
        kinds.setdefault(res.kind.replace("_", " "), []).append(res.id.rstrip("/").rsplit("/", 1)[-1])
    parts = [f"{kind} {', '.join(ids[:limit])}{f' and {len(ids) - limit} more' if len(ids) > limit else ''}"
             for kind, ids in kinds.items()]
    return "; ".join(parts) or "its record (no resource was created yet)"


def _after_failed_up(name: str, provider: providers.Provider, keep: bool) -> str:
    """Roll back a failed ``up`` (or keep it); returns the end of the error line saying which. A
    rollback that does not finish (interrupted, or failing) names what may be left."""
    teardown_hint = f"`xeontune teardown --name {name}`"
    billing = " and billing" if provider.remote else ""
    if keep:
        return f"; what it created is kept{billing} (--keep-on-failure): delete it with {teardown_hint}"
    try:
        with _hangup_ignored():
            # stdout, like `up`'s progress: stderr carries only the one-line error
            _say(f"`cluster up` failed: deleting what it created for cluster {name!r} (Ctrl-C stops this)")
            report = provider.terminate(name, state.load(name))
    except KeyboardInterrupt:
        return (f"; the clean-up was interrupted: what may be left{billing}: {what_is_left(name)}; "
                f"delete it with {teardown_hint}")
    except Exception as exc:  # any failure of the clean-up: the user must still learn what to run
        return (f"; cleanup failed too ({' '.join(str(exc).split())[:300]}): what may be left{billing}: "
                f"{what_is_left(name)}; delete it with {teardown_hint}")
    if report.ok:
        state.delete(name)
        return " (rolled back: nothing was left running)"
    return f"; could not delete {', '.join(report.failed)}: run {teardown_hint}"


def drop_broken_stdio() -> None:
    """After a hang-up the terminal is gone: writes to it fail, and so would Python's last flush at
    exit (exit status 120 instead of the signal's). Stdout and stderr then go to /dev/null."""
    for name in ("stdout", "stderr"):
        try:
            getattr(sys, name).flush()
        except (OSError, ValueError):
            setattr(sys, name, open(os.devnull, "w"))  # noqa: SIM115 (the process's stream until exit)


def up_command(args: argparse.Namespace) -> int:
    spec = spec_from_args(args)
    attempt = UpAttempt()
    try:
        record, written = up(spec, args.provider, bool(getattr(args, "keep_on_failure", False)), attempt)
    except KeyboardInterrupt as exc:  # up's last line said what became of the cluster, if it made one
        if not attempt.recorded:
            _say(f"interrupted ({signal_name(exc)}): nothing was created", err=True)
        drop_broken_stdio()
        return interrupt_status(exc)
    print(f"cluster {record.name!r} is up ({record.provider}, {len(record.nodes)} node(s)):")
    _print_nodes(record)
    if written:
        print(f"files in {files.files_dir(record)}:")
        for name in sorted(written):
            print(f"  {name}")
    provider = providers.get(record.provider)
    cost = provider.cost_per_hour(record)
    if cost is not None:
        print(f"estimated cost: ${cost:.2f}/hour")
    if record.autostop_minutes:
        print(f"autostop: the head stops the cluster after {record.autostop_minutes} min idle")
    data = ""
    if spec.data_dir and provider.needs_bootstrap and not spec.skip_bootstrap:
        from xeontune.cluster import bootstrap

        node_data = bootstrap.data_target(record, spec.data_dir)  # the ranks read their node's disk
        print(f"--data-dir {spec.data_dir} is copied to {node_data} on every node")
        data = f"--data-dir {shlex.quote(node_data)} "
    print(f"next: xeontune launch -n {provider.slots(record, 1)} --name {record.name} -- {data}<train options>")
    return 0


def _print_nodes(record: ClusterRecord, statuses: dict[str, str] | None = None) -> None:
    for node in record.nodes:
        line = f"  {node.name:<8} {node.role:<7} {node.private_ip:<15}"
        if node.public_ip:
            line += f" public {node.public_ip:<15}"
        if statuses is not None:
            line += f" {statuses.get(node.name, 'unknown')}"
        print(line.rstrip())


def status_command(args: argparse.Namespace) -> int:
    names = [args.name] if args.name else state.list_names()
    if not names:
        print("no clusters (create one with `xeontune cluster up --provider local -n 3`)")
        return 0
    failed = 0
    for name in names:
        if not args.name:  # listing all: one damaged record must not hide the others (they may be billing)
            try:
                record = state.load(name)
            except UserError as exc:
                print(f"warning: {exc}", file=sys.stderr)
                failed += 1
                continue
        else:
            record = state.load(name)
        provider = providers.get(record.provider)
        statuses = {s.name: s.state for s in provider.query(record)}
        print(f"cluster {record.name!r}: provider {record.provider}, {len(record.nodes)} node(s), "
              f"files in {files.files_dir(record)}")
        _print_nodes(record, statuses)
        if _clean_up_if_gone(record, statuses):
            continue
        cost = provider.cost_per_hour(record)
        if cost is not None:
            print(f"  estimated cost: ${cost:.2f}/hour")
        if record.autostop_minutes:
            from xeontune.cluster import autostop

            print(f"  autostop: after {record.autostop_minutes} min idle, {autostop.watcher_state(record)} "
                  f"(log: {record.head.name}:{_autostop_log(record)})")
    return 2 if failed else 0


def _autostop_log(record: ClusterRecord) -> str:
    from xeontune.cluster import autostop

    return autostop.log_path(record)


def _clean_up_if_gone(record: ClusterRecord, statuses: dict[str, str]) -> bool:
    """When no node exists any more (autostop powered them off, or they were terminated outside
    xeontune), delete what they leave behind (a security group, a key pair) and forget the cluster."""
    states = [statuses.get(n.name, "missing") for n in record.nodes]
    if not states or not all(s in ("terminated", "missing") for s in states):
        return False
    if "terminated" not in states:  # never seen terminated: maybe not visible yet, so only say how
        print(f"  no node exists; delete what is left with `xeontune teardown --name {record.name}`")
        return True
    print("  every node is terminated (by autostop, or outside xeontune): deleting what is left")
    report = teardown(record.name)
    for item in report.deleted:
        print(f"  deleted {item}")
    for item in report.failed:
        print(f"  could not delete {item}", file=sys.stderr)
    print(f"  cluster {record.name!r} forgotten" if report.ok
          else f"  cluster {record.name!r} is not fully cleaned up; run `xeontune teardown --name {record.name}`")
    return True


def ssh_argv(record: ClusterRecord, node_name: str, command: list[str]) -> list[str]:
    """The OpenSSH command line that logs into a node with the cluster's pinned config."""
    node = record.node(node_name)
    if not providers.get(record.provider).uses_ssh:  # the node is this machine
        return command or [os.environ.get("SHELL", "/bin/sh")]
    argv = ["ssh", "-F", str(files.files_dir(record) / "ssh_config")]
    if not command:
        return [*argv, node.name]
    return [*argv, node.name, "--", shlex.join(command)]


def ssh_command(args: argparse.Namespace) -> int:
    name, command = args.name, list(args.remote_command)
    # argparse's REMAINDER after the node also takes a `--name X` written there; honour it.
    while len(command) >= 2 and command[0] == "--name":
        name, command = command[1], command[2:]
    if command and command[0] == "--":
        command = command[1:]
    record = state.load(name)
    return subprocess.call(ssh_argv(record, args.node, command))


def teardown(name: str, provider_name: str | None = None, region: str | None = None) -> providers.TeardownReport:
    """Delete everything of cluster ``name``; forget it when nothing is left. Safe to repeat."""
    state.validate_name(name)
    with state.locked(name, "teardown"):
        record = None
        if state.exists(name):
            try:
                record = state.load(name)
            except state.CorruptRecord as exc:
                provider_name, region = _salvage(exc.path, provider_name, region)
                if provider_name is None:
                    raise UserError(f"the record of cluster {name!r} is unreadable ({exc.reason}) and names no "
                                    "provider: pass --provider (and --region) to find its resources by tag") from None
                print(f"warning: the record of cluster {name!r} is unreadable ({exc.reason}); looking for its "
                      f"resources by the name tag instead ({provider_name})", file=sys.stderr)
        elif provider_name is not None:
            print(f"no record of cluster {name!r} in {state.home()}: looking for resources tagged with its name "
                  "(a cluster of this name from another state dir would match too)", file=sys.stderr)
        provider_name = record.provider if record else provider_name
        if record is not None:
            _stop_job_on_this_machine(record)
        if provider_name is None:
            # No record and no --provider: ask every provider that can look for leftovers by name alone.
            report = providers.TeardownReport()
            for provider in providers.all_providers():
                report.merge(provider.sweep(name))
        else:
            report = providers.get(provider_name).terminate(name, record, region)
        if report.ok:
            state.delete(name)
        return report


def _stop_job_on_this_machine(record: ClusterRecord) -> None:
    """A detached job whose runner is on this machine (localhost, namespaces, Ray's driver) outlives the
    deletion of its cluster: stop it first, as Ctrl-C stops an attached one (SIGINT to its runner, which
    passes it to every rank, or aborts Ray Train's run; a second one stops them hard). Clouds' jobs end
    with their VMs, Slurm's are cancelled."""
    from xeontune.job import engines
    from xeontune.job.record import load_job, record_path

    provider = providers.get(record.provider)
    if provider.remote or engines.get(provider.engine).scheduled or not record_path(record.name).is_file():
        return
    try:
        job = load_job(record.name)
    except UserError:
        return
    running = Path(f"/proc/{job.pid}")
    if not job.pid or Path(job.rc_path).exists() or not running.exists():
        return
    with contextlib.suppress(OSError):  # a pid reused by another process since the job's runner ended
        if b"xeontune.job.process" not in (running / "cmdline").read_bytes():
            return
    print(f"stopping job {job.id}, still running on cluster {record.name!r}", file=sys.stderr)
    for _ in range(2):
        try:
            os.kill(job.pid, signal.SIGINT)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + 30
        while running.exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        if not running.exists():
            return
    raise UserError(f"job {job.id} (pid {job.pid}) did not stop: kill it, then run teardown again")


def _salvage(path: os.PathLike[str], provider_name: str | None, region: str | None) -> tuple[str | None, str | None]:
    """--provider / --region, else what an unreadable record still shows of them."""
    try:
        text = Path(path).read_text(errors="replace")
    except OSError:
        text = ""
    found = {k: m.group(1) for k in ("provider", "region") if (m := re.search(rf'"{k}":\s*"([a-z0-9-]+)"', text))}
    provider = provider_name or (found.get("provider") if found.get("provider") in providers.names() else None)
    return provider, region or found.get("region")


def teardown_command(args: argparse.Namespace) -> int:
    name = state.validate_name(args.name)
    known = state.exists(name)
    report = teardown(name, getattr(args, "provider", None), getattr(args, "region", None))
    for item in report.deleted:
        print(f"deleted {item}")
    for item in report.failed:
        print(f"could not delete {item}", file=sys.stderr)
    if not report.ok:
        print(f"cluster {name!r} is not fully torn down; the record is kept, run teardown again", file=sys.stderr)
        return 1
    if known or report.deleted:
        print(f"cluster {name!r} torn down")
    elif report.searched:  # say where: a cluster in another region is not found by looking here
        print(f"no cluster {name!r} found in {'; '.join(report.searched)}: nothing to tear down")
    else:
        print(f"no cluster {name!r}: nothing to tear down")
    return 0
