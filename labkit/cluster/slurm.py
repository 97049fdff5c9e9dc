"""A real Slurm cluster on the emulated cluster: slurmctld, one slurmd per node, munge.

``with slurm_cluster(nodes=2) as slurm: job = slurm.sbatch(script)`` brings up, on the
netns cluster of :mod:`labkit.cluster.netns` (root only)::

    netns lk-t-sw, host "head" (10.77.255.254 on the bridge)  munged, slurmctld; sbatch, scontrol
    netns lk-t-n0, host "node0" (10.77.0.1)                    slurmd -> slurmstepd -> job steps
    netns lk-t-n1, host "node1" (10.77.0.2)                    slurmd -> slurmstepd -> job steps

Each daemon is Debian's (packages ``slurm-wlm``, ``munge``) run in the foreground with a
configuration written for this run only: every file (slurm.conf, munge key and socket, state,
spool, logs) lives in the run's folder. Each daemon runs as its host (:func:`_on_host`): its
node's network namespace, its own UTS namespace (hostname) and a mount namespace where the
run's hosts file is bound over ``/etc/hosts``, so a job script's ``scontrol show hostnames``
gives names that torchrun and gloo resolve to the nodes' addresses, as on a real cluster.
Client commands run on the head through ``ip netns exec``, which binds
``/etc/netns/<namespace>/hosts`` the same way. munge's socket is a file: every namespace
reaches it.

Teardown on every way out (a job that fails or hangs, an exception, an interrupt): every
process started here is a member of a :class:`~labkit.launch.lifeline.Lifeline` (the daemons,
and through the environment the job steps slurmd starts); deleting the run's namespaces kills
whatever still runs inside them (:func:`labkit.cluster.netns.remove`); the ``/etc/netns``
entries and, unless the caller chose it, the run's folder are removed. A SIGKILLed caller:
the lifeline's watchdog kills the processes, and a :class:`~labkit.cluster.slurm_reaper.Reaper`
told of every namespace and path before it was made removes them at once; the next start
sweeps whatever both missed.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from labkit.cluster import netns, spec
from labkit.cluster.netns import NETNS_DIR, NetnsPlan
from labkit.cluster.slurm_reaper import Reaper, sweep_stale_runs
from labkit.launch.lifeline import RUN_ID_VAR, Lifeline

__all__ = ["SlurmCluster", "hosts_file", "slurm_conf", "slurm_cluster", "slurm_unavailable"]

DAEMONS = ("slurmctld", "slurmd", "munged", "sbatch", "scontrol", "scancel", "sinfo", "nsenter")
HEAD_ADDR = "10.77.255.254"  # the controller's address on the run's bridge (nodes: 10.77.0.N)
NETNS_ETC = Path("/etc/netns")
_OURS = re.compile(r"^lk-[0-9a-f]{6}-(?:n\d+|sw)$")  # netns.py's namespace names


def slurm_unavailable() -> str | None:
    """Why a Slurm cluster cannot start here (root, netns, Debian's slurm-wlm and munge), or
    None when it can."""
    why = spec.netns_unavailable()
    if why is not None:
        return f"the netns cluster is unavailable: {why}"
    missing = [tool for tool in (*DAEMONS, "unshare") if shutil.which(tool) is None]
    if missing:
        return (f"{', '.join(missing)} not found (apt-get install slurm-wlm munge)")  # fmt: skip
    return None


def sweep_stale_etc() -> list[str]:
    """Remove ``/etc/netns`` entries of labkit runs whose namespace is gone (a caller killed
    with SIGKILL could not remove them; :func:`labkit.cluster.netns.sweep_stale` removes the
    namespaces themselves). Returns the names removed."""
    gone = []
    for entry in NETNS_ETC.glob("lk-*") if NETNS_ETC.is_dir() else []:
        if _OURS.match(entry.name) and not (NETNS_DIR / entry.name).exists():
            shutil.rmtree(entry, ignore_errors=True)
            gone.append(entry.name)
    return gone


def node_names(nodes: int) -> list[str]:
    return [f"node{i}" for i in range(nodes)]


def hosts_file(plan: NetnsPlan) -> str:
    """``/etc/hosts`` of every namespace of the run: the head and each node by name."""
    lines = ["127.0.0.1 localhost", f"{HEAD_ADDR} head"]
    lines += [f"{plan.address(i)} {name}" for i, name in enumerate(node_names(plan.nodes))]
    return "\n".join(lines) + "\n"


def slurm_conf(plan: NetnsPlan, run_dir: Path, cpus: int) -> str:
    """The run's slurm.conf: munge auth through the run's socket, no cgroups, no accounting,
    every path in ``run_dir`` (``%n``: the node's name)."""
    d = run_dir
    nodes = " ".join(
        f"NodeName={name} NodeAddr={plan.address(i)} CPUs={cpus} State=UNKNOWN\n"
        for i, name in enumerate(node_names(plan.nodes))
    )
    return f"""ClusterName=labkit
SlurmctldHost=head({HEAD_ADDR})
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={d}/munge.socket
SlurmUser=root
SlurmdUser=root
StateSaveLocation={d}/ctld
SlurmdSpoolDir={d}/spool-%n
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd-%n.pid
SlurmctldLogFile={d}/slurmctld.log
SlurmdLogFile={d}/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SwitchType=switch/none
MpiDefault=none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
SlurmctldTimeout=30
MailProg=/bin/true
SlurmdTimeout=30
KillWait=2
MinJobAge=300
PlugStackConfig={d}/plugstack.conf
{nodes}PartitionName=lab Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""


@dataclass
class SlurmCluster:
    """A running cluster: run client commands on the head, submit and wait for jobs."""

    plan: NetnsPlan
    run_dir: Path
    env: dict[str, str]
    jobs: list[str] = field(default_factory=list)

    def head(self, *cmd: str, timeout: float = 30, env: dict[str, str] | None = None,
             ) -> subprocess.CompletedProcess[str]:  # fmt: skip
        """Run a Slurm client command on the head node (its namespace and hosts file)."""
        return subprocess.run(["ip", "netns", "exec", self.plan.switch, *cmd],
                              env={**self.env, **(env or {})}, capture_output=True, text=True,
                              timeout=timeout)  # fmt: skip

    def sbatch(self, script: str | Path, *options: str, cwd: str | Path,
               env: dict[str, str] | None = None) -> str:  # fmt: skip
        """Submit ``script`` from ``cwd`` with the head's environment plus ``env`` (sbatch
        exports it to the job); the job's id."""
        done = self.head("sbatch", "--parsable", f"--chdir={cwd}", *options, str(script), env=env)
        if done.returncode != 0:
            raise RuntimeError(f"sbatch {script} failed: {done.stderr.strip()}")
        job = done.stdout.strip().split(";")[0]
        self.jobs.append(job)
        return job

    def state(self, job: str) -> str:
        out = self.head("scontrol", "-o", "show", "job", job).stdout
        fields = dict(w.split("=", 1) for w in out.split() if "=" in w)
        return fields.get("JobState", "UNKNOWN")

    def wait(self, job: str, timeout: float) -> str:
        """Block until ``job`` ends; its final state (COMPLETED, FAILED...); TimeoutError."""
        deadline = time.monotonic() + timeout
        while (state := self.state(job)) in ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING"):
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {job} still {state} after {timeout} s:\n{self.logs()}")
            time.sleep(0.2)
        return state

    def wait_nodes_idle(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            out = self.head("sinfo", "-h", "-N", "-o", "%N %t").stdout.split("\n")
            states = dict(line.split() for line in out if line.strip())
            if len(states) == self.plan.nodes and set(states.values()) == {"idle"}:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"Slurm nodes not idle after {timeout} s: {states}\n"
                                   f"{self.logs()}")  # fmt: skip
            time.sleep(0.2)

    def logs(self, tail: int = 1500) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-tail:]}"
                         for p in sorted(self.run_dir.glob("*.log")))  # fmt: skip


def _start_munge(
    run: Path, ns: str, lifeline: Lifeline, env: dict[str, str]
) -> subprocess.Popen[bytes]:
    key = run / "munge.key"
    key.write_bytes(os.urandom(1024))  # a fresh key for this run: nothing else can sign
    key.chmod(0o400)
    cmd = ["ip", "netns", "exec", ns, "munged", "--foreground", "--force",
           f"--socket={run}/munge.socket", f"--key-file={key}", f"--pid-file={run}/munged.pid",
           f"--log-file={run}/munged.log", f"--seed-file={run}/munged.seed"]  # fmt: skip
    return subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, **lifeline.member())  # fmt: skip


def _on_host(ns: str, name: str, run: Path, command: str) -> list[str]:
    """``command`` as host ``name``: in namespace ``ns`` (network), its own UTS namespace
    (hostname) and mount namespace (``/etc/hosts`` of the run bound over the machine's).

    ``nsenter --net`` rather than ``ip netns exec``: the latter remounts ``/sys``, which hides
    ``/sys/fs/cgroup``, and slurmd refuses to start without its cgroup mount."""
    script = f"mount --bind {run}/hosts /etc/hosts && hostname {name} && exec {command}"
    return ["nsenter", f"--net={NETNS_DIR / ns}", "unshare", "--uts", "--mount",
            "--propagation", "private", "sh", "-c", script]  # fmt: skip


def _wait_file(path: Path, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} did not start within {timeout} s (no {path})")
        time.sleep(0.05)


@contextlib.contextmanager
def slurm_cluster(
    nodes: int = 2, run_dir: str | Path | None = None, env: dict[str, str] | None = None,
    start_timeout: float = 60.0,
) -> Iterator[SlurmCluster]:  # fmt: skip
    """A Slurm cluster of ``nodes`` emulated nodes for the ``with`` block (see module doc).
    ``env``: added to every process's environment (a test's tag)."""
    why = slurm_unavailable()
    if why is not None:
        raise RuntimeError(f"cannot start a Slurm cluster here: {why}")
    netns.sweep_stale()  # first: a stale namespace's /etc/netns entry goes with it below
    sweep_stale_etc()
    sweep_stale_runs()
    reaper = Reaper(env)  # announced before created: a SIGKILLed caller's objects go at once
    own_dir = run_dir is None
    run = reaper.own_folder() if own_dir else Path(str(run_dir))
    run.mkdir(parents=True, exist_ok=True)
    run_id = f"slurm-{uuid.uuid4().hex[:8]}"
    full_env = {**os.environ, **(env or {}), RUN_ID_VAR: run_id,
                "SLURM_CONF": str(run / "slurm.conf")}  # fmt: skip
    etc: list[Path] = []
    plan = NetnsPlan.new(nodes, 1e9)
    spaces = [plan.switch, *(plan.namespace(i) for i in range(nodes))]
    for ns in spaces:
        reaper.track("netns", ns)
        reaper.track("path", NETNS_ETC / ns)
    reaper.track("path", netns.RECORDS / plan.tag)
    clean = False
    try:
        netns.create(plan)
        try:
            subprocess.run(["ip", "-n", plan.switch, "addr", "add", f"{HEAD_ADDR}/16", "dev",
                            plan.bridge], check=True, capture_output=True)  # fmt: skip
            # the head talks to itself (clients to slurmctld) over its own loopback
            subprocess.run(["ip", "-n", plan.switch, "link", "set", "lo", "up"], check=True,
                           capture_output=True)  # fmt: skip
            for ns in spaces:
                (NETNS_ETC / ns).mkdir(parents=True, exist_ok=True)
                etc.append(NETNS_ETC / ns)
                (NETNS_ETC / ns / "hosts").write_text(hosts_file(plan))
            (run / "hosts").write_text(hosts_file(plan))
            (run / "ctld").mkdir(exist_ok=True)
            (run / "plugstack.conf").write_text("")
            (run / "slurm.conf").write_text(slurm_conf(plan, run, os.cpu_count() or 1))
            lifeline = Lifeline(full_env, run_id)
            procs: list[subprocess.Popen[bytes]] = []
            handle = SlurmCluster(plan, run, full_env)
            try:
                procs.append(_start_munge(run, plan.switch, lifeline, full_env))
                _wait_file(run / "munge.socket", 10, "munged")
                daemons = [_on_host(plan.switch, "head", run, "slurmctld -D -i")]
                for i, name in enumerate(node_names(nodes)):
                    (run / f"spool-{name}").mkdir(exist_ok=True)
                    daemons.append(_on_host(plan.namespace(i), name, run, "slurmd -D"))
                for cmd in daemons:
                    procs.append(subprocess.Popen(cmd, env=full_env, stdin=subprocess.DEVNULL,
                                                  stdout=subprocess.DEVNULL,
                                                  stderr=subprocess.DEVNULL,
                                                  **lifeline.member()))  # fmt: skip
                handle.wait_nodes_idle(start_timeout)
                yield handle
            finally:
                for job in handle.jobs:
                    with contextlib.suppress(Exception):
                        handle.head("scancel", job, timeout=10)
                lifeline.end([p.pid for p in procs])
        finally:
            netns.remove(plan)
            clean = True  # the namespaces went; the paths below cannot fail
    finally:
        for path in etc:
            shutil.rmtree(path, ignore_errors=True)
        with contextlib.suppress(OSError):
            NETNS_ETC.rmdir()  # only when empty: another run's entries stay
        if own_dir:
            shutil.rmtree(run, ignore_errors=True)
        reaper.close(clean)  # a teardown cut short: the reaper finishes it
