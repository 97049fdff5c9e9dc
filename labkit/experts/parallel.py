"""Expert parallelism: experts sharded over an ``ep`` group, tokens moved by all-to-all.

Each rank routes its own tokens (its own routing group: same capacity, same drops as
:class:`labkit.experts.layer.MoELayer` given the ranks' token counts as ``group_sizes``), then:

1. counts: rank r's kept rows per expert, ``counts`` (E,), are all-to-all'ed ``E/ep`` to each
   rank, so rank q learns ``recv[r, e]``, the rows r sends for each of q's experts. Every rank
   takes part even when it sends or expects nothing (routing differs by rank: that is normal);
2. dispatch: rows sorted by expert are all-to-all'ed with ``send[q] = sum of counts of q's
   experts`` and ``receive[r] = sum_e recv[r, e]`` (split sizes, uneven in general);
3. the received rows arrive source-major (r, then expert); a stable sort by local expert
   makes them expert-major for the grouped matmul, and its *inverse* restores source-major;
4. combine: the outputs travel back on the reverse all-to-all (splits swapped), and each
   rank adds ``gate * output`` into its tokens. Backward is the same two all-to-alls with
   their splits swapped (:class:`_RemoteExperts`).

Off the happy path: every rank checks first (cached) that all send rows of one width and
dtype, with one expert count (another ``d`` on one rank would abort gloo's all-to-all); and
the experts run as a compute step of a guard (:mod:`labkit.collectives.guard`), forward and
backward: a rank whose experts raise still sends and receives every row (zeros), and every
rank raises at the end, the ep group usable for the next call.

Bytes per layer, forward, per rank: (my rows for other ranks' experts + their rows for
mine, sent back) ``* d * itemsize`` (dispatch and combine; ``self.sent_rows`` counts the
rows), ``2 k n (ep-1)/ep d`` bytes when routing is uniform; backward the same again
(:func:`labkit.experts.costs.all_to_all_bytes`).

With ``tp_comm``, each tp rank holds an ``f / tp`` slice of its experts (see
:class:`labkit.experts.layer.Experts`); the tp ranks of a group hold the same tokens, so they
route alike and each runs the all-to-all inside its own ep group (same tp index). Sequence
parallelism around the MoE is not supported (the tokens must be replicated over tp).
"""

from __future__ import annotations

import copy
from collections import deque
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup

from labkit.collectives import Comm
from labkit.collectives.all_to_all import all_to_all
from labkit.collectives.guard import guarded, same_everywhere
from labkit.experts.layer import MoELayer, group_losses, moe_group
from labkit.experts.router import Routing

__all__ = ["A2A_IMPLS", "ExpertParallelMoE", "exchange_rows"]

A2A_IMPLS = ("labkit", "torch")
HISTORY = 64  # calls whose received counts a layer keeps, for measurements and tests


def exchange_rows(
    x: torch.Tensor, send: list[int], recv: list[int], group: ProcessGroup, impl: str
) -> torch.Tensor:
    """All-to-all of rows: ``send[q]`` rows of x (M, ...) to rank q -> (sum(recv), ...)."""
    out = x.new_empty(sum(recv), *x.shape[1:])
    if impl == "torch":
        dist.all_to_all_single(out, x.contiguous(), recv, send, group=group)
    else:
        all_to_all(out, x.contiguous(), recv, send, group, check=False)
    return out


def _local_experts(moe: Any, arrived: torch.Tensor, perm: torch.Tensor, counts: torch.Tensor):
    """Rows arrived source-major (R, d) -> this rank's experts' outputs, source-major again."""
    out = moe.experts(arrived[perm], counts)  # (R, d) expert-major
    return moe.unpermute(out, perm)  # (R, d) source-major


def _local_backward(back: torch.Tensor, grad: torch.Tensor) -> None:
    """The experts' local backward: fills ``arrived.grad`` and the experts' ``.grad``."""
    torch.autograd.backward(back, grad)


class _RemoteExperts(torch.autograd.Function):
    """Dispatch, this rank's experts, combine, as ONE Function: its forward and backward each
    run the experts as a compute step of a guard (:mod:`labkit.collectives.guard`), so a rank
    whose experts raise still takes part in every remaining all-to-all (with zeros) and every
    rank raises at the end, the ep group usable. Backward: the two all-to-alls transposed
    (splits swapped) around the experts' local backward (which fills their ``.grad``)."""

    @staticmethod
    def forward(ctx: Any, rows, moe, send, recv, perm, counts):  # type: ignore[override]
        group, impl = moe.group, moe.impl
        with guarded("expert_parallel", group, rows.device) as g:
            arrived = exchange_rows(rows, send, recv, group, impl).requires_grad_()  # (R, d)
            with torch.enable_grad():  # the local graph, kept for backward
                back = g.run(_local_experts, moe, arrived, perm, counts)  # (R, d)
            sent = arrived.new_zeros(arrived.shape) if back is None else back.detach()
            result = exchange_rows(sent, recv, send, group, impl)  # (M, d); zeros if failed
        ctx.args, ctx.saved = (group, impl, send, recv), (arrived, back)
        return result

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        (group, impl, send, recv), (arrived, back) = ctx.args, ctx.saved
        with guarded("expert_parallel backward", group, grad.device) as g:
            g_back = exchange_rows(grad.contiguous(), send, recv, group, impl)  # (R, d)
            g.run(_local_backward, back, g_back)  # into arrived.grad and the params
            g_arrived = arrived.grad if arrived.grad is not None else torch.zeros_like(arrived)
            g_rows = exchange_rows(g_arrived, recv, send, group, impl)  # (M, d)
        ctx.saved = None
        return g_rows, None, None, None, None, None


class ExpertParallelMoE(nn.Module):
    """A :class:`MoELayer` whose experts are split over ``ep_group`` (``E / ep`` per rank).

    Built from the full layer (every rank passes the same one): router and shared expert are
    copied whole, the experts sliced (:meth:`labkit.experts.layer.Experts.shard`).
    ``impl``: "labkit" (:func:`labkit.collectives.all_to_all.all_to_all`, one batch of
    point-to-point messages) or "torch" (``dist.all_to_all_single`` with split sizes).
    """

    def __init__(
        self,
        layer: MoELayer,
        ep_group: ProcessGroup,
        *,
        tp_comm: Comm | None = None,
        impl: str = "labkit",
    ) -> None:
        super().__init__()
        if impl not in A2A_IMPLS:
            raise ValueError(f"impl={impl!r}: expected one of {A2A_IMPLS}")
        E = layer.experts.n_experts
        self.ep, self.ep_rank = dist.get_world_size(ep_group), dist.get_rank(ep_group)
        if E % self.ep:
            raise ValueError(f"n_experts={E} is not divisible by ep={self.ep}")
        self.n_experts, self.local = E, E // self.ep
        tp, tp_rank = (tp_comm.world_size, tp_comm.rank) if tp_comm else (1, 0)
        self.router = copy.deepcopy(layer.router)
        self.shared = copy.deepcopy(layer.shared)
        first = self.ep_rank * self.local
        self.experts = layer.experts.shard(first, self.local, tp_rank, tp, tp_comm)
        self.group, self.impl = ep_group, impl
        self.aux: dict[str, torch.Tensor] = {}
        self.routings: list[Routing] = []
        self.sent_rows = 0  # rows sent to other ranks by forwards (dispatch + combine), all calls
        # the last HISTORY calls (bounded: a long run must not grow them): rows my experts
        # processed, and recv_counts as (source rank, local expert)
        self.received_rows: deque[int] = deque(maxlen=HISTORY)
        self.recv_counts: deque[list[list[int]]] = deque(maxlen=HISTORY)

    def exchange_counts(self, counts: torch.Tensor) -> torch.Tensor:
        """This rank's kept rows per expert (E,) -> (ep, E/ep): rows each rank sends my experts."""
        equal = [self.local] * self.ep  # E/ep counts to each rank, E/ep from each
        recv = exchange_rows(counts, equal, equal, self.group, self.impl)  # (ep * E/ep,)
        return recv.view(self.ep, self.local)  # (ep * E/ep,) -> (source rank, local expert)

    def _remote_experts(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """rows (M, d) sorted by global expert -> their outputs (M, d), computed where the
        experts live: the ExpertFn :func:`moe_group` calls."""
        with guarded("expert_parallel", self.group, rows.device):  # counts, dispatch, combine
            recv_counts = self.exchange_counts(counts)  # (ep, E/ep)
            send = counts.view(self.ep, self.local).sum(1).tolist()  # rows to each rank
            recv = recv_counts.sum(1).tolist()  # rows from each rank
            me = self.ep_rank
            # dispatch sends my rows to other ranks; combine returns theirs
            self.sent_rows += sum(send) - send[me] + sum(recv) - recv[me]
            # local expert of each arriving row: source-major segments (r, e) of recv_counts[r, e]
            expert_of = torch.arange(self.local, device=rows.device).repeat(self.ep)  # (ep * E/ep,)
            expert_of = expert_of.repeat_interleave(recv_counts.reshape(-1))  # (R,)
            perm = torch.sort(expert_of, stable=True).indices  # (R,) source-major -> expert-major
            self.received_rows.append(int(perm.numel()))
            self.recv_counts.append(recv_counts.tolist())
            out: torch.Tensor = _RemoteExperts.apply(
                rows, self, send, recv, perm, recv_counts.sum(0)
            )
            return out  # (M, d)

    @staticmethod
    def unpermute(out: torch.Tensor, perm: torch.Tensor) -> torch.Tensor:
        """Undo ``arrived[perm]``: row ``perm[i]`` of the result is ``out[i]``."""
        return out.index_select(0, torch.argsort(perm))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (..., d), this rank's tokens (one routing group) -> (..., d)."""
        shape = x.shape
        flat = x.reshape(-1, shape[-1])  # (..., d) -> (n, d)
        # rows of one width and dtype, one expert count, one impl on every rank (cached): a rank
        # with another d would abort gloo's all-to-all; token counts may differ (routing does)
        fields = {"n_experts": self.n_experts, "impl": A2A_IMPLS.index(self.impl)}
        same_everywhere("expert_parallel", self.group, {"rows": flat[:0]}, fields)
        y, routing = moe_group(self.router, flat, self._remote_experts)
        self.routings = [routing]
        self.aux = group_losses(self.routings)
        if self.shared is not None:
            y = y + self.shared(flat)
        return y.reshape(shape)
