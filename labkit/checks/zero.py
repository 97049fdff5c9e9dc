"""Check for exercise 05 (ZeRO-1): the learner's step, against single-process AdamW.

Contract checked::

    zero1_step(flat_params, grad_shard, exp_avg, exp_avg_sq, step, cfg, group=None)

* ``flat_params``: (padded,) every parameter end to end, identical on every rank; the model
  computes with views of it. Rank r owns ``flat_params[r * s : (r + 1) * s]``, s = padded / N.
* ``grad_shard``, ``exp_avg``, ``exp_avg_sq``: (s,) this rank's averaged gradient and Adam
  moments (already reduce-scattered for you).
* after the call, every rank's ``flat_params`` holds every rank's updated shard.

The harness trains a small MLP with a 35-element weight (divisible by neither 2 nor 3) on 3
ranks for 3 steps with the learner's step, and compares every parameter after every step
with ``torch.optim.AdamW`` on the full batch. The first difference is reported by step,
rank and parameter name, with a hint about what usually causes it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from labkit.checks.core import CheckFailed, compare, launch_check, passed
from labkit.reference import first_mismatch, snapshot, train_reference

__all__ = ["check_zero1"]

WORLD_SIZE, STEPS, LR = 3, 3, 1e-2


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(7, 5), nn.Tanh(), nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3))


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(12, 7, generator=g), torch.randn(12, 3, generator=g)


def _run_learner(zero1_step: Callable[..., Any]) -> list[dict[str, torch.Tensor]]:
    import torch.distributed as dist

    from labkit.zero import AdamConfig, flat_layout
    from labkit.zero.partition import flatten_into, param_views

    rank, n = dist.get_rank(), dist.get_world_size()
    model = _model()
    names = [name for name, _ in model.named_parameters()]
    params = list(model.parameters())
    layout = flat_layout([p.numel() for p in params], n)
    flat = flatten_into(torch.zeros(layout.padded), layout, [p.detach() for p in params])
    for p, view in zip(params, param_views(flat, layout, [p.shape for p in params])):
        p.data = view
    exp_avg, exp_avg_sq = torch.zeros(layout.shard_size), torch.zeros(layout.shard_size)
    history = []
    for step in range(1, STEPS + 1):
        x, y = _batch(step)
        _loss(model, x.chunk(n)[rank], y.chunk(n)[rank]).backward()
        grads = flatten_into(torch.zeros(layout.padded), layout, [p.grad for p in params])
        grad_shard = torch.zeros(layout.shard_size)
        dist.reduce_scatter_single(grad_shard, grads)
        grad_shard /= n
        zero1_step(flat, grad_shard, exp_avg, exp_avg_sq, step, AdamConfig(lr=LR))
        model.zero_grad(set_to_none=True)
        history.append(snapshot(zip(names, params)))
    return history


def _reference() -> list[dict[str, torch.Tensor]]:
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    steps = [[_batch(step)] for step in range(1, STEPS + 1)]  # one micro-batch per step
    return train_reference(model, opt, steps, _loss).params


def _loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(model(x), y)


def _hint(rank: int, owner: int, owner_also_wrong: bool) -> str:
    if rank != owner and owner_also_wrong:
        return (
            f"That element belongs to rank {owner}'s shard and is wrong on rank {owner} too: check "
            "the slice each rank updates (start rank * shard_size, length shard_size)."
        )
    if rank != owner:
        return (
            f"That element belongs to rank {owner}'s shard: rank {rank} only gets it through the "
            "all-gather. Did you all-gather every rank's updated shard into flat_params?"
        )
    return (
        f"That element is in rank {rank}'s own shard: check the slice you update "
        "(start rank * shard_size, length shard_size) and the AdamW step on it."
    )


def check_zero1(zero1_step: Callable[..., Any]) -> None:
    """Run ``zero1_step`` on 3 ranks for 3 steps; raise CheckFailed at the first divergence."""
    from labkit.zero import flat_layout

    per_rank = launch_check(_run_learner, zero1_step, world_size=WORLD_SIZE, quiet=True)
    reference = _reference()
    model = _model()
    names = [name for name, _ in model.named_parameters()]
    layout = flat_layout([p.numel() for p in model.parameters()], WORLD_SIZE)
    for step in range(STEPS):
        for i, name in enumerate(names):
            for rank, history in enumerate(per_rank):
                problem = compare(
                    reference[step][name],
                    history[step][name],
                    what=f"'{name}' on rank {rank}",
                    atol=1e-6,
                    rtol=1e-5,
                )
                if problem is not None:
                    want, got = reference[step][name], history[step][name]
                    miss = first_mismatch(want, got) if isinstance(got, torch.Tensor) else None
                    owner, owner_wrong = rank, True
                    if miss is not None and got.shape == want.shape:  # whose shard holds it?
                        element = miss[0]
                        owner = next(
                            pc.rank
                            for pc in layout.owners(i)
                            if pc.param_start <= element < pc.param_start + pc.length
                        )
                        at_owner = per_rank[owner][step][name].flatten()[element : element + 1]
                        owner_wrong = (
                            compare(want.flatten()[element : element + 1], at_owner, what=name)
                            is not None
                        )
                    raise CheckFailed(
                        f"after step {step + 1}, the first diverging parameter is {problem}.\n"
                        f"{_hint(rank, owner, owner_wrong)}"
                    )
    passed(
        f"ZeRO-1 on {WORLD_SIZE} ranks matches torch.optim.AdamW on the full batch "
        f"for {STEPS} steps ({len(names)} parameters, a flat buffer of {layout.total} "
        f"+ {layout.padded - layout.total} padding)."
    )
