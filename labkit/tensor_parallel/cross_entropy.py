"""Vocab-parallel cross-entropy: the loss over V classes when each rank holds V/t logits.

Gathering the logits would cost B*T*V floats per rank, often the largest activation of a GPT
(V = 50,257). Megatron-LM (Shoeybi et al. 2019, section 3, "fuse the output embedding GEMM
with the cross-entropy loss") never builds them. For token n with target y_n, on rank r with
the logits z_{n, v} of vocabulary slice [r V/t, (r+1) V/t)::

    m_n   = max_r max_v z_{n,v}            one all-reduce (MAX; here an all-gather of t maxima,
                                           since Comm sums)
    S_n   = sum_r sum_v exp(z_{n,v} - m_n) one all-reduce (SUM)
    z_y   = sum_r [y_n on r] z_{n,y_n}     one all-reduce (SUM): only the owner contributes
    loss  = sum_{n counted} (log S_n - (z_y - m_n)) / C

Each collective moves N = B*T numbers (the first N + 1), not N*V. The backward needs no
communication: the gradient on rank r is [n counted] (softmax_{n,v} - [v == y_n]) / C for
its own v, with the softmax built from the reduced S_n and saved in the forward.

``F.cross_entropy``'s semantics at the edges, which labkit's unsharded ``lm_loss`` follows:

* a target equal to ``ignore_index`` (default -100, the padding convention) is not counted:
  ``C`` is the number of the other tokens, and an ignored token's logits get zero gradient;
* every target ignored (``C = 0``): the loss is ``0 / 0 = nan`` and the gradient zero, as
  torch gives;
* a target outside ``[0, V)`` (other than ``ignore_index``) raises ``IndexError`` naming it,
  as torch does. Every rank must raise, or its peers would wait forever in the next
  collective: so each rank appends its count of bad targets to the maxima it all-gathers
  anyway (one number more, no extra collective), and after that first collective every rank
  knows whether any rank saw one, and all raise together (even if, wrongly, the ranks were
  given different targets).
"""

from __future__ import annotations

from typing import Any

import torch

from labkit.collectives import Comm

__all__ = ["vocab_parallel_cross_entropy"]


class _VocabParallelCE(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        logits: torch.Tensor,
        targets: torch.Tensor,
        vocab_start: int,
        comm: Comm,
        ignore_index: int,
    ) -> torch.Tensor:
        V_local = logits.shape[-1]
        z = logits.reshape(-1, V_local)  # (B, T, V/t) -> (N, V/t)
        N, t = z.shape[0], comm.world_size
        V = V_local * t

        y = targets.reshape(-1)  # (N,)
        counted = y != ignore_index  # (N,)
        bad = counted & ((y < 0) | (y >= V))  # out of range: torch raises IndexError

        # m_n: subtracting any per-token constant leaves the loss unchanged, so no gradient
        # here. Each rank's slot is [its N maxima, its count of bad targets].
        gathered = z.new_empty(t * (N + 1))  # (t * (N + 1),)
        mine = torch.cat([z.max(dim=-1).values, bad.sum().reshape(1).to(z.dtype)])
        comm.all_gather(gathered, mine)
        gathered = gathered.view(t, N + 1)
        if bool((gathered[:, N] > 0).any()):  # the same verdict on every rank: all raise
            per_rank = ", ".join(f"rank {r}: {int(c)}" for r, c in enumerate(gathered[:, N]))
            values = y[bad].unique()[:5].tolist()
            raise IndexError(
                f"vocab-parallel cross-entropy: targets out of range [0, {V}) (vocabulary "
                f"{V} = {V_local} per rank x tp={t}) and not ignore_index={ignore_index}: "
                f"this rank's first bad values {values}; bad targets per rank: {per_rank}"
            )
        m = gathered[:, :N].max(dim=0).values  # (N,)
        shifted = z - m.unsqueeze(1)  # (N, V/t)

        local_y = y - vocab_start  # (N,)
        outside = (local_y < 0) | (local_y >= V_local) | ~counted  # no target logit here
        local_y = local_y.masked_fill(outside, 0)
        target_logit = shifted.gather(1, local_y.unsqueeze(1)).squeeze(1).masked_fill(outside, 0.0)
        comm.all_reduce(target_logit)  # (N,): z_y - m_n, from its owner

        exp = shifted.exp_()  # (N, V/t), in place: `shifted` is not needed any more
        sum_exp = exp.sum(dim=-1)  # (N,)
        comm.all_reduce(sum_exp)
        count = counted.sum()  # C: the same on every rank (the same targets)
        per_token = (sum_exp.log() - target_logit).masked_fill(~counted, 0.0)
        loss = per_token.sum() / count  # C = 0: 0 / 0 = nan, as F.cross_entropy

        softmax = exp.div_(sum_exp.unsqueeze(1))  # (N, V/t): this rank's softmax slice
        ctx.save_for_backward(softmax, local_y, outside, counted)
        ctx.shape, ctx.count = logits.shape, int(count)
        return loss

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None, None]:
        softmax, local_y, outside, counted = ctx.saved_tensors
        N = softmax.shape[0]
        g = softmax.clone()  # (N, V/t)
        rows = torch.arange(N, device=g.device)[~outside]
        g[rows, local_y[~outside]] -= 1.0  # minus the one-hot, only where this rank owns y_n
        g.mul_(counted.unsqueeze(1))  # an ignored token: zero gradient
        g.mul_(grad / max(ctx.count, 1))  # C = 0: every row is zero already, as torch's
        return g.view(ctx.shape), None, None, None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor,
    targets: torch.Tensor,
    comm: Comm,
    vocab_start: int | None = None,
    *,
    ignore_index: int = -100,
) -> torch.Tensor:
    """Mean cross-entropy of ``logits`` (B, T, V/t), this rank's vocabulary slice starting at
    ``vocab_start`` (default rank * V/t), against ``targets`` (B, T) over the full vocabulary,
    the mean taken over the targets not equal to ``ignore_index``, as ``F.cross_entropy``.
    Equal on every rank of ``comm``'s group, which must all pass the same ``targets``."""
    if vocab_start is None:
        vocab_start = comm.rank * logits.shape[-1]
    return _VocabParallelCE.apply(logits, targets, vocab_start, comm, ignore_index)
