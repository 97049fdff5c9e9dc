"""Check for exercise 00 (warm-up): gather every rank's id with a collective."""

from __future__ import annotations

from collections.abc import Callable

import torch

from labkit.checks.core import CheckFailed, compare, launch_check, passed


def _run(fn: Callable[[], torch.Tensor]) -> torch.Tensor:
    return fn()


def check_gather_ranks(gather_ranks: Callable[[], torch.Tensor], world_size: int = 3) -> None:
    """``gather_ranks()`` must return ``tensor([0., 1., ..., world_size-1])`` on every rank."""
    results = launch_check(_run, gather_ranks, world_size=world_size, quiet=True)
    expected = torch.arange(world_size, dtype=torch.float32)
    for rank, got in enumerate(results):
        problem = compare(expected, got, what=f"rank {rank}'s result")
        if problem:
            raise CheckFailed(
                f"{problem}. Every rank should hold the ids of all {world_size} ranks, "
                "in rank order."
            )
    passed(f"all {world_size} ranks hold {expected.tolist()}")
