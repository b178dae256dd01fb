"""Kubernetes: the ranks as the pods of an Indexed Job on the user's own cluster, driven by `kubectl`.

`xeontune launch --provider kubernetes -n N --dry-run -- <train options>` prints the manifests;
without --dry-run (and `xeontune run --provider kubernetes`) they are created with the user's
kubeconfig, every pod's log is followed (each line prefixed ``[rank]``, as mpirun's are), and the Job
and everything made with it are deleted at the end, whatever happened (Ctrl-C, SIGTERM, SIGHUP too).
There is no `cluster up`: the cluster is the user's.

What is made (``manifests``):

- a headless Service (``clusterIP: None``, ``publishNotReadyAddresses``: a pod's DNS name exists as
  soon as it has an address, before any readiness), whose name is the pods' ``subdomain``: pod ``i`` is
  ``<job>-<i>.<service>`` (an Indexed Job names each pod's host ``<job>-<i>``);
- an Indexed Job: ``completions = parallelism = N``, one rank per pod, ``backoffLimit: 0`` (a rank
  that fails cannot rejoin a running process group: the Job fails and its other pods are stopped).
  Each pod's rank is its ``JOB_COMPLETION_INDEX``, which the trainer reads (``train/world.py``);
  WORLD_SIZE, MASTER_ADDR (the index-0 pod's DNS name) and MASTER_PORT are in its environment.
  Requests = limits = ``--cpus`` / ``--memory`` (a Guaranteed pod), OMP_NUM_THREADS = whole CPUs.
  The PersistentVolumeClaim ``--volume-claim`` is mounted at ``--mount-path`` (the working dir):
  --data-dir, --output-dir, --class-data-dir, a checkpoint path and a relative --model are on it;
  the hub cache too (HF_HOME), so a model is downloaded once, not once per pod and run;
- with ``--env``, a Secret whose keys every pod gets (``envFrom``): values never appear in the Job,
  and `--dry-run` does not print them.

Nothing here needs an API server until ``run_command`` calls kubectl; ``manifests`` is pure.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import posixpath
import re
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from xeontune.errors import UserError

LABEL = "xeontune.io/job"  # on everything made for a job: the Service selects the pods by it
INDEX_LABEL = "batch.kubernetes.io/job-completion-index"  # set on each pod by the Job controller
MASTER_PORT = 29500  # torch's own default rendezvous port
DEFAULT_MOUNT = "/workspace"
CONTAINER = "rank"
COMMAND = ["python", "-m", "xeontune.train"]  # the image's python (Dockerfile: /opt/venv first on PATH)
POLL_S = 2.0  # how often the Job and its pods are asked about while they run
LOG_DRAIN_S = 15.0  # after the Job ended, how long its pods' last log lines may take to arrive
KUBECTL_TIMEOUT_S = 120.0  # one kubectl call (not a log follower)
GET_FAILURES = 15  # consecutive failed `kubectl get`s (an API server gone) before giving up
SECRET_SHOWN = "<--env {key}: not shown>"
# A Job's name is a DNS label (its pods' host names, <job>-<index>, must stay one: 63 characters).
NAME_RE = re.compile(r"[a-z]([-a-z0-9]{0,50}[a-z0-9])?")
NAMESPACE_RE = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")  # a DNS label
CLAIM_RE = re.compile(r"[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?")  # a DNS subdomain
MEMORY_RE = re.compile(r"(\d+(?:\.\d+)?)(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E)")
CPU_RE = re.compile(r"(\d+(?:\.\d+)?)(m?)")
# Waiting reasons of a pod's container worth one line to the user (it may never start otherwise).
WAITING_SAID = ("ErrImagePull", "ImagePullBackOff", "InvalidImageName", "CreateContainerConfigError",
                "CreateContainerError", "CrashLoopBackOff")
# Options of other providers that `run`'s parser may carry: a value given for one is a mistake here.
FOREIGN_OPTIONS = {"region": "--region", "instance_type": "--instance-type", "ssh_cidr": "--ssh-cidr",
                   "autostop": "--autostop", "keep": "--keep", "address": "--address"}
OTHER_PROVIDERS_DEST = "provider_option_"  # argparse dests of the other providers' own flags (cli.py)


@dataclass
class KubernetesOptions:
    """What the Kubernetes-only flags say (``add_arguments``), checked (``check``)."""

    image: str  # the container image every pod runs (Dockerfile)
    volume_claim: str  # a PersistentVolumeClaim (ReadWriteMany for more than one node) with data and outputs
    cpus: str  # a Kubernetes CPU quantity per pod: "8", "7.5", "7500m"
    memory: str  # a Kubernetes memory quantity per pod: "32Gi", "30000M"
    job_name: str  # the Job's, Service's (and Secret's) name
    namespace: str | None = None  # None: the kubeconfig context's
    mount_path: str = DEFAULT_MOUNT  # where the claim is mounted in each pod, and its working dir
    master_port: int = MASTER_PORT

    @property
    def service(self) -> str:
        return self.job_name

    @property
    def secret(self) -> str:
        return f"{self.job_name}-env"

    @property
    def master_addr(self) -> str:
        """The index-0 pod's DNS name, as every pod of the namespace resolves it."""
        return f"{self.job_name}-0.{self.service}"

    @property
    def threads(self) -> int:
        """OMP_NUM_THREADS: the pod's whole CPUs (a fraction of one would oversubscribe it)."""
        number, milli = CPU_RE.fullmatch(self.cpus).groups()  # type: ignore[union-attr]
        return max(1, math.floor(float(number) / (1000 if milli else 1)))

    def check(self) -> None:
        """One-line UserErrors for what Kubernetes would refuse, or what could not work."""
        if not self.image or any(c.isspace() for c in self.image):
            raise UserError(f"--image {self.image!r} is not an image reference (e.g. registry.example.com/xeontune:0.1)")
        if not CLAIM_RE.fullmatch(self.volume_claim or ""):
            raise UserError(f"--volume-claim {self.volume_claim!r} is not a PersistentVolumeClaim name "
                            "(lower-case letters, digits, '-' and '.')")
        cpu = CPU_RE.fullmatch(self.cpus)
        if not cpu or float(cpu[1]) <= 0:
            raise UserError(f"--cpus {self.cpus!r} is not a positive CPU count (e.g. 8, 7.5 or 7500m)")
        memory = MEMORY_RE.fullmatch(self.memory)
        if not memory or float(memory[1]) <= 0:
            raise UserError(f"--memory {self.memory!r} is not a memory size with a unit (e.g. 32Gi or 30000M)")
        if not NAME_RE.fullmatch(self.job_name):
            raise UserError(f"--job-name {self.job_name!r} must be 1-52 lower-case letters, digits or '-', "
                            "starting with a letter and ending with a letter or digit")
        if self.namespace is not None and not NAMESPACE_RE.fullmatch(self.namespace):
            raise UserError(f"--namespace {self.namespace!r} is not a namespace name")
        if not posixpath.isabs(self.mount_path) or posixpath.normpath(self.mount_path) == "/":
            raise UserError(f"--mount-path {self.mount_path!r} must be an absolute path other than /")
        if not 1 <= self.master_port <= 65535:
            raise UserError(f"master port {self.master_port} is not a port")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The Kubernetes-only flags, for `launch` and `run` (their -n, --ppn, --env, --dry-run and
    --dist-backend are the parsers' own). Destinations start with ``k8s_``: `run`'s --ami is ``image``."""
    group = parser.add_argument_group("kubernetes (--provider kubernetes)")
    group.add_argument("--image", dest="k8s_image", metavar="IMAGE",
                       help="kubernetes: the container image of every pod (built from the Dockerfile)")
    group.add_argument("--volume-claim", dest="k8s_volume_claim", metavar="CLAIM",
                       help="kubernetes: a PersistentVolumeClaim holding the data; outputs are written to it "
                       "(ReadWriteMany when the pods may land on more than one node)")
    group.add_argument("--cpus", dest="k8s_cpus", metavar="CPUS",
                       help="kubernetes: CPUs per pod (one rank each), requested and the limit: 8, 7.5 or 7500m")
    group.add_argument("--memory", dest="k8s_memory", metavar="SIZE",
                       help="kubernetes: memory per pod, requested and the limit: 32Gi")
    group.add_argument("--namespace", dest="k8s_namespace", metavar="NS",
                       help="kubernetes: namespace (default: your kubeconfig context's)")
    group.add_argument("--job-name", dest="k8s_job_name", metavar="NAME",
                       help="kubernetes: the Job's (and Service's) name (default: xeontune-<6 hex digits>)")
    group.add_argument("--mount-path", dest="k8s_mount_path", default=DEFAULT_MOUNT, metavar="PATH",
                       help=f"kubernetes: where the claim is mounted in each pod, and the pods' working dir: "
                       f"relative --data-dir / --output-dir are on the claim (default {DEFAULT_MOUNT})")


def options_from_args(args: argparse.Namespace) -> KubernetesOptions:
    """``KubernetesOptions`` from the parsed flags, checked; the missing required ones named in one line."""
    missing = [flag for flag, dest in (("--image", "k8s_image"), ("--volume-claim", "k8s_volume_claim"),
                                       ("--cpus", "k8s_cpus"), ("--memory", "k8s_memory"))
               if not getattr(args, dest, None)]
    if missing:
        raise UserError(f"--provider kubernetes needs {', '.join(missing)} (the pods' image, the claim that holds "
                        "data and outputs, and each pod's resources; e.g. --image registry/xeontune:0.1 "
                        "--volume-claim xeontune-data --cpus 8 --memory 32Gi)")
    for dest, flag in FOREIGN_OPTIONS.items():
        if getattr(args, dest, None):
            raise UserError(f"{flag} is not used with --provider kubernetes")
    for dest, value in vars(args).items():
        if dest.startswith(OTHER_PROVIDERS_DEST) and value not in (None, False):
            flag = "--" + dest[len(OTHER_PROVIDERS_DEST):].replace("_", "-")
            raise UserError(f"{flag} is an option of another provider, not of --provider kubernetes")
    options = KubernetesOptions(
        image=str(args.k8s_image), volume_claim=str(args.k8s_volume_claim), cpus=str(args.k8s_cpus).strip(),
        memory=str(args.k8s_memory).strip(),
        job_name=getattr(args, "k8s_job_name", None) or f"xeontune-{secrets.token_hex(3)}",
        namespace=getattr(args, "k8s_namespace", None) or None,
        mount_path=posixpath.normpath(getattr(args, "k8s_mount_path", None) or DEFAULT_MOUNT))
    options.check()
    return options


# --- the manifests ---------------------------------------------------------------------------------


def rank_env(options: KubernetesOptions, ranks: int, backend: str = "gloo") -> dict[str, str]:
    """Every pod's environment besides ``--env`` (which overrides it) and JOB_COMPLETION_INDEX (the Job's)."""
    import os

    from xeontune.job.engines.env import PASSTHROUGH_ENV, every_rank_env

    env = {
        **every_rank_env(backend),  # what every engine gives its ranks
        "WORLD_SIZE": str(ranks),
        "MASTER_ADDR": options.master_addr,
        "MASTER_PORT": str(options.master_port),
        "OMP_NUM_THREADS": str(options.threads),
        # On the claim: the hub's files are downloaded once, not once per pod and run.
        "HF_HOME": posixpath.join(options.mount_path, ".cache", "huggingface"),
    }
    for key in PASSTHROUGH_ENV:
        if key in os.environ:
            env[key] = os.environ[key]
    return env


def _labels(options: KubernetesOptions) -> dict[str, str]:
    return {"app.kubernetes.io/name": "xeontune", LABEL: options.job_name}


def _metadata(options: KubernetesOptions, name: str) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name}
    if options.namespace:
        meta["namespace"] = options.namespace
    meta["labels"] = _labels(options)
    return meta


def literal(value: str) -> str:
    """``value`` as a container's command, args or env ``value`` must spell it to reach the pod as given:
    the kubelet expands ``$(NAME)`` there to another variable's value and ``$$`` to ``$``, so every ``$``
    is doubled (a prompt or path with ``$(HF_TOKEN)`` must not become the token)."""
    return value.replace("$", "$$")


def unliteral(value: str) -> str:
    """What the pod gets from a ``literal`` value."""
    return value.replace("$$", "$")


def manifests(options: KubernetesOptions, ranks: int, train_args: list[str], env: dict[str, str]) -> list[dict]:
    """The Secret (only with ``env``: the user's --env), headless Service and Indexed Job of one
    job: ``ranks`` pods, each running the trainer with ``train_args`` (flags as a rank takes them,
    ``pod_args``). Pure."""
    if ranks < 1:
        raise UserError(f"-n {ranks}: a job needs at least one rank (one pod each)")
    options.check()
    base = rank_env(options, ranks)
    for key in env:
        base.pop(key, None)  # --env overrides launch's own value (an explicit env entry would beat envFrom)
    container: dict[str, Any] = {
        "name": CONTAINER,
        "image": options.image,
        "command": [literal(word) for word in COMMAND],
        "args": [literal(arg) for arg in train_args],
        "workingDir": options.mount_path,  # not expanded by the kubelet, unlike command, args and env values
        "env": [{"name": key, "value": literal(value)} for key, value in base.items()],
    }
    if env:
        container["envFrom"] = [{"secretRef": {"name": options.secret}}]
    container["resources"] = {"requests": {"cpu": options.cpus, "memory": options.memory},
                              "limits": {"cpu": options.cpus, "memory": options.memory}}
    container["volumeMounts"] = [{"name": "work", "mountPath": options.mount_path}]
    docs: list[dict] = []
    if env:
        docs.append({"apiVersion": "v1", "kind": "Secret", "metadata": _metadata(options, options.secret),
                     "type": "Opaque", "stringData": dict(env)})
    docs.append({
        "apiVersion": "v1", "kind": "Service", "metadata": _metadata(options, options.service),
        "spec": {
            "clusterIP": "None",  # headless: DNS names for the pods, no proxy
            "publishNotReadyAddresses": True,  # rank 0's name resolves as soon as its pod has an address
            "selector": {LABEL: options.job_name},
            "ports": [{"name": "rendezvous", "port": options.master_port, "targetPort": options.master_port}],
        },
    })
    docs.append({
        "apiVersion": "batch/v1", "kind": "Job", "metadata": _metadata(options, options.job_name),
        "spec": {
            "completionMode": "Indexed",
            "completions": ranks,
            "parallelism": ranks,
            "backoffLimit": 0,  # a restarted rank could not rejoin the running group: fail, stop the rest
            "template": {
                "metadata": {"labels": _labels(options)},
                "spec": {
                    "subdomain": options.service,  # with the pod's host name <job>-<i>: <job>-<i>.<service>
                    "restartPolicy": "Never",
                    "enableServiceLinks": False,  # no variables for every Service of the namespace
                    "containers": [container],
                    "volumes": [{"name": "work", "persistentVolumeClaim": {"claimName": options.volume_claim}}],
                },
            },
        },
    })
    return docs


def shown(docs: list[dict]) -> list[dict]:
    """``docs`` as `--dry-run` prints them: a Secret's values replaced by what they come from."""
    out = []
    for doc in docs:
        if doc.get("kind") == "Secret":
            doc = {**doc, "stringData": {key: SECRET_SHOWN.format(key=key) for key in doc.get("stringData", {})}}
        out.append(doc)
    return out


def to_yaml(docs: list[dict]) -> str:
    """The manifests as one multi-document YAML stream, in ``docs``' order (kubectl creates them so)."""
    import yaml

    return yaml.safe_dump_all(docs, sort_keys=False, default_flow_style=False, explicit_start=True)


# --- the trainer's options, placed on the claim ----------------------------------------------------


def on_claim(path: str, mount: str, flag: str) -> str:
    """``path`` as the pods read it: relative to the claim's root, or already under its mount path."""
    if path.startswith("~"):
        raise UserError(f"{flag} {path}: the pods have no home of yours; give a path relative to the volume "
                        f"claim (mounted at {mount})")
    joined = posixpath.normpath(posixpath.join(mount, path))
    if joined != mount and not joined.startswith(mount.rstrip("/") + "/"):
        raise UserError(f"{flag} {path} is not on the volume claim, which each pod mounts at {mount}: give a "
                        "path relative to the claim's root")
    return joined


def pod_args(train_args: list[str], options: KubernetesOptions, backend: str = "auto") -> tuple[list[str], str]:
    """The trainer's options read as a rank reads them (every check that needs no cluster, one line each),
    with the data, outputs and checkpoints on the claim; returned as explicit flags (``--config``
    merged, so the file needs no copy in the pods), with the backend the ranks use."""
    from xeontune.job.spec import looks_local, rank_args, read_request

    request = read_request(list(train_args), "1", backend, remote=True)
    opts = dataclasses.replace(request.options)
    given = set(request.given)
    mount = options.mount_path
    for name, flag in (("data_dir", "--data-dir"), ("output_dir", "--output-dir"),
                       ("class_data_dir", "--class-data-dir")):
        value = getattr(opts, name)
        if value is not None:
            setattr(opts, name, on_claim(str(value), mount, flag))
            given.add(name)  # the default output dir too: it must be the claim's
    if opts.resume_from_checkpoint and opts.resume_from_checkpoint != "latest":
        opts.resume_from_checkpoint = on_claim(opts.resume_from_checkpoint, mount, "--resume-from-checkpoint")
    model = str(opts.model)
    if looks_local(model) and not posixpath.isabs(model):  # an absolute path may be in the image
        opts.model = on_claim(model, mount, "--model")
    # rank_args writes a list as one flag; the trainer takes such an option once per value
    lists = [f.name for f in dataclasses.fields(opts) if f.name in given and isinstance(getattr(opts, f.name), list)]
    args = rank_args(opts, given - set(lists))
    for name in lists:
        for value in getattr(opts, name):
            args += ["--" + name.replace("_", "-"), str(value)]
    return args, request.backend


@dataclass
class Job:
    """One job, ready to be created: its options, ranks, manifests and --env values."""

    options: KubernetesOptions
    ranks: int
    docs: list[dict]
    env: dict[str, str]


def job_from_args(args: argparse.Namespace) -> Job:
    """Everything `launch` and `run` read, checked, as the manifests they create (no kubectl yet)."""
    from xeontune.job.spec import parse_env

    ranks = getattr(args, "num_processes", None)
    if ranks is None:
        ranks = getattr(args, "nodes", None)
    if ranks is None:
        raise UserError("--provider kubernetes needs -n N: the number of ranks, one pod each")
    if int(ranks) < 1:
        raise UserError(f"-n {ranks}: a job needs at least one rank (one pod each)")
    ppn = str(getattr(args, "ppn", "1") or "1").strip()
    if ppn != "1":
        raise UserError(f"--ppn {ppn}: with --provider kubernetes every rank is a pod of its own; give the "
                        "ranks with -n and each pod's CPUs with --cpus")
    backend = getattr(args, "dist_backend", "auto") or "auto"
    if backend == "ccl":
        raise UserError("--dist-backend ccl: the image has no oneCCL bindings; the pods use gloo")
    options = options_from_args(args)
    env = parse_env(list(getattr(args, "env", None) or []))
    train, _ = pod_args(list(getattr(args, "train_args", None) or []), options, "gloo")
    return Job(options=options, ranks=int(ranks), docs=manifests(options, int(ranks), train, env), env=env)


# --- kubectl -----------------------------------------------------------------------------------------


def find_kubectl() -> str:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        raise UserError("--provider kubernetes needs kubectl on PATH, set up for your cluster (its kubeconfig: "
                        "~/.kube/config or $KUBECONFIG); see https://kubernetes.io/docs/tasks/tools/")
    return kubectl


def kubectl_argv(kubectl: str, options: KubernetesOptions, *args: str) -> list[str]:
    return [kubectl, *(["--namespace", options.namespace] if options.namespace else []), *args]


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return (lines[-1] if lines else "no output")[:300]


def create(kubectl: str, job: Job, created: list[str]) -> None:
    """``kubectl create`` (not apply: a job of the same name that exists already is refused, never
    changed, and never deleted by this job's end). ``created`` gets what kubectl made, also when it
    refused the rest: only those are this job's to delete."""
    proc = subprocess.run(kubectl_argv(kubectl, job.options, "create", "-f", "-"), input=to_yaml(job.docs),
                          capture_output=True, text=True, timeout=KUBECTL_TIMEOUT_S,
                          start_new_session=True)  # a Ctrl-C must not cut it short: see apply_and_follow
    made = [m[1] for m in re.finditer(r"^(\S+/\S+) created$", proc.stdout, re.MULTILINE)]
    if proc.returncode == 0 and not made:  # an unusual kubectl's wording: all of them were made
        made = resource_names(job)
    created += made
    if proc.returncode != 0:
        raise UserError(f"kubectl create failed: {_last_line(proc.stderr or proc.stdout)}")


def resource_names(job: Job) -> list[str]:
    return [f"{doc['kind'].lower()}/{doc['metadata']['name']}" for doc in job.docs]


def delete(kubectl: str, job: Job, names: list[str]) -> tuple[bool, str]:
    """Delete ``names`` (the Job's pods with it); what is already gone is fine. Shielded from a second
    Ctrl-C (its own session, these signals ignored meanwhile): a half-done delete would leave pods
    running. Returns (done, kubectl's last line)."""
    if not names:
        return True, ""
    argv = kubectl_argv(kubectl, job.options, "delete", *names, "--ignore-not-found", "--wait=false")
    with _signals(signal.SIG_IGN):
        try:
            proc = subprocess.run(argv, capture_output=True, text=True, timeout=KUBECTL_TIMEOUT_S,
                                  start_new_session=True)
        except subprocess.TimeoutExpired:
            return False, f"kubectl delete took over {KUBECTL_TIMEOUT_S:.0f} s"
    return proc.returncode == 0, _last_line(proc.stderr or proc.stdout)


def get_json(kubectl: str, options: KubernetesOptions, *args: str) -> dict | None:
    """``kubectl get ... -o json``, or None where kubectl failed (the caller counts failures)."""
    try:
        proc = subprocess.run(kubectl_argv(kubectl, options, "get", *args, "-o", "json"), capture_output=True,
                              text=True, timeout=KUBECTL_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return None
    if proc.returncode != 0:
        if "NotFound" in proc.stderr or "not found" in proc.stderr:
            return {"notFound": True, "message": _last_line(proc.stderr)}
        return None
    try:
        return json.loads(proc.stdout)
    except json.JSONDecodeError:
        return None


def job_outcome(job: dict) -> str | None:
    """"Complete" or "Failed" once the Job controller said so; None while it runs."""
    for condition in job.get("status", {}).get("conditions") or []:
        if condition.get("status") == "True" and condition.get("type") in ("Complete", "Failed"):
            return str(condition["type"])
    return None


def pod_index(pod: dict) -> str:
    meta = pod.get("metadata", {})
    return str(meta.get("labels", {}).get(INDEX_LABEL) or meta.get("annotations", {}).get(INDEX_LABEL) or "?")


def failed_exit_code(pods: list[dict]) -> int:
    """The exit code of the first rank (lowest index) that failed; 1 where none says."""
    codes = []
    for pod in pods:
        for status in pod.get("status", {}).get("containerStatuses") or []:
            code = (status.get("state", {}).get("terminated") or {}).get("exitCode")
            if code:
                index = pod_index(pod)
                codes.append((int(index) if index.isdigit() else 1 << 30, int(code)))
    return min(codes)[1] if codes else 1


def output_dir(job: Job) -> str | None:
    """Where the pods write their outputs (on the claim)."""
    args = job.docs[-1]["spec"]["template"]["spec"]["containers"][0]["args"]
    return unliteral(args[args.index("--output-dir") + 1]) if "--output-dir" in args[:-1] else None


class LogFollower:
    """``kubectl logs -f`` of one pod, each line printed as ``[rank] line``."""

    def __init__(self, argv: list[str], rank: str, out_lock: threading.Lock) -> None:
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     start_new_session=True)  # Ctrl-C is ours to handle, not its
        self.thread = threading.Thread(target=self._pump, args=(rank, out_lock), daemon=True)
        self.thread.start()

    def _pump(self, rank: str, out_lock: threading.Lock) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            with out_lock:
                sys.stdout.write(f"[{rank}] {line if line.endswith(chr(10)) else line + chr(10)}")
                sys.stdout.flush()

    def stop(self, wait_s: float) -> None:
        self.thread.join(timeout=wait_s)
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.thread.join(timeout=1)


def follow(kubectl: str, job: Job, say: Callable[[str], None], followers: dict[str, LogFollower]) -> int:
    """Follow the job until the Job controller says it is complete (0) or failed (the failed rank's
    exit code): each pod's log once it runs (into ``followers``, which the caller drains and stops),
    each reason a pod cannot start once."""
    options = job.options
    out_lock = threading.Lock()
    said: set[str] = set()
    failures = 0
    while True:
        state = get_json(kubectl, options, f"job/{options.job_name}")
        pods_doc = get_json(kubectl, options, "pods", "-l", f"{LABEL}={options.job_name}")
        if state is not None and state.get("notFound"):
            raise UserError(f"job {options.job_name} is gone (deleted by someone else?): {state['message']}")
        if state is None or pods_doc is None or pods_doc.get("notFound"):
            failures += 1
            if failures >= GET_FAILURES:
                raise UserError(f"kubectl get failed {failures} times in a row: is the cluster reachable?")
            time.sleep(POLL_S)
            continue
        failures = 0
        pods = pods_doc.get("items") or []
        for pod in pods:
            name = pod.get("metadata", {}).get("name", "")
            if name and name not in followers and pod.get("status", {}).get("phase") in ("Running", "Succeeded",
                                                                                         "Failed"):
                followers[name] = LogFollower(kubectl_argv(kubectl, options, "logs", "-f", f"pod/{name}",
                                                           "-c", CONTAINER), pod_index(pod), out_lock)
            for line in _waiting_lines(pod):
                if line not in said:
                    said.add(line)
                    say(line)
        outcome = job_outcome(state)
        if outcome == "Complete":
            return 0
        if outcome == "Failed":
            final = get_json(kubectl, options, "pods", "-l", f"{LABEL}={options.job_name}")
            return failed_exit_code((final or {}).get("items") or pods)
        time.sleep(POLL_S)


def drain(followers: dict[str, LogFollower]) -> None:
    """Let the pods' last lines arrive (their containers ended, or were stopped by the delete), then stop
    whatever follower is left, also on a second Ctrl-C meanwhile."""
    deadline = time.monotonic() + LOG_DRAIN_S
    try:
        for follower in followers.values():
            follower.thread.join(timeout=max(0.0, deadline - time.monotonic()))
    finally:
        for follower in followers.values():
            follower.stop(0.0)


def _waiting_lines(pod: dict) -> list[str]:
    """Why a pod does not run yet, in words worth showing once (a bad image, an unschedulable pod)."""
    rank = pod_index(pod)
    lines = []
    for condition in pod.get("status", {}).get("conditions") or []:
        if condition.get("type") == "PodScheduled" and condition.get("reason") == "Unschedulable":
            lines.append(f"rank {rank}: not scheduled yet: {condition.get('message', '')}".strip())
    for status in pod.get("status", {}).get("containerStatuses") or []:
        waiting = status.get("state", {}).get("waiting") or {}
        if waiting.get("reason") in WAITING_SAID:
            lines.append(f"rank {rank}: {waiting['reason']}: {waiting.get('message', '')}".strip().rstrip(":"))
    return lines


@contextlib.contextmanager
def _signals(handler: Any) -> Iterator[None]:
    """SIGINT, SIGTERM and SIGHUP handled by ``handler`` inside the block (main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    for sig in saved:
        signal.signal(sig, handler)
    try:
        yield
    finally:
        for sig, old in saved.items():
            signal.signal(sig, old)


class Interrupted(Exception):
    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _interrupt(signum: int, _frame: object) -> None:
    raise Interrupted(signum)


def apply_and_follow(kubectl: str, job: Job, say: Callable[[str], None]) -> int:
    """Create the job, follow it to its end, delete it: at the end, on an error, and on Ctrl-C,
    SIGTERM or SIGHUP (128 + the signal's number then, as a shell reports a job it stopped)."""
    name = job.options.job_name
    created: list[str] = []
    followers: dict[str, LogFollower] = {}
    try:
        with _signals(_interrupt):
            try:
                pending: list[int] = []  # a signal during create waits for it: then `created` is complete
                with _signals(lambda signum, _frame: pending.append(signum)):
                    try:
                        create(kubectl, job, created)
                    finally:
                        if pending:
                            raise Interrupted(pending[0])
                say(f"created job {name}: {job.ranks} pod(s) of {job.options.cpus} CPU(s) and {job.options.memory}, "
                    f"image {job.options.image}; following their logs")
                rc = follow(kubectl, job, say, followers)
                ended = f"job {name} {'completed' if rc == 0 else f'failed (exit code {rc})'}"
            except Interrupted as exc:
                say(f"interrupted ({exc}): deleting job {name}")
                rc, ended = 128 + exc.signum, f"job {name} stopped"
            except KeyboardInterrupt:
                say(f"interrupted: deleting job {name}")
                rc, ended = 128 + signal.SIGINT, f"job {name} stopped"
    finally:  # also after a failed create: what it made already (never another job's of this name)
        try:
            done, line = delete(kubectl, job, created)
            if not done:
                say(f"could not delete job {name} ({line}); delete it with: "
                    + " ".join(kubectl_argv("kubectl", job.options, "delete", *created)))
        finally:
            drain(followers)
    say(ended)  # after the pods' last lines
    out_dir = output_dir(job)
    if rc == 0 and out_dir:
        say(f"outputs: {out_dir} on volume claim {job.options.volume_claim} (docs/kubernetes.md: copying them out)")
    return rc


# --- the commands ------------------------------------------------------------------------------------


def launch_command(args: argparse.Namespace) -> int:
    """`xeontune launch --provider kubernetes`: --dry-run prints the manifests (a Secret's values not
    shown); --detach creates them and returns; else as `run`."""
    job = job_from_args(args)
    if getattr(args, "dry_run", False):
        print(to_yaml(shown(job.docs)), end="")
        return 0
    if getattr(args, "detach", False):
        kubectl = find_kubectl()
        create(kubectl, job, [])
        name, ns = job.options.job_name, (["--namespace", job.options.namespace] if job.options.namespace else [])
        print(f"created job {name} ({job.ranks} pod(s)), detached")
        many = [f"--max-log-requests={job.ranks}"] if job.ranks > 5 else []  # kubectl's default: 5
        print(f"follow it: kubectl {' '.join(ns + ['logs', '-f', '--prefix', *many, '-l', f'{LABEL}={name}'])}    "
              f"delete it: kubectl {' '.join(ns + ['delete', 'job,service,secret', '-l', f'{LABEL}={name}'])}")
        return 0
    return run_command(args, job)


def run_command(args: argparse.Namespace, job: Job | None = None) -> int:
    """`xeontune run --provider kubernetes`: create the manifests with kubectl, follow every pod's
    log, delete them at the end (or on Ctrl-C / SIGTERM / SIGHUP). Exit code 0 only when the Job
    completed."""
    job = job or job_from_args(args)
    if getattr(args, "dry_run", False):
        print(to_yaml(shown(job.docs)), end="")
        return 0
    kubectl = find_kubectl()
    return apply_and_follow(kubectl, job, lambda text: print(text, file=sys.stderr, flush=True))
