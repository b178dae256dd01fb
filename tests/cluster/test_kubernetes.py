"""`--provider kubernetes` (xeontune/job/engines/kubernetes.py), as far as it can be proven without an API server.

- The manifests validate strictly (unknown fields rejected) against Kubernetes 1.37's schemas, offline
  (kubernetes-validate), and a manifest with an unknown field is rejected: the check can fail.
- `--dry-run` prints YAML that parses back to those manifests; bad inputs are one-line errors.
- The kubectl orchestration against a fake `kubectl` on PATH that records its argv and plays a Job's life:
  create, logs of every pod (prefixed by rank), the Job's end, delete; a failed rank's exit code; Ctrl-C
  and SIGTERM delete the Job too; a create refused for a name in use deletes nothing of the other job's.
- The pod itself: on three network-namespace hosts, each with the host name and /etc/hosts an Indexed Job's
  pod has (``<job>-<i>``, and ``<job>-<i>.<service>`` resolving to pod i), exactly the container's command,
  args, working dir and environment from the manifest (its env, the Secret's keys, JOB_COMPLETION_INDEX)
  train the tiny model's vectors of one process with 3x the batch, in fp32.

What no test here covers (docs/kubernetes.md, "What is tested"): a real API server, scheduler, kubelet,
cluster DNS, PersistentVolume, the image build (Dockerfile), and kubectl's own output formats.
"""

from __future__ import annotations

import contextlib
import fnmatch
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest
import yaml
from packaging.specifiers import SpecifierSet

from tests.checks import assert_same_vectors
from tests.cluster.clusterlib import REPO
from tests.cluster.kubelib import BASE, TRAIN, args_of
from xeontune.errors import UserError, exit_status
from xeontune.job.engines import kubernetes as k8s

VALIDATE = Path(sys.prefix) / "bin" / "kubernetes-validate"


def launch(capsys, *argv: str) -> tuple[int, str, str]:
    """launch_command as the CLI runs it (exit_status: a UserError is one line and exit code 2)."""
    capsys.readouterr()
    args = args_of(*argv)
    rc = exit_status(lambda: k8s.launch_command(args))
    out, err = capsys.readouterr()
    return rc, out, err


def validate(tmp_path: Path, docs: list[dict]) -> subprocess.CompletedProcess[str]:
    path = tmp_path / "manifests.yaml"
    path.write_text(k8s.to_yaml(docs))
    return subprocess.run([str(VALIDATE), "--strict", str(path)], capture_output=True, text=True, timeout=120)


def test_the_manifests_validate_strictly_and_an_unknown_field_fails(tmp_path):
    job = k8s.job_from_args(args_of("-n", "3", *BASE, "--namespace", "team-a", "--env", "HF_TOKEN=secret", "--",
                                    *TRAIN))
    assert [d["kind"] for d in job.docs] == ["Secret", "Service", "Job"]
    checked = validate(tmp_path, job.docs)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert checked.stdout.count("passed") == 3, checked.stdout
    plain = k8s.job_from_args(args_of("-n", "1", *BASE, "--", *TRAIN))  # no --env: no Secret
    assert [d["kind"] for d in plain.docs] == ["Service", "Job"]
    assert validate(tmp_path, plain.docs).returncode == 0

    # the same manifests with one field Kubernetes does not know (a plausible typo): refused, by name
    wrong = json.loads(json.dumps(job.docs))
    wrong[-1]["spec"]["template"]["spec"]["containers"][0]["cpus"] = "4"
    refused = validate(tmp_path, wrong)
    assert refused.returncode != 0 and "cpus" in refused.stdout + refused.stderr, refused.stdout + refused.stderr
    typo = json.loads(json.dumps(job.docs))
    typo[-1]["spec"]["completionsMode"] = typo[-1]["spec"].pop("completionMode")
    assert validate(tmp_path, typo).returncode != 0


def test_dry_run_prints_the_indexed_job_and_headless_service(capsys, monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")  # no kubectl needed
    rc, out, err = launch(capsys, "-n", "3", *BASE, "--env", "HF_TOKEN=s3cret-value", "--dry-run", "--", *TRAIN,
                          "--output-dir", "runs/one", "--validation-prompt", "a <t>", "--validation-prompt", "b")
    assert rc == 0, err
    printed = list(yaml.safe_load_all(out))
    job = k8s.job_from_args(args_of("-n", "3", *BASE, "--env", "HF_TOKEN=s3cret-value", "--", *TRAIN,
                                    "--output-dir", "runs/one", "--validation-prompt", "a <t>",
                                    "--validation-prompt", "b"))
    assert printed == k8s.shown(job.docs)
    assert "s3cret-value" not in out and job.docs[0]["stringData"] == {"HF_TOKEN": "s3cret-value"}

    secret, service, indexed = printed
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["selector"] == {k8s.LABEL: "tj"}
    spec = indexed["spec"]
    assert (spec["completionMode"], spec["completions"], spec["parallelism"]) == ("Indexed", 3, 3)
    pod = spec["template"]["spec"]
    assert pod["subdomain"] == service["metadata"]["name"] == "tj"
    assert spec["template"]["metadata"]["labels"][k8s.LABEL] == "tj"
    [container] = pod["containers"]
    env = {e["name"]: e["value"] for e in container["env"]}
    assert (env["MASTER_ADDR"], env["WORLD_SIZE"], env["OMP_NUM_THREADS"]) == ("tj-0.tj", "3", "4")
    assert "RANK" not in env  # the pod's JOB_COMPLETION_INDEX is its rank (train/world.py)
    assert "HF_TOKEN" not in env and container["envFrom"] == [{"secretRef": {"name": secret["metadata"]["name"]}}]
    assert container["image"] == "registry.example.com/xeontune:0.1"
    assert container["resources"]["limits"] == container["resources"]["requests"] == {"cpu": "4", "memory": "16Gi"}
    assert pod["volumes"] == [{"name": "work", "persistentVolumeClaim": {"claimName": "xeontune-data"}}]
    assert container["volumeMounts"] == [{"name": "work", "mountPath": "/workspace"}]
    assert container["command"] == ["python", "-m", "xeontune.train"] and container["workingDir"] == "/workspace"
    args = container["args"]
    assert args[args.index("--data-dir") + 1] == "/workspace/concept"
    assert args[args.index("--output-dir") + 1] == "/workspace/runs/one"
    assert [args[i + 1] for i, a in enumerate(args) if a == "--validation-prompt"] == ["a <t>", "b"]

    # the default output dir is on the claim too; --env overrides launch's own value, via the Secret alone
    rc, out, _ = launch(capsys, "-n", "2", *BASE, "--env", "OMP_NUM_THREADS=2", "--dry-run", "--", *TRAIN)
    [_, _, indexed] = yaml.safe_load_all(out)
    container = indexed["spec"]["template"]["spec"]["containers"][0]
    assert "/workspace/textual_inversion_output" in container["args"]
    assert "OMP_NUM_THREADS" not in {e["name"] for e in container["env"]}


def kubelet_expand(value: str, defined: dict[str, str]) -> str:
    """The kubelet's expansion of a container's command, args and env values (Kubernetes'
    third_party/forked/golang/expansion, ``Expand`` with ``MappingFuncFor``): ``$$`` is ``$``, ``$(NAME)``
    is NAME's value where defined and stays as written where not, an unterminated ``$(`` and any other
    ``$`` (a trailing one too) stay as written."""
    out: list[str] = []
    i = 0
    while i < len(value):
        if value[i] != "$" or i + 1 == len(value):
            out.append(value[i])
            i += 1
        elif value[i + 1] == "$":
            out.append("$")
            i += 2
        elif value[i + 1] == "(" and (close := value.find(")", i + 2)) != -1:
            name = value[i + 2:close]
            out.append(defined.get(name, f"$({name})"))
            i = close + 1
        else:  # "$(" with no ")" after it, or "$x": both kept, the scan goes on after them
            out.append(value[i:i + 2])
            i += 2
    return "".join(out)


def pod_view(container: dict, secret: dict[str, str] | None = None) -> tuple[dict[str, str], list[str]]:
    """The environment and argv the kubelet gives ``container`` (the Job controller's own variables and
    the image's aside): envFrom's Secret values as they are, then each env value expanded against those
    and the ones before it, then command and args expanded against the whole environment."""
    env = dict(secret or {})
    for item in container["env"]:
        env[item["name"]] = kubelet_expand(item["value"], env)
    return env, [kubelet_expand(word, env) for word in (*container["command"], *container["args"])]


def test_kubelet_expand_is_the_kubelets_rule():
    """The helper against cases of Kubernetes' own expansion tests (expand_test.go), so the next test's
    claim is about the kubelet, not about the helper."""
    defined = {"VAR_A": "A", "VAR_B": "B", "VAR_C": "C", "VAR_REF": "$(VAR_A)", "VAR_EMPTY": ""}
    cases = {"$(VAR_A)-$(VAR_A)": "A-A", "$$(VAR_B)_$(VAR_A)": "$(VAR_B)_A", "f000-$$VAR_A": "f000-$VAR_A",
             "foo\\$(VAR_C)bar": "foo\\Cbar", "$(VAR_A$(VAR_B))": "$(VAR_A$(VAR_B))",
             "$(VAR_A$(VAR_B)": "$(VAR_A$(VAR_B)", "$(VAR_REF)": "$(VAR_A)", "foo$(VAR_EMPTY)bar": "foobar",
             "foo$(VAR_Awhoops!": "foo$(VAR_Awhoops!", "$?_boo_$!": "$?_boo_$!", "$VAR_A": "$VAR_A",
             "$(VAR_DNE)": "$(VAR_DNE)", "$$$$$$(BIG_MONEY)": "$$$(BIG_MONEY)", "$$$$$$$(GOOD_ODDS)": "$$$$(GOOD_ODDS)",
             "$$$$$$$(VAR_A)": "$$$A", "${VAR_A}": "${VAR_A}", "$(VAR_B)_______$(A": "B_______$(A",
             "$(VAR_C)_______$(": "C_______$(", "$(VAR_A)foobarzab$": "Afoobarzab$", "--$($($($($--": "--$($($($($--",
             "$($($($($--foo$(": "$($($($($--foo$(", "$(foo$$var)": "$(foo$$var)", "\n": "\n"}
    assert {value: kubelet_expand(value, defined) for value in cases} == cases


DOLLARS = ["$(HF_TOKEN)", "a $(HF_TOKEN) b", "$$", "$$(HF_TOKEN)", "$", "cost: $5", "$(", "$(HF_TOKEN", "trailing $",
           "$(WORLD_SIZE)$(UNDEFINED)", "${HOME} $HOME", "été $$$ 鍵"]


def test_the_pods_get_args_and_env_values_as_given_whatever_dollars_they_hold(capsys, monkeypatch):
    """The kubelet expands $(NAME) and $$ in a container's command, args and env values: the manifests
    double every $, so that the pod, HF_TOKEN (the Secret's) and WORLD_SIZE defined, runs exactly the argv
    and environment given, as `--dry-run`'s manifests say, never a prompt or path with the token in it."""
    options = k8s.options_from_args(args_of(*BASE, "--mount-path", "/work/$(HF_TOKEN)$$/x$"))
    argv = ["--validation-prompt", *DOLLARS, "--output-dir", "/work/$(HF_TOKEN)$$/x$/out$"]
    secret, _, indexed = k8s.manifests(options, 2, argv, {"HF_TOKEN": "s3cret"})
    [container] = indexed["spec"]["template"]["spec"]["containers"]
    env, pod_argv = pod_view(container, secret["stringData"])
    assert pod_argv == [*k8s.COMMAND, *argv]
    assert env["HF_HOME"] == "/work/$(HF_TOKEN)$$/x$/.cache/huggingface" and env["HF_TOKEN"] == "s3cret"
    assert {item["name"]: env[item["name"]] for item in container["env"]} == k8s.rank_env(options, 2)
    assert container["workingDir"] == options.mount_path  # the kubelet does not expand it
    assert "s3cret" not in json.dumps(indexed)

    # through the CLI: the trainer's options placed on the claim, as `--dry-run` prints them
    monkeypatch.setenv("PATH", "/nonexistent")
    given = ["--validation-prompt", "$(HF_TOKEN) $$ $", "--output-dir", "runs/$(HF_TOKEN)$"]
    rc, out, err = launch(capsys, "-n", "2", *BASE, "--env", "HF_TOKEN=s3cret", "--dry-run", "--", *TRAIN, *given)
    assert rc == 0, err
    [_, _, printed] = yaml.safe_load_all(out)
    job = k8s.job_from_args(args_of("-n", "2", *BASE, "--env", "HF_TOKEN=s3cret", "--", *TRAIN, *given))
    assert printed == job.docs[-1]
    _, pod_argv = pod_view(printed["spec"]["template"]["spec"]["containers"][0], job.docs[0]["stringData"])
    assert pod_argv[pod_argv.index("--validation-prompt") + 1] == "$(HF_TOKEN) $$ $"
    assert pod_argv[pod_argv.index("--output-dir") + 1] == "/workspace/runs/$(HF_TOKEN)$" == k8s.output_dir(job)


BAD = {
    "no -n": ((*BASE, "--dry-run"), "needs -n"),
    "-n 0": (("-n", "0", *BASE, "--dry-run"), "at least one rank"),
    "no image": (("-n", "2", *BASE[2:], "--dry-run"), "needs --image"),
    "no claim": (("-n", "2", *BASE[:2], *BASE[4:], "--dry-run"), "needs --volume-claim"),
    "memory without a unit": (("-n", "2", *BASE, "--memory", "16", "--dry-run"), "--memory '16'"),
    "memory in GB": (("-n", "2", *BASE, "--memory", "16GB", "--dry-run"), "--memory '16GB'"),
    "cpus 0": (("-n", "2", *BASE, "--cpus", "0", "--dry-run"), "--cpus '0'"),
    "cpus word": (("-n", "2", *BASE, "--cpus", "four", "--dry-run"), "--cpus 'four'"),
    "job name": (("-n", "2", *BASE, "--job-name", "My_Job", "--dry-run"), "--job-name 'My_Job'"),
    "claim name": (("-n", "2", *BASE, "--volume-claim", "Data Claim", "--dry-run"), "--volume-claim 'Data Claim'"),
    "namespace": (("-n", "2", *BASE, "--namespace", "team_a", "--dry-run"), "--namespace 'team_a'"),
    "mount path": (("-n", "2", *BASE, "--mount-path", "work", "--dry-run"), "--mount-path 'work'"),
    "ppn": (("-n", "2", "--ppn", "2", *BASE, "--dry-run"), "every rank is a pod"),
    "ccl": (("-n", "2", "--dist-backend", "ccl", *BASE, "--dry-run"), "ccl"),
    "bad env": (("-n", "2", *BASE, "--env", "1X=2", "--dry-run"), "--env"),
    "data off the claim": (("-n", "2", *BASE, "--dry-run", "--", *TRAIN, "--data-dir", "/etc/concept"),
                           "not on the volume claim"),
    "output above the claim": (("-n", "2", *BASE, "--dry-run", "--", *TRAIN, "--output-dir", "../out"),
                               "not on the volume claim"),
    "home path": (("-n", "2", *BASE, "--dry-run", "--", *TRAIN, "--data-dir", "~/concept"), "no home"),
    "training option": (("-n", "2", *BASE, "--dry-run", "--", *TRAIN, "--learning-rate", "fast"),
                        "training options after --"),
    "missing training option": (("-n", "2", *BASE, "--dry-run", "--", "--model", "org/sd"), "--data-dir"),
    "no kubectl": (("-n", "2", *BASE, "--", *TRAIN), "needs kubectl on PATH"),
}


def test_other_providers_flags_are_refused():
    for dest, value, flag in (("region", "us-east-1", "--region"), ("provider_option_partition", "cpu", "--partition"),
                              ("provider_option_spot", True, "--spot")):
        args = args_of("-n", "2", *BASE, "--dry-run", "--", *TRAIN)
        setattr(args, dest, value)  # as `run`'s parser (xeontune/cli.py) holds them
        with pytest.raises(UserError, match=f"^{flag} is"):
            k8s.job_from_args(args)


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_inputs_are_one_line_errors(case, capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))  # no kubectl
    argv, words = BAD[case]
    rc, _, err = launch(capsys, *argv)
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert rc == 2 and len(errors) == 1 and "Traceback" not in err, err
    assert words in errors[0], errors[0]


# --- kubectl's side, played by a fake ---------------------------------------------------------------

FAKE_KUBECTL = r'''#!PYTHON
"""A fake kubectl: records its argv (calls.jsonl) and plays one Indexed Job's life (scenario.json)."""
import json, os, sys, time
from pathlib import Path

state = Path(os.environ["FAKE_KUBE_DIR"])
argv = sys.argv[1:]
with open(state / "calls.jsonl", "a") as f:
    f.write(json.dumps(argv) + "\n")
scenario = json.loads((state / "scenario.json").read_text())
if argv[:1] == ["--namespace"]:
    argv = argv[2:]
verb = argv[0]
deleted = (state / "deleted").exists()


def polls() -> int:
    return len((state / "polls").read_text()) if (state / "polls").exists() else 0


if verb == "create":
    (state / "created.yaml").write_text(sys.stdin.read())
    names = scenario["made"]
    for name in names[: scenario.get("made_before_refusal", len(names))]:
        print(f"{name} created")
    if "refuse" in scenario:
        print(scenario["refuse"], file=sys.stderr)
        sys.exit(1)
elif verb == "get" and argv[1].startswith("job/"):
    with open(state / "polls", "a") as f:
        f.write(".")
    if deleted:
        print(f'Error from server (NotFound): jobs.batch "{argv[1][4:]}" not found', file=sys.stderr)
        sys.exit(1)
    ended = scenario["outcome"] != "never" and polls() >= scenario["polls_to_end"]
    conditions = [{"type": scenario["outcome"], "status": "True"}] if ended else []
    print(json.dumps({"kind": "Job", "status": {"conditions": conditions}}))
elif verb == "get" and argv[1] == "pods":
    items = []
    for i in range(scenario["ranks"]):
        ended = scenario["outcome"] != "never" and polls() >= scenario["polls_to_end"]
        status = {"phase": "Pending", "containerStatuses": [{"state": {"waiting": {"reason": "ContainerCreating"}}}]}
        if polls() >= scenario["polls_to_run"]:
            status = {"phase": "Running", "containerStatuses": [{"state": {"running": {}}}]}
        if ended:
            code = scenario.get("exit_code", 0) if i == scenario.get("failed_index") else 0
            status = {"phase": "Failed" if code else "Succeeded",
                      "containerStatuses": [{"state": {"terminated": {"exitCode": code}}}]}
        if i == scenario.get("bad_image_index") and polls() < scenario["polls_to_run"]:
            status["containerStatuses"] = [{"state": {"waiting": {"reason": "ImagePullBackOff",
                                                                  "message": "Back-off pulling image"}}}]
        items.append({"metadata": {"name": f"tj-{i}-x{i}z", "labels": {"batch.kubernetes.io/job-completion-index": str(i)}},
                      "status": status})
    print(json.dumps({"kind": "List", "items": items}))
elif verb == "logs":
    index = argv[2].split("-")[1]
    print(f"hello from rank {index}", flush=True)
    print(f"step 1 on rank {index}", flush=True)
    while scenario["outcome"] == "never" and not (state / "deleted").exists():
        time.sleep(0.05)
    print(f"done on rank {index}", flush=True)
elif verb == "delete":
    (state / "deleted").write_text("")
    print("deleted")
else:
    print(f"fake kubectl: unexpected {argv}", file=sys.stderr)
    sys.exit(3)
'''

DRIVER = """
import sys
sys.path.insert(0, {tests!r})
from tests.cluster.kubelib import launch_parser
from xeontune.errors import UserError, exit_status
from xeontune.job.engines import kubernetes as k8s
k8s.POLL_S = 0.05
args = launch_parser().parse_args(sys.argv[1:])
sys.exit(exit_status(lambda: k8s.launch_command(args)))
"""


def fake_kubectl(tmp_path: Path, **scenario) -> dict[str, str]:
    """A bin dir with the fake kubectl first on PATH, playing ``scenario``; the environment to run under."""
    bin_dir, state = tmp_path / "bin", tmp_path / "kube"
    bin_dir.mkdir()
    state.mkdir()
    kubectl = bin_dir / "kubectl"
    kubectl.write_text(FAKE_KUBECTL.replace("#!PYTHON", f"#!{sys.executable}", 1))
    kubectl.chmod(0o755)
    made = ["secret/tj-env", "service/tj", "job.batch/tj"]
    (state / "scenario.json").write_text(json.dumps({"ranks": 3, "polls_to_run": 2, "polls_to_end": 5,
                                                     "outcome": "Complete", "made": made, **scenario}))
    return {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "FAKE_KUBE_DIR": str(state)}


def calls(env: dict[str, str]) -> list[list[str]]:
    path = Path(env["FAKE_KUBE_DIR"]) / "calls.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def drive(env: dict[str, str], *argv: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-c", DRIVER.format(tests=str(REPO)), *argv], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


RUN = ("-n", "3", *BASE, "--namespace", "team-a", "--env", "HF_TOKEN=s3cret")


def test_run_creates_follows_every_rank_and_deletes_at_the_end(tmp_path):
    env = fake_kubectl(tmp_path, bad_image_index=1)
    proc = drive(env, *RUN, "--", *TRAIN)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, out + err
    made = calls(env)
    assert all(c[:2] == ["--namespace", "team-a"] for c in made), made
    verbs = [c[2] for c in made]
    assert verbs[0] == "create" and verbs[-1] == "delete" and verbs.count("delete") == 1, verbs
    assert made[0][3:] == ["-f", "-"]
    assert made[-1][3:] == ["secret/tj-env", "service/tj", "job.batch/tj", "--ignore-not-found", "--wait=false"]
    # what was created is what --dry-run prints, values and all (the Secret's value only reaches kubectl)
    created = list(yaml.safe_load_all((tmp_path / "kube" / "created.yaml").read_text()))
    assert created == k8s.job_from_args(args_of(*RUN, "--", *TRAIN)).docs
    # every rank's log, whole lines, prefixed by its rank; followed only once its pod ran
    for rank in range(3):
        assert [line for line in out.splitlines() if line.startswith(f"[{rank}] ")] == [
            f"[{rank}] hello from rank {rank}", f"[{rank}] step 1 on rank {rank}", f"[{rank}] done on rank {rank}"]
    logs = [c for c in made if c[2] == "logs"]
    assert sorted(c[4] for c in logs) == ["pod/tj-0-x0z", "pod/tj-1-x1z", "pod/tj-2-x2z"]
    assert made.index(logs[0]) > 2 * 2  # not before the pods ran (the second poll's pair of gets)
    assert err.count("ImagePullBackOff") == 1 and "rank 1: ImagePullBackOff: Back-off pulling image" in err
    assert "completed" in err and "/workspace/textual_inversion_output on volume claim xeontune-data" in err


def test_a_failed_rank_gives_its_exit_code_and_the_job_is_deleted(tmp_path):
    env = fake_kubectl(tmp_path, outcome="Failed", failed_index=1, exit_code=2)
    proc = drive(env, *RUN, "--", *TRAIN)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 2, out + err
    assert calls(env)[-1][2] == "delete" and "failed (exit code 2)" in err


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP])
def test_ctrl_c_sigterm_or_a_closed_terminal_deletes_the_job(tmp_path, sig):
    env = fake_kubectl(tmp_path, outcome="never")
    proc = drive(env, *RUN, "--", *TRAIN)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and sum(c[2] == "logs" for c in calls(env)) < 3:
            time.sleep(0.05)
        assert sum(c[2] == "logs" for c in calls(env)) == 3, calls(env)
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 128 + sig, out + err
    made = calls(env)
    assert [c[2] for c in made].count("delete") == 1 and made[-1][2] in ("delete", "get", "logs"), made
    assert f"interrupted ({signal.Signals(sig).name}): deleting job tj" in err
    assert "Traceback" not in err, err
    # the log followers ended: each printed its last line once the job was deleted
    assert sorted(line for line in out.splitlines() if line.startswith("[") and "done" in line) == [
        f"[{i}] done on rank {i}" for i in range(3)]


def test_a_name_in_use_is_refused_and_nothing_of_the_other_job_is_deleted(tmp_path):
    """`kubectl create` (never apply): a Job named tj exists already; the Secret was made before the refusal,
    so it alone is deleted, never the other job's Service or Job."""
    env = fake_kubectl(tmp_path, made_before_refusal=1,
                       refuse='Error from server (AlreadyExists): error when creating "STDIN": services "tj" already exists')
    proc = drive(env, *RUN, "--", *TRAIN)
    out, err = proc.communicate(timeout=60)
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert proc.returncode == 2 and len(errors) == 1 and "already exists" in errors[0], out + err
    assert [c[2:] for c in calls(env)] == [
        ["create", "-f", "-"], ["delete", "secret/tj-env", "--ignore-not-found", "--wait=false"]]


# --- the pod's command, on three hosts named as an Indexed Job names its pods ------------------------

COMMON = ("--placeholder-token", "<cat-toy>", "--initializer-token", "toy", "--resolution", "32", "--max-train-steps",
          "2", "--learning-rate", "5e-3", "--seed", "7", "--checkpointing-steps", "0", "--save-steps", "0",
          "--no-random-flip", "--scale-lr", "--mixed-precision", "fp32", "--num-vectors", "2")
NAMESPACE = "default"  # the Kubernetes namespace the pods' own /etc/hosts line names
# Rank 0's pod starts later than the process group's rendezvous waits (its node pulled the image last):
# the pods wait for each other first (train/world.py's wait_for_pods), so the short timeout still guards steps.
DIST_TIMEOUT_S, LATE_S = 6, 10


def pod_hosts(cluster, job: str, service: str, own: int) -> str:
    """/etc/hosts of pod ``own``: its own line as the kubelet writes it (FQDN, then host name), and the other
    pods' names as the cluster DNS answers them through the pods' search path (``<job>-<i>.<service>``)."""
    lines = ["127.0.0.1 localhost"]
    for i, node in enumerate(cluster.nodes):
        names = [f"{job}-{i}.{service}.{NAMESPACE}.svc.cluster.local", f"{job}-{i}"] if i == own else []
        lines.append(" ".join([node.private_ip, *names, f"{job}-{i}.{service}"]))
    return "\n".join(lines) + "\n"


@pytest.mark.slow
@pytest.mark.root
def test_the_pods_command_on_three_hosts_trains_like_one_process_with_three_times_the_batch(
        local_cluster, tiny_model, sample_images, tmp_path):
    """Each network namespace is one pod: its own host name (`unshare --uts`), its /etc/hosts (`ip netns
    exec` binds /etc/netns/<ns>/hosts over /etc/hosts), the claim mounted as the working dir, and exactly
    the container's command, args and environment from the manifest (env, the Secret's keys through
    envFrom, the Job controller's JOB_COMPLETION_INDEX and HOSTNAME; PATH and HOME as the image sets
    them). No GLOO_SOCKET_IFNAME and no MASTER_ADDR but the manifest's: names alone reach rank 0. Rank 0's
    pod starts LATE_S after the others, longer than --dist-timeout."""
    claim = tmp_path / "claim"
    claim.mkdir()
    (claim / "data").symlink_to(sample_images, target_is_directory=True)
    (claim / "tiny").symlink_to(tiny_model, target_is_directory=True)
    job = k8s.job_from_args(args_of("-n", "3", "--image", "local/xeontune:test", "--volume-claim", "claim", "--cpus",
                                    "1", "--memory", "2Gi", "--job-name", "tj", "--mount-path", str(claim),
                                    "--env", "HF_HUB_OFFLINE=1", "--", "--model", "./tiny", "--data-dir", "data",
                                    "--output-dir", "out", "--train-batch-size", "1", "--dist-timeout",
                                    str(DIST_TIMEOUT_S), *COMMON))
    secret, service, indexed = job.docs
    pod = indexed["spec"]["template"]["spec"]
    [container] = pod["containers"]
    assert container["workingDir"] == str(claim) and indexed["spec"]["completions"] == len(local_cluster.nodes)
    home = tmp_path / "home"
    home.mkdir()
    image_env = {"PATH": f"{sys.prefix}/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
                 "HOME": str(home)}  # the Dockerfile's: its venv's bin first
    netns_etc = Path("/etc/netns")
    made_etc = not netns_etc.exists()
    procs: dict[int, subprocess.Popen[str]] = {}
    logs = {}
    # the reference, one process with 3x the batch, trains meanwhile (rank 0's pod starts late)
    one = tmp_path / "one"
    single = subprocess.Popen([sys.executable, "-m", "xeontune.train", "--model", str(tiny_model), "--data-dir",
                               str(sample_images), "--output-dir", str(one), "--train-batch-size", "3", *COMMON],
                              cwd=REPO, stdout=subprocess.DEVNULL, stderr=(tmp_path / "one.log").open("w"),
                              text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    deadline = time.monotonic() + 300
    try:
        for i, node in reversed(list(enumerate(local_cluster.nodes))):  # rank 0's pod last, and late
            if i == 0:
                time.sleep(LATE_S)
            etc = netns_etc / node.resource_id
            etc.mkdir(parents=True, exist_ok=True)
            (etc / "hosts").write_text(pod_hosts(local_cluster, "tj", pod["subdomain"], i))
            pod_env, pod_argv = pod_view(container, secret["stringData"])  # as the kubelet expands them
            env = {**image_env, **pod_env, "JOB_COMPLETION_INDEX": str(i), "HOSTNAME": f"tj-{i}"}
            argv = ["ip", "netns", "exec", node.resource_id, "unshare", "--uts", "sh", "-c",
                    'hostname "$0" && exec "$@"', f"tj-{i}", "env", "-i", *(f"{k}={v}" for k, v in env.items()),
                    *pod_argv]
            logs[i] = (tmp_path / f"pod-{i}.log").open("w+")
            procs[i] = subprocess.Popen(argv, cwd=container["workingDir"], stdout=logs[i], stderr=subprocess.STDOUT,
                                        text=True)
        for proc in [*procs.values(), single]:
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        for proc in [*procs.values(), single]:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        for node in local_cluster.nodes:
            (netns_etc / node.resource_id / "hosts").unlink(missing_ok=True)
            with contextlib.suppress(OSError):
                (netns_etc / node.resource_id).rmdir()
        if made_etc:
            with contextlib.suppress(OSError):
                netns_etc.rmdir()
    output = {}
    for i, log in sorted(logs.items()):
        log.seek(0)
        output[i] = log.read()
        log.close()
        assert procs[i].returncode == 0, f"pod {i}:\n{output[i][-3000:]}"
    assert "loopback" not in "".join(output.values()).lower()  # gloo found each pod's address by its name

    assert single.returncode == 0, (tmp_path / "one.log").read_text()[-3000:]
    diff = assert_same_vectors(claim / "out", one, atol=1e-5)
    steps = [json.loads(line)["step"] for line in (claim / "out" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2]  # rank 0 alone logs, once a step
    print(f"3 pods vs 1 process with 3x the batch: max abs difference {diff:.2e}")


# --- the image ----------------------------------------------------------------------------------------


def dockerignored(path: str, patterns: list[str]) -> bool:
    """Whether the build context leaves ``path`` out (.dockerignore's patterns as this file uses them:
    names, globs, and ``**/`` for any folder)."""
    parts = path.split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    for pattern in patterns:
        if pattern.startswith("**/"):
            if any(fnmatch.fnmatchcase(part, pattern[3:]) for part in parts):
                return True
        elif any(fnmatch.fnmatchcase(prefix, pattern) for prefix in prefixes):
            return True
    return False


def test_the_dockerfile_builds_the_package_the_pods_run(tmp_path):
    """The image build cannot run here (no registry, no builder): what it is made of is checked instead.
    The files it copies, as the build context holds them (.dockerignore), build the package's wheel."""
    text = (REPO / "Dockerfile").read_text()
    project = (REPO / "pyproject.toml").read_text()  # (tomllib is 3.11's; the project supports 3.10)
    base = re.search(r"^FROM python:(\d+\.\d+)-slim\S*$", text, re.MULTILINE)
    requires = re.search(r'^requires-python = "([^"]+)"$', project, re.MULTILINE)
    assert base and requires and SpecifierSet(requires[1]).contains(base[1] + ".0"), (base, requires)
    [torch_pin] = re.findall(r'^\s*"torch==([^"]+)",', project, re.MULTILINE)
    assert re.search(rf"^ARG TORCH_VERSION={re.escape(torch_pin)}$", text, re.MULTILINE)
    assert 'pip install --index-url https://download.pytorch.org/whl/cpu "torch==${TORCH_VERSION}"' in text
    # the manifests' command: the venv's python, first on PATH, with xeontune installed into it
    assert k8s.COMMAND == ["python", "-m", "xeontune.train"]
    assert "python -m venv /opt/venv" in text and re.search(r"PATH=/opt/venv/bin:\$PATH", text)
    assert re.search(rf"^WORKDIR {k8s.DEFAULT_MOUNT}$", text, re.MULTILINE)

    ignore = [line.strip() for line in (REPO / ".dockerignore").read_text().splitlines()
              if line.strip() and not line.startswith("#")]
    for local_state in (".git", ".venv", ".venv-ipex", "models", "data/sample", "textual_inversion_output",
                        "xeontune/__pycache__/cli.cpython-311.pyc"):
        assert dockerignored(local_state, ignore), local_state
    sources = [src for line in re.findall(r"^COPY (.+)$", text, re.MULTILINE) for src in line.split()[:-1]]
    assert sorted(sources) == ["README.md", "pyproject.toml", "xeontune"]
    context = tmp_path / "src"
    for src in sources:
        assert (REPO / src).exists() and not dockerignored(src, ignore), src
        paths = [REPO / src] if (REPO / src).is_file() else sorted((REPO / src).rglob("*"))
        for path in paths:
            rel = path.relative_to(REPO).as_posix()
            if path.is_file() and not dockerignored(rel, ignore):
                (context / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(path, context / rel)
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                            str(tmp_path / "wheel"), str(context)], capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stdout[-2000:] + built.stderr[-2000:]
    [wheel] = (tmp_path / "wheel").glob("xeontune-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert {"xeontune/train/__main__.py", "xeontune/job/engines/kubernetes.py", "xeontune/py.typed"} <= set(names)
    assert not [name for name in names if "__pycache__" in name]


def test_detach_creates_the_job_and_leaves_it_running(tmp_path):
    env = fake_kubectl(tmp_path, outcome="never")
    proc = drive(env, *RUN, "--detach", "--", *TRAIN)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, out + err
    assert [c[2] for c in calls(env)] == ["create"]
    assert "kubectl --namespace team-a logs -f --prefix -l xeontune.io/job=tj" in out
    assert "kubectl --namespace team-a delete job,service,secret -l xeontune.io/job=tj" in out
