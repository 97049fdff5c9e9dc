"""Measure the links of an emulated cluster: bandwidth and fitted alpha-beta per link class.

Inside ranks, :func:`probe_links` times a ping-pong between two ranks of node 0 (``intra``:
ranks 0 and 1) and between rank 0 and the first rank of node 1 (``inter``), with
:func:`labkit.measure.collectives.pair_one_way` (one ``batch_isend_irecv`` per side and phase:
NCCL-safe). One-way time = round trip / 2, the median of ``repeats``
after one warm-up; ``fit_alpha_beta`` fits ``time = alpha + size * beta`` over the sizes, and
the measured bandwidth is the largest size over its one-way time.

:func:`probe` launches that on a cluster and returns rank 0's :class:`ProbeResult`. From a shell:
``python -m labkit.cluster --nodes 2 --world-size 4 --bandwidth 20e6 --mode software``.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from labkit.cluster.spec import EmulatedCluster, NodeTopology
from labkit.collectives.cost_model import AlphaBeta, fit_alpha_beta
from labkit.measure.collectives import pair_one_way

# bytes; past 64 KB so that tbf's burst (the bytes a link lets through at line rate after an
# idle spell, netns.py) does not pass for bandwidth
SIZES = (1 << 12, 1 << 18, 1 << 20, 1 << 22)


@dataclass(frozen=True)
class LinkProbe:
    """One link class: ``seconds[i]`` one-way for ``sizes[i]`` bytes, the fit and bandwidth."""

    pair: tuple[int, int]
    sizes: tuple[int, ...]
    seconds: tuple[float, ...]
    fit: AlphaBeta
    bandwidth: float  # bytes/s at the largest size


@dataclass(frozen=True)
class ProbeResult:
    """What :func:`probe` measured; ``intra`` is None with one rank per node, ``inter`` with
    one node."""

    mode: str
    intra: LinkProbe | None
    inter: LinkProbe | None


def probe_links(
    topology: NodeTopology, sizes: tuple[int, ...] = SIZES, repeats: int = 3
) -> dict[str, LinkProbe | None]:
    """Run on every rank of the default group; rank 0 returns ``{"intra": .., "inter": ..}``
    (other ranks return the same keys with the probes they took part in, or None)."""
    if len(sizes) < 2:
        raise ValueError(f"need >= 2 sizes to fit alpha and beta, got sizes={sizes!r}")
    rank = dist.get_rank()
    pairs = {
        "intra": (0, 1) if topology.ranks_per_node > 1 else None,
        "inter": (0, topology.ranks_per_node) if topology.nodes > 1 else None,
    }
    out: dict[str, LinkProbe | None] = {}
    for name, pair in pairs.items():
        out[name] = None
        if pair is not None and rank in pair:
            one_way = pair_one_way(pair, sizes, repeats, warmup=1)
            seconds = tuple(statistics.median(one_way[size]) for size in sizes)
            fit = fit_alpha_beta([float(s) for s in sizes], seconds)
            out[name] = LinkProbe(pair, tuple(sizes), seconds, fit, sizes[-1] / seconds[-1])
        dist.barrier()
    return out


def _probe_rank(topology: NodeTopology, mode: str, sizes: tuple[int, ...]) -> ProbeResult:
    links = probe_links(topology, sizes)
    return ProbeResult(mode, links["intra"], links["inter"])


def probe(
    cluster: EmulatedCluster,
    world_size: int,
    sizes: tuple[int, ...] = SIZES,
    **launch_options: Any,
) -> ProbeResult:
    """Launch ``world_size`` gloo ranks on ``cluster`` and measure its two link classes."""
    from labkit.launch import launch

    topology = cluster.topology(world_size)
    launch_options.setdefault("backend", "gloo")
    results = launch(
        _probe_rank,
        topology,
        cluster.resolved_mode(),
        tuple(sizes),
        world_size=world_size,
        cluster=cluster,
        **launch_options,
    )
    return results[0]


def main(argv: list[str] | None = None) -> None:
    import argparse

    parser = argparse.ArgumentParser(description="measure an emulated cluster's links")
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--bandwidth", type=float, default=20e6, help="bytes/s per uplink")
    parser.add_argument("--latency", type=float, default=0.0, help="seconds (software only)")
    parser.add_argument("--mode", default="auto", choices=("auto", "netns", "software"))
    args = parser.parse_args(argv)
    cluster = EmulatedCluster(args.nodes, args.bandwidth, args.latency, args.mode)
    result = probe(cluster, args.world_size, timeout=300, quiet=True)
    print(f"mode={result.mode} nodes={args.nodes} world_size={args.world_size} "
          f"asked inter_bandwidth={args.bandwidth / 1e6:.1f} MB/s")  # fmt: skip
    for name, link in (("intra", result.intra), ("inter", result.inter)):
        if link is not None:
            print(f"{name}: ranks {link.pair} measured {link.bandwidth / 1e6:.1f} MB/s, "
                  f"fit alpha={link.fit.alpha * 1e6:.0f} us "
                  f"bandwidth={link.fit.bandwidth / 1e6:.1f} MB/s")  # fmt: skip
