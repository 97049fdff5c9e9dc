"""The 10B-on-mixed-interconnects scenario: the planner with two link classes (by hand), and a
miniature whose every layout, the wrong placement included, trains like one process."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest

from labkit.collectives.cost_model import (
    flat_ring_two_level_time,
    hierarchical_all_reduce_time,
    ring_all_reduce_time,
)
from labkit.labs.mixed_links import (
    GPT_10B,
    MiniConfig,
    MiniLayout,
    comm_by_link,
    predict_miniature,
    rank_layouts,
    run_miniature,
    slow_link_scan,
    traffic,
    train_layouts,
)
from labkit.labs.threed import reference
from labkit.measure.mixed_links import miniature_cluster
from labkit.memory.model import MIXED_ADAM
from labkit.models.gpt import GPTConfig
from labkit.parallel.layout import ParallelDegrees
from labkit.planner import CLUSTERS, Candidate, Cluster, predict
from labkit.planner.links import group_links
from tests.ranks import run_ranks

ETH = CLUSTERS["a100-80gb-eth100"].with_nodes(4)  # 4 x 8 A100, 100 Gb/s Ethernet per node
IB = CLUSTERS["dgx-a100-80gb"].with_nodes(4)  # the same nodes, 8 x 200 Gb/s InfiniBand


def test_presets_and_the_10b_parameter_count_by_hand() -> None:
    assert ETH.inter_bandwidth == pytest.approx(100e9 / 8 / 8)  # 100 Gb/s over 8 GPUs
    assert IB.inter_bandwidth == pytest.approx(8 * 200e9 / 8 / 8)  # one 200 Gb/s per GPU
    assert ETH.intra_bandwidth == IB.intra_bandwidth and ETH.world_size == 32
    h, layers, v, s = 4096, 48, 51_200, 2048  # 12 l h^2 + 13 l h + V h + s h + 2 h
    assert GPT_10B.num_params() == layers * (12 * h * h + 13 * h) + v * h + s * h + 2 * h
    assert 9.8e9 < GPT_10B.num_params() < 10e9


def test_group_links_follow_the_rank_order() -> None:
    # Megatron's order on nodes of 8: tp adjacent, dp at stride t, pp outermost
    links = group_links(ETH, dp=8, tp=2, pp=2)
    assert (links["tp"].slow, links["tp"].nodes) == (False, 1)
    assert (links["dp"].ranks_per_node, links["dp"].nodes, links["dp"].slow) == (4, 2, True)
    assert links["pp"].slow and links["pp"].alpha == ETH.inter_latency  # stages 16 ranks apart
    assert group_links(ETH, dp=2, tp=16, pp=1)["tp"].slow  # tp=16 cannot fit a node of 8
    assert not group_links(ETH, dp=1, tp=4, pp=2)["pp"].slow  # both stages in one node
    # stages 4 ranks apart: every other boundary leaves a node, and paces the pipeline
    assert group_links(ETH, dp=2, tp=2, pp=8)["pp"].nodes == 4
    assert group_links(ETH, dp=2, tp=2, pp=8)["pp"].slow
    # dp innermost (the wrong placement): tp's partners are dp=8 ranks apart, off the node
    wrong = group_links(ETH, dp=8, tp=2, pp=2, order="dp-tp-pp")
    assert wrong["tp"].slow and not wrong["dp"].slow and wrong["dp"].ranks_per_node == 8
    with pytest.raises(ValueError, match="rank order 'pp-tp-dp'"):
        group_links(ETH, 8, 2, 2, order="pp-tp-dp")


def test_tp_comm_by_hand_inside_and_across_nodes() -> None:
    b, s, h, layers = 1, GPT_10B.block_size, GPT_10B.n_embd, GPT_10B.n_layer
    cand = Candidate(dp=2, tp=16, pp=1, micro_batch=b, recompute="selective")
    m = 64 // (2 * b)
    act = 2 * b * s * h  # one micro-batch's 16-bit hidden states
    across = predict(GPT_10B, ETH, 64, cand)
    # the ring crossing a node edge shares the node's port only with the other rings that
    # cross it: here one per node, so it gets the whole port, 8 per-GPU shares (issue 24)
    slow, fast = (
        (ETH.inter_latency, 1 / (8 * ETH.inter_bandwidth)),
        (ETH.intra_latency, 1 / ETH.intra_bandwidth),
    )
    want = layers * m * 4 * ring_all_reduce_time(act, 16, *slow)
    assert across.time["tp_comm"] == pytest.approx(want)
    inside = predict(GPT_10B, ETH, 64, replace(cand, dp=4, tp=8))
    want = layers * m * 4 * ring_all_reduce_time(act, 8, *fast)
    assert inside.time["tp_comm"] == pytest.approx(want / 2)  # m halves: dp doubled
    assert across.time["tp_comm"] > 30 * inside.time["tp_comm"]


def test_hierarchical_dp_comm_by_hand_and_below_the_flat_ring() -> None:
    cand = Candidate(dp=8, tp=2, pp=2, micro_batch=1, zero=0, recompute="selective")
    # MIXED_ADAM: the recipe keeps (and reduces) 16-bit gradients, 2 bytes each on the wire
    hier = predict(GPT_10B, ETH, 64, cand, dp_collective="hierarchical", precision=MIXED_ADAM)
    flat = predict(GPT_10B, ETH, 64, cand, dp_collective="ring", precision=MIXED_ADAM)
    h, v, s = GPT_10B.n_embd, GPT_10B.vocab_size, GPT_10B.block_size
    # the first stage's shard: 24 blocks of 12h^2/2 + 7h/2 split, 6h replicated (LayerNorms,
    # row-parallel biases), the vocabulary split, the positions whole (labkit.memory.per_gpu)
    psi = 24 * (12 * h * h / 2 + 7 * h / 2 + 6 * h) + v * h / 2 + s * h
    want = hierarchical_all_reduce_time(
        2 * psi, 2, 4,
        intra=(ETH.intra_latency, 1 / ETH.intra_bandwidth),
        inter=(ETH.inter_latency, 1 / ETH.inter_bandwidth), nics_per_node=4,
    )  # fmt: skip
    assert hier.time["dp_comm"] == pytest.approx(want)
    # the flat ring: dp groups [0, 2, ..., 14] and [1, 3, ..., 15] each hold 4 ranks on nodes 0
    # and 1, so 2 rings share a node's uplink (8 GPUs' worth): each crossing gets 4 GPUs' share
    assert flat.time["dp_comm"] == pytest.approx(
        ring_all_reduce_time(2 * psi, 8, ETH.inter_latency, 1 / (4 * ETH.inter_bandwidth))
    )
    # both send about the same bytes through a node's uplink (2(p-1)/p D against 2(n-1)/n D
    # per group): flat / hierarchical = (7/8) / (1/2) = 1.75 on bandwidth alone, a little less
    # with the flat ring's 14 slow latencies; charging the flat ring every GPU's share (6.8x)
    # is the negative control
    ratio = flat.time["dp_comm"] / hier.time["dp_comm"]
    assert 1.6 < ratio <= 1.75, ratio
    per_gpu_share = ring_all_reduce_time(2 * psi, 8, ETH.inter_latency, 1 / ETH.inter_bandwidth)
    assert per_gpu_share / hier.time["dp_comm"] > 6
    assert {k: hier.time[k] for k in ("compute", "tp_comm", "pp_comm")} == {
        k: flat.time[k] for k in ("compute", "tp_comm", "pp_comm")
    }
    with pytest.raises(ValueError, match="dp_collective='tree'"):
        predict(GPT_10B, ETH, 64, cand, dp_collective="tree")


def test_the_planners_dp_all_reduce_is_notebook_09s_cost_model() -> None:
    # one dp group filling 2 whole nodes of 8 (tp = pp = 1): the planner's flat ring and
    # hierarchical all-reduce must equal cost_model's two-level formulas with one uplink per
    # node (12.5 GB/s), the model notebook 09 prints, so the two notebooks cannot disagree
    two = ETH.with_nodes(2)
    cand = Candidate(dp=16, tp=1, pp=1, micro_batch=1, zero=0, recompute="selective")
    h, v, s = GPT_10B.n_embd, GPT_10B.vocab_size, GPT_10B.block_size
    grad = 2 * (GPT_10B.n_layer * (12 * h * h + 13 * h) + v * h + s * h)
    intra = (two.intra_latency, 1 / two.intra_bandwidth)
    uplink = (two.inter_latency, 1 / (two.gpus_per_node * two.inter_bandwidth))
    for alg, model in (("ring", flat_ring_two_level_time), ("hierarchical",
                       hierarchical_all_reduce_time)):  # fmt: skip
        got = predict(GPT_10B, two, 64, cand, dp_collective=alg,
                      precision=MIXED_ADAM).time["dp_comm"]  # 16-bit gradients on the wire
        assert got == pytest.approx(model(grad, 2, 8, intra, uplink)), alg


@pytest.mark.parametrize("cluster", [ETH, IB], ids=["ethernet", "infiniband"])
def test_the_best_layout_keeps_tp_inside_a_node(cluster: Cluster) -> None:
    preds = rank_layouts(GPT_10B, cluster, 256)
    fitting = [r for r in preds if r.fits]
    best = fitting[0]
    assert best.candidate.tp <= cluster.gpus_per_node
    assert comm_by_link(best, cluster)["tp"] in ("fast", "none")
    crossing = [r for r in fitting if r.candidate.tp > cluster.gpus_per_node]
    assert crossing, "tp=16 and 32 must be candidates (they fit)"
    assert all(r.step_seconds > best.step_seconds for r in crossing)
    # negative control: ranks in the wrong order put tp on the slow link once dp x tp
    # outgrows a node; never faster
    checked = 0
    for r in fitting:
        c = r.candidate
        if 1 < c.tp <= cluster.gpus_per_node and c.dp > 1:
            wrong = predict(GPT_10B, cluster, 256, c, order="dp-tp-pp",
                            dp_collective="hierarchical")  # fmt: skip
            if c.dp * c.tp > cluster.gpus_per_node:
                # a crossing ring gets ranks_per_node per-GPU shares of the uplink (2 or 4
                # here: 50 or 100 GB/s against NVLink's 300), so at least 2x slower
                assert wrong.time["tp_comm"] > 2 * r.time["tp_comm"], c
                checked += 1
            else:
                assert wrong.time["tp_comm"] == r.time["tp_comm"], c
    assert checked


def test_traffic_per_link_by_hand() -> None:
    """tp moves tens of times the bytes of pp and dp together: it gets the fast link."""
    cand = Candidate(dp=8, tp=2, pp=2, micro_batch=1, zero=1, recompute="selective")
    s, h, v = GPT_10B.block_size, GPT_10B.n_embd, GPT_10B.vocab_size
    m, act = 256 // 8, 2 * s * h
    got = traffic(GPT_10B, 256, cand, ETH)
    assert got["tp"] == (pytest.approx(24 * m * 4 * act / 2 * 2 * 1), "fast")
    assert got["pp"] == (pytest.approx(2 * m * act / 2), "slow")
    psi = (24 * (12 * h * h + 13 * h) + v * h) / 2 + s * h
    # ZeRO-1: fp32 gradients reduce-scattered, 16-bit parameters gathered, across 2 nodes of 4
    # dp ranks: (2-1)/2 of each buffer, 1/4 of it leaving a node
    assert got["dp"] == (pytest.approx((4 + 2) * psi / 2 / 4), "slow")
    flat = traffic(GPT_10B, 256, replace(cand, dp=2, tp=8, pp=2), ETH)["dp"]  # 1 rank a node
    psi8 = (24 * (12 * h * h + 13 * h) + v * h) / 8 + s * h
    assert flat[0] == pytest.approx((4 + 2) * psi8 / 2)
    ddp = traffic(GPT_10B, 256, replace(cand, dp=2, tp=8, pp=2, zero=0), ETH)["dp"]
    assert ddp[0] == pytest.approx(2 * (2 - 1) / 2 * 4 * psi8)  # an fp32 all-reduce, not 16-bit
    assert got["tp"][0] > 20 * (got["dp"][0] + got["pp"][0])


def test_a_slower_inter_link_raises_dp_and_pp_comm_not_tp() -> None:
    cand = Candidate(dp=4, tp=4, pp=2, micro_batch=1, zero=1, recompute="selective")
    fast_bw = ETH.inter_bandwidth
    rows = slow_link_scan(GPT_10B, ETH, 256, cand, [fast_bw * 4, fast_bw, fast_bw / 4])
    assert [r["tp_comm"] for r in rows] == [rows[0]["tp_comm"]] * 3
    assert [r["compute"] for r in rows] == [rows[0]["compute"]] * 3
    for term in ("dp_comm", "pp_comm", "step"):
        assert rows[0][term] < rows[1][term] < rows[2][term], term
    assert comm_by_link(predict(GPT_10B, ETH, 256, cand), ETH) == {
        "dp": "slow", "pp": "slow", "tp": "fast"
    }  # fmt: skip


def test_miniature_prediction_uses_the_measured_links() -> None:
    from labkit.collectives.cost_model import AlphaBeta

    links = {"intra": AlphaBeta(1e-4, 1e-9), "inter": AlphaBeta(1e-3, 1e-7)}
    cl = miniature_cluster(links, 4e9, world_size=4, ranks_per_node=2, cores=2)
    assert cl.peak_flops == 2e9 and cl.nodes == 2 and cl.gpus_per_node == 2
    assert cl.inter_bandwidth == pytest.approx(0.5e7)  # fp32 bytes counted as 16-bit ones
    cfg = MiniConfig()
    right, pp, wrong = (predict_miniature(cfg, cl, layout) for layout in cfg.layouts)
    assert wrong.time["tp_comm"] > 10 * right.time["tp_comm"]
    assert wrong.time["dp_comm"] < right.time["dp_comm"]
    assert pp.time["dp_comm"] == 0 and pp.time["pp_comm"] > 0
    with pytest.raises(ValueError, match="world_size=6 is not divisible by ranks_per_node=4"):
        MiniConfig(ranks_per_node=4).check(6)
    with pytest.raises(ValueError, match="world_size=4 on 4 nodes is not ranks_per_node=2"):
        run_miniature(cfg, world_size=4, cluster=SimpleNamespace(nodes=4))  # before launching
    with pytest.raises(ValueError, match="order 'tp-pp-dp'"):
        MiniLayout("bad", ParallelDegrees(2, 2), order="tp-pp-dp")


def test_every_miniature_layout_trains_like_one_process() -> None:
    """Placement changes the speed, never the result: dp x tp in Megatron's order and in the
    wrong one, and tp x pp, each equal the single-process reference step by step."""
    model = GPTConfig(vocab_size=64, block_size=8, n_layer=2, n_head=2, n_embd=16)
    cfg = MiniConfig(model=model, micro_batches=2, micro_batch=2, steps=2,
                     probe_sizes=(1, 256), repeats=1)  # fmt: skip
    results = run_ranks(train_layouts, cfg, world_size=4, timeout=240)
    for layout in cfg.layouts:
        want = reference(cfg.lab_config(layout))["losses"]
        got = results[-1]["runs"][layout.name]["losses"]  # rank 3 holds the last stage
        assert got == pytest.approx(want, rel=1e-5), layout.name
        assert len(results[0]["runs"][layout.name]["times"]) == cfg.steps - 1
    # the placements are what their names say: 2 ranks a node, so 0 and 1 share node 0
    tp_of_rank0 = [results[0]["runs"][layout.name]["tp_ranks"] for layout in cfg.layouts]
    assert tp_of_rank0 == [[0, 1], [0, 1], [0, 2]]
    # negative control: the reference with one replica's data differs from the dp=2 run
    half = reference(cfg.lab_config(cfg.layouts[0]), replicas=1)["losses"]
    assert half[0] != pytest.approx(results[-1]["runs"][cfg.layouts[0].name]["losses"][0])
    assert results[0]["links"] == results[-1]["links"]  # every rank fits the same numbers
