"""Vocab-parallel cross-entropy: the loss over V classes when each rank holds V/t logits.

Gathering the logits would cost B*T*V floats per rank, often the largest activation of a GPT
(V = 50,257). Megatron-LM (Shoeybi et al. 2019, section 3, "fuse the output embedding GEMM
with the cross-entropy loss") never builds them. For token n with target y_n, on rank r with
the logits z_{n, v} of vocabulary slice [r V/t, (r+1) V/t)::

    m_n   = max_r max_v z_{n,v}            one all-reduce (MAX; here an all-gather of t maxima,
                                           since Comm sums)
    S_n   = sum_r sum_v exp(z_{n,v} - m_n) one all-reduce (SUM)
    z_y   = sum_r [y_n on r] z_{n,y_n}     one all-reduce (SUM): only the owner contributes
    loss  = mean_n (log S_n - (z_y - m_n))

Each collective moves N = B*T numbers, not N*V. The backward needs no communication: the
gradient on rank r is (softmax_{n,v} - [v == y_n]) / N for its own v, with the softmax built
from the reduced S_n and saved in the forward.
"""

from __future__ import annotations

from typing import Any

import torch

from labkit.collectives import Comm

__all__ = ["vocab_parallel_cross_entropy"]


class _VocabParallelCE(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, logits: torch.Tensor, targets: torch.Tensor, vocab_start: int, comm: Comm
    ) -> torch.Tensor:
        V_local = logits.shape[-1]
        z = logits.reshape(-1, V_local)  # (B, T, V/t) -> (N, V/t)
        N, t = z.shape[0], comm.world_size

        # m_n: subtracting any per-token constant leaves the loss unchanged, so no gradient here
        maxima = z.new_empty(t * N)  # (t * N,): rank r's maxima at [r N, (r+1) N)
        comm.all_gather(maxima, z.max(dim=-1).values.contiguous())
        m = maxima.view(t, N).max(dim=0).values  # (N,)
        shifted = z - m.unsqueeze(1)  # (N, V/t)

        local_y = targets.reshape(-1) - vocab_start  # (N,)
        outside = (local_y < 0) | (local_y >= V_local)  # the target lives on another rank
        local_y = local_y.masked_fill(outside, 0)
        target_logit = shifted.gather(1, local_y.unsqueeze(1)).squeeze(1).masked_fill(outside, 0.0)
        comm.all_reduce(target_logit)  # (N,): z_y - m_n, from its owner

        exp = shifted.exp_()  # (N, V/t), in place: `shifted` is not needed any more
        sum_exp = exp.sum(dim=-1)  # (N,)
        comm.all_reduce(sum_exp)
        loss = (sum_exp.log() - target_logit).mean()

        ctx.save_for_backward(exp.div_(sum_exp.unsqueeze(1)), local_y, outside)  # softmax slice
        ctx.shape = logits.shape
        return loss

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        softmax, local_y, outside = ctx.saved_tensors
        N = softmax.shape[0]
        g = softmax.clone()  # (N, V/t)
        rows = torch.arange(N, device=g.device)[~outside]
        g[rows, local_y[~outside]] -= 1.0  # minus the one-hot, only where this rank owns y_n
        g.mul_(grad / N)
        return g.view(ctx.shape), None, None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor, targets: torch.Tensor, comm: Comm, vocab_start: int | None = None
) -> torch.Tensor:
    """Mean cross-entropy of ``logits`` (B, T, V/t), this rank's vocabulary slice starting at
    ``vocab_start`` (default rank * V/t), against ``targets`` (B, T) over the full vocabulary.
    Equal on every rank of ``comm``'s group."""
    if vocab_start is None:
        vocab_start = comm.rank * logits.shape[-1]
    return _VocabParallelCE.apply(logits, targets, vocab_start, comm)
