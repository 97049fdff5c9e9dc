"""The planner's link placement and bytes per axis against the messages a 3D miniature really
sends: every collective and point-to-point call counted on every rank, attributed to its
group (tp, pp, dp), classified intra- or inter-node (rank r on node r // 2), summed per step."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from labkit.labs.wire_count import (
    LAYOUTS,
    ZERO_RUNS,
    WireConfig,
    WireLayout,
    compare,
    compare_zero,
    count_layouts,
    count_zero,
)
from labkit.measure.wire_count import Message, wire_bytes
from labkit.measure.wire_tally import (
    BOOKKEEPING,
    PRICED,
    counted_placement,
    planner_bytes,
    tally,
)
from labkit.memory.model import FP32_ADAM
from labkit.parallel.layout import ParallelDegrees
from labkit.planner.cluster import Cluster
from labkit.planner.links import embedding_link
from tests.ranks import run_ranks

CFG = WireConfig()


def _sum(counted: dict, axis: str, terms: tuple[str, ...]) -> float:
    return sum(v for (a, t, _), v in counted.items() if a == axis and t in terms)


def _count(cfg: WireConfig) -> dict[str, Any]:
    before = {name: getattr(dist, name) for name in ("all_reduce", "isend", "irecv")}
    before_c10d = c10d.isend
    out = count_layouts(cfg)
    out["zero"] = count_zero(cfg)
    out["restored"] = all(getattr(dist, n) is f for n, f in before.items()) and (
        c10d.isend is before_c10d
    )
    return out


@pytest.fixture(scope="module")
def counted() -> list[dict[str, Any]]:
    return run_ranks(_count, CFG, world_size=4, timeout=120)


def test_the_ring_conversion_and_the_attribution_by_hand() -> None:
    four = (0, 1, 2, 3)
    assert wire_bytes(Message("all_reduce", four, 400, "x")) == 600  # 2(p-1)/p
    assert wire_bytes(Message("reduce_scatter", four, 400, "x")) == 300  # (p-1)/p
    assert wire_bytes(Message("all_gather", (0, 1), 400, "x")) == 200
    assert wire_bytes(Message("send", (0, 2), 400, "x")) == 400
    assert wire_bytes(Message("recv", (2, 0), 400, "x")) == 0
    dp2tp2 = ParallelDegrees(dp=2, tp=2)
    recs = [(Message("all_reduce", (0, 1), 100, "x"), "layers"),  # tp: inside node 0
            (Message("all_reduce", (0, 2), 100, "x"), "gradients"),  # dp: nodes 0 and 1
            (Message("all_reduce", (0, 3), 100, "x"), "?")]  # fmt: skip
    assert tally(recs, dp2tp2, "tp-dp-pp", 2) == {
        ("tp", "layers", "intra"): 100, ("dp", "gradients", "inter"): 100,
        ("other", "?", "inter"): 100,  # a group the rank grid does not have: flagged
    }  # fmt: skip
    # dp innermost: (0, 1) is now a dp group, (0, 2) a tp group across nodes
    assert tally(recs[:2], dp2tp2, "dp-tp-pp", 2) == {
        ("dp", "layers", "intra"): 100, ("tp", "gradients", "inter"): 100}  # fmt: skip
    chain = [[(Message("send", (0, 4), 8, "x"), "a")], [(Message("send", (4, 8), 8, "x"), "a")]]
    pp3 = ParallelDegrees(tp=4, pp=3)  # stages 4 ranks apart, a pipeline chained by sends
    assert counted_placement(chain, pp3, "tp-dp-pp", 4) == {"pp": (1, 3, True)}
    # the embedding group (the pipeline's two ends, ranks 0 and 8 here) is pp's, on the link
    # the planner's embedding_link names; a middle-to-end pair of ranks is no group of pp's
    tied = [(Message("all_reduce", (0, 8), 64, "x"), "tied_embedding"),
            (Message("all_reduce", (4, 8), 64, "x"), "tied_embedding")]  # fmt: skip
    ends = ("pp", "tied_embedding", "inter")
    assert tally(tied, pp3, "tp-dp-pp", 4) == {ends: 64, ("other", *ends[1:]): 64}
    nodes = Cluster(nodes=3, gpus_per_node=4, memory_bytes=1e9, peak_flops=1e12,
                    intra_bandwidth=2.0, inter_bandwidth=1.0)  # fmt: skip
    assert embedding_link(nodes, 1, 4, 3).slow  # stages on nodes 0 and 2
    inside = embedding_link(replace(nodes, nodes=1), 2, 1, 2)  # pp groups [0, 2], [1, 3]
    assert not inside.slow and inside.bandwidth == 2.0


@pytest.mark.slow
def test_counted_bytes_and_links_equal_the_planners(counted: list[dict[str, Any]]) -> None:
    assert all(r["restored"] for r in counted), "the counter left torch.distributed patched"
    report, pp_checked = [], False
    for layout in LAYOUTS:
        runs = [r["layouts"][layout.name]["steps"] for r in counted]
        assert all(len(set(map(len, steps))) == 1 for steps in runs), "steps differ in calls"
        c = compare(CFG, counted, layout)
        for axis, (got, want) in c["placement"].items():  # (ranks per node, nodes, balanced)
            assert got == want, f"{layout.name} {axis}: counted {got}, planner {want}"
        for rank, r in enumerate(c["ranks"]):
            terms = {(a, t) for a, t, _ in r["counted"]}
            assert {a for a, _ in terms} <= set(PRICED), f"rank {rank}: {terms}"
            # nothing unpriced but the stated bookkeeping
            assert all(t in PRICED[a] or t in BOOKKEEPING for a, t in terms), (rank, terms)
            for axis, term in [(a, t) for a in ("tp", "dp", "pp") for t in PRICED[a]]:
                if getattr(layout.degrees, axis) == 1 or term == "activations":
                    continue  # pp's sends: per boundary, below
                links = {link for a, t, link in r["counted"] if (a, t) == (axis, term)}
                slow = c["placement"][axis][1][1] > 1
                if term == "tied_embedding":  # the planner's own link for the pipeline's ends
                    d = layout.degrees
                    two = Cluster(nodes=2, gpus_per_node=CFG.gpus_per_node, memory_bytes=1e9,
                                  peak_flops=1e12, intra_bandwidth=2.0, inter_bandwidth=1.0)
                    slow = embedding_link(two, d.dp, d.tp, d.pp, layout.order).slow
                assert links == {"inter" if slow else "intra"}, (layout.name, term, links)
                got = _sum(r["counted"], axis, (term,))
                assert got == pytest.approx(r["planned"][term], rel=1e-12), (layout.name, term)
                assert got > 0, (layout.name, term)  # every priced term really sent
                if term == "gradients":  # the formula at this rank's own parameter count, too
                    assert got == pytest.approx(r["dp_formula"], rel=1e-12)
                report.append((layout.name, rank, term, got))
            for axis in ("tp", "dp"):
                if getattr(layout.degrees, axis) == 1:
                    continue
                small = _sum(r["counted"], axis, BOOKKEEPING)
                # a few values a token (loss) or a flag a parameter, against h a token per
                # layer: 0.6-1.2% at h = 32 and 2-4 layers a stage, falling as 1 / (h l / p)
                assert small < 0.02 * _sum(r["counted"], axis, PRICED[axis]), (layout.name, axis)
        for pair, (got, want) in c["pp"].items():  # both directions of a boundary, a tp lane
            assert got == pytest.approx(want, rel=1e-12), (layout.name, pair)
        if layout.degrees.pp > 1:
            assert len(c["pp"]) == layout.degrees.tp  # one boundary per tp lane
            pp_checked = True
    # per rank: 3 dp x tp layouts (layers, ends, gradients), 2 tp x pp (layers, ends, tied)
    assert len(report) == 4 * (3 * 3 + 2 * 3) and pp_checked


@pytest.mark.slow
def test_a_wrong_placement_or_the_old_dp_charge_disagrees(counted: list[dict[str, Any]]) -> None:
    right, wrong = LAYOUTS[0], LAYOUTS[2]  # the same degrees, tp innermost or outermost
    for layout, other in ((right, wrong.order), (wrong, right.order)):
        place = compare(CFG, counted, layout, order=other)["placement"]
        for axis in ("tp", "dp"):
            got, want = place[axis]
            assert got != want and (got[1] > 1) != (want[1] > 1), (layout.name, axis)
    # the single-constant planner charged dp in 16 bits (half of what the fp32 job sends) and
    # priced neither the ends' all-reduces nor the tied gradient
    cand, batch = CFG.candidate(right), 2 * CFG.micro_batches * CFG.micro_batch
    old = planner_bytes(CFG.model, cand, batch, FP32_ADAM, efficiency=0.5)
    rank0 = compare(CFG, counted, right)["ranks"][0]
    sent = _sum(rank0["counted"], "dp", ("gradients",))
    assert old["gradients"] == pytest.approx(sent / 2, rel=1e-12)
    assert old["gradients"] != pytest.approx(sent)
    assert old["ends"] == 0 < _sum(rank0["counted"], "tp", ("ends",))
    pp = LAYOUTS[1]
    old = planner_bytes(CFG.model, CFG.candidate(pp), CFG.micro_batches * CFG.micro_batch,
                        FP32_ADAM, efficiency=0.5)  # fmt: skip
    first = compare(CFG, counted, pp)["ranks"][0]
    assert old["tied_embedding"] == 0 < _sum(first["counted"], "pp", ("tied_embedding",))
    # an untied model sends no tied gradient, and the planner charges none
    untied = planner_bytes(replace(CFG.model, tie_weights=False), CFG.candidate(pp),
                           CFG.micro_batches * CFG.micro_batch, FP32_ADAM)  # fmt: skip
    assert untied["tied_embedding"] == 0 and first["planned"]["tied_embedding"] > 0


@pytest.mark.slow
def test_zero_stages_send_what_the_planner_charges(counted: list[dict[str, Any]]) -> None:
    # dp alone over 4 ranks (2 nodes of 2), m = 2 micro-batches accumulated: ZeRO-1 reduces
    # once a step, ZeRO-2 reduce-scatters every micro-batch, ZeRO-3 also gathers twice
    m, world, h, vocab = CFG.micro_batches, 4, CFG.model.n_embd, CFG.model.vocab_size
    for rank, r in enumerate(counted):
        for stage, tied in ZERO_RUNS:
            c = compare_zero(CFG, r["zero"][(stage, tied)], stage, tied, world)
            assert c["counted"] == pytest.approx(c["formula"], rel=1e-12), (rank, stage, tied, c)
            assert c["counted"] == pytest.approx(c["planned"], rel=1e-12), (rank, stage, tied, c)
            assert c["bookkeeping"] < 0.01 * c["counted"]
            if (stage, tied) != ("zero3", True):
                assert c["untied_formula"] == pytest.approx(c["formula"], rel=1e-12)
                continue
            # a tied embedding and head: one unit used by two modules, gathered for each
            # use (3 gathers a micro-batch, not 2): the old 2m charge misses one, rejected
            extra = m * wire_bytes(Message("all_gather", tuple(range(world)), vocab * h * 4, "x"))
            assert c["counted"] - c["untied_formula"] == pytest.approx(extra, rel=1e-12), c


@pytest.mark.slow
def test_three_axes_on_two_nodes_of_four() -> None:
    # dp2 x tp2 x pp2 on 8 ranks, nodes of 4: tp and dp inside a node, pp across
    cfg = WireConfig(layouts=(WireLayout("dp2 tp2 pp2", ParallelDegrees(2, 2, 2)),),
                     gpus_per_node=4)  # fmt: skip
    results = run_ranks(count_layouts, cfg, world_size=8, timeout=180)
    c = compare(cfg, results, cfg.layouts[0])
    assert c["placement"] == {"tp": ((2, 1, True),) * 2, "pp": ((1, 2, True),) * 2,
                              "dp": ((2, 1, True),) * 2}  # fmt: skip
    for pair, (got, want) in c["pp"].items():
        assert pair[1] - pair[0] == 4 and got == pytest.approx(want, rel=1e-12)
    for r in c["ranks"]:
        for axis, term in (("tp", "layers"), ("tp", "ends"), ("pp", "tied_embedding")):
            got = _sum(r["counted"], axis, (term,))
            assert got == pytest.approx(r["planned"][term], rel=1e-12) and got > 0, term
        assert {t for a, t, _ in r["counted"] if t not in PRICED[a]} <= set(BOOKKEEPING)
        gradients = _sum(r["counted"], "dp", ("gradients",))
        assert gradients == pytest.approx(r["dp_formula"], rel=1e-12)
        if r["pp_rank"] == 0:  # the planner charges the first (fullest) stage
            assert gradients == pytest.approx(r["planned"]["gradients"], rel=1e-12)
        assert {link for (a, _, link) in r["counted"] if a == "pp"} == {"inter"}
        assert {link for (a, _, link) in r["counted"] if a != "pp"} == {"intra"}
