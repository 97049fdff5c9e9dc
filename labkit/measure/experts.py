"""Measured mixture of experts: load balance with and without the auxiliary loss, tokens dropped
at each capacity factor, and (on ranks) expert parallelism's bytes, imbalance and step time
against its peers. Notebook 16 and ``benchmarks/bench_experts.py`` call these.

Timings run contenders interleaved with warm-up and report medians
(:func:`labkit.measure.timing.interleaved_times`); on a shared CPU they are rough.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup

from labkit.collectives import Comm
from labkit.experts.costs import all_to_all_bytes, imbalance
from labkit.experts.layer import MoELayer
from labkit.experts.parallel import ExpertParallelMoE
from labkit.experts.peers import all_gather_moe, dense_moe
from labkit.experts.router import route
from labkit.measure.timing import interleaved_times, spread

__all__ = ["balance_run", "dispatch_race", "drops_by_capacity", "skew_router", "skewed_steps"]


def _world() -> ProcessGroup:
    group = dist.group.WORLD
    assert group is not None, "call inside a launched rank"
    return group


def _toy_batch(n: int, d: int, g: torch.Generator) -> torch.Tensor:
    x = torch.randn(n, d, generator=g) * 2
    x[:, 0] += 3  # a feature every token shares: one expert for all is the router's easy way out
    return x


def balance_run(
    aux_coef: float,
    steps: int = 60,
    n_experts: int = 8,
    d: int = 16,
    seed: int = 0,
    threads: int = 1,
) -> tuple[list[float], MoELayer]:
    """Train a top-1 dropless MoE layer to imitate a small teacher MLP (Adam, 256 tokens a
    step), with ``aux_coef`` times the balancing loss added; returns the per-step load
    imbalance (max / mean tokens per expert) and the trained layer.

    ``threads``: torch's intra-op threads meanwhile (restored after). Its matmuls are tiny:
    on a shared 2-core machine two threads ran them 16x slower than one (measured)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return _balance_run(aux_coef, steps, n_experts, d, seed)
    finally:
        torch.set_num_threads(before)


def _balance_run(
    aux_coef: float, steps: int, n_experts: int, d: int, seed: int
) -> tuple[list[float], MoELayer]:
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed)
    teacher = nn.Sequential(nn.Linear(d, 64), nn.Tanh(), nn.Linear(64, d))
    layer = MoELayer(d, 32, n_experts, top_k=1, capacity_factor=None)
    opt = torch.optim.Adam(layer.parameters(), lr=1e-2)
    out = []
    for _ in range(steps):
        x = _toy_batch(256, d, g)
        with torch.no_grad():
            target = teacher(x)
        loss = (layer(x) - target).square().mean() + aux_coef * layer.aux["balance"]
        opt.zero_grad()
        loss.backward()
        opt.step()
        out.append(imbalance(layer.routings[0].load.tolist()))
    return out, layer


@torch.no_grad()
def drops_by_capacity(
    layer: MoELayer, factors: tuple[float, ...], tokens: int = 1024, seed: int = 1
) -> list[float]:
    """Fraction of (token, choice) pairs dropped at each capacity factor, same tokens."""
    d = layer.router.proj.in_features
    logits = layer.router.proj(_toy_batch(tokens, d, torch.Generator().manual_seed(seed)))
    k = layer.router.top_k
    return [route(logits, k, cf).dropped / (tokens * k) for cf in factors]


def skew_router(layer: MoELayer, x: torch.Tensor, skew: float) -> None:
    """Send a fraction ``skew`` of the tokens to the first half of the experts (rank 0's at
    ep = 2): those tokens carry 1 in feature 0, which adds 5 to those experts' logits; the
    rest (feature 0 = 0) route as the random router says, about evenly. Rank 0 then gets
    ``skew + (1 - skew) / 2`` of the rows: a rank imbalance of about ``1 + skew``."""
    if not 0.0 <= skew <= 1.0:
        raise ValueError(f"skew={skew} must be a fraction in [0, 1]")
    with torch.no_grad():
        w = layer.router.proj.weight  # (E, d)
        w[:, 0] = 0.0
        w[: w.shape[0] // 2, 0] = 5.0
        x[:, 0] = 0.0
        x[: round(skew * x.shape[0]), 0] = 1.0


def skewed_steps(
    skews: tuple[float, ...],
    tokens: int = 1024,
    d: int = 64,
    d_ff: int = 1024,
    n_experts: int = 4,
    top_k: int = 1,
    steps: int = 6,
    impl: str = "labkit",
) -> list[dict[str, Any]]:
    """On each rank of the world (= the ep group): per skew, the rank-level load imbalance,
    the median forward+backward time of the expert-parallel layer, and the bytes sent per
    forward (dispatch + combine) against two predictions: ``routed bytes``, the rows this
    rank's router sends off-rank plus the rows the other ranks' routers send here (counted
    from the routers alone, before any exchange: exact for any routing), and ``formula
    bytes``, the uniform formula ``2 k n (ep-1)/ep d``, which only perfectly even routing
    meets. Dropless, so every routed row travels."""
    rank, p = dist.get_rank(), dist.get_world_size()
    layers, inputs = {}, {}
    for skew in skews:
        torch.manual_seed(0)
        full = MoELayer(d, d_ff, n_experts, top_k, None)
        x = torch.randn(tokens, d, generator=torch.Generator().manual_seed(rank))
        skew_router(full, x, skew)
        layers[skew], inputs[skew] = ExpertParallelMoE(full, _world(), impl=impl), x

    def step(skew: float) -> None:
        layers[skew](inputs[skew]).square().mean().backward()

    fns = {str(skew): (lambda skew=skew: step(skew)) for skew in skews}
    times = interleaved_times(fns, steps, warmup=2, sync=dist.barrier)  # skews interleaved
    rows = []
    for skew in skews:
        moe = layers[skew]
        with torch.no_grad():  # where this rank's router sends each (token, choice): by owner
            owner = moe.router(inputs[skew]).experts.flatten() // (n_experts // p)  # (n k,)
        to_rank = torch.bincount(owner, minlength=p).float()  # (p,) rows for each rank
        every = [torch.zeros(p) for _ in range(p)]
        dist.all_gather(every, to_rank)  # every[i][j]: rows rank i routes to rank j
        routed = sum(float(every[rank][j] + every[j][rank]) for j in range(p) if j != rank)
        received = torch.tensor([float(moe.received_rows[-1])])
        loads = [torch.zeros(1) for _ in range(p)]
        dist.all_gather(loads, received)
        sent = moe.sent_rows / (steps + 2)  # per forward, dispatch + combine
        rows.append({
            "skew": skew,
            "rank imbalance": imbalance([float(t) for t in loads]),
            "step ms": spread(times[str(skew)]).median * 1e3,
            "a2a bytes": sent * d * 4,
            "routed bytes": routed * d * 4,
            "formula bytes": 2 * all_to_all_bytes(tokens, d, top_k, p, itemsize=4),
        })  # fmt: skip
    return rows


def dispatch_race(
    tokens: int = 2048,
    d: int = 64,
    d_ff: int = 256,
    n_experts: int = 8,
    top_k: int = 1,
    steps: int = 8,
) -> dict[str, Any]:
    """Forward of one MoE layer on every rank, interleaved: the all-to-all EP layer (labkit's
    and torch's all-to-all), the all-gather dispatch, and the dense computation (every token
    through every expert, on one process). Medians in ms and bytes sent per rank."""
    rank, p = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    full = MoELayer(d, d_ff, n_experts, top_k, None)
    ours = ExpertParallelMoE(full, _world(), impl="labkit")
    theirs = ExpertParallelMoE(full, _world(), impl="torch")
    x = torch.randn(tokens, d, generator=torch.Generator().manual_seed(rank))
    comm = Comm(None)
    first = rank * (n_experts // p)
    with torch.no_grad():
        fns = {
            "all-to-all (labkit)": lambda: ours(x),
            "all-to-all (torch)": lambda: theirs(x),
            "all-gather dispatch": lambda: all_gather_moe(
                full, ours.experts, first, x, _world(), comm
            ),
            "dense, one process": lambda: dense_moe(full, x),
        }
        times = interleaved_times(fns, steps, warmup=2, sync=dist.barrier)
    calls = steps + 2
    return {
        "ms": {name: spread(t).median * 1e3 for name, t in times.items()},
        "bytes": {
            "all-to-all": ours.sent_rows / calls * d * 4,
            "all-gather dispatch": comm.total_sent / calls,
        },
    }
