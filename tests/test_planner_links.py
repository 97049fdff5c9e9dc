"""The planner's link classes, read off the real rank grid for every divisor layout (no
power-of-two or alignment assumption): groups that straddle nodes ride the slow link."""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest

from labkit.collectives.cost_model import ring_all_reduce_time
from labkit.models.gpt import GPTConfig
from labkit.parallel.layout import ParallelDegrees, rank_grid
from labkit.planner import Candidate, Cluster, predict
from labkit.planner.links import ORDERS, group_links


def _cluster(nodes: int, gpus: int) -> Cluster:
    return Cluster(
        nodes=nodes, gpus_per_node=gpus, memory_bytes=80e9, peak_flops=1e15,
        intra_bandwidth=3e11, inter_bandwidth=2.5e10, intra_latency=5e-6, inter_latency=1e-5,
    )  # fmt: skip


def _groups(dp: int, tp: int, pp: int, order: str) -> dict[str, list[list[int]]]:
    """Every group by the rank formula itself (innermost axis first in ``order``), not by
    rank_grid: ``tp-dp-pp``: r = pp_i dp tp + dp_i tp + tp_i; ``dp-tp-pp``: pp_i tp dp +
    tp_i dp + dp_i."""
    size = {"dp": dp, "tp": tp, "pp": pp}
    inner, middle, outer = order.split("-")

    def rank(idx: dict[str, int]) -> int:
        return (idx[outer] * size[middle] + idx[middle]) * size[inner] + idx[inner]

    out = {}
    for axis in ("tp", "dp", "pp"):
        others = [a for a in ("tp", "dp", "pp") if a != axis]
        out[axis] = [
            [rank({axis: i, others[0]: j, others[1]: k}) for i in range(size[axis])]
            for j in range(size[others[0]])
            for k in range(size[others[1]])
        ]
    return out


def test_groups_that_straddle_nodes_ride_the_slow_link() -> None:
    # 2 nodes of 6 GPUs at tp=4: the tp group [4, 5, 6, 7] has 2 ranks on each node
    six = _cluster(2, 6)
    tp = group_links(six, dp=3, tp=4, pp=1)["tp"]
    assert (tp.slow, tp.nodes, tp.ranks_per_node) == (True, 2, 2)
    assert tp.alpha == six.inter_latency and tp.bandwidth == six.inter_bandwidth
    # tp=6 on nodes of 8: [6, ..., 11] spans nodes 0 and 1
    eight = _cluster(3, 8)
    assert group_links(eight, dp=4, tp=6, pp=1)["tp"].slow
    # the planner prices their all-reduces on the slow link (was: NVLink)
    cfg = GPTConfig(vocab_size=1200, block_size=64, n_layer=4, n_head=12, n_embd=96)
    b, m, act = 1, 4, 2 * 64 * 96
    pred = predict(cfg, six, 12, Candidate(dp=3, tp=4, pp=1, micro_batch=b, recompute="none"))
    # a ring crossing a node edge gets GroupLink.ring_bandwidth, like dp's: the uplink's
    # per-GPU share x the 2 ranks per node of [4, 5, 6, 7] (issue 24: was the per-GPU share)
    bw = 2 * six.inter_bandwidth
    assert tp.ring_bandwidth == bw
    want = 4 * m * 4 * ring_all_reduce_time(act, 4, six.inter_latency, 1 / bw)
    assert pred.time["tp_comm"] == pytest.approx(want)
    # the dp groups [0, 4, 8] etc. hold 2 ranks on one node and 1 on the other: no two-level
    # all-reduce for a ragged group, a flat ring on the slow link
    dp = group_links(six, dp=3, tp=4, pp=1)["dp"]
    assert dp.slow and not dp.balanced and dp.ranks_per_node == 1
    cand = Candidate(dp=3, tp=4, pp=1, micro_batch=b, recompute="none")
    flat = predict(cfg, six, 12, cand, dp_collective="ring").time["dp_comm"]
    assert predict(cfg, six, 12, cand, dp_collective="hierarchical").time["dp_comm"] == flat


def _old_formula(g: int, dp: int, tp: int, pp: int, order: str) -> dict[str, tuple]:
    """The placement links.py used to compute (powers of two, aligned groups only)."""
    sizes, stride, out = {"dp": dp, "tp": tp, "pp": pp}, 1, {}
    for axis in order.split("-"):
        n = sizes[axis]
        per_node = min(n, g // stride) if stride < g else 1
        nodes = -(-n // per_node)
        out[axis] = (nodes > 1, per_node, nodes)
        stride *= n
    return out


def test_aligned_power_of_two_layouts_are_priced_as_before() -> None:
    powers = (1, 2, 4, 8, 16)
    for g, nodes, order in itertools.product((1, 2, 4, 8), (1, 2, 4), ORDERS):
        world = g * nodes
        for tp, pp in itertools.product(powers, repeat=2):
            if world % (tp * pp):
                continue
            dp = world // (tp * pp)
            links = group_links(_cluster(nodes, g), dp, tp, pp, order)
            got = {a: (k.slow, k.ranks_per_node, k.nodes) for a, k in links.items()}
            assert got == _old_formula(g, dp, tp, pp, order), (g, nodes, dp, tp, pp, order)


def test_link_class_equals_what_the_rank_grid_says() -> None:
    """Property: for every divisor layout on nodes of 1 to 8 GPUs, an axis rides the slow link
    exactly when one of its groups (by the rank formula) spans nodes, and the counts agree."""
    checked = 0
    for g, nodes, order in itertools.product(range(1, 9), (1, 2, 3, 4), ORDERS):
        world = g * nodes
        divisors = [k for k in range(1, world + 1) if world % k == 0]
        for tp, pp in itertools.product(divisors, repeat=2):
            if world % (tp * pp):
                continue
            dp = world // (tp * pp)
            groups = _groups(dp, tp, pp, order)
            grid = rank_grid(ParallelDegrees(dp=dp, tp=tp, pp=pp), order)
            links = group_links(_cluster(nodes, g), dp, tp, pp, order)
            for axis, link in links.items():
                assert sorted(grid[axis]) == sorted(groups[axis])
                spans = [len({r // g for r in grp}) for grp in groups[axis]]
                assert link.slow == (max(spans) > 1), (g, nodes, dp, tp, pp, order, axis)
                assert link.nodes == max(spans)
                checked += 1
    assert checked > 1000


def test_the_ends_and_the_tied_embedding_are_priced_on_their_links() -> None:
    # the counted miniature's unpriced terms (tests/test_wire_count.py), by hand: the tp
    # all-reduces at the embedding and into the head (2bsh, one each per micro-batch on an
    # end stage) and the tied V/t x h gradient over the pipeline's ends, once a step
    cfg = GPTConfig(vocab_size=1200, block_size=64, n_layer=8, n_head=12, n_embd=96)
    two = _cluster(2, 8)
    act, m = 2 * 64 * 96, 4
    cand = Candidate(dp=1, tp=4, pp=4, micro_batch=1, recompute="none")
    pred = predict(cfg, two, m, cand)
    tp_ring = ring_all_reduce_time(act, 4, two.intra_latency, 1 / two.intra_bandwidth)
    assert pred.time["tp_ends_comm"] == pytest.approx(m * 1 * tp_ring)  # an end stage: 1
    # stages 0 and 3 sit on nodes 0 and 1 (tp 4 x pp 4 on 2 nodes of 8): the slow link, at
    # MEGATRON_MIXED's fp32 wire (V/t = 300 rows of h = 96)
    wire = 300 * 96 * 4
    tied = ring_all_reduce_time(wire, 2, two.inter_latency, 1 / two.inter_bandwidth)
    assert pred.time["tied_comm"] == pytest.approx(tied)
    # one stage holds both ends: 2 all-reduces a micro-batch, no tied gradient to sum
    one = predict(cfg, _cluster(1, 4), m, Candidate(dp=1, tp=4, pp=1, micro_batch=1,
                                                     recompute="none"))  # fmt: skip
    assert one.time["tp_ends_comm"] == pytest.approx(2 * m * tp_ring)
    assert "tied_comm" not in one.time
    # a middle stage with more blocks paces tp: the lighter ends charge no extra all-reduce
    light = replace(cand, stage_layers=(1, 3, 3, 1))
    assert predict(cfg, two, m, light).time["tp_ends_comm"] == 0
    # an untied model (its own head) sums no tied gradient; pipeline ends inside one node:
    # NVLink (dp 2 x pp 2 on a node of 4: groups [0, 2], [1, 3])
    untied = predict(replace(cfg, tie_weights=False), two, m, cand)
    assert "tied_comm" not in untied.time and untied.step_seconds < pred.step_seconds
    inside = predict(cfg, _cluster(1, 4), 2 * m, Candidate(dp=2, tp=1, pp=2, micro_batch=1,
                                                            recompute="none"))  # fmt: skip
    wire = 1200 * 96 * 4
    assert inside.time["tied_comm"] == pytest.approx(
        ring_all_reduce_time(wire, 2, 5e-6, 1 / 3e11))
    assert "tp_ends_comm" not in inside.time  # tp = 1: nothing to reduce
