"""The node-loss drill: N emulated nodes train under torchrun's elastic rendezvous; one dies.

``run_node_loss(NodeLossConfig(), workdir)`` brings up an emulated cluster
(:mod:`labkit.cluster`: one network namespace per node as root, plain loopback otherwise),
starts ONE torchrun agent per node (``--nnodes N-1:N --rdzv-backend c10d --max-restarts 2``:
torchrun's own restart, no loop of ours), waits until every rank of ``kill_node`` stands
mid-step, then kills that node: its link goes down first (netns mode; software mode has no
link), then every process in it, agent included, with SIGKILL. Like a node that loses power,
it says nothing: the survivors learn of it from their collective's timeout (netns: no FIN
crosses a dead link) or from a closed connection (software mode: the kernel closes it).

What happens then, timed by the events every rank appends to ``events.jsonl``
(:func:`labkit.labs.node_loss_report.analyse` reads them):

1. detection: a survivor's training collective raises (``collective_timeout`` s in netns);
2. torchrun's agents see their worker fail and re-run the rendezvous: the dead node's
   heartbeat must expire first (``keep_alive_interval * keep_alive_max_attempt`` =
   ``RDZV_CONF``'s 1 s x 2), then the round waits ``last_call_timeout`` (1 s) for latecomers;
3. fresh workers start on N-1 nodes, read the newest checkpoint (resharded: dp shrinks, each
   ZeRO-1 range is read from the old shards that overlap it) and raise the accumulation to
   keep the global batch.

The rendezvous store lives in node 0's agent: the drill never kills node 0 (at scale the
store sits outside the training nodes, or in etcd). Every process started here dies with the
caller (:class:`labkit.launch.lifeline.Lifeline`) and the namespaces go with the ``with``
block of :func:`labkit.cluster.run.cluster_network`, on every way out.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import labkit
from labkit.cluster import EmulatedCluster
from labkit.cluster.run import ClusterRun, cluster_network
from labkit.labs.node_loss_report import DrillReport, analyse
from labkit.labs.node_loss_train import NodeLossConfig, schedule
from labkit.launch.lifeline import RUN_ID_VAR, Lifeline
from labkit.safe_files import make_private_dir, open_private

__all__ = ["RDZV_CONF", "NodeLossConfig", "agent_command", "run_node_loss"]

ROOT = Path(labkit.__file__).resolve().parents[1]
RDZV_CONF = "join_timeout=60,last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=2"
RDZV_PORT = 29400  # inside the run's own namespaces nothing else listens; software: a free port


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def agent_command(cfg: NodeLossConfig, nodes: int, node: int, endpoint: str, run_id: str,
                  local_addr: str, max_restarts: int = 2,
                  log_dir: Path | None = None) -> list[str]:  # fmt: skip
    """Node ``node``'s torchrun: elastic between N-1 and N nodes, one rank per node.
    ``log_dir``: where the agent keeps its workers' logs (the drill passes its own work folder;
    without one, torchrun makes a ``torchelastic_*`` folder in the system temp that nobody
    removes)."""
    return [
        sys.executable, "-m", "torch.distributed.run",
        *(["--log-dir", str(log_dir)] if log_dir is not None else []),
        "--nnodes", f"{nodes - 1}:{nodes}", "--nproc-per-node", "1",
        "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", run_id,
        "--rdzv-conf", f"{RDZV_CONF},is_host={'true' if node == 0 else 'false'}",
        "--max-restarts", str(max_restarts), "--monitor-interval", "0.1",
        "--local-addr", local_addr,
        "-m", "labkit.labs.node_loss_train", "--config", json.dumps(asdict(cfg)),
    ]  # fmt: skip


def _check(cfg: NodeLossConfig, nodes: int) -> None:
    if nodes < 2:
        raise ValueError(f"the drill needs nodes >= 2 (one dies), got nodes={nodes}")
    if not 1 <= cfg.kill_node < nodes:
        raise ValueError(
            f"kill_node={cfg.kill_node} must be in [1, {nodes}): node 0 hosts the rendezvous"
        )
    if not 0 <= cfg.kill_step < cfg.steps:
        raise ValueError(f"kill_step={cfg.kill_step} is not a step of steps={cfg.steps}")
    for dp in (nodes, nodes - 1):
        schedule(cfg.global_batch, cfg.micro_batch, dp)  # names the dp that cannot keep G


def _events(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _kill_node(net: ClusterRun, node: int, agent: subprocess.Popen[bytes]) -> None:
    """Link down (netns), then SIGKILL every process of the node: agent and ranks."""
    import psutil

    if net.plan is not None:
        ns = net.plan.namespace(node)
        subprocess.run(["ip", "-n", ns, "link", "set", net.plan.node_if(node), "down"],
                       check=True, capture_output=True)  # fmt: skip
        pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True)
        victims = [int(p) for p in pids.stdout.split()]
    else:
        top = psutil.Process(agent.pid)
        victims = [agent.pid, *(c.pid for c in top.children(recursive=True))]
    for pid in victims:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def run_node_loss(
    cfg: NodeLossConfig,
    workdir: str | Path,
    nodes: int = 3,
    mode: str = "auto",
    timeout: float = 120.0,
    env: dict[str, str] | None = None,
) -> DrillReport:
    """Run the drill on ``nodes`` emulated nodes (one rank each) and return its report.

    ``mode``: the cluster's (``auto``: netns as root, else software). ``env``: added to every
    process's environment (a test's tag). Bad input raises before any process starts."""
    _check(cfg, nodes)
    work = make_private_dir(workdir, 0o755, parents=True, exist_ok=True, what="drill folder")
    cfg = replace(cfg, ckpt_dir=str(work / "ckpt"), events=str(work / "events.jsonl"))
    events = Path(cfg.events)
    run_id = f"drill-{uuid.uuid4().hex[:8]}"
    path = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    base = {**os.environ, **(env or {}), RUN_ID_VAR: run_id, "OMP_NUM_THREADS": "1",
            "LOGLEVEL": "INFO",  # torchrun: the agent says what it does (restarts, rounds)
            "PYTHONPATH": path}  # fmt: skip
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        base.pop(var, None)
    cluster = EmulatedCluster(nodes=nodes, inter_bandwidth=100e6, mode=mode)
    with cluster_network(cluster, nodes) as net:
        lifeline = Lifeline(base, run_id)
        agents: list[subprocess.Popen[bytes]] = []
        try:
            plan = net.plan
            host = plan.address(0) if plan else "127.0.0.1"
            endpoint = f"{host}:{RDZV_PORT if plan else _free_port()}"
            for node in range(nodes):
                addr = plan.address(node) if plan else "127.0.0.1"
                cmd = agent_command(cfg, nodes, node, endpoint, run_id, addr,
                                    log_dir=work / f"agent{node}")  # fmt: skip
                prefix = ["ip", "netns", "exec", plan.namespace(node)] if plan else []
                node_env = {**base, "LABKIT_NODE": str(node),
                            "GLOO_SOCKET_IFNAME": plan.node_if(node) if plan else "lo"}  # fmt: skip
                with open_private(work / f"node{node}.log", "wb", overwrite=True) as out:
                    agents.append(subprocess.Popen(
                        prefix + cmd, cwd=ROOT, env=node_env, stdout=out,
                        stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                        **lifeline.member()))  # fmt: skip
            deadline = time.monotonic() + timeout
            while sum(e["event"] == "midstep" for e in _events(events)) < 1:
                _bounded(deadline, agents, work, "the doomed node to reach mid-step")
            _log_kill(events, cfg.kill_node)
            _kill_node(net, cfg.kill_node, agents[cfg.kill_node])
            survivors = [a for n, a in enumerate(agents) if n != cfg.kill_node]
            while any(a.poll() is None for a in survivors):
                _bounded(deadline, survivors, work, "the surviving nodes to finish")
            failed = {n: a.returncode for n, a in enumerate(agents)
                      if n != cfg.kill_node and a.returncode != 0}  # fmt: skip
            if failed:
                raise RuntimeError(f"surviving agents failed {failed}:\n{_tails(work)}")
        finally:
            lifeline.end([a.pid for a in agents])
        logs = {n: (work / f"node{n}.log").read_text(errors="replace") for n in range(nodes)}
        report = analyse(cfg, _events(events), nodes=nodes, mode=net.mode, agent_logs=logs)
        report.tag = net.plan.tag if net.plan else ""
        return report


def _log_kill(events: Path, node: int) -> None:
    with open_private(events, "a") as f:
        f.write(json.dumps({"t": time.monotonic(), "event": "kill", "node": node}) + "\n")


def _bounded(deadline: float, agents: list[subprocess.Popen[bytes]], work: Path,
             what: str) -> None:  # fmt: skip
    if time.monotonic() > deadline:
        raise TimeoutError(f"timed out waiting for {what}:\n{_tails(work)}")
    if any(a.poll() not in (None, 0) for a in agents):
        raise RuntimeError(f"an agent failed while waiting for {what}:\n{_tails(work)}")
    time.sleep(0.05)


def _tails(work: Path) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-1500:]}"
                     for p in sorted(work.glob("node*.log")))  # fmt: skip
