"""Lab 10: a 10B GPT on mixed interconnects (fast inside a node, slow between nodes).

Two halves, one vocabulary (dp, tp, pp; Megatron's rank order, tp innermost):

* the planner's side, pure functions: :data:`GPT_10B`, :func:`rank_layouts` (every layout
  on the mixed cluster, gradients reduced hierarchically across nodes), :func:`comm_by_link`
  (which link class each communication term rides on) and :func:`slow_link_scan` (what a
  slower inter-node link does to each term). Why tp stays inside a node: its all-reduces
  move ``b s h`` bytes 4-6 times per layer and micro-batch; pp sends ``b s h / t`` once per
  stage boundary, and dp moves the gradients once per step, and only 1/k of them leave a
  node of k dp ranks (hierarchical all-reduce);
* a miniature that really runs: :func:`train_layouts` on every rank measures the fitted
  alpha-beta of the intra- and inter-node links, then trains the same tiny GPT under each
  :class:`MiniLayout` (labkit's 3D composition, :mod:`labkit.parallel.threed`), the wrong
  placement (tp across the slow link) included; :func:`run_miniature` launches it, on an
  emulated cluster when given one; :func:`predict_miniature` is the planner's number for it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist

from labkit.collectives.cost_model import busbw_factor
from labkit.labs.threed import LabConfig, batch, build_model
from labkit.launch import launch
from labkit.measure.mixed_links import measure_links
from labkit.memory.model import FP32_ADAM
from labkit.models.gpt import GPTConfig
from labkit.parallel.layout import MESH_DIMS, Layout, ParallelDegrees
from labkit.parallel.threed import ThreeDConfig, build_threed, check_threed
from labkit.planner.cluster import Cluster
from labkit.planner.links import ORDERS, group_links
from labkit.planner.memory import MEGATRON_MIXED
from labkit.planner.plan import Candidate, Prediction, _stage_params, plan, predict
from labkit.planner.space import WIRE_OPS, wire_bytes

__all__ = [
    "GPT_10B", "MINI_LAYOUTS", "MiniConfig", "MiniLayout", "comm_by_link", "ordered_layout",
    "predict_miniature", "rank_layouts", "run_miniature",
    "slow_link_scan", "traffic", "train_layouts",
]  # fmt: skip

# 48 layers of 4,096 (32 heads of 128), Megatron's vocabulary and sequence:
# 12 l h^2 = 9.66B in the layers, V h = 0.21B in the embedding
GPT_10B = GPTConfig(vocab_size=51_200, block_size=2_048, n_layer=48, n_head=32, n_embd=4_096)
SEARCH: dict[str, Any] = dict(
    micro_batches=(1, 2, 4), zero_stages=(0, 1), recompute=("full", "selective")
)


def rank_layouts(
    cfg: GPTConfig, cluster: Cluster, global_batch: int, order: str = "tp-dp-pp"
) -> list[Prediction]:
    """Every layout of ``cfg`` on ``cluster`` (ranks in ``order``), dp reduced hierarchically:
    what fits first, fastest first (:func:`labkit.planner.plan`)."""
    return plan(cfg, cluster, global_batch, order=order, dp_collective="hierarchical", **SEARCH)


def comm_by_link(pred: Prediction, cluster: Cluster, order: str = "tp-dp-pp") -> dict[str, str]:
    """``{"tp": "fast" | "slow", "dp": ..., "pp": ...}``: the link each group's traffic rides
    ("none" for an axis of degree 1: it sends nothing)."""
    c = pred.candidate
    degree = {"tp": c.tp, "dp": c.dp, "pp": c.pp}
    links = group_links(cluster, c.dp, c.tp, c.pp, order)
    return {
        axis: "none" if degree[axis] == 1 else ("slow" if link.slow else "fast")
        for axis, link in sorted(links.items())
    }


def traffic(
    cfg: GPTConfig, global_batch: int, cand: Candidate, cluster: Cluster, order: str = "tp-dp-pp"
) -> dict[str, tuple[float, str]]:
    """Bytes each GPU sends per step on each axis, and the link they ride (the planner's
    arithmetic, :mod:`labkit.planner.plan`): tp ``(l/p) m (4 | 6) 2(t-1)/t b s h x 2``; pp
    ``2 m v b s h x 2 / t``; dp every collective ``space.wire_bytes`` lists for a stage under
    Megatron's recipe (fp32 gradients, 16-bit parameters: the planner's own list), a ring's
    share of each buffer (``2(n-1)/n`` of an all-reduce, ``(n-1)/n`` of a reduce-scatter or
    gather) over the d dp ranks, or, hierarchically across n nodes of k dp ranks, over the n
    nodes on ``1/k`` of the bytes: what leaves the node (the in-node steps stay on the fast
    link). The embedding-ends and tied-gradient terms are left out here (small; the planner
    prices them)."""
    s, h, layers = cfg.block_size, cfg.n_embd, cfg.n_layer
    t, p, d, b, v = cand.tp, cand.pp, cand.dp, cand.micro_batch, cand.virtual
    m = global_batch // (d * b)
    act = 2 * b * s * h
    ars = 4 + (2 if cand.recompute == "full" else 0)
    links = group_links(cluster, d, t, p, order)
    dpl = links["dp"]
    two_level = dpl.slow and dpl.ranks_per_node > 1 and dpl.balanced  # the planner's two levels
    n, k = (dpl.nodes, dpl.ranks_per_node) if two_level else (d, 1)
    dp_bytes = 0.0
    for name, (buf, _, times) in wire_bytes(cand, _stage_params(cfg, t, p), MEGATRON_MIXED,
                                            d, m).items():  # fmt: skip
        dp_bytes += busbw_factor(WIRE_OPS[name], n) * buf / k * times
    sent = {
        "tp": layers / p * m * ars * 2 * (t - 1) / t * act,
        "pp": 2 * m * v * act / t if p > 1 else 0.0,
        "dp": dp_bytes,
    }
    return {axis: (sent[axis], "slow" if links[axis].slow else "fast") for axis in sent}


def slow_link_scan(
    cfg: GPTConfig, cluster: Cluster, global_batch: int, cand: Candidate,
    bandwidths: list[float], order: str = "tp-dp-pp",
) -> list[dict[str, float]]:  # fmt: skip
    """One row per inter-node bandwidth (bytes/s per GPU): the candidate's communication
    terms and step seconds, everything else unchanged."""
    rows = []
    for bw in bandwidths:
        p = predict(
            cfg, replace(cluster, inter_bandwidth=bw), global_batch, cand,
            order=order, dp_collective="hierarchical",
        )  # fmt: skip
        rows.append({"inter_bandwidth": bw, **p.time, "step": p.step_seconds})
    return rows


# ---------------------------------------------------------------- the miniature that runs


@dataclass(frozen=True)
class MiniLayout:
    """A layout of the miniature: its degrees and its rank order (innermost axis first)."""

    name: str
    degrees: ParallelDegrees
    order: str = "tp-dp-pp"

    def __post_init__(self) -> None:
        if self.order not in ORDERS:
            raise ValueError(f"layout {self.name!r}: order {self.order!r} not in {ORDERS}")


MINI_LAYOUTS = (
    MiniLayout("tp in node, dp across", ParallelDegrees(dp=2, tp=2)),
    MiniLayout("tp in node, pp across", ParallelDegrees(tp=2, pp=2)),
    MiniLayout("tp across, dp in node", ParallelDegrees(dp=2, tp=2), order="dp-tp-pp"),
)


@dataclass(frozen=True)
class MiniConfig:
    """The miniature: one tiny GPT, trained ``steps`` steps (the first a warm-up) under each
    layout, on ``ranks_per_node`` ranks per node; the link probe's fp32 element counts."""

    model: GPTConfig = GPTConfig(vocab_size=256, block_size=32, n_layer=4, n_head=4, n_embd=128)
    layouts: tuple[MiniLayout, ...] = MINI_LAYOUTS
    ranks_per_node: int = 2
    micro_batches: int = 4
    micro_batch: int = 4
    steps: int = 4
    probe_sizes: tuple[int, ...] = (1, 1 << 14, 1 << 18)
    repeats: int = 5

    def lab_config(self, layout: MiniLayout) -> LabConfig:
        three = ThreeDConfig(layout.degrees, self.micro_batches, self.micro_batch)
        return LabConfig(model=self.model, threed=three, steps=self.steps,
                         seq=self.model.block_size)  # fmt: skip

    def check(self, world_size: int) -> None:
        """Every layout valid on ``world_size`` ranks and the nodes whole, before launching."""
        if world_size % self.ranks_per_node:
            raise ValueError(
                f"world_size={world_size} is not divisible by ranks_per_node={self.ranks_per_node}"
            )
        for layout in self.layouts:
            check_threed(self.model, self.lab_config(layout).threed, world_size)
        if self.steps < 2:
            raise ValueError(f"steps={self.steps}: need a warm-up step and one to time")


def ordered_layout(degrees: ParallelDegrees, order: str) -> Layout:
    """The (pp, dp, tp) groups with ranks numbered in ``order`` (innermost first). Every
    order keeps pp outermost, so pipeline and embedding groups equal Megatron's."""
    from torch.distributed.device_mesh import DeviceMesh

    pp, dp, tp = degrees.pp, degrees.dp, degrees.tp
    grid = torch.arange(degrees.world_size)
    if order == "tp-dp-pp":
        grid = grid.reshape(pp, dp, tp)
    else:  # dp innermost: rank = pp_idx * (dp tp) + tp_idx * dp + dp_idx
        grid = grid.reshape(pp, tp, dp).transpose(1, 2)  # (pp, tp, dp) -> (pp, dp, tp)
    mesh = DeviceMesh("cpu", grid.unsqueeze(2), mesh_dim_names=MESH_DIMS)  # (pp, dp, cp=1, tp)
    return Layout(degrees, mesh, mesh.get_group("tp"), mesh.get_group("dp"),
                  mesh.get_group("pp"))  # fmt: skip


def train_layouts(cfg: MiniConfig) -> dict[str, Any]:
    """On every rank: measure the links, then train every layout, interleaved step by step
    (the machine's drift hits all alike); per layout, this rank's step seconds (warm-up
    dropped), its parts (``ThreeD.last``), the global loss (on the last stage, else None)
    and the global ranks of its tp group."""
    links = measure_links(cfg.ranks_per_node, cfg.probe_sizes, cfg.repeats)
    labs = [cfg.lab_config(layout) for layout in cfg.layouts]
    jobs = [
        build_threed(build_model(lab), lab.threed, lab.adam,
                     ordered_layout(layout.degrees, layout.order))
        for lab, layout in zip(labs, cfg.layouts)
    ]  # fmt: skip
    runs: dict[str, dict[str, list[Any]]] = {
        layout.name: {"times": [], "parts": [], "losses": [],
                      "tp_ranks": dist.get_process_group_ranks(job.layout.tp_group)}
        for layout, job in zip(cfg.layouts, jobs)
    }  # fmt: skip
    for step in range(cfg.steps):
        for lab, layout, job in zip(labs, cfg.layouts, jobs):
            d, m = job.dp_rank, lab.threed.micro_batches
            x, y = batch(lab, step)  # (dp * m, b, T) each
            dist.barrier()
            start = time.perf_counter()
            loss = job.step(list(x[d * m : (d + 1) * m]), list(y[d * m : (d + 1) * m]))
            seconds = time.perf_counter() - start
            if loss is not None:  # the last stage: the dp replicas' mean, the global loss
                mean = torch.tensor([loss])
                dist.all_reduce(mean, group=job.layout.dp_group)
                loss = mean.item() / layout.degrees.dp
            run = runs[layout.name]
            if step > 0:  # the first step warms up
                run["times"].append(seconds)
                run["parts"].append(job.last)
            run["losses"].append(loss)
    for job in jobs:
        job.close()
    return {"rank": dist.get_rank(), "links": links, "runs": runs}


def run_miniature(
    cfg: MiniConfig, world_size: int = 4, cluster: Any = None, timeout: float = 300
) -> list[dict[str, Any]]:
    """Launch :func:`train_layouts` on ``world_size`` gloo ranks; ``cluster``: an
    ``EmulatedCluster`` (its nodes hold ``cfg.ranks_per_node`` ranks each) or None (one
    machine, every link alike)."""
    cfg.check(world_size)
    options: dict[str, Any] = {}
    if cluster is not None:
        if world_size != cluster.nodes * cfg.ranks_per_node:
            raise ValueError(
                f"world_size={world_size} on {cluster.nodes} nodes is not "
                f"ranks_per_node={cfg.ranks_per_node} ranks a node"
            )
        options["cluster"] = cluster
    return launch(train_layouts, cfg, world_size=world_size, timeout=timeout, quiet=True,
                  backend="gloo", **options)  # fmt: skip


def predict_miniature(cfg: MiniConfig, cluster: Cluster, layout: MiniLayout) -> Prediction:
    """The planner's prediction for one miniature layout: fp32 Adam, no recompute, compute at
    the measured FLOP/s (efficiency 1), hierarchical dp where a dp group spans nodes."""
    d = layout.degrees
    lab = cfg.lab_config(layout)
    cand = Candidate(d.dp, d.tp, d.pp, cfg.micro_batch, 0, "none")
    return predict(
        cfg.model, cluster, lab.threed.global_batch, cand, efficiency=1.0,
        precision=FP32_ADAM, order=layout.order, dp_collective="hierarchical",
    )  # fmt: skip
