"""Issue 18's findings on the job wing, without root: `run` through a provider registered from the
tests (tests/cluster/fake_provider.py: nothing it creates exists, every call is logged), `fetch`
and `logs` against a head that is a folder here (or a fake SFTP), the launch spec read once.
Each test's docstring names the finding it covers; each failed on the code before issue 18."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.cluster import fake_provider
from xeontune.cli import main
from xeontune.cluster import manage, providers, state
from xeontune.errors import UserError
from xeontune.job import fetch, record, spec, start
from xeontune.job.record import JobInfo

REQUIRED = ["--model", "org/model", "--placeholder-token", "<t>", "--initializer-token", "toy"]
# A folder of images here: run copies --data-dir from this machine, reading it first as a rank would
# (made by the fixture below, not at import: a process that only collects this module makes nothing)
DATA = str(Path(tempfile.gettempdir()) / f"xeontune-findings-data-{os.getpid()}")


@pytest.fixture(autouse=True, scope="module")
def _sample_data() -> Iterator[None]:
    from xeontune import models

    models.write_sample_data(Path(DATA), count=2, size=32)
    yield
    shutil.rmtree(DATA, ignore_errors=True)


@pytest.fixture
def fake(xeontune_home) -> Iterator[list]:
    providers.register("fake", fake_provider.__name__)
    fake_provider.CALLS.clear()
    yield fake_provider.CALLS
    providers.unregister("fake")


def ups(calls: list) -> int:
    return sum(1 for what, _ in calls if what == "up")


def terminations(calls: list) -> int:
    return sum(1 for what, _ in calls if what == "terminate")


class FolderHead(fetch.LocalFiles):
    """A head whose files are a folder on this disk (its listing can be doctored)."""

    def __init__(self, extra: dict[str, list[tuple[str, bool]]] | None = None) -> None:
        self.extra = extra or {}

    def listdir(self, path: str) -> list[tuple[str, bool]] | None:
        return (super().listdir(path) or []) + self.extra.get(path, []) if Path(path).is_dir() else None


def use_head(monkeypatch, head: fetch.HeadFiles) -> None:
    @contextlib.contextmanager
    def head_files(_record) -> Iterator[fetch.HeadFiles]:
        yield head

    monkeypatch.setattr(fetch, "head_files", head_files)


def write_outputs(where: Path, tag: bytes = b"vectors", pipeline: bool = False) -> None:
    where.mkdir(parents=True, exist_ok=True)
    (where / "learned_embeds.safetensors").write_bytes(tag)
    (where / "metrics.jsonl").write_text('{"step": 1}\n')
    (where / "validation").mkdir(exist_ok=True)
    (where / "validation" / "step-000001-0.png").write_bytes(b"png")
    if pipeline:
        (where / "pipeline" / "unet").mkdir(parents=True, exist_ok=True)
        (where / "pipeline" / "model_index.json").write_text("{}")
        (where / "pipeline" / "unet" / "w.bin").write_bytes(b"w")


def fake_start(monkeypatch, head_dir: Path, before_end=None, rc: int = 0, write: bool = True) -> None:
    """`start.start` that "trains" by writing outputs into ``head_dir`` (the head's output dir; with
    ``write`` False, nothing), and a job that ends with ``rc`` as `run` follows it."""
    monkeypatch.setattr(fetch, "follow_job", lambda rec, job, reconnect_s, say, pos=None: rc)

    def started(rec, launch_spec, detached, local_output_dir=None, say=print, hold_for_fetch=False):
        job = JobInfo(id="job1", cluster=rec.name, output_dir=str(head_dir), local_output_dir=str(local_output_dir),
                      job_dir="/srv/fake/work/jobs/job1")
        record.save_job(job)
        if write:
            write_outputs(head_dir)
        if before_end:
            before_end()
        return job, rc

    monkeypatch.setattr(start, "start", started)


def run_cli(*argv: str) -> int:
    return main(["run", "--provider", "fake", "-n", "2", *argv])


# --- 1: a failed final fetch never tears the cluster down ---------------------------------------


def test_a_refused_destination_sends_the_outputs_to_a_fresh_folder_beside_it(fake, monkeypatch, tmp_path, capsys):
    """Finding 1: a mid-run `xeontune fetch` of another job filled the destination; the final fetch
    refused it and the cluster (embedding included) was deleted. Now the outputs go beside it."""
    dest = tmp_path / "out"
    use_head(monkeypatch, FolderHead())

    def someone_fills_dest() -> None:
        write_outputs(dest, b"another run")

    fake_start(monkeypatch, tmp_path / "head", someone_fills_dest)
    assert run_cli("--name", "c1", "--", *REQUIRED, "--data-dir", DATA, "--output-dir", str(dest)) == 0
    out = capsys.readouterr().out
    beside = tmp_path / "out-job1"
    assert (beside / "learned_embeds.safetensors").read_bytes() == b"vectors"
    assert (dest / "learned_embeds.safetensors").read_bytes() == b"another run"  # left alone
    assert f"refused the outputs; they went to {beside}" in out
    assert terminations(fake) == 1 and out.strip().splitlines()[-1].startswith("deleted cluster 'c1'")


@pytest.mark.parametrize("failure", [fetch.HeadError("lost the connection to node0"), KeyboardInterrupt(),
                                     OSError(28, "No space left on device")])
def test_a_failed_final_fetch_keeps_the_cluster_and_says_how_to_fetch(fake, monkeypatch, tmp_path, capsys, failure):
    """Finding 1: an SFTP error, ENOSPC here or Ctrl-C during the final fetch deleted the cluster
    with the only copy of the embedding. Now it stays and the last line says how to fetch and delete."""
    fake_start(monkeypatch, tmp_path / "head")

    def failing_fetch(*_args, **_kwargs):
        raise failure

    monkeypatch.setattr(fetch, "fetch", failing_fetch)
    rc = run_cli("--name", "c2", "--", *REQUIRED, "--data-dir", DATA, "--output-dir", str(tmp_path / "out"))
    assert rc != 0
    assert terminations(fake) == 0 and state.exists("c2")
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert "xeontune fetch --name c2" in last and "xeontune teardown --name c2" in last, last


def test_a_connection_lost_during_the_final_fetch_is_tried_again(fake, monkeypatch, tmp_path, capsys):
    """Finding 1, the fetch's half of a short network drop: the final fetch is tried again for the
    reconnect window, and the cluster goes only once it succeeded; a connection that does not come
    back in the window keeps the cluster."""

    class FlakyHead(FolderHead):
        def __init__(self, drops: int) -> None:
            super().__init__()
            self.drops = drops

        def listdir(self, path: str) -> list[tuple[str, bool]] | None:
            if self.drops:
                self.drops -= 1
                raise fetch.ConnectionLost("lost the connection to node0 while trying to list x: OSError: closed")
            return super().listdir(path)

    monkeypatch.setattr(fetch, "RECONNECT_INTERVAL_S", 0.0)
    fake_start(monkeypatch, tmp_path / "head")
    head = FlakyHead(drops=2)
    use_head(monkeypatch, head)
    out = tmp_path / "out"
    assert run_cli("--name", "c3", "--", *REQUIRED, "--data-dir", DATA, "--output-dir", str(out)) == 0
    assert head.drops == 0 and (out / "learned_embeds.safetensors").read_bytes() == b"vectors"
    assert capsys.readouterr().out.count("trying again") == 1
    assert terminations(fake) == 1 and not state.exists("c3")
    monkeypatch.setenv("XEONTUNE_RECONNECT_S", "0")
    use_head(monkeypatch, FlakyHead(drops=10**6))
    assert run_cli("--name", "c4", "--", *REQUIRED, "--data-dir", DATA, "--output-dir", str(tmp_path / "o4")) != 0
    assert terminations(fake) == 1 and state.exists("c4")
    assert "xeontune fetch --name c4" in capsys.readouterr().out.strip().splitlines()[-1]


# --- issue 29: what a failed or interrupted job wrote is fetched before anything is deleted ------


def test_a_failed_jobs_outputs_are_fetched_before_the_teardown(fake, monkeypatch, tmp_path, capsys):
    """Issue 29 (HIGH): a job that failed after writing its embedding (a rank killed in the final
    validation) had nothing fetched, and the cluster was deleted with it. Now what it wrote comes
    here first; the exit code stays the job's, and the messages say that training failed and where
    its outputs went."""
    fake_start(monkeypatch, tmp_path / "head", rc=3)
    use_head(monkeypatch, FolderHead())
    out = tmp_path / "out"
    assert run_cli("--name", "f1", "--", *REQUIRED, "--data-dir", DATA, "--output-dir", str(out)) == 3
    text = capsys.readouterr().out
    assert (out / "learned_embeds.safetensors").read_bytes() == b"vectors"
    assert f"training failed (exit 3); fetched what it wrote into {out}: learned_embeds.safetensors" in text, text
    assert terminations(fake) == 1 and text.strip().splitlines()[-1].startswith("deleted cluster 'f1'")


def test_a_failed_job_that_wrote_nothing_tears_down_with_its_exit_code(fake, monkeypatch, tmp_path, capsys):
    """Issue 29: the fetch of a failed job that wrote nothing (its output dir was never made) is no
    reason to keep the cluster: it goes, nothing is created here, and the exit code is the job's."""
    fake_start(monkeypatch, tmp_path / "head", rc=2, write=False)
    use_head(monkeypatch, FolderHead())
    out = tmp_path / "out"
    assert run_cli("--name", "f2", "--", *REQUIRED, "--data-dir", DATA, "--output-dir", str(out)) == 2
    text = capsys.readouterr().out
    assert "training failed (exit 2); the job wrote no outputs: nothing to fetch" in text, text
    assert not out.exists()
    assert terminations(fake) == 1 and text.strip().splitlines()[-1].startswith("deleted cluster 'f2'")


@pytest.mark.parametrize("failure", [fetch.HeadError("node0 refused to read /x: Permission denied"),
                                     KeyboardInterrupt()])
def test_a_failed_job_whose_outputs_cannot_be_fetched_keeps_the_cluster(fake, monkeypatch, tmp_path, capsys,
                                                                        failure):
    """Issue 29: where what the failed job wrote cannot be fetched (the head refuses, Ctrl-C during
    that fetch), the cluster stays; the last line says that training failed and how to fetch and tear
    down, and the exit code is the job's (130 for the Ctrl-C)."""
    fake_start(monkeypatch, tmp_path / "head", rc=3)

    def failing_fetch(*_args, **_kwargs):
        raise failure

    monkeypatch.setattr(fetch, "fetch", failing_fetch)
    rc = run_cli("--name", "f3", "--", *REQUIRED, "--data-dir", DATA, "--output-dir", str(tmp_path / "out"))
    assert rc == (130 if isinstance(failure, KeyboardInterrupt) else 3)
    assert terminations(fake) == 0 and state.exists("f3")
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("kept cluster 'f3': training failed (exit 3)"), last
    assert "xeontune fetch --name f3" in last and "xeontune teardown --name f3" in last, last


def test_fetch_brings_the_final_embedding_first_and_the_latest_checkpoint_durably(fake, monkeypatch, tmp_path):
    """Issue 29: the final embedding comes before the step copies, and these newest first (a fetch cut
    short keeps the newest vectors); the latest complete checkpoint comes too once the job has ended
    (not a peek's: the trainer may prune it meanwhile); every fetched file is fsynced before its
    rename and the folders after, so that `run` deletes the cluster only once they are on disk."""
    from xeontune import io

    rec = fake_record(fake)
    head_dir = tmp_path / "head"
    write_outputs(head_dir)
    (head_dir / "train_config.json").write_text("{}")
    for step in (2, 4, 10):
        (head_dir / f"learned_embeds-steps-{step}.safetensors").write_bytes(b"s%d" % step)

    def checkpoint(step: int, complete: bool = True) -> None:
        (head_dir / f"checkpoint-{step}").mkdir()
        (head_dir / f"checkpoint-{step}" / "state.pt").write_bytes(b"state %d" % step)
        if complete:
            (head_dir / f"checkpoint-{step}" / "complete.json").write_text("{}")

    checkpoint(2)
    checkpoint(4)
    checkpoint(6, complete=False)  # an older xeontune's, or cut short: not one to resume from
    jobs = tmp_path / "jobs"
    jobs.mkdir()
    job = JobInfo(id="j", cluster="c", output_dir=str(head_dir), local_output_dir="", job_dir=str(jobs))
    got: list[str] = []

    class Recording(FolderHead):
        def get(self, path: str, local: Path) -> None:
            got.append(Path(path).relative_to(head_dir).as_posix())
            super().get(path, local)

    use_head(monkeypatch, Recording())
    peek = tmp_path / "peek"
    fetch.fetch(rec, job, peek)  # the job runs still: no checkpoint
    assert not list(peek.glob("checkpoint-*"))

    (jobs / "rc").write_text("1\n")  # now it has ended (failed)
    got.clear()
    synced: list[Path] = []
    real_fsync = io.fsync_path
    monkeypatch.setattr(io, "fsync_path", lambda path: (synced.append(Path(path)), real_fsync(path))[1])
    dest = tmp_path / "dest"
    report = fetch.fetch(rec, job, dest)
    assert [g for g in got if "/" not in g] == [
        "learned_embeds.safetensors", "learned_embeds-steps-10.safetensors", "learned_embeds-steps-4.safetensors",
        "learned_embeds-steps-2.safetensors", "train_config.json", "metrics.jsonl"]
    assert sorted(p.name for p in dest.glob("checkpoint-*")) == ["checkpoint-4"]
    assert (dest / "checkpoint-4" / "state.pt").read_bytes() == b"state 4"
    assert "checkpoint-4/" in report.files
    for name in ("learned_embeds.safetensors", "metrics.jsonl", "validation/step-000001-0.png"):
        where = (dest / name).parent
        assert any(p.parent == where and p.name.startswith(f".{Path(name).name}.") for p in synced), (name, synced)
    assert dest in synced and dest / "validation" in synced
    assert any(p.name == "state.pt" and p.parent.name.startswith(".checkpoint-4.") for p in synced), synced

    checkpoint(8)  # fetched again later: the newer checkpoint replaces the older one
    fetch.fetch(rec, job, dest)
    assert sorted(p.name for p in dest.glob("checkpoint-*")) == ["checkpoint-8"]


# --- 2: `created` only once `up` returned -------------------------------------------------------


def test_a_run_whose_up_fails_never_deletes_a_cluster_it_did_not_make(fake, monkeypatch, tmp_path, capsys):
    """Finding 2: `created = True` came before `up`; a second `run --name X` racing the first got
    "already exists" from `up`, then tore down the first one's cluster."""
    def racing_up(cluster_spec, provider_name, keep_on_failure=False, attempt=None):
        providers.get("fake").up(cluster_spec)  # the other run's cluster, made meanwhile
        raise UserError(f"cluster {cluster_spec.name!r} already exists")

    monkeypatch.setattr(manage, "up", racing_up)
    assert run_cli("--name", "race", "--", *REQUIRED, "--data-dir", DATA, "--output-dir", str(tmp_path / "o")) == 2
    assert "already exists" in capsys.readouterr().err
    assert terminations(fake) == 0 and state.exists("race")


# --- 5: mistakes found before anything bills ----------------------------------------------------


@pytest.mark.parametrize(("run_flags", "train_flags", "message"), [
    (["--ppn", "two"], [], "--ppn must be a positive number or auto"),
    (["--dist-backend", "ccl"], [], "--dist-backend ccl needs oneccl_bindings_for_pytorch"),
    ([], ["--config", "/nonexistent.yaml"], "config file /nonexistent.yaml does not exist"),
    ([], ["--model", "./no-such-model"], "--model ./no-such-model is a path"),
    ([], ["--resume-from-checkpoint", "latest"], "a new cluster holds no checkpoint"),
    ([], ["--resolution", "33"], "--resolution must be a positive multiple of 8"),
    ([], ["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
    (["--env", "XT_UNSET_FOR_TESTS"], [], "give KEY=VALUE, or export it"),
    (["--autostop", "-1"], [], "--autostop takes minutes"),
    ([], ["--data-dir", "/no-such-data"], "is not a directory on this machine"),
    ([], ["--dist-backend", "ccl"], "--dist-backend ccl needs oneccl_bindings_for_pytorch"),
])
def test_mistakes_are_refused_before_a_cluster_is_created(fake, monkeypatch, tmp_path, capsys, run_flags,
                                                          train_flags, message):
    """Finding 5: --ppn, an unavailable ccl, --config, a local --model path and
    --resume-from-checkpoint were found only once the cluster was billing."""
    from xeontune import hardware

    monkeypatch.setattr(hardware, "ccl_available", lambda: (False, "it does not import"))
    assert run_cli("--name", "c5", *run_flags, "--", *REQUIRED, "--data-dir", DATA,
                   "--output-dir", str(tmp_path / "o"), *train_flags) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err and "Traceback" not in err, err
    assert ups(fake) == 0 and not state.exists("c5")


def test_a_config_file_is_read_once_as_the_ranks_read_it(fake, tmp_path, fake_cpu):
    """The design: `run -- --config c.yaml` with data_dir and model in the file synced nothing and
    sized --ppn auto on 0 bytes of weights; the ranks now get the merged options as flags (no
    --config path that a node would not have), and `--mixed-precision no` is fp32 everywhere."""
    data = tmp_path / "data"
    data.mkdir()
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"data_dir: {data}\nmodel: org/model\nmixed_precision: 'no'\nplaceholder_token: <t>\n"
                   "initializer_token: toy\nlearning_rate: 0.001\n")
    request = spec.read_request(["--", "--config", str(cfg), "--max-train-steps", "5"])
    assert request.options.data_dir == str(data) and request.options.mixed_precision == "fp32"
    assert spec.ranks_precision(request.options, remote=False) == "fp32"  # not bf16 on an AMX Xeon
    assert spec.ranks_precision(request.options, remote=True) == "fp32"
    args = spec.rank_args(request.options, request.given)
    assert "--config" not in args and args[args.index("--data-dir") + 1] == str(data)
    assert args[args.index("--learning-rate") + 1] == "0.001" and args[args.index("--max-train-steps") + 1] == "5"
    from xeontune.train.options import parse_args

    assert dataclasses.replace(parse_args(args), config=request.options.config) == request.options  # what a rank reads from these flags is what was read here


# --- 7, 8: fetch writes only where it should ----------------------------------------------------


def job_at(head_dir: Path, cluster: str = "c") -> JobInfo:
    return JobInfo(id="j", cluster=cluster, output_dir=str(head_dir), local_output_dir="", job_dir="/nowhere")


def fake_record(fake) -> object:
    rec, _ = manage.up(providers.ClusterSpec(name="c", num_nodes=1), "fake")
    return rec


@pytest.mark.parametrize("evil", ["../../escaped", "/tmp/xeontune-escaped-abs", ".."])
def test_fetch_refuses_names_that_leave_the_destination(fake, monkeypatch, tmp_path, evil):
    """Finding 7: `fetch` joined the head's file names unchecked: `../` and absolute names wrote
    outside the destination."""
    head_dir = tmp_path / "head"
    write_outputs(head_dir, pipeline=True)
    use_head(monkeypatch, FolderHead({str(head_dir / "pipeline" / "unet"): [(evil, False)]}))
    monkeypatch.setattr(fetch.LocalFiles, "get", lambda self, path, local: Path(local).write_bytes(b"x"))
    dest = tmp_path / "a" / "b" / "dest"
    with pytest.raises(fetch.HeadError, match="unsafe file name"):
        fetch.fetch(fake_record(fake), job_at(head_dir), dest)
    assert not (tmp_path / "a" / "escaped").exists() and not Path("/tmp/xeontune-escaped-abs").exists()
    assert not (dest / "pipeline").exists()


def test_fetch_leaves_an_unrelated_pipeline_alone_and_overwrite_leaves_nothing_stale(fake, monkeypatch, tmp_path):
    """Finding 8: `fetch` replaced an unrelated DEST/pipeline/ without --overwrite, and --overwrite
    left the older run's validation images and pipeline behind."""
    rec = fake_record(fake)
    use_head(monkeypatch, FolderHead())
    head_dir = tmp_path / "head"
    write_outputs(head_dir)  # this run saved no pipeline
    dest = tmp_path / "dest"
    (dest / "pipeline").mkdir(parents=True)
    (dest / "pipeline" / "mine.txt").write_text("keep me")
    with pytest.raises(fetch.DestinationError, match="holds a run already.*pipeline/"):
        fetch.fetch(rec, job_at(head_dir), dest)
    assert (dest / "pipeline" / "mine.txt").read_text() == "keep me"

    (dest / "validation").mkdir()
    (dest / "validation" / "step-000900-0.png").write_bytes(b"old")
    (dest / "learned_embeds-steps-900.safetensors").write_bytes(b"old")
    report = fetch.fetch(rec, job_at(head_dir), dest, overwrite=True)
    assert "learned_embeds.safetensors" in report.files
    assert sorted(p.name for p in (dest / "validation").iterdir()) == ["step-000001-0.png"]
    assert not (dest / "pipeline").exists() and not (dest / "learned_embeds-steps-900.safetensors").exists()
    # the same job fetched again (a peek, then the final fetch) needs no --overwrite
    assert fetch.fetch(rec, job_at(head_dir), dest).files == report.files


# --- 11: one-line errors -------------------------------------------------------------------------


NEWER = ('{"id": "x", "cluster": "c", "output_dir": "/o", "local_output_dir": "/l", "job_dir": "/j", '
         '"version": 99}')  # complete, but from a newer xeontune


@pytest.mark.parametrize("content", ["{not json", '["a list"]', '{"id": "x", "cluster": "c"}', "\xff\xfe", NEWER])
def test_a_corrupt_or_old_job_record_is_one_line(fake, capsys, content):
    """Finding 11: a corrupt or old job.json gave a traceback in `fetch` and `logs`."""
    fake_record(fake)
    record.record_path("c").write_text(content, encoding="latin-1")
    for command in (["fetch", "--name", "c"], ["logs", "--name", "c"]):
        assert main(command) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "job record" in err and "cannot be read" in err, err


class RefusingSftp:
    """paramiko's SFTPClient as a head that refuses (or loses the connection) on reads."""

    def __init__(self, error: BaseException) -> None:
        self.error = error

    def listdir_attr(self, path):
        raise self.error

    def open(self, path, mode="rb"):
        raise self.error

    def stat(self, path):
        raise self.error


@pytest.mark.parametrize("error", [PermissionError(13, "Permission denied"), FileNotFoundError(2, "No such file"),
                                   EOFError(), OSError("Socket is closed")])
def test_sftp_errors_are_one_line(fake, tmp_path, error):
    """Finding 11: SFTP permission and not-found errors (and a dropped connection) were tracebacks."""
    head = fetch.SftpFiles(RefusingSftp(error), "node0")  # type: ignore[arg-type]
    with pytest.raises(fetch.HeadError, match="node0"):
        head.get("/srv/out/learned_embeds.safetensors", tmp_path / "x")
    if not isinstance(error, FileNotFoundError):  # a missing file is "not there yet" for these
        with pytest.raises(fetch.HeadError, match="node0"):
            head.listdir("/srv/out")


def test_an_unwritable_destination_is_one_line(fake, monkeypatch, tmp_path, capsys):
    """Finding 11: a destination that cannot be written (here: under a file; EACCES and ENOSPC
    take the same path) was a traceback."""
    rec = fake_record(fake)
    use_head(monkeypatch, FolderHead())
    write_outputs(tmp_path / "head")
    blocker = tmp_path / "file"
    blocker.write_text("")
    record.save_job(JobInfo(id="j", cluster="c", output_dir=str(tmp_path / "head"),
                            local_output_dir=str(blocker / "dest"), job_dir="/nowhere"))
    assert main(["fetch", "--name", rec.name]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{blocker / 'dest'}" in err and "Traceback" not in err, err


def test_a_connection_dropped_during_logs_follow_is_one_line(fake, monkeypatch, capsys):
    """Finding 11: a connection dropped during `logs -f` was a traceback; now one line that says
    the job goes on and how to follow it again."""
    fake_record(fake)
    record.save_job(JobInfo(id="j", cluster="c", output_dir="/o", local_output_dir="/o", job_dir="/srv/jobs/j",
                            detached=True))

    class Dropping(fetch.LocalFiles):
        reads = 0

        def read(self, path: str, offset: int = 0) -> bytes | None:
            Dropping.reads += 1
            if Dropping.reads > 2:
                raise fetch.HeadError("lost the connection to node0 while trying to read /srv/jobs/j/log")
            return b"step 1\n" if path.endswith("log") else None

        def exists(self, path: str) -> bool:
            return True

    use_head(monkeypatch, Dropping())
    monkeypatch.setattr(fetch, "FOLLOW_INTERVAL_S", 0.0)
    assert main(["logs", "--name", "c", "-f"]) == 2
    captured = capsys.readouterr()
    assert "step 1" in captured.out
    assert captured.err.count("\n") == 1 and "xeontune logs --name c -f" in captured.err, captured.err


def test_job_record_round_trips(fake):
    fake_record(fake)
    job = JobInfo(id="j", cluster="c", output_dir="/o", local_output_dir="/l", job_dir="/d", world_size=3)
    record.save_job(job)
    assert record.load_job("c") == job
    assert json.loads(record.record_path("c").read_text())["version"] == record.RECORD_VERSION


def recording_starts(monkeypatch) -> list:
    """Every launch spec `run` starts (start.start faked: the job is "new", exit 1 when followed)."""
    seen = []

    def started(rec, launch_spec, detached, local_output_dir=None, say=print, hold_for_fetch=False):
        seen.append(launch_spec)
        return JobInfo(id="new", cluster="c", output_dir=launch_spec.output_dir, local_output_dir="",
                       job_dir="/j"), 1

    monkeypatch.setattr(start, "start", started)
    return seen


def test_run_resumes_on_a_reused_cluster_in_its_last_jobs_output_dir(fake, monkeypatch, tmp_path, capsys):
    """Finding 5: `run` could not resume at all on SSH providers (each run wrote a new runs/<id>,
    where `--resume-from-checkpoint latest` found nothing)."""
    from xeontune.job import run

    fake_record(fake)
    record.save_job(JobInfo(id="old", cluster="c", output_dir="/srv/fake/work/runs/old", local_output_dir="/l",
                            job_dir="/srv/fake/work/jobs/old"))
    monkeypatch.setattr(run, "sync_data", lambda rec, data_dir: "/srv/fake/work/data/d")
    seen = recording_starts(monkeypatch)
    monkeypatch.setattr(fetch, "follow_job", lambda rec, job, reconnect_s, say, pos=None: 1)
    use_head(monkeypatch, FolderHead())  # the failed job's fetch finds nothing written
    assert run_cli("--name", "c", "--", *REQUIRED, "--data-dir", DATA, "--output-dir", str(tmp_path / "o"),
                   "--resume-from-checkpoint", "latest") == 1
    spec_seen = seen[0]
    assert spec_seen.output_dir == "/srv/fake/work/runs/old"
    args = spec_seen.rank_args
    assert args[args.index("--resume-from-checkpoint") + 1] == "latest"
    assert args[args.index("--output-dir") + 1] == "/srv/fake/work/runs/old"
    assert args[args.index("--data-dir") + 1] == "/srv/fake/work/data/d"
    assert terminations(fake) == 0  # a reused cluster is kept


def test_run_copies_a_class_folder_to_remote_nodes_and_leaves_a_missing_one_to_them(fake, monkeypatch, tmp_path):
    """Prior preservation on a cloud: class photos here are synced as --data-dir is; a --class-data-dir that
    does not exist here is where the ranks generate the class images on the nodes (their work dir)."""
    from xeontune.job import run

    fake_record(fake)
    synced = []
    monkeypatch.setattr(run, "sync_data", lambda rec, folder: synced.append(folder) or f"/srv/data/{Path(folder).name}")
    seen = recording_starts(monkeypatch)
    monkeypatch.setattr(fetch, "follow_job", lambda rec, job, reconnect_s, say, pos=None: 1)
    use_head(monkeypatch, FolderHead())
    classes = tmp_path / "dogs"
    classes.mkdir()
    lora = ["--method", "lora", "--model", "org/model", "--instance-prompt", "a photo of sks dog",
            "--with-prior-preservation", "--class-prompt", "a photo of a dog", "--data-dir", DATA]
    for class_dir, want in ((str(classes), "/srv/data/dogs"), ("dog-class", "dog-class")):
        synced.clear()
        assert run_cli("--name", "c", "--", *lora, "--class-data-dir", class_dir, "--output-dir",
                       str(tmp_path / f"o{len(seen)}")) == 1
        args = seen[-1].rank_args
        assert args[args.index("--class-data-dir") + 1] == want
        assert synced == ([DATA, str(classes)] if want != class_dir else [DATA])


# --- the behaviour to reach: the job runs detached, `run` re-attaches -------------------------------


def test_env_takes_a_value_from_this_environment_without_a_command_line(monkeypatch, capsys, xeontune_home):
    """Finding 9: the value of `--env HF_TOKEN=...` was in this machine's process arguments (ps):
    `--env HF_TOKEN` takes it from this environment, and no output shows it."""
    monkeypatch.setenv("HF_TOKEN", "hf_from_env")
    assert spec.parse_env(["HF_TOKEN", "A=1"]) == {"HF_TOKEN": "hf_from_env", "A": "1"}
    with pytest.raises(UserError) as info:
        spec.parse_env(["1BAD=hf_secret"])
    assert "hf_secret" not in str(info.value)


def test_following_the_job_survives_a_dropped_connection(fake, monkeypatch, tmp_path, capsys):
    """Issue 18's behaviour to reach: a lost connection loses nothing; `run` reconnects and the log
    goes on where it stopped (each line once), then the job's status comes back."""
    rec = fake_record(fake)
    jobs = tmp_path / "jobs"
    jobs.mkdir()
    (jobs / "log").write_text("step 1\n")
    job = JobInfo(id="j", cluster="c", output_dir="/o", local_output_dir="/o", job_dir=str(jobs), detached=True)

    class Flaky(fetch.LocalFiles):
        drops = 2

        def read(self, path: str, offset: int = 0) -> bytes | None:
            if path.endswith("rc") and (jobs / "log").read_text().count("\n") == 1 and offset == 0:
                (jobs / "log").write_text("step 1\nstep 2\n")  # the job went on meanwhile
                if Flaky.drops:
                    Flaky.drops -= 1
                    raise fetch.HeadError("lost the connection to node0")
            if path.endswith("log") and (jobs / "log").read_text().count("\n") == 2:
                (jobs / "rc").write_text("0\n")
            return super().read(path, offset)

        def exists(self, path: str) -> bool:
            return True

    use_head(monkeypatch, Flaky())
    monkeypatch.setattr(fetch, "RECONNECT_INTERVAL_S", 0.0)
    monkeypatch.setattr(fetch, "FOLLOW_INTERVAL_S", 0.0)
    said: list[str] = []
    assert fetch.follow_job(rec, job, 60, said.append) == 0
    assert capsys.readouterr().out == "step 1\nstep 2\n"
    assert said[0].startswith("lost the connection to node0; trying again") and "reconnected" in said[1]


def test_a_connection_that_does_not_come_back_keeps_the_cluster(fake, monkeypatch, tmp_path, capsys):
    """Issue 18 finding 1 (the lost SSH connection): ssh exited 255 after ~45 s of silence and that
    ended the job and the cluster. Now the job goes on on the head and the cluster stays."""
    fake_start(monkeypatch, tmp_path / "head")
    monkeypatch.setattr(fetch, "follow_job", lambda rec, job, reconnect_s, say, pos=None: None)
    assert run_cli("--name", "gone", "--", *REQUIRED, "--data-dir", DATA,
                   "--output-dir", str(tmp_path / "o")) == 1
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert "did not come back" in last and "xeontune fetch --name gone" in last and "teardown --name gone" in last
    assert terminations(fake) == 0 and state.exists("gone")


def test_ctrl_c_while_following_stops_the_job_on_the_head_then_tears_down(fake, monkeypatch, tmp_path, capsys):
    """Ctrl-C during a detached run's job reaches the ranks (SIGINT to the runner on the head), the
    log is followed to the job's end, what the job wrote is fetched (issue 29), then the cluster
    this run made is deleted; exit 130."""
    fake_start(monkeypatch, tmp_path / "head")
    use_head(monkeypatch, FolderHead())
    calls: list[str] = []

    def follow(rec, job, reconnect_s, say, pos=None):
        calls.append("follow")
        if len(calls) == 1:
            raise KeyboardInterrupt
        return 130

    monkeypatch.setattr(fetch, "follow_job", follow)
    monkeypatch.setattr(fetch, "stop_job", lambda rec, job: calls.append("stop"))
    assert run_cli("--name", "int", "--", *REQUIRED, "--data-dir", DATA, "--output-dir", str(tmp_path / "o")) == 130
    assert calls == ["follow", "stop", "follow"]
    out = capsys.readouterr().out
    assert "stopping the job on every rank" in out and out.strip().splitlines()[-1].startswith("deleted cluster 'int'")
    assert f"fetched what it wrote into {tmp_path / 'o'}" in out, out
    assert terminations(fake) == 1 and (tmp_path / "o" / "learned_embeds.safetensors").read_bytes() == b"vectors"


# --- 10: nothing waits for every node, and the teardown can be abandoned ----------------------------


def test_a_failure_on_one_node_does_not_wait_for_the_others():
    """Finding 10: Ctrl-C (or a failure) during the bootstrap, the data sync or the preflight waited
    for every node's work to end (the thread pool's exit joined them); now it is raised at once."""
    import threading
    import time

    from xeontune.cluster import ssh
    from xeontune.cluster.state import Node

    release = threading.Event()

    def work(node: Node) -> str:
        if node.name == "node0":
            raise UserError("node0 refused")
        release.wait(10)  # a long upload
        return node.name

    start_at = time.monotonic()
    with pytest.raises(UserError, match="node0 refused"):
        ssh.on_every_node([Node("node0", "head", "x"), Node("node1", "worker", "y")], work)
    assert time.monotonic() - start_at < 3
    release.set()
    assert ssh.on_every_node([Node("node1", "worker", "y"), Node("node2", "worker", "z")], work) == ["node1", "node2"]


def test_one_signal_does_not_stop_the_teardown_a_second_abandons_it(fake, monkeypatch, capsys):
    """Finding 10: the teardown could be interrupted only by SIGKILL. A first Ctrl-C still must not
    leave half a cluster billing; a second one abandons it, and the last line says how to finish."""
    import os
    import signal
    import time

    from xeontune.job import run

    fake_record(fake)
    progress = []

    def slow_teardown(name, provider=None, region=None):
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.2)
        progress.append("went on after the first")
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)
        progress.append("not abandoned")

    monkeypatch.setattr(manage, "teardown", slow_teardown)
    outcome = run.Outcome(name="c", provider="fake", region=None, keep=False, reused=False, created=True, rc=0)
    assert run.finish(outcome) == 130
    assert progress == ["went on after the first"]
    out = capsys.readouterr().out.strip().splitlines()
    assert "SIGINT again to abandon it" in out[-2] and out[-1].startswith("abandoned the teardown of cluster 'c'")
    assert "xeontune teardown --name c" in out[-1]


# --- 3: ranks check they loaded the same images ------------------------------------------------------


def _rank_checks(rank: int, port: int, values: list[str], results) -> None:  # noqa: ANN001 (a Queue)
    import torch.distributed as dist

    from xeontune.train.loop import Sync

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=len(values))
    try:
        Sync.create(len(values), 30).check_same(values[rank], "training images")
        results.put((rank, "same"))
    except UserError as exc:
        results.put((rank, str(exc)))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow  # two processes that import torch: about 10 s each
@pytest.mark.parametrize("values", [["3 images, aaa", "3 images, aaa"], ["3 images, aaa", "2 images, bbb"]])
def test_ranks_refuse_to_train_on_different_image_sets(values, tmp_path):
    """Finding 3: ranks never checked that they all loaded the same image set (a node with a stale
    copy of --data-dir trained on other images, silently). Two gloo ranks, as the trainer runs them."""
    import multiprocessing
    import socket

    from xeontune.train.data import image_set_digest

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_rank_checks, args=(r, port, values, results)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    got = dict(results.get(timeout=5) for _ in procs)
    if values[0] == values[1]:
        assert got == {0: "same", 1: "same"}
    else:
        assert all("rank(s) 1 loaded other training images than rank 0 (2 images, bbb vs 3 images, aaa)" in got[r]
                   for r in (0, 1)), got
    a, b = tmp_path / "a", tmp_path / "b"
    for folder, content in ((a, b"x"), (b, b"y")):
        folder.mkdir()
        (folder / "1.png").write_bytes(content)
    assert image_set_digest([a / "1.png"]) != image_set_digest([b / "1.png"])
    assert image_set_digest([a / "1.png"]).startswith("1 images, ")


def test_autostop_waits_for_a_run_whose_outputs_were_not_fetched(fake, monkeypatch, tmp_path):
    """Issue 18's behaviour to reach: if the connection does not come back, the cluster stays and its
    autostop waits for a fetch (at most a day). `run` marks the job at its start; the fetch of an
    ended job clears the mark, a peek at a running one does not."""
    import os
    import time

    from xeontune.cluster import autostop_watch

    work = tmp_path / "work"
    jobs = work / "jobs" / "j"
    jobs.mkdir(parents=True)
    head_dir = tmp_path / "head"
    write_outputs(head_dir)
    rec = fake_record(fake)
    local_rec = dataclasses.replace(rec, provider="local")  # whose head's disk is this one
    job = JobInfo(id="j", cluster="c", output_dir=str(head_dir), local_output_dir="", job_dir=str(jobs))
    start.put_head_text(local_rec, job.unfetched_path, "x\n")
    assert autostop_watch.unfetched_jobs(str(work)) == ["job j's outputs not fetched yet"]
    assert "job j's outputs not fetched yet" in autostop_watch.busy_reasons(str(work))
    use_head(monkeypatch, FolderHead())
    fetch.fetch(rec, job, tmp_path / "peek")  # the job runs still: the mark stays
    assert Path(job.unfetched_path).exists()
    (jobs / "rc").write_text("0\n")
    fetch.fetch(rec, job, tmp_path / "final")
    assert not Path(job.unfetched_path).exists() and autostop_watch.unfetched_jobs(str(work)) == []
    start.put_head_text(local_rec, job.unfetched_path, "x\n")
    old = time.time() - autostop_watch.FETCH_WAIT_S - 60
    os.utime(job.unfetched_path, (old, old))
    assert autostop_watch.unfetched_jobs(str(work)) != []  # the day counts from the job's end (issue 29) ...
    os.utime(jobs / "rc", (old, old))
    assert autostop_watch.unfetched_jobs(str(work)) == []  # ... never forever: a day at most after it
