"""Notebook 09's section 3 in one launch: the links, the all-reduces' busbw, the DDP step.

Every launch of a fresh world on the emulated cluster pays seconds of process start-up (each
rank imports torch), more than these measurements take. The section's three measurements
share one world instead, one after the other, each exactly what its own function measures in
a launch of its own: :func:`labkit.cluster.probe.probe` (one-way times of a pair inside a node
and a pair across nodes, alpha-beta fitted), :func:`labkit.measure.cluster.measure_busbw` and
:func:`labkit.measure.cluster.measure_ddp`. Bad input raises before any process starts.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from labkit.cluster.probe import SIZES, ProbeResult, probe_links
from labkit.cluster.spec import NodeTopology
from labkit.measure.cluster import DEFAULT_VARIANTS, Variant, _check_ddp, _ddp_result, ddp_worker
from labkit.measure.cluster_comm import _busbw_result, _launch, busbw_worker
from labkit.models.bert import BertConfig, bert_preset

__all__ = ["measure_section", "section_worker"]


def section_worker(
    topology: NodeTopology, mode: str, sizes: Sequence[int], busbw_steps: int,
    ddp_args: tuple[Any, ...],
) -> tuple[ProbeResult, dict[str, dict[int, float]], dict[str, Any]]:
    """On every rank: the probe, then :func:`busbw_worker` (one warm-up round), then
    :func:`ddp_worker` (``ddp_args``: all its arguments, in its order)."""
    links = probe_links(topology, SIZES)
    probe = ProbeResult(mode, links["intra"], links["inter"])
    busbw = busbw_worker(sizes, topology.ranks_per_node, busbw_steps, 1)
    return probe, busbw, ddp_worker(*ddp_args)


def measure_section(
    cluster: Any,
    world_size: int,
    sizes: Sequence[int] = (2**14, 2**17, 2**20),
    variants: Sequence[Variant] = DEFAULT_VARIANTS,
    *,
    busbw_steps: int = 5,
    cfg: BertConfig | None = None,
    global_batch: int = 32,
    steps: int = 5,
    warmup: int = 2,
    profile: Variant | None = None,
    timeout: float = 300,
) -> dict[str, Any]:
    """``{"probe": ProbeResult, "busbw": measure_busbw's dict, "ddp": measure_ddp's dict}``,
    from one launch of ``world_size`` ranks on ``cluster`` (``busbw_steps`` timed rounds per
    size after one warm-up; ``steps`` and ``warmup`` are the DDP step's)."""
    cfg = cfg or bert_preset("lab")
    rpn = _check_ddp(cluster, world_size, variants, global_batch, profile)
    topology, mode = cluster.topology(world_size), cluster.resolved_mode()
    ddp_args = (cfg, list(variants), global_batch, rpn, steps, warmup, profile)
    ranks = _launch(
        section_worker, topology, mode, list(sizes), busbw_steps, ddp_args,
        world_size=world_size, cluster=cluster, timeout=timeout,
    )  # fmt: skip
    return {
        "probe": ranks[0][0],
        "busbw": _busbw_result(ranks[0][1], world_size, mode, rpn),
        "ddp": _ddp_result([r[2] for r in ranks], mode, rpn, profile is not None),
    }
