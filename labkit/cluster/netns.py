"""The real-network cluster: one Linux network namespace per node, joined through a bridge.

Layout of a run tagged ``t`` (6 hex digits) with N nodes::

    namespace lk-t-n0              namespace lk-t-sw                  namespace lk-t-n1
    lo + lktn0 10.77.0.1/16 <-veth-> lkts0 -+- bridge lktbr -+- lkts1 <-veth-> lktn1 10.77.0.2/16
         tbf (uplink)                tbf (downlink)    tbf (downlink)       tbf (uplink)

* Every object lives inside a namespace the run creates (veth ends are created directly in
  their namespaces), so addresses never touch the machine's own network and deleting the
  namespaces deletes everything. Interface names fit Linux's 15 characters.
* Both directions of each node's link are shaped with ``tbf`` at ``inter_bandwidth``: the
  node-side veth shapes what the node sends (uplink), the switch-side veth what it receives
  (downlink). A node's ranks share both. veth hands ``tbf`` GSO super-packets of up to 64 KB;
  ``tbf`` splits a packet larger than its burst into segments, so the burst only sets how many
  bytes may pass at line rate after an idle period (``_BURST_S`` of traffic, at least 32 KB).
* Ranks of one node talk to their node's address, which the kernel routes over the
  namespace's loopback: unshaped, as inside a real node.
* Latency is NOT emulated: this kernel has no ``netem``. Messages see the machine's own
  latency (tens of microseconds); ``EmulatedCluster.inter_latency`` applies to software mode.

Cleanup: the launcher calls :func:`remove` on every exit path and registers it ``atexit``.
Each run writes ``/run/labkit-cluster/<tag>`` holding its creator's pid, start time and user
before creating anything; :func:`sweep_stale` (at the start of every netns launch) removes
runs whose creator is gone (SIGKILL of the caller, a crash). :func:`leftovers` lists what
remains.

Records are written whole or not at all (a temporary file, then ``os.replace``) in a folder
only their user can write (checked like the runs folder, ``labkit.launch.runs``). The sweep
acts on a record only when it is complete, a regular file, and its user's own: a partial or
foreign record is left alone, never read as "creator gone". A network with no record at all
was made by hand or outlived its record: it is stale.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import json
import os
import re
import signal
import stat
import subprocess
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from labkit.cluster.slurm_reaper import process_id
from labkit.safe_files import make_private_dir, replace_private

RECORDS = Path("/run/labkit-cluster")
NETNS_DIR = Path("/var/run/netns")
_CLONE_NEWNET = 0x40000000
_BURST_S = 0.002  # tbf bucket: 2 ms of traffic at the shaped rate
_QUEUE_S = 0.2  # tbf queue: at most 200 ms of traffic waits before drops
_NS = re.compile(r"^lk-([0-9a-f]{6})-(?:n\d+|sw)$")
_LINK = re.compile(r"^lk([0-9a-f]{6})(?:[ns]\d+|br)$")
_TAG = re.compile(r"^[0-9a-f]{6}$")
_live_plans: set[NetnsPlan] = set()  # created by this process and not yet removed


@dataclass(frozen=True)
class NetnsPlan:
    """The names and addresses of one run's network (pure: computing them creates nothing)."""

    tag: str
    nodes: int
    bandwidth: float  # bytes/s, each direction of each node's link

    @staticmethod
    def new(nodes: int, bandwidth: float) -> NetnsPlan:
        return NetnsPlan(uuid.uuid4().hex[:6], nodes, float(bandwidth))

    def namespace(self, node: int) -> str:
        return f"lk-{self.tag}-n{node}"

    @property
    def switch(self) -> str:
        return f"lk-{self.tag}-sw"

    def node_if(self, node: int) -> str:
        return f"lk{self.tag}n{node}"

    def switch_if(self, node: int) -> str:
        return f"lk{self.tag}s{node}"

    @property
    def bridge(self) -> str:
        return f"lk{self.tag}br"

    def address(self, node: int) -> str:
        """Node ``node``'s address in 10.77.0.0/16 (private to the run's namespaces)."""
        return f"10.77.{(node + 1) // 256}.{(node + 1) % 256}"


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(list(args), capture_output=True, text=True)
    if check and done.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} failed: {done.stderr.strip()}")
    return done


def _shape(namespace: str, dev: str, bandwidth: float) -> None:
    rate = int(bandwidth * 8)  # tc's "bit" unit: bits per second
    burst = max(int(bandwidth * _BURST_S), 32 * 1024)
    limit = max(int(bandwidth * _QUEUE_S), 4 * burst)
    _ip("tc", "-n", namespace, "qdisc", "replace", "dev", dev, "root", "tbf",
        "rate", f"{rate}bit", "burst", str(burst), "limit", str(limit))  # fmt: skip


def _records() -> Path:
    """The records folder, created mode 0700; refused when others can write or read it (or
    a folder above it: safe_files)."""
    make_private_dir(RECORDS, 0o700, parents=True, exist_ok=True, what="records folder")
    return RECORDS


def write_record(tag: str) -> None:
    """Record that this process creates run ``tag``: whole or not at all (temp + rename)."""
    payload = json.dumps({"creator": process_id(os.getpid()), "uid": os.geteuid()})
    replace_private(_records() / tag, payload)  # its temporary ".<tag>...": never read as a tag


def read_record(tag: str) -> dict[str, Any] | None:
    """Run ``tag``'s record when it is complete, a regular file and this user's; else None."""
    path = RECORDS / tag
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return None
    with os.fdopen(fd) as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
            return None
        try:
            record = json.loads(f.read())
        except ValueError:  # partial (or not ours in any format)
            return None
    if not (isinstance(record, dict) and record.get("uid") == os.geteuid()):
        return None
    creator = record.get("creator")
    parts = creator.split() if isinstance(creator, str) else []
    return record if len(parts) == 2 and all(p.isdigit() for p in parts) else None


def create(plan: NetnsPlan) -> None:
    """Build the run's namespaces, bridge, veth pairs, addresses and shaping (root only).
    On any failure everything built so far is removed before the error propagates."""
    write_record(plan.tag)
    _live_plans.add(plan)
    atexit.register(remove, plan)
    try:
        _ip("ip", "netns", "add", plan.switch)
        _ip("ip", "-n", plan.switch, "link", "add", plan.bridge, "type", "bridge")
        _ip("ip", "-n", plan.switch, "link", "set", plan.bridge, "up")
        for node in range(plan.nodes):
            ns, here, there = plan.namespace(node), plan.node_if(node), plan.switch_if(node)
            _ip("ip", "netns", "add", ns)
            _ip("ip", "link", "add", here, "netns", ns, "type", "veth",
                "peer", "name", there, "netns", plan.switch)  # fmt: skip
            _ip("ip", "-n", ns, "addr", "add", f"{plan.address(node)}/16", "dev", here)
            _ip("ip", "-n", ns, "link", "set", "lo", "up")
            _ip("ip", "-n", ns, "link", "set", here, "up")
            _ip("ip", "-n", plan.switch, "link", "set", there, "master", plan.bridge)
            _ip("ip", "-n", plan.switch, "link", "set", there, "up")
            _shape(ns, here, plan.bandwidth)  # uplink: what the node sends
            _shape(plan.switch, there, plan.bandwidth)  # downlink: what the node receives
    except BaseException:
        remove(plan)
        raise


def remove(plan: NetnsPlan | str) -> None:
    """Delete everything of the run (idempotent): its namespaces take their veths, bridge and
    qdiscs with them; links that never left the root namespace are deleted by name."""
    tag = plan if isinstance(plan, str) else plan.tag
    for kind, name in leftovers(tag):
        if kind == "netns":
            # A rank still inside (its launcher was SIGKILLed, or it outlived its job) would
            # keep the namespace alive, unnamed, and wait on peers it can no longer reach:
            # only this run's ranks ever enter its namespaces, so they go with it.
            for pid in _ip("ip", "netns", "pids", name, check=False).stdout.split():
                with contextlib.suppress(OSError, ValueError):
                    os.kill(int(pid), signal.SIGKILL)
            _ip("ip", "netns", "del", name, check=False)
        elif kind == "link":
            _ip("ip", "link", "del", name, check=False)
    with contextlib.suppress(OSError):
        (RECORDS / tag).unlink()
    if not isinstance(plan, str) and plan in _live_plans:
        _live_plans.discard(plan)
        atexit.unregister(remove)  # drops every registration of remove: re-add the others
        for other in _live_plans:
            atexit.register(remove, other)


def leftovers(tag: str | None = None) -> list[tuple[str, str]]:
    """``[(kind, name)]`` of labkit network objects present now (of run ``tag``, or of all
    runs): ``netns`` namespaces, root-namespace ``link``s and the ``qdisc``s on them."""
    found: list[tuple[str, str]] = []
    names = _ip("ip", "netns", "list", check=False).stdout.split()
    for name in names:
        if (m := _NS.match(name)) and (tag is None or m[1] == tag):
            found.append(("netns", name))
    for line in _ip("ip", "-o", "link", "show", check=False).stdout.splitlines():
        dev = line.split(":")[1].strip().split("@")[0] if ":" in line else ""
        if (m := _LINK.match(dev)) and (tag is None or m[1] == tag):
            found.append(("link", dev))
            qdiscs = _ip("tc", "qdisc", "show", "dev", dev, check=False).stdout
            found += [("qdisc", f"{dev}: {q}") for q in qdiscs.splitlines() if "tbf" in q]
    return found


def sweep_stale() -> list[str]:
    """Remove the networks of runs whose creator process is gone; return their tags.

    Only complete records of this user's runs are read (see the module docstring)."""
    tags = {m[1] for _, name in leftovers() if (m := re.search(r"lk-?([0-9a-f]{6})", name))}
    if RECORDS.exists():
        tags.update(p.name for p in _records().iterdir() if _TAG.match(p.name))
    stale = []
    for tag in sorted(tags):
        if os.path.lexists(RECORDS / tag):
            record = read_record(tag)
            if record is None:
                continue  # partial, foreign or not a file: never taken for "creator gone"
            if process_id(int(record["creator"].split()[0])) == record["creator"]:
                continue  # its creator lives
        remove(tag)  # its creator is gone, or it has no record (made by hand, record lost)
        stale.append(tag)
    return stale


def enter(plan: NetnsPlan, node: int) -> None:
    """Move the calling process (its current thread: call before starting threads that open
    sockets) into ``node``'s namespace, and point gloo at the node's interface."""
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    fd = os.open(NETNS_DIR / plan.namespace(node), os.O_RDONLY)
    try:
        if libc.setns(fd, _CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns into {plan.namespace(node)}: {os.strerror(err)}")
    finally:
        os.close(fd)
    os.environ["GLOO_SOCKET_IFNAME"] = plan.node_if(node)
