"""The mixture-of-experts feed-forward layer on one process: the reference expert parallelism
must match.

Invariant: ``y = shared(x) + sum over kept (token t, choice c) of gate[t, c] * expert[e](x[t])``
with ``e = experts[t, c]`` (Shazeer et al. 2017, eq. 1; Switch/GShard add capacity). Each
routing group (``group_sizes``) is routed on its own (its own capacity and balancing loss), so
a batch split over ``ep`` ranks is this layer called with those ranks' token counts as groups.

Arithmetic per token (``k`` routed experts of hidden width ``f``, GELU MLPs as in the GPT):
``2 * k * 2 d f`` FLOPs forward, against ``E * 2 d f`` parameters in the experts: parameters grow
with ``E``, compute with ``k`` (:mod:`labkit.experts.costs` holds the formulas).

The experts are one stacked tensor per weight (``w1`` (E, d, f), ``w2`` (E, f, d)), so expert
parallelism slices the leading dimension and tensor parallelism the ``f`` dimension
(:meth:`Experts.shard`). Their FFN is computed one expert at a time on its contiguous rows: the
"grouped matmul" (MegaBlocks, Gale et al. 2022) written as a loop.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.nn import functional as F

from labkit.collectives import Comm
from labkit.experts.router import (
    Routing,
    TopKRouter,
    dispatch_order,
    load_balancing_loss,
    router_z_loss,
)
from labkit.tensor_parallel.mappings import copy_to_tp, reduce_from_tp

__all__ = ["Experts", "MoELayer", "combine", "moe_group"]

ExpertFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (rows (M, d), counts (E,))


class Experts(nn.Module):
    """``E`` GELU MLPs d -> f -> d stacked: ``w1`` (E, d, f), ``b1`` (E, f), ``w2`` (E, f, d),
    ``b2`` (E, d). ``tp_comm``: the weights hold an ``f / tp`` slice (columns of ``w1``, rows of
    ``w2``; Megatron's MLP split, Shoeybi et al. 2019, section 3), and the partial outputs are
    all-reduced over tp before ``b2`` (added once)."""

    def __init__(self, n_experts: int, d: int, d_ff: int, tp_comm: Comm | None = None) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(n_experts, d, d_ff) * 0.02)
        self.b1 = nn.Parameter(torch.zeros(n_experts, d_ff))
        self.w2 = nn.Parameter(torch.randn(n_experts, d_ff, d) * 0.02)
        self.b2 = nn.Parameter(torch.zeros(n_experts, d))
        self.tp_comm = tp_comm

    @property
    def n_experts(self) -> int:
        return self.w1.shape[0]

    def forward(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """rows (M, d) grouped by expert, ``counts[e]`` rows each -> (M, d)."""
        if rows.shape[0] != int(counts.sum()) or counts.numel() != self.n_experts:
            raise ValueError(
                f"{rows.shape[0]} rows for counts {counts.tolist()} summing to "
                f"{int(counts.sum())}, over {self.n_experts} experts"
            )
        if self.tp_comm is not None:
            rows = copy_to_tp(rows, self.tp_comm)  # every tp rank consumes the same rows
        outs = []
        for e, part in enumerate(rows.split(counts.tolist())):  # (count_e, d) each
            h = F.gelu(part @ self.w1[e] + self.b1[e])  # (count_e, f)
            outs.append(h @ self.w2[e])  # (count_e, d), a partial sum under tp
        out = torch.cat(outs) if outs else rows[:0]  # (M, d)
        if self.tp_comm is not None:
            out = reduce_from_tp(out, self.tp_comm)
        return out + self.b2.repeat_interleave(counts, dim=0)  # b2 once, after the sum

    @torch.no_grad()
    def shard(
        self, first: int, count: int, tp_rank: int = 0, tp: int = 1, tp_comm: Comm | None = None
    ) -> Experts:
        """Experts ``[first, first + count)``, ``f`` slice ``tp_rank`` of ``tp``: a copy."""
        d, f = self.w1.shape[1:]
        if f % tp:
            raise ValueError(f"expert hidden size {f} is not divisible by tp={tp}")
        if first < 0 or count < 1 or first + count > self.n_experts:
            raise ValueError(f"experts [{first}, {first + count}) not in [0, {self.n_experts})")
        fs = slice(tp_rank * f // tp, (tp_rank + 1) * f // tp)
        e = slice(first, first + count)
        out = Experts(count, d, f // tp, tp_comm).to(self.w1.device, self.w1.dtype)  # keep bf16
        out.w1.copy_(self.w1[e, :, fs])
        out.b1.copy_(self.b1[e, fs])
        out.w2.copy_(self.w2[e, fs, :])
        out.b2.copy_(self.b2[e])
        return out


def combine(n: int, token: torch.Tensor, weights: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """(n, d): row ``token[i]`` gets ``weights[i] * out[i]`` summed (dropped pairs add 0)."""
    y = out.new_zeros(n, out.shape[-1])
    return y.index_add(0, token, out * weights[:, None].to(out.dtype))


def moe_group(
    router: TopKRouter, x: torch.Tensor, experts: ExpertFn
) -> tuple[torch.Tensor, Routing]:
    """One routing group: route x (n, d), gather the kept rows by expert, run ``experts`` on
    them (locally, or across an all-to-all), and combine with the gates -> (n, d)."""
    routing = router(x)
    token, choice, counts = dispatch_order(routing)  # (M,), (M,), (E,)
    out = experts(x[token], counts)  # (M, d) -> (M, d)
    return combine(x.shape[0], token, routing.gates[token, choice], out), routing


class MoELayer(nn.Module):
    """Router, ``n_experts`` routed experts, optionally a shared expert (DeepSeekMoE, Dai et al.
    2024): ``x`` (..., d) -> (..., d). After each call ``aux`` holds the balancing and z losses
    (means over groups) and ``routings`` the groups' :class:`Routing` (loads, drops)."""

    def __init__(
        self,
        d: int,
        d_ff: int,
        n_experts: int,
        top_k: int = 2,
        capacity_factor: float | None = 1.25,
        normalize: bool = True,
        shared_d_ff: int = 0,
    ) -> None:
        super().__init__()
        self.router = TopKRouter(d, n_experts, top_k, capacity_factor, normalize)
        self.experts = Experts(n_experts, d, d_ff)
        self.shared = (
            nn.Sequential(nn.Linear(d, shared_d_ff), nn.GELU(), nn.Linear(shared_d_ff, d))
            if shared_d_ff
            else None
        )
        self.aux: dict[str, torch.Tensor] = {}
        self.routings: list[Routing] = []

    def forward(self, x: torch.Tensor, group_sizes: list[int] | None = None) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])  # (..., d) -> (n, d)
        sizes = group_sizes if group_sizes is not None else [flat.shape[0]]
        if sum(sizes) != flat.shape[0] or min(sizes, default=0) < 0:
            raise ValueError(f"group_sizes {sizes} must be >= 0 and sum to {flat.shape[0]} tokens")
        ys, self.routings = [], []
        for part in flat.split(sizes):  # (n_g, d) each
            y, routing = moe_group(self.router, part, self.experts)
            ys.append(y)
            self.routings.append(routing)
        self.aux = group_losses(self.routings)
        y = torch.cat(ys)  # (n, d)
        if self.shared is not None:
            y = y + self.shared(flat)
        return y.reshape(shape)


def group_losses(routings: list[Routing]) -> dict[str, torch.Tensor]:
    """The balancing and z losses, each the mean over the groups (a rank's own, under EP)."""
    balance = torch.stack([load_balancing_loss(r) for r in routings]).mean()
    z = torch.stack([router_z_loss(r.logits) for r in routings]).mean()
    return {"balance": balance, "z": z}
