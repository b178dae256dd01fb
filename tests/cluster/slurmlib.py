"""A real Slurm on this machine for the tests: one slurmctld and three slurmd (Debian's slurm-wlm,
installed as root by scripts/install-test-deps.sh), no munge (auth/none, cred/none), each daemon with
its own port, spool and pid file under a temporary folder; every node at 127.0.0.1."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

DAEMONS = ("slurmctld", "slurmd", "sbatch", "srun", "scontrol", "squeue", "scancel", "sinfo")


def slurm_missing() -> str | None:
    if os.geteuid() != 0:
        return "needs root (slurmd runs jobs as their user)"
    missing = [name for name in DAEMONS if not shutil.which(name)]
    return f"needs slurm-wlm ({', '.join(missing)} missing; scripts/install-test-deps.sh)" if missing else None


def require_slurm() -> None:
    """Skip only for a developer without root; as root or in CI a missing Slurm is a failed install."""
    why = slurm_missing()
    if why and (os.geteuid() == 0 or os.environ.get("CI")):
        pytest.fail(f"root (or CI) runs the Slurm tests after scripts/install-test-deps.sh, yet Slurm {why}")
    if why:
        pytest.skip(why)


def _free_ports(count: int) -> list[int]:
    """``count`` consecutive free TCP ports on 127.0.0.1 (slurm.conf takes a node range's ports as a range)."""
    for start in range(17000, 30000, 7):
        sockets = []
        try:
            for port in range(start, start + count):
                s = socket.socket()
                s.bind(("127.0.0.1", port))
                sockets.append(s)
            return list(range(start, start + count))
        except OSError:
            continue
        finally:
            for s in sockets:
                s.close()
    raise RuntimeError("no free ports for Slurm")


@dataclass
class Slurm:
    root: Path
    nodes: int

    @property
    def env(self) -> dict[str, str]:
        return {**os.environ, "SLURM_CONF": str(self.root / "slurm.conf")}

    def run(self, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        return subprocess.run(list(args), capture_output=True, text=True, timeout=timeout, env=self.env)

    def jobs(self, settle_s: float = 30.0) -> list[str]:
        """Job ids still known to the controller as pending or running. A job that ended is listed as
        COMPLETING until its nodes have cleaned up (seconds, on a busy machine): waited out, up to
        ``settle_s``, then listed like any other."""
        deadline = time.monotonic() + settle_s
        while True:
            rows = [line.split() for line in self.run("squeue", "-h", "-o", "%i %T").stdout.splitlines() if line.strip()]
            if not any(state == "COMPLETING" for _, state in rows) or time.monotonic() > deadline:
                return [job for job, _ in rows]
            time.sleep(0.2)

    def client_env(self, **settings: object) -> dict[str, str]:
        """``env`` with a slurm.conf of the commands' own (sbatch, scontrol, ...): the daemons' plus
        ``settings`` (MessageTimeout=4: a command gives up on a silent slurmctld after about 3 s, 6 s for
        `scontrol show job ID`, instead of 9 and 18). The daemons keep theirs, and so does a batch script
        (slurmd sets its SLURM_CONF)."""
        conf = self.root / f"client-{'-'.join(f'{k}{v}' for k, v in sorted(settings.items()))}.conf"
        conf.write_text((self.root / "slurm.conf").read_text() + "".join(f"{k}={v}\n" for k, v in settings.items()))
        return {**self.env, "SLURM_CONF": str(conf)}

    def log(self) -> str:
        return "\n".join(p.read_text(errors="replace")[-3000:] for p in sorted((self.root / "log").glob("*.log")))


# With ``preemption``: a second partition over the same nodes whose jobs preempt the default one's
# (PreemptMode=REQUEUE after a GraceTime, as sites configure it), so a test preempts for real.
PREEMPTION = """PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP PriorityTier=1 GraceTime={grace}
PartitionName=urgent Nodes=ALL MaxTime=INFINITE State=UP PriorityTier=2 PreemptMode=OFF
"""
GRACE_S = 20


def start(root: Path, nodes: int = 3, cpus_per_node: int = 1, preemption: bool = False) -> Slurm:
    """A controller and ``nodes`` slurmd, answering `sinfo` when this returns."""
    for sub in ("state", "log", *(f"spool/n{i}" for i in range(1, nodes + 1))):
        (root / sub).mkdir(parents=True, exist_ok=True)
    ports = _free_ports(2 + nodes)
    conf = f"""ClusterName=xttest
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort={ports[0]}
SlurmdPort={ports[1]}
AuthType=auth/none
CredType=cred/none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmUser=root
SlurmdUser=root
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool/%n
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd-%n.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd-%n.log
SlurmdParameters=config_overrides
ReturnToService=2
MpiDefault=none
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
KillWait=5
NodeName=n[1-{nodes}] NodeHostname=localhost NodeAddr=127.0.0.1 CPUs={cpus_per_node} RealMemory=4000 Port={ports[2]}-{ports[-1]}
"""
    conf += PREEMPTION.format(grace=GRACE_S) if preemption else \
        f"PartitionName=debug Nodes=n[1-{nodes}] Default=YES MaxTime=INFINITE State=UP\n"
    (root / "slurm.conf").write_text(conf)
    slurm = Slurm(root, nodes)
    conf_path = str(root / "slurm.conf")
    start_controller(slurm)
    for i in range(1, nodes + 1):
        subprocess.run(["slurmd", "-f", conf_path, "-N", f"n{i}"], check=True, env=slurm.env, timeout=60)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        # one line per node and partition: count the nodes
        states = set(slurm.run("sinfo", "-h", "-N", "-o", "%N %T").stdout.splitlines())
        if sum(line.split()[-1] == "idle" for line in states) == nodes:
            return slurm
        time.sleep(0.5)
    stop(slurm)
    raise RuntimeError(f"Slurm did not come up: {slurm.log()}")


def processes(*prefixes: str) -> str:
    """Each process whose command line starts with one of ``prefixes``: pid, parent, state, command line."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
            stat = (proc / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if proc.name.isdigit() and cmd.startswith(prefixes):
            found.append(f"{proc.name} ppid {stat[1]} {stat[0]} {cmd[:300]}")
    return "\n".join(found)


def start_controller(slurm: Slurm) -> None:
    """slurmctld, which recovers the jobs of an earlier one from the state dir."""
    subprocess.run(["slurmctld", "-f", str(slurm.root / "slurm.conf")], check=True, env=slurm.env, timeout=60)


def stop_controller(slurm: Slurm) -> None:
    """slurmctld only (SIGTERM: it saves its state and exits); the nodes' slurmd and the jobs go on."""
    pid_file = slurm.root / "slurmctld.pid"
    os.kill(int(pid_file.read_text().split()[0]), signal.SIGTERM)
    deadline = time.monotonic() + 30
    while _alive(pid_file):
        if time.monotonic() > deadline:
            raise RuntimeError("slurmctld did not stop within 30 s")
        time.sleep(0.1)


def stop(slurm: Slurm) -> None:
    """Cancel every job, then stop the daemons (their pid files say which)."""
    jobs = slurm.jobs()
    if jobs:
        slurm.run("scancel", "--full", "--quiet", *jobs)
    for pid_file in slurm.root.glob("*.pid"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            os.kill(int(pid_file.read_text().split()[0]), signal.SIGTERM)
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and any(_alive(p) for p in slurm.root.glob("*.pid")):
        time.sleep(0.2)


def _alive(pid_file: Path) -> bool:
    try:
        os.kill(int(pid_file.read_text().split()[0]), 0)
        return True
    except (OSError, ValueError, IndexError):
        return False
