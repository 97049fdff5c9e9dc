"""A real Slurm cluster on the emulated cluster: slurmctld, one slurmd per node, munge.

``with slurm_cluster(nodes=2) as slurm: job = slurm.sbatch(script)`` brings up, on the
netns cluster of :mod:`labkit.cluster.netns` (root only)::

    netns lk-t-sw, host "head" (10.77.255.254 on the bridge)  munged, slurmctld; sbatch, scontrol
    netns lk-t-n0, host "node0" (10.77.0.1)                    slurmd -> slurmstepd -> job steps
    netns lk-t-n1, host "node1" (10.77.0.2)                    slurmd -> slurmstepd -> job steps

Each daemon is Debian's (packages ``slurm-wlm``, ``munge``) run in the foreground with a
configuration written for this run only: every file (slurm.conf, munge key and socket, state,
spool, logs) lives in the run's folder. The daemons run as root and trust that folder (a
swapped ``slurm.conf`` could name a ``Prolog=`` that runs as root), so a caller's ``run_dir``
must be new or empty and pass the runs folder's checks, and every file is created new, private
and without following a link (:mod:`labkit.safe_files`); bad arguments are refused before
anything starts. Each daemon runs as its host (:func:`_on_host`): its node's network namespace,
its own UTS namespace (hostname) and a mount namespace where the run's hosts file is bound over
``/etc/hosts``, so a job script's ``scontrol show hostnames`` gives names that torchrun and
gloo resolve to the nodes' addresses, as on a real cluster. Client commands run on the head
through ``ip netns exec``, which binds ``/etc/netns/<namespace>/hosts`` the same way. munge's
socket is a file: every namespace reaches it.

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
from labkit.cluster.slurm_conf import HEAD_ADDR, hosts_file, node_names, slurm_conf
from labkit.cluster.slurm_reaper import Reaper, sweep_stale_runs
from labkit.launch.lifeline import RUN_ID_VAR, Lifeline
from labkit.safe_files import check_folder, make_private_dir, write_private

__all__ = ["SlurmCluster", "hosts_file", "slurm_conf", "slurm_cluster", "slurm_unavailable"]

DAEMONS = ("slurmctld", "slurmd", "munged", "sbatch", "scontrol", "scancel", "sinfo", "nsenter")
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
    key = write_private(run / "munge.key", os.urandom(1024), perm=0o400)  # this run's alone
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


def _check_args(nodes: int, run_dir: str | Path | None, start_timeout: float) -> Path | None:
    """Refuse bad arguments before anything starts. A caller's ``run_dir`` must be a folder
    of this user's that no one else can write, with no folder above it others could swap
    (labkit.safe_files), and empty: every file of the run is created new in it, as root.
    Returns its checked real path (created 0700 when missing), or None."""
    if isinstance(nodes, bool) or not isinstance(nodes, int) or not 1 <= nodes < 65533:
        raise ValueError(f"slurm_cluster: nodes must be an int from 1 to 65532 (10.77.0.0/16 "
                         f"holds the nodes and the head), got nodes={nodes!r}")  # fmt: skip
    if not start_timeout > 0:
        raise ValueError(f"slurm_cluster: start_timeout must be > 0 s, got {start_timeout!r}")
    if run_dir is None:
        return None
    if not os.path.lexists(run_dir):
        return make_private_dir(run_dir, 0o700, parents=True, what="Slurm run folder")
    run = check_folder(run_dir, others_may_read=True, what="Slurm run folder")
    there = sorted(p.name for p in run.iterdir())
    if there:
        raise ValueError(f"slurm_cluster: run_dir={str(run_dir)!r} is not empty (it holds "
                         f"{', '.join(there[:5])}): pass a new or empty folder")  # fmt: skip
    return run


@contextlib.contextmanager
def slurm_cluster(
    nodes: int = 2, run_dir: str | Path | None = None, env: dict[str, str] | None = None,
    start_timeout: float = 60.0,
) -> Iterator[SlurmCluster]:  # fmt: skip
    """A Slurm cluster of ``nodes`` emulated nodes for the ``with`` block (see module doc).
    ``run_dir``: a new or empty folder of the caller's for the run's files (checked, see
    :func:`_check_args`); by default a private one in the temp folder, removed at the end.
    ``env``: added to every process's environment (a test's tag)."""
    given = _check_args(nodes, run_dir, start_timeout)
    why = slurm_unavailable()
    if why is not None:
        raise RuntimeError(f"cannot start a Slurm cluster here: {why}")
    netns.sweep_stale()  # first: a stale namespace's /etc/netns entry goes with it below
    sweep_stale_etc()
    sweep_stale_runs()
    etc: list[Path] = []
    run: Path | None = None
    clean = False
    reaper = Reaper(env)  # announced before created: a SIGKILLed caller's objects go at once
    try:  # from here on, every way out ends the reaper (and it reaps when not clean)
        run = reaper.own_folder() if given is None else given
        run_id = f"slurm-{uuid.uuid4().hex[:8]}"
        full_env = {**os.environ, **(env or {}), RUN_ID_VAR: run_id,
                    "SLURM_CONF": str(run / "slurm.conf")}  # fmt: skip
        plan = NetnsPlan.new(nodes, 1e9)
        spaces = [plan.switch, *(plan.namespace(i) for i in range(nodes))]
        for ns in spaces:
            reaper.track("netns", ns)
            reaper.track("path", NETNS_ETC / ns)
        reaper.track("path", netns.RECORDS / plan.tag)
        netns.create(plan)
        try:
            subprocess.run(["ip", "-n", plan.switch, "addr", "add", f"{HEAD_ADDR}/16", "dev",
                            plan.bridge], check=True, capture_output=True)  # fmt: skip
            # the head talks to itself (clients to slurmctld) over its own loopback
            subprocess.run(["ip", "-n", plan.switch, "link", "set", "lo", "up"], check=True,
                           capture_output=True)  # fmt: skip
            for ns in spaces:  # new (0755: ip netns exec binds hosts for every user)
                etc.append(make_private_dir(NETNS_ETC / ns, 0o755, parents=True))
                write_private(NETNS_ETC / ns / "hosts", hosts_file(plan), perm=0o644)
            write_private(run / "hosts", hosts_file(plan), perm=0o644)
            make_private_dir(run / "ctld")
            write_private(run / "plugstack.conf", "", perm=0o644)
            write_private(run / "slurm.conf", slurm_conf(plan, run, os.cpu_count() or 1),
                          perm=0o644)  # fmt: skip
            lifeline = Lifeline(full_env, run_id)
            procs: list[subprocess.Popen[bytes]] = []
            handle = SlurmCluster(plan, run, full_env)
            try:
                procs.append(_start_munge(run, plan.switch, lifeline, full_env))
                _wait_file(run / "munge.socket", 10, "munged")
                daemons = [_on_host(plan.switch, "head", run, "slurmctld -D -i")]
                for i, name in enumerate(node_names(nodes)):
                    make_private_dir(run / f"spool-{name}")
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
        if given is None and run is not None:
            shutil.rmtree(run, ignore_errors=True)
        reaper.close(clean)  # a teardown cut short: the reaper finishes it
