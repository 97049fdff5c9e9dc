"""The emulated cluster: validation, the link models, the probe, and netns cleanup.

Multi-process tests use ``labkit.launch`` directly: they test where ranks run and what the
launch leaves behind. The netns tests need root and ``ip netns``; they skip with the reason
elsewhere, but CI (``CI=true``) requires them.
"""

from __future__ import annotations

import os
import signal
import subprocess
import uuid
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from labkit.cluster import EmulatedCluster, NodeTopology, netns, probe_links
from labkit.cluster import spec as cluster_spec
from labkit.cluster.software import LinkClock, flat_ring_cost, reserve
from labkit.launch import LaunchConfig, LaunchError, launch

SLOW = 10e6  # bytes/s of each node's uplink in the multi-process tests
SIZES = (1 << 14, 1 << 18, 1 << 20)


def _netns_or_skip() -> None:
    why = cluster_spec.netns_unavailable()
    if why:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"CI requires the netns cluster tests, but {why}")
        pytest.skip(f"netns cluster unavailable: {why}")


# ------------------------------------------------------------------ no processes


def test_topology_layout():
    topo = EmulatedCluster(nodes=3, inter_bandwidth=1e6).topology(6)
    assert topo == NodeTopology(nodes=3, ranks_per_node=2)
    assert [topo.node_of(r) for r in range(6)] == [0, 0, 1, 1, 2, 2]
    assert [topo.local_rank(r) for r in range(6)] == [0, 1, 0, 1, 0, 1]
    assert topo.ranks_of_node(2) == [4, 5]
    with pytest.raises(ValueError, match="rank must be in"):
        topo.node_of(6)


@pytest.mark.parametrize(
    ("kwargs", "world_size", "message"),
    [
        (dict(nodes=5, inter_bandwidth=1e6), 4, "nodes=5 > world_size=4"),
        (dict(nodes=3, inter_bandwidth=1e6), 4, "world_size=4 is not divisible by nodes=3"),
    ],
)
def test_bad_layout_fails_before_any_process(tmp_path, kwargs, world_size, message):
    cluster = EmulatedCluster(**kwargs, mode="software")
    with pytest.raises(ValueError, match=message):
        launch(print, world_size=world_size, backend="gloo", cluster=cluster,
                      log_dir=tmp_path)  # fmt: skip
    assert list(tmp_path.iterdir()) == []  # no run folder: nothing was started


def test_bad_spec_names_the_value():
    with pytest.raises(ValueError, match="inter_bandwidth must be positive.*-1"):
        EmulatedCluster(nodes=2, inter_bandwidth=-1)
    with pytest.raises(ValueError, match="inter_bandwidth must be positive.*0"):
        EmulatedCluster(nodes=2, inter_bandwidth=0)
    with pytest.raises(ValueError, match="nodes=0"):
        EmulatedCluster(nodes=0, inter_bandwidth=1e6)
    with pytest.raises(ValueError, match="mode='tc'"):
        EmulatedCluster(nodes=2, inter_bandwidth=1e6, mode="tc")


def test_netns_without_root_points_at_software(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    cluster_spec.netns_unavailable.cache_clear()
    try:
        with pytest.raises(ValueError, match=r"needs root \(euid=1000\).*mode='software'"):
            LaunchConfig(world_size=4, backend="gloo", cluster=EmulatedCluster(2, 1e6, 0, "netns"))
        assert EmulatedCluster(2, 1e6).resolved_mode() == "software"  # auto falls back
    finally:
        cluster_spec.netns_unavailable.cache_clear()


def test_link_model_arithmetic():
    # A 1 MB message on a free 1 MB/s link with 1 ms latency: busy 1 s, arrives 1 ms later.
    assert reserve(0.0, 0.0, 10.0, 10**6, 1e-3, 1e-6) == pytest.approx((11.0, 11.001))
    # The downlink is busy until 12 s: the message waits for it.
    assert reserve(0.0, 12.0, 10.0, 10**6, 0.0, 1e-6) == pytest.approx((13.0, 13.0))
    # 2 nodes x 2 ranks, ring 0-1-2-3: one edge leaves each node; 2(p-1) steps of D/p.
    assert flat_ring_cost("all_reduce", 400, [0, 0, 1, 1], 1.0, 0.01) == pytest.approx(6 * 2)
    # Interleaved ring 0-2-1-3 on nodes [0,1,0,1]: two edges share each uplink.
    assert flat_ring_cost("all_gather", 400, [0, 1, 0, 1], 0.0, 0.01) == pytest.approx(3 * 2)
    assert flat_ring_cost("all_reduce", 400, [0, 0], 1.0, 0.01) == 0.0  # one node: free


def test_node_uplink_is_shared_by_its_ranks(tmp_path):
    # Two ranks of node 0 (two clocks on one file, as two processes) each send 1 MB at 1 MB/s:
    # the second message waits for the first on node 0's uplink, even toward another node.
    first = LinkClock(tmp_path / "links", nodes=3).send(0, 1, 10**6, 0.0, 1e-6)
    second = LinkClock(tmp_path / "links", nodes=3).send(0, 2, 10**6, 0.0, 1e-6)
    assert second == pytest.approx(first + 1.0, abs=0.05)
    # Node 1 to node 0 uses two free links: it does not queue behind node 0's uplink traffic.
    assert LinkClock(tmp_path / "links", nodes=3).send(1, 0, 10, 0.0, 1e-6) < first


def test_link_clock_loses_no_reservation_between_threads(tmp_path):
    # Two sending threads of one rank share its LinkClock (fcntl locks belong to the process,
    # so they alone do not exclude the other thread). Every reservation holds node 0's uplink
    # for 1 s, far longer than the test runs, so each one starts where the previous ended:
    # after N of them the uplink is busy exactly N s past the first start, and no two arrive
    # at the same time. A lost update (both threads read the same busy time) breaks both.
    import threading

    clock, n = LinkClock(tmp_path / "links", nodes=2), 4000
    arrivals: list[list[float]] = [[], []]
    start = threading.Barrier(2)

    def sender(i: int) -> None:
        start.wait()
        arrivals[i] = [clock.send(0, 1, 10**6, 0.0, 1e-6) for _ in range(n)]

    threads = [threading.Thread(target=sender, args=(i,)) for i in (0, 1)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    every = sorted(arrivals[0] + arrivals[1])
    lost = 2 * n - len(set(every))
    assert lost == 0, f"{lost} of {2 * n} reservations lost"
    assert every[-1] - every[0] == pytest.approx(2 * n - 1, abs=1e-6)


# ------------------------------------------------------------------ ranks on a cluster


def _on_cluster(topology: NodeTopology, tmp: str) -> dict:
    """Probe the links, all-reduce, and report where this rank's network lives."""
    import time as _time

    links = probe_links(topology, SIZES, repeats=2)
    rank = dist.get_rank()
    x = torch.arange(1000, dtype=torch.float32) * (rank + 1)
    start = _time.monotonic()
    dist.all_reduce(x)
    took = _time.monotonic() - start
    # Async sends overlap with compute: a cross-node isend of 2 MB (0.2 s on the link) returns
    # at once, not yet complete (asserted in software mode: there the model guarantees it).
    big = torch.zeros(1 << 19)
    done_at_issue = None
    if rank in (0, 2):
        op = dist.isend if rank == 0 else dist.irecv
        (work,) = dist.batch_isend_irecv([dist.P2POp(op, big, 2 - rank)])
        done_at_issue = work.is_completed()
        work.wait()
    addrs = subprocess.run(["ip", "-o", "-4", "addr"], capture_output=True, text=True).stdout
    return {
        "links": links,
        "sum_ok": torch.equal(x, torch.arange(1000, dtype=torch.float32) * 10),
        "all_reduce_s": took,
        "send_done_at_issue": done_at_issue,
        "netns": os.readlink("/proc/self/ns/net"),
        "addresses": [w.split("/")[0] for w in addrs.split() if "/" in w and w[:4] != "127."],
        "ifname": os.environ.get("GLOO_SOCKET_IFNAME", ""),
    }


def _check_probe(out: list[dict]) -> tuple[float, float]:
    intra, inter = out[0]["links"]["intra"], out[0]["links"]["inter"]
    assert intra.pair == (0, 1) and inter.pair == (0, 2)
    assert intra.bandwidth / inter.bandwidth > 3, (intra.bandwidth, inter.bandwidth)
    assert SLOW / 2 < inter.fit.bandwidth < SLOW * 2, inter.fit
    assert all(r["sum_ok"] for r in out)
    return intra.bandwidth, inter.bandwidth


def test_software_cluster_is_slow_across_nodes(tmp_path):
    cluster = EmulatedCluster(nodes=2, inter_bandwidth=SLOW, mode="software")
    topo = cluster.topology(4)
    out = launch(_on_cluster, topo, str(tmp_path), world_size=4, cluster=cluster,
                        backend="gloo", timeout=90, quiet=True)  # fmt: skip
    _check_probe(out)
    floor = flat_ring_cost("all_reduce", 4000, [0, 0, 1, 1], 0.0, 1 / SLOW)
    assert all(r["all_reduce_s"] >= floor * 0.99 for r in out)  # the modeled cost was paid
    assert all(r["ifname"] == "" for r in out)  # no namespaces in software mode
    assert out[0]["send_done_at_issue"] is False


def test_arrival_board_gives_the_last_arrival_of_each_call(tmp_path):
    # Two ranks of one group (two boards on one run folder, as two processes): call n on the
    # group is the same collective on both, whatever each rank did on other groups.
    from types import SimpleNamespace

    from labkit.cluster.modeled import ArrivalBoard

    group, other = SimpleNamespace(group_name="7"), SimpleNamespace(group_name="dp/8")
    a, b = ArrivalBoard(tmp_path / "links", 0), ArrivalBoard(tmp_path / "links", 1)
    a.arrive(other, [0, 1], 50.0)  # another group's calls do not shift this group's count
    last_a = [a.arrive(group, [0, 1], t) for t in (10.0, 20.0)]
    last_b = [b.arrive(group, [0, 1], t) for t in (12.0, 19.0)]
    assert [f() for f in last_a] == [12.0, 20.0] and [f() for f in last_b] == [12.0, 20.0]


LATE, COST_BW = 0.4, 20e3  # rank 1 enters 0.4 s late; 4000 bytes at 20 kB/s: a 0.2 s ring


def _late_rank() -> dict:
    """Each rank's (enter, exit) of a cross-node all-reduce that rank 1 enters late, blocking
    and async, on the shared monotonic clock."""
    import time as _time

    out = {}
    for mode in ("blocking", "async"):
        dist.barrier()  # uncharged: both start together
        x = torch.ones(1000)  # 4000 bytes
        if dist.get_rank() == 1:
            _time.sleep(LATE)
        enter = _time.monotonic()
        if mode == "async":
            dist.all_reduce(x, async_op=True).wait()
        else:
            dist.all_reduce(x)
        out[mode] = (enter, _time.monotonic())
    return out


@pytest.mark.timing  # the closeness of the two ends is a measured duration
def test_charged_collective_ends_at_the_last_arrival_plus_its_cost(tmp_path):
    # A collective cannot start before its last rank arrives: the early rank must not be
    # charged from its own start (where the late rank's 0.4 s would hide the 0.2 s cost).
    cluster = EmulatedCluster(nodes=2, inter_bandwidth=COST_BW, mode="software")
    cost = flat_ring_cost("all_reduce", 4000, [0, 1], 0.0, 1 / COST_BW)
    assert cost == pytest.approx(0.2)
    out = launch(_late_rank, world_size=2, cluster=cluster, backend="gloo", timeout=60,
                 quiet=True)  # fmt: skip
    for mode in ("blocking", "async"):
        (_, early_exit), (late_enter, late_exit) = out[0][mode], out[1][mode]
        assert early_exit >= late_enter + cost * 0.98, (mode, early_exit - late_enter)
        assert late_exit >= late_enter + cost * 0.98, (mode, late_exit - late_enter)
        assert abs(early_exit - late_exit) < 0.1, (mode, early_exit - late_exit)
        assert late_exit < late_enter + cost + 0.1, (mode, late_exit - late_enter)  # charged once


def test_netns_cluster_is_slow_across_nodes_and_cleans_up(tmp_path):
    _netns_or_skip()
    cluster = EmulatedCluster(nodes=2, inter_bandwidth=SLOW, mode="netns")
    out = launch(_on_cluster, cluster.topology(4), str(tmp_path), world_size=4,
                        cluster=cluster, backend="gloo", timeout=90, quiet=True)  # fmt: skip
    _check_probe(out)
    spaces = [r["netns"] for r in out]
    assert spaces[0] == spaces[1] != spaces[2] == spaces[3]  # ranks live in their node
    node_addr = [r["addresses"] for r in out]
    assert node_addr[0] == node_addr[1] != node_addr[2] == node_addr[3]
    assert all(len(a) == 1 for a in node_addr), node_addr  # the node's one address...
    here = subprocess.run(["ip", "-o", "addr"], capture_output=True, text=True).stdout
    assert not any(r["ifname"] in here or r["addresses"][0] in here for r in out)  # ...inside
    tag = out[0]["ifname"][2:8]
    assert netns.leftovers(tag) == []


def _die_on_rank_1(tag_file: str) -> None:
    ifname = os.environ["GLOO_SOCKET_IFNAME"]  # lk<tag>n<node>
    if dist.get_rank() == 1:
        alive = sum(kind == "netns" for kind, _ in netns.leftovers(ifname[2:8]))
        Path(tag_file).write_text(f"{ifname[2:8]} {alive}")
        os.kill(os.getpid(), signal.SIGKILL)
    dist.barrier()


def test_netns_cleanup_after_a_rank_is_killed(tmp_path):
    _netns_or_skip()
    cluster = EmulatedCluster(nodes=2, inter_bandwidth=SLOW, mode="netns")
    tag_file = tmp_path / "tag"
    with pytest.raises(LaunchError, match="rank 1"):
        launch(_die_on_rank_1, str(tag_file), world_size=2, cluster=cluster,
                      backend="gloo", timeout=60, quiet=True)  # fmt: skip
    tag, alive = tag_file.read_text().split()
    assert int(alive) == 3  # while it ran: two node namespaces and the switch
    assert netns.leftovers(tag) == []


def test_leftovers_finds_a_stray_namespace_and_the_sweep_removes_it():
    _netns_or_skip()
    tag = uuid.uuid4().hex[:6]
    name = netns.NetnsPlan(tag, 1, 1e6).namespace(0)
    subprocess.run(["ip", "netns", "add", name], check=True)
    # a process left inside (a rank whose launcher was SIGKILLed) must go with the network
    inside = subprocess.Popen(["ip", "netns", "exec", name, "sleep", "120"])
    try:
        assert netns.leftovers(tag) == [("netns", name)]  # negative control: it is seen
        assert tag in netns.sweep_stale()  # no live creator: stale
        assert netns.leftovers(tag) == []
        assert inside.wait(timeout=10) == -signal.SIGKILL
    finally:
        inside.kill()
        subprocess.run(["ip", "netns", "del", name], capture_output=True)
