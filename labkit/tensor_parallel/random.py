"""Dropout under tensor parallelism: which ranks must draw the same mask, and which must not.

A tensor-parallel GPT has two kinds of activation (Shoeybi et al. 2019, section 3; Megatron-LM's
``model_parallel_cuda_manual_seed`` and its RNG tracker):

* **replicated** ones (the residual stream after g, the embedding output): every rank holds
  the same tensor, so every rank must drop the *same* elements or the copies drift apart.
  Their masks come from a stream seeded identically on every tensor-parallel rank.
* **sharded** ones (attention probabilities of this rank's heads; with sequence parallelism,
  the residual stream of this rank's tokens): each rank holds different elements, and reusing
  one mask on all of them would correlate the noise. Megatron draws them from a second stream,
  seeded ``seed + 2718 + tp_rank``: ``masks="per_rank"`` here.

``masks="sliced"`` instead draws the *full* mask from the shared stream and keeps this rank's
slice: the exact mask the unsharded model draws, at the cost of generating t times more random
numbers. That makes a tensor-parallel run equal to the single-process one with dropout active,
which is how the tests prove equivalence; ``per_rank`` is what one trains with.

Masks are a function of (seed, site, forward pass), not of a global generator's position, so
the reference model (:func:`seeded_dropout`) and its tensor-parallel version agree pass by
pass. The forward-pass count is a :class:`DropoutClock` that the *model's* forward advances
(a forward pre-hook on the root), not each dropout call: recomputing a checkpointed block in
backward reruns its dropouts without advancing the clock, so it draws the same masks.
The kept mask is 1 byte per element, as Korthikanti et al. 2022 count it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["MASKS", "REGIONS", "DropoutClock", "RegionDropout", "seeded_dropout"]

MASKS = ("per_rank", "sliced")
REGIONS = ("replicated", "sharded")
MEGATRON_TP_SEED_OFFSET = 2718  # Megatron-LM's tensor-model-parallel seed offset


class _ApplyMask(torch.autograd.Function):
    """y = x * mask / (1 - p), saving only the bool mask (1 byte per element) for backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.save_for_backward(mask)
        ctx.scale = scale
        return x.masked_fill(~mask, 0.0).mul_(scale)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        (mask,) = ctx.saved_tensors
        return grad.masked_fill(~mask, 0.0).mul_(ctx.scale), None, None


class DropoutClock:
    """The forward-pass count that every dropout of one model reads."""

    def __init__(self) -> None:
        self.value = 0

    def tick(self, *_: Any) -> None:  # usable as a forward pre-hook
        self.value += 1

    def attach(self, model: nn.Module) -> None:
        """Give every RegionDropout of ``model`` this clock; ``model``'s forward ticks it."""
        for m in model.modules():
            if isinstance(m, RegionDropout):
                m.clock = self
        model.register_forward_pre_hook(self.tick)


def _generator(device: torch.device, *key: int) -> torch.Generator:
    seed = 0
    for k in key:  # a fixed mix (Python's hash of ints is not randomised, but be explicit)
        seed = (seed * 1_000_003 + k) % (1 << 62)
    return torch.Generator(device=device).manual_seed(seed)


class RegionDropout(nn.Module):
    """Dropout with probability ``p`` whose mask depends on (seed, site, call count).

    ``region="sharded"``: this rank's tensor is slice ``rank`` of a tensor ``world_size``
    times larger along ``dim`` (heads: dim 1 of (B, h, T, T); sequence: dim 1 of (B, T, d)).
    """

    def __init__(
        self, p: float, seed: int, site: int, *, region: str = "replicated",
        masks: str = "per_rank",
        rank: int = 0, world_size: int = 1, dim: int = 1,
    ) -> None:  # fmt: skip
        super().__init__()
        if region not in REGIONS or masks not in MASKS:
            raise ValueError(f"region={region!r}, masks={masks!r}; expected {REGIONS} and {MASKS}")
        self.p, self.seed, self.site = p, seed, site
        self.region, self.masks, self.rank, self.world_size, self.dim = (
            region,
            masks,
            rank,
            world_size,
            dim,
        )
        self.clock = DropoutClock()  # replaced by the model's shared clock (DropoutClock.attach)
        self.last_mask: torch.Tensor | None = None  # kept only when record_masks is set
        self.record_masks = False

    def _mask(self, x: torch.Tensor) -> torch.Tensor:
        keep = 1.0 - self.p
        if self.region == "replicated" or self.world_size == 1:
            g = _generator(x.device, self.seed, self.site, self.clock.value)
            return torch.rand(x.shape, generator=g, device=x.device) < keep
        if self.masks == "per_rank":
            g = _generator(
                x.device,
                self.seed + MEGATRON_TP_SEED_OFFSET + self.rank,
                self.site,
                self.clock.value,
            )
            return torch.rand(x.shape, generator=g, device=x.device) < keep
        full = list(x.shape)
        full[self.dim] *= self.world_size  # the unsharded tensor's shape
        g = _generator(x.device, self.seed, self.site, self.clock.value)
        n = x.shape[self.dim]
        return (torch.rand(full, generator=g, device=x.device) < keep).narrow(
            self.dim, self.rank * n, n
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        mask = self._mask(x).contiguous()
        if self.record_masks:
            self.last_mask = mask
        return _ApplyMask.apply(x, mask, 1.0 / (1.0 - self.p))

    def extra_repr(self) -> str:
        return f"p={self.p}, site={self.site}, region={self.region}, masks={self.masks}"


def dropout_sites(model: nn.Module) -> list[str]:
    """Names of ``model``'s dropout modules, in module order: site i is the i-th."""
    return [name for name, m in model.named_modules() if isinstance(m, nn.Dropout | RegionDropout)]


def _set(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, leaf, module)


def seeded_dropout(model: nn.Module, seed: int) -> nn.Module:
    """Replace every ``nn.Dropout`` of ``model`` (in place) by a :class:`RegionDropout` with
    the same p: the single-process reference whose masks a tensor-parallel copy reproduces."""
    for site, name in enumerate(dropout_sites(model)):
        old = model.get_submodule(name)
        if isinstance(old, nn.Dropout):
            _set(model, name, RegionDropout(old.p, seed, site))
    DropoutClock().attach(model)
    return model
