"""The peers expert parallelism is measured against: dense compute, and an all-gather dispatch.

* :func:`dense_moe`: one process pushes *every* token through *every* expert and weights the
  outputs with the gates (zero for experts not chosen or dropped). Same numbers as
  :class:`labkit.experts.layer.MoELayer`, ``E / k`` times its expert FLOPs: what a MoE would
  cost if sparsity bought nothing.
* :func:`all_gather_moe`: expert parallelism without the all-to-all (Megatron-Core's
  "allgather" token dispatcher is this idea): every rank all-gathers every rank's tokens and
  gate weights, runs its own experts on the rows that chose them, and a reduce-scatter sums
  the partial outputs back to the tokens' ranks. Per rank it sends ``(ep-1) n d`` bytes in
  the all-gather and ``(ep-1) n d`` in the reduce-scatter, whatever the routing, against the
  all-to-all's ``2 k n (ep-1)/ep d``: ``ep / k`` times more. Forward only (the benchmark's
  comparison); counts are padded to the largest rank's ``n``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup
from torch.nn import functional as F

from labkit.collectives import Comm
from labkit.experts.layer import Experts, MoELayer
from labkit.experts.router import Routing

__all__ = ["all_gather_moe", "dense_moe", "gate_matrix"]


def gate_matrix(routing: Routing, n_experts: int) -> torch.Tensor:
    """(n, E): the gate of each kept (token, expert) pair, 0 elsewhere."""
    n = routing.experts.shape[0]
    w = routing.gates.new_zeros(n, n_experts)
    return w.scatter_add(1, routing.experts, routing.gates * routing.kept.to(routing.gates.dtype))


def _all_experts(experts: Experts, x: torch.Tensor) -> torch.Tensor:
    """x (n, d) through every expert -> (E, n, d) (a batched matmul, no routing)."""
    h = F.gelu(torch.einsum("nd,edf->enf", x, experts.w1) + experts.b1[:, None, :])  # (E, n, f)
    return torch.einsum("enf,efd->end", h, experts.w2) + experts.b2[:, None, :]  # (E, n, d)


def dense_moe(layer: MoELayer, x: torch.Tensor) -> torch.Tensor:
    """``layer(x)`` (one group) computed densely: x (n, d) -> (n, d)."""
    routing = layer.router(x)
    w = gate_matrix(routing, layer.experts.n_experts)  # (n, E)
    y = torch.einsum("ne,end->nd", w, _all_experts(layer.experts, x))  # (n, d)
    return y if layer.shared is None else y + layer.shared(x)


@torch.no_grad()
def all_gather_moe(
    layer: MoELayer, experts: Experts, first: int, x: torch.Tensor, group: ProcessGroup, comm: Comm
) -> torch.Tensor:
    """This rank's tokens x (n, d) -> (n, d), its ``experts`` being ``[first, first + E/ep)``
    of ``layer``'s; tokens and gates travel by all-gather, outputs by reduce-scatter (``comm``
    counts their bytes)."""
    p = dist.get_world_size(group)
    n, d = x.shape
    sizes = torch.zeros(p, dtype=torch.int64, device=x.device)  # NCCL sends device tensors
    comm.all_gather(sizes, torch.tensor([n], device=x.device))  # every rank's token count
    n_max = int(sizes.max())
    routing = layer.router(x)
    packed = x.new_zeros(n_max, d + layer.experts.n_experts)  # padded to the largest rank
    packed[:n] = torch.cat([x, gate_matrix(routing, layer.experts.n_experts)], 1)
    everyone = packed.new_empty(p * n_max, packed.shape[1])  # (p * n_max, d + E)
    comm.all_gather(everyone, packed)
    xs, ws = everyone[:, :d], everyone[:, d + first : d + first + experts.n_experts]
    partial = xs.new_zeros(p * n_max, d)  # my experts' share of every token's output
    picked = [ws[:, e].nonzero().squeeze(1) for e in range(experts.n_experts)]  # rows per expert
    rows = torch.cat(picked)  # (M,) grouped by my expert
    counts = torch.tensor([r.numel() for r in picked], device=x.device)  # (E/ep,)
    gates = torch.cat([ws[r, e] for e, r in enumerate(picked)])  # (M,)
    partial.index_add_(0, rows, experts(xs[rows], counts) * gates[:, None])
    y = partial.new_empty(n_max, d)
    comm.reduce_scatter(y, partial)  # sum over ranks of the partial outputs of my tokens
    y = y[:n]
    return y if layer.shared is None else y + layer.shared(x)
