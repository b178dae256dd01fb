"""`--provider ray` against a real local Ray cluster: a head and two workers, one CPU each, started by
``ray start`` in this module (three Ray nodes on this machine, so one filesystem: shared by nature)."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.checks import rank_pids
from tests.cluster.clusterlib import require_installed
from tests.trainlib import assert_same_unet, full_args, train_in_process
from xeontune.errors import UserError

REPO = Path(__file__).resolve().parents[2]
STEPS, EVERY = 6, 2  # the restart test: a checkpoint every 2 steps, two restarts, 2 steps after
PAUSE = "XEONTUNE_TEST_PAUSE=alone:0:1"  # rank 0 rests 1 s after each step: a window to kill or stop in


@dataclass
class RayCluster:
    address: str
    temp: str  # the nodes' temp dirs and logs
    env: dict[str, str]  # what runs the CLI against it
    procs: list[subprocess.Popen] = field(default_factory=list)  # one `ray start --block` per node

    def node(self, name: str, *first: str, wrap: list[str] | None = None) -> subprocess.Popen:
        """Start a node (``first``: --head ... or --address ...), in a session of its own."""
        common = ["--num-cpus", "1", "--node-ip-address", "127.0.0.1", "--object-store-memory", str(100 * 2**20),
                  "--disable-usage-stats", "--block", "--temp-dir", os.path.join(self.temp, name)]
        with open(os.path.join(self.temp, f"{name}.log"), "w") as log:
            proc = subprocess.Popen([*(wrap or []), str(Path(sys.executable).parent / "ray"), "start", *first,
                                     *common], env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        self.procs.append(proc)
        return proc

    def wait_for_nodes(self, count: int) -> None:
        wait = ("import ray, sys, time\n"
                "for _ in range(240):\n"
                "    try:\n"
                "        ray.init(address=sys.argv[1], logging_level='WARNING', log_to_driver=False)\n"
                "        break\n"
                "    except Exception:\n"
                "        time.sleep(0.5)\n"
                "while sum(n['Alive'] for n in ray.nodes()) < int(sys.argv[2]):\n"
                "    time.sleep(0.3)\n")
        up = subprocess.run([sys.executable, "-c", wait, self.address, str(count)], env=self.env, timeout=180,
                            capture_output=True, text=True)
        assert up.returncode == 0, up.stderr[-2000:]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# Prints, as JSON, what of xeontune's runs is left on the cluster: Ray jobs still alive and actors still
# alive (Ray's own detached singletons aside), once none is left or after argv[2] seconds.
LEFT = """
import json, sys, time
import ray
from ray._private import state
ray.init(address=sys.argv[1], logging_level="WARNING", log_to_driver=False)
me = ray.get_runtime_context().get_job_id()
deadline = time.monotonic() + float(sys.argv[2])
while True:
    jobs = [j["JobID"] for j in state.jobs() if not j["IsDead"] and j["JobID"] != me]
    actors = [a["ActorClassName"] for a in state.actors().values()
              if a["State"] == "ALIVE" and not (a["IsDetached"] and a["ActorClassName"].startswith("_"))]
    if not (jobs or actors) or time.monotonic() > deadline:
        break
    time.sleep(0.5)
print(json.dumps({"jobs": jobs, "actors": actors, "free_cpus": ray.available_resources().get("CPU", 0)}))
"""


def left_on(cluster: RayCluster, wait_s: float = 30.0) -> dict:
    out = subprocess.run([sys.executable, "-c", LEFT, cluster.address, str(wait_s)], capture_output=True, text=True,
                         timeout=wait_s + 60, env=cluster.env)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def _in_session(sid: int) -> list[int]:
    """The live processes of session ``sid`` (one `ray start` began it: its node's GCS, raylet, workers)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            if int(fields[3]) == sid and fields[0] != "Z":  # a zombie is dead already
                found.append(int(entry.name))
    return found


def _kill_session(sid: int) -> None:
    """SIGKILL every process of the session until none is left."""
    for _ in range(50):
        pids = _in_session(sid)
        if not pids:
            return
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.2)


@pytest.fixture(scope="module")
def ray_cluster():
    require_installed(None if importlib.util.find_spec("ray") else "needs ray (the [ray] extra)")
    temp = tempfile.mkdtemp(prefix="xtr-", dir="/tmp")  # short: Ray's socket paths must fit 107 bytes
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "HF_HUB_OFFLINE": "1",
           "PATH": f"{Path(sys.executable).parent}:{os.environ.get('PATH', '/usr/bin:/bin')}"}
    env.pop("RAY_ADDRESS", None)
    cluster = RayCluster(f"127.0.0.1:{_free_port()}", temp, env)
    try:
        cluster.node("head", "--head", "--port", cluster.address.rsplit(":", 1)[1], "--include-dashboard", "false")
        cluster.wait_for_nodes(1)
        for name in ("worker1", "worker2"):
            cluster.node(name, "--address", cluster.address)
        cluster.wait_for_nodes(3)
        yield cluster
    finally:
        # Hard, at once: a node's graceful stop drains for up to 30 s, and nothing of it need survive
        # (`ray stop --force` would do the same to every Ray cluster on this machine, not only these).
        for proc in cluster.procs:
            _kill_session(proc.pid)  # each `ray start` leads the session it began
            proc.wait(timeout=30)
        shutil.rmtree(temp, ignore_errors=True)


def _options(tiny_model, sample_images, out: Path | None, steps: int = STEPS) -> list[str]:
    return ["--model", str(tiny_model), "--data-dir", str(sample_images), "--placeholder-token", "<toy-bot>",
            "--initializer-token", "toy", "--resolution", "32", "--max-train-steps", str(steps),
            "--checkpointing-steps", str(EVERY), "--save-steps", "0", "--mixed-precision", "fp32",
            "--learning-rate", "5e-3", "--no-random-flip", *(["--output-dir", str(out)] if out else [])]


def _cli(cluster: RayCluster, home: Path, *argv: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "xeontune.cli", *argv], capture_output=True, text=True,
                          timeout=timeout, env={**cluster.env, "XEONTUNE_HOME": str(home)}, cwd=REPO)


def _cli_popen(cluster: RayCluster, home: Path, log: Path, *argv: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "xeontune.cli", *argv], stdout=log.open("w"),
                            stderr=subprocess.STDOUT, env={**cluster.env, "XEONTUNE_HOME": str(home)}, cwd=REPO)


def _wait_for_ranks(marker: str, count: int, timeout_s: float = 240, alive=lambda: True) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while len(pids := rank_pids(marker)) < count and time.monotonic() < deadline and alive():
        time.sleep(0.2)
    assert len(pids) == count, f"{len(pids)} of {count} ranks started"
    return pids


def _gone(pids: list[int], timeout_s: float = 30) -> bool:
    deadline = time.monotonic() + timeout_s
    while any(Path(f"/proc/{p}").exists() for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    return not any(Path(f"/proc/{p}").exists() for p in pids)


def _assert_nothing_left(cluster: RayCluster) -> None:
    left = left_on(cluster)
    assert left["jobs"] == [] and left["actors"] == [], left
    assert left["free_cpus"] == 3, left


# --- on the cluster -------------------------------------------------------------------------------


def _wait_for_checkpoint(out: Path, step: int, timeout_s: float = 240, alive=lambda: True) -> None:
    deadline = time.monotonic() + timeout_s
    while not (out / f"checkpoint-{step}" / "complete.json").is_file() and time.monotonic() < deadline and alive():
        time.sleep(0.1)
    assert (out / f"checkpoint-{step}" / "complete.json").is_file(), f"no checkpoint-{step}"


@pytest.mark.slow
def test_run_on_three_ray_workers_restarts_after_a_killed_rank_or_worker_and_trains_what_one_process_does(
        ray_cluster, tiny_model, sample_images, tmp_path):
    """`xeontune run --provider ray -n 3`: 3 Ray Train workers of 1 CPU, each rank batch 1 and one thread
    (Ray's CPUs, said so), fine-tuning the whole UNet with the optimizer state sharded over them (issue 49:
    every engine runs it unchanged). SIGKILL to one rank's trainer after checkpoint-2: its worker raises;
    then, in the restarted group, SIGKILL to the Ray worker that hosts a rank after checkpoint-4: the rank
    goes with it (its parent-death signal). Each time Ray restarts the worker group (FailureConfig), whose
    ranks resume from the newest checkpoint (its optimizer state gathered to rank 0 when written, each
    rank's third taken back): the UNet equals 1 process with 3x the batch (fp32). The cluster is
    forgotten after, and nothing of the run is left on Ray. (One run for all: each worker group's start
    costs this 2-core machine tens of seconds.)"""
    out, log = tmp_path / "out", tmp_path / "run.log"
    full = lambda out, batch: full_args(tiny_model, sample_images, out, batch, STEPS,  # noqa: E731
                                        "--checkpointing-steps", str(EVERY), "--shard", "optimizer", "--scale-lr")
    proc = _cli_popen(ray_cluster, tmp_path / "home", log, "run", "--provider", "ray", "--address",
                      ray_cluster.address, "-n", "3", "--env", PAUSE, "--", *full(out, 1))
    alive = lambda: proc.poll() is None  # noqa: E731
    try:
        _wait_for_checkpoint(out, EVERY, alive=alive)
        os.kill(_wait_for_ranks(str(out), 3, alive=alive)[-1], signal.SIGKILL)
        _wait_for_checkpoint(out, 2 * EVERY, alive=alive)
        rank = _wait_for_ranks(str(out), 3, alive=alive)[-1]
        worker = int((Path(f"/proc/{rank}/stat").read_text().rsplit(")", 1)[1].split())[1])  # the rank's parent
        assert Path(f"/proc/{worker}/cmdline").read_bytes().startswith(b"ray::"), "not a Ray worker"
        os.kill(worker, signal.SIGKILL)
        rc = proc.wait(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    said = log.read_text()
    assert rc == 0, said[-5000:]
    assert "OMP_NUM_THREADS=1" in said and "[0] wrote " in said
    assert "was killed (SIGKILL)" in said
    assert f"Ray restarted the worker group (start 2 of at most 4): resuming from checkpoint-{EVERY}" in said
    assert f"Ray restarted the worker group (start 3 of at most 4): resuming from checkpoint-{2 * EVERY}" in said
    assert json.loads((out / "train_config.json").read_text())["world_size"] == 3
    assert "optimizer state sharded over the ranks (ZeRO-1)" in said
    train_in_process([*full(tmp_path / "one", 3), "--shard", "none"])
    assert_same_unet(out / "pipeline", tmp_path / "one" / "pipeline", tiny_model)
    assert not (tmp_path / "home" / "clusters").exists() or not any((tmp_path / "home" / "clusters").iterdir())
    _assert_nothing_left(ray_cluster)


@pytest.mark.slow
def test_ctrl_c_to_an_attached_run_leaves_no_ray_job_actor_or_rank(ray_cluster, tiny_model, sample_images, tmp_path):
    out = tmp_path / "out"
    log = tmp_path / "run.log"
    proc = _cli_popen(ray_cluster, tmp_path / "home", log, "run", "--provider", "ray", "--address",
                      ray_cluster.address, "-n", "3", "--env", PAUSE, "--",
                      *_options(tiny_model, sample_images, out, steps=200))
    try:
        pids = _wait_for_ranks(str(out), 3, alive=lambda: proc.poll() is None)
        proc.send_signal(signal.SIGINT)
        rc = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert rc == 130, log.read_text()[-4000:]
    assert _gone(pids), "a rank outlived the Ctrl-C"
    _assert_nothing_left(ray_cluster)


@pytest.mark.slow
def test_teardown_of_a_detached_launch_stops_it_and_leaves_no_ray_job_actor_or_rank(
        ray_cluster, tiny_model, sample_images, tmp_path):
    home = tmp_path / "home"
    assert _cli(ray_cluster, home, "cluster", "up", "--provider", "ray", "--address", ray_cluster.address, "-n", "3",
                "--name", "td").returncode == 0
    out = tmp_path / "out"
    started = _cli(ray_cluster, home, "launch", "--name", "td", "--detach", "--env", PAUSE, "--",
                   *_options(tiny_model, sample_images, out, steps=200))
    assert started.returncode == 0, started.stdout + started.stderr
    pids = _wait_for_ranks(str(out), 3)
    env_file = Path(json.loads((home / "clusters" / "td" / "job.json").read_text())["job_dir"], "env")
    assert env_file.is_file()  # the --env values: read by each start of the worker group, never on a command line
    shown = _cli(ray_cluster, home, "logs", "--name", "td")  # the detached job's log so far
    assert shown.returncode == 0 and "Ray Train run of 3 worker(s)" in shown.stdout, shown.stdout + shown.stderr
    down = _cli(ray_cluster, home, "teardown", "--name", "td")
    assert down.returncode == 0, down.stdout + down.stderr
    assert "stopping job" in down.stderr and "torn down" in down.stdout, down.stdout + down.stderr
    assert _gone(pids), "a rank outlived the teardown"
    assert not env_file.exists()  # the run is over: the --env values went with it
    _assert_nothing_left(ray_cluster)
    assert _cli(ray_cluster, home, "teardown", "--name", "td").returncode == 0  # again: nothing to do


@pytest.mark.slow
@pytest.mark.root
def test_a_node_that_does_not_see_the_output_dir_is_refused_in_one_line(ray_cluster, tiny_model, sample_images,
                                                                        tmp_path):
    """A fourth Ray node whose filesystem differs: it runs in a mount namespace of its own, where a
    tmpfs hides --output-dir's folder. The driver's check from every node names it, before any worker
    starts. (Last in this module: the node stays until the module's cluster stops.)"""
    require_installed(None if os.geteuid() == 0 else "needs root (a mount namespace for the fourth node)")
    assert shutil.which("unshare"), "unshare (util-linux) is missing: the fourth node needs it"
    hidden = tmp_path / "hidden"
    hidden.mkdir()
    node = ray_cluster.node(
        "worker3", "--address", ray_cluster.address,
        wrap=["unshare", "-m", "--propagation", "private", "sh", "-c",
              f'mount -t tmpfs tmpfs {hidden} && exec "$@"', "sh"])
    ray_cluster.wait_for_nodes(4)
    done = _cli(ray_cluster, tmp_path / "home", "run", "--provider", "ray", "--address", ray_cluster.address, "-n",
                "3", "--", *_options(tiny_model, sample_images, hidden / "out"))
    errors = [line for line in done.stderr.splitlines() if line.startswith("error: ")]
    assert done.returncode == 2, done.stdout + done.stderr
    assert len(errors) == 1 and errors[0].startswith("error: the Ray node ") and "(--output-dir)" in errors[0], errors
    assert "must share this machine's filesystem" in errors[0]
    assert not (hidden / "out").exists()  # the check leaves nothing behind
    assert node.poll() is None


# --- without a cluster ----------------------------------------------------------------------------


def test_without_ray_installed_provider_ray_says_how_to_install_it_in_one_line(tiny_model, sample_images, tmp_path):
    """Ray hidden from the import system (``sys.modules['ray'] = None``): `run` and `cluster up` stop
    before anything starts, with the install hint."""
    hide = "import sys; sys.modules['ray'] = None; from xeontune.cli import main; sys.exit(main(sys.argv[1:]))"
    env = {**os.environ, "XEONTUNE_HOME": str(tmp_path / "home")}
    for argv in (["run", "--provider", "ray", "--address", "127.0.0.1:1", "-n", "2", "--",
                  *_options(tiny_model, sample_images, tmp_path / "out")],
                 ["cluster", "up", "--provider", "ray", "--address", "127.0.0.1:1", "-n", "2"]):
        done = subprocess.run([sys.executable, "-c", hide, *argv], capture_output=True, text=True, timeout=120,
                              env=env, cwd=REPO)
        errors = [line for line in done.stderr.splitlines() if line.startswith("error: ")]
        assert done.returncode == 2, done.stdout + done.stderr
        assert errors == ["error: --provider ray needs Ray: install it with pip install 'xeontune[ray]'"], done.stderr
    assert not (tmp_path / "out").exists()


def test_a_node_that_does_not_see_the_shared_paths_is_refused_in_one_line(tmp_path):
    """The driver's check: each node reads the marker written into the storage path and --output-dir, and
    looks for the paths the ranks read; the first node that misses one is named, with what it is."""
    from xeontune.job.engines.ray import look, unshared

    mark = tmp_path / "storage" / ".xeontune-shared-ab"
    mark.parent.mkdir()
    mark.write_text("ab")
    assert look({str(mark): "ab"}, [str(tmp_path)]) is None  # the driver's own node
    assert look({str(mark): "other node's file"}, []) == str(mark)  # a same-named path elsewhere
    assert look({str(mark): "ab"}, [str(tmp_path / "data")]) == str(tmp_path / "data")
    assert unshared({"n1": None, "n2": None}, {}) is None
    error = unshared({"n1": None, "n2": str(mark)}, {str(mark): "the run's storage path"})
    assert error.startswith(f"the Ray node n2 does not see {mark} (the run's storage path): ") and "\n" not in error


def test_workers_per_node_follow_ppn_and_the_nodes_cpus():
    from xeontune.cluster.providers.ray import layout
    from xeontune.cluster.state import ClusterRecord

    record = ClusterRecord(name="r", provider="ray", address="h:6379", extra={"cpus": "8,8,4", "ranks": "3"})
    assert layout(record, 3, 1) == 4  # one worker a node: the smallest node's CPUs each
    assert layout(record, 4, 2) == 2
    assert layout(record, 1, 4) == 4  # fewer ranks than --ppn share a node's CPUs
    with pytest.raises(UserError, match="needs 6 Ray workers of 4"):
        layout(record, 6, 1)
    with pytest.raises(UserError, match="--ppn 8 is more ranks per node"):
        layout(record, 8, 8)


def test_a_restart_resumes_from_this_jobs_newest_complete_checkpoint(tmp_path):
    from xeontune.job.engines.ray import resume_args

    out = tmp_path / "out"
    (out / "checkpoint-2").mkdir(parents=True)
    (out / "checkpoint-2" / "complete.json").write_text("{}")  # another run's, before this job started
    time.sleep(0.01)
    started = tmp_path / "started"
    started.write_text("1\n")
    assert resume_args(str(out), str(started), []) == ([], "starting as first given")
    time.sleep(0.01)
    (out / "train_config.json").write_text("{}")
    assert resume_args(str(out), str(started), [])[0] == ["--overwrite"]
    assert resume_args(str(out), str(started), ["--resume-from-checkpoint", "latest"])[0] == []
    for step in (4, 6):
        (out / f"checkpoint-{step}").mkdir()
    (out / "checkpoint-4" / "complete.json").write_text("{}")  # checkpoint-6 is incomplete
    assert resume_args(str(out), str(started), [])[0] == ["--resume-from-checkpoint", str(out / "checkpoint-4")]


def test_a_node_that_cannot_run_the_check_is_named_in_one_line(tmp_path):
    """The check's task fails on a node (xeontune not importable there: another venv): one line naming the
    node, not Ray's traceback; and the driver's markers are gone."""
    require_installed(None if importlib.util.find_spec("ray") else "needs ray (the [ray] extra)")
    from xeontune.job.engines import ray as engine

    class Task:
        def options(self, **_options):
            return self

        def remote(self, *_args):
            return "ref"

    class FakeRay:
        def remote(self, **_options):
            return lambda fn: Task()

        def get(self, ref, timeout=None):
            raise RuntimeError("ray.exceptions.RayTaskError: ...\nModuleNotFoundError: No module named 'xeontune'")

    with pytest.raises(UserError) as caught:
        engine.check_shared(FakeRay(), ["a9" * 28], tmp_path / "storage", tmp_path / "out", [], engine)
    assert str(caught.value).startswith(f"the Ray node {'a9' * 28} could not run xeontune's check (ModuleNotFoundError: No "
                                        "module named 'xeontune'): ") and "\n" not in str(caught.value)
    assert list((tmp_path / "storage").iterdir()) == [] and not (tmp_path / "out").exists()


ENV_VALUES = {
    "PEM": "-----BEGIN PRIVATE KEY-----\nMIIEv\nQ==\n-----END PRIVATE KEY-----\n",
    "QUOTES": "it's \"quoted\" '' \\ end",
    "EQUALS": "a=b==c=",
    "NON_ASCII": "mot de passe: été 鍵 🔑",
    "SHELLISH": "$HOME `id` $(id) # not a comment; \t tab",
    "CRLF": "line one\r\nline two",
    "EMPTY": "",
    "SPACES": "  both ends  ",
}


def test_env_values_reach_the_ray_ranks_exactly_as_given_and_as_sh_reads_them(tmp_path):
    """--env values round-trip through the job's env file (written by ``write_secret_env``) into each
    worker's rank environment: newlines, quotes, '=' and non-ASCII included; and sh (mpirun's and srun's
    ranks source the same file) reads the same values."""
    from xeontune.cluster.state import ClusterRecord
    from xeontune.job.engines.ray import read_env_file
    from xeontune.job.start import write_secret_env

    record = ClusterRecord(name="r", provider="ray", address="h:6379")
    job_dir = tmp_path / "job"
    write_secret_env(record, str(job_dir), ENV_VALUES)
    path = job_dir / "env"
    assert read_env_file(str(path)) == ENV_VALUES
    dump = "import json, os, sys; print(json.dumps({k: os.environ[k] for k in sys.argv[1:]}))"
    sourced = subprocess.run(["sh", "-c", 'set -a && . "$0" && exec "$@"', str(path), sys.executable, "-c", dump,
                              *ENV_VALUES], capture_output=True, text=True, encoding="utf-8", check=True,
                             env={"PATH": os.environ.get("PATH", ""), "LC_ALL": "C.UTF-8"})
    assert json.loads(sourced.stdout) == ENV_VALUES
    assert read_env_file(None) == {} and read_env_file(str(tmp_path / "gone")) == {}


def test_the_ranks_statuses_decide_between_done_a_user_error_and_a_restart():
    from xeontune.job.engines.ray import job_status

    assert job_status([0, 0, 0]) == 0
    assert job_status([2, 1, 1]) == 2  # rank 0's one-line error; the others stopped as it left: not retried
    assert job_status([0, -9, 1]) is None  # killed: Ray restarts the group
    assert job_status([1, 1, 1]) is None


def test_an_address_where_nothing_answers_is_one_line_at_once(xeontune_home, capsys):
    """`ray.init` retries a dead GCS address for minutes (seen: over 2 min of silence); `up` says in one
    line that nothing answers there, before Ray is asked."""
    from xeontune.cli import main

    require_installed(None if importlib.util.find_spec("ray") else "needs ray (the [ray] extra)")
    port = _free_port()  # closed again: nothing listens there
    started = time.monotonic()
    assert main(["cluster", "up", "--provider", "ray", "--address", f"127.0.0.1:{port}", "-n", "2",
                 "--name", "gone"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: cannot reach the Ray cluster at 127.0.0.1:{port}: nothing answers there (Connection "
                   "refused); is `ray start --head` running, and is this its GCS port (6379 by default)?"]
    assert time.monotonic() - started < 15
