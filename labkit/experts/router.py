"""The top-k router: which experts each token goes to, with what weight, and which tokens fit.

Invariant: routing is a pure, deterministic function of the router logits of one *routing
group* (the tokens one rank routes together: GShard's "group", Lepikhin et al. 2020, section
2.2; Switch's per-core batch, Fedus et al. 2021, section 2.2). The single-process reference
and expert parallelism call the same functions on the same group, so they keep and drop the
same tokens.

* top-k softmax: ``probs = softmax(logits)`` over the ``E`` experts in float32 (float64 for
  float64 logits), and the ``k`` largest win, chosen on those float32 probabilities: rounding
  them to 16 bits first would tie experts that differ (bfloat16 keeps 8 bits: at 8 experts a
  logit lead of 2**-8 vanishes). Ties go to the lower expert index, on every device: the
  choice is a stable descending sort (:func:`top_k_lowest_index`), which keeps equal values
  in index order; ``torch.topk`` promises no order among ties (on CPU, 8 equal logits pick
  experts [6, 5]). Gates are the winners' float32 probabilities, renormalised over the k
  winners when ``normalize`` (Mixtral, Jiang et al. 2024) or left as they are (Switch with
  k = 1; GShard k = 2 renormalises), then rounded to the logits' dtype once.
* capacity: an expert takes at most ``C = ceil(capacity_factor * k * n / E)`` token-slots of a
  group of ``n`` tokens (Switch eq. 3). Priority: every token's first choice before any
  second choice (GShard Algorithm 1), then token order. A (token, choice) past ``C`` is
  *dropped*: it contributes nothing (the residual stream carries the token on). ``None``:
  dropless, every choice kept (MegaBlocks, Gale et al. 2022).
* auxiliary load-balancing loss (Switch eq. 4, GShard's form): ``E * sum_e f_e * P_e``, ``f_e``
  the fraction of the group's routed slots (before drops) that chose ``e``, ``P_e`` the mean
  router probability of ``e``. It is 1 when balanced (``f = P = 1/E``), up to ``E`` when all
  goes to one expert; only ``P`` carries gradient (``f`` is a count).
* router z-loss (ST-MoE, Zoph et al. 2022, eq. 5): ``mean over tokens of logsumexp(logits)^2``,
  keeping logits small so the softmax stays stable in low precision.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

__all__ = [
    "Routing",
    "TopKRouter",
    "capacity",
    "dispatch_order",
    "load_balancing_loss",
    "route",
    "router_z_loss",
    "top_k_lowest_index",
]


def capacity(tokens: int, n_experts: int, top_k: int, capacity_factor: float | None) -> int | None:
    """Token-slots per expert for a group of ``tokens``: ``ceil(factor * k * tokens / E)``;
    None (dropless) when ``capacity_factor`` is None. Switch eq. 3."""
    if capacity_factor is None:
        return None
    if not capacity_factor > 0:
        raise ValueError(f"capacity_factor must be > 0 or None (dropless), got {capacity_factor}")
    return math.ceil(capacity_factor * top_k * tokens / n_experts)


@dataclass
class Routing:
    """One group's routing. ``n`` tokens, ``E`` experts, top ``k``.

    ``logits``/``probs`` (n, E); ``experts``/``gates``/``kept`` (n, k): the chosen expert of
    each (token, choice), its weight, and whether it fit within capacity. ``load`` (E,): slots
    each expert was asked for (before drops); ``kept_load`` (E,): slots it processes.
    """

    logits: torch.Tensor
    probs: torch.Tensor
    experts: torch.Tensor
    gates: torch.Tensor
    kept: torch.Tensor
    load: torch.Tensor
    kept_load: torch.Tensor

    @property
    def dropped(self) -> int:
        return int((~self.kept).sum())


def route(
    logits: torch.Tensor,
    top_k: int,
    capacity_factor: float | None = None,
    normalize: bool = True,
) -> Routing:
    """Route one group: logits (n, E) -> :class:`Routing` (top-k, gates, capacity, drops)."""
    n, E = logits.shape
    if not 1 <= top_k <= E:
        raise ValueError(f"top_k={top_k} must be in [1, n_experts={E}]")
    wide = torch.promote_types(logits.dtype, torch.float32)  # 16-bit logits: softmax in fp32
    probs_wide = F.softmax(logits.to(wide), dim=-1)  # (n, E), chosen from before any rounding
    experts = top_k_lowest_index(probs_wide, top_k)  # (n, k), largest first
    gates = probs_wide.gather(-1, experts)  # (n, k)
    if normalize:
        gates = gates / gates.sum(-1, keepdim=True)
    probs, gates = probs_wide.to(logits.dtype), gates.to(logits.dtype)
    load = torch.bincount(experts.reshape(-1), minlength=E)  # (E,)
    cap = capacity(n, E, top_k, capacity_factor)
    if cap is None:
        kept = torch.ones_like(experts, dtype=torch.bool)
    else:
        # slot of each (token, choice) in its expert's queue; priority: choice, then token
        by_choice = experts.t().reshape(-1)  # (k*n,), all first choices, then second, ...
        onehot = F.one_hot(by_choice, E)  # (k*n, E)
        slot = (onehot.cumsum(0) - 1).gather(1, by_choice[:, None]).squeeze(1)  # (k*n,)
        kept = (slot < cap).reshape(top_k, n).t()  # (k, n) -> (n, k)
    kept_load = torch.bincount(experts[kept], minlength=E)  # (E,)
    return Routing(logits, probs, experts, gates, kept, load, kept_load)


def top_k_lowest_index(probs: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the ``k`` largest values of each row of ``probs`` (n, E), largest first; equal
    values in ascending index order (a stable sort keeps them so on CPU and CUDA alike)."""
    return torch.sort(probs, dim=-1, descending=True, stable=True).indices[:, :k]  # (n, k)


def dispatch_order(routing: Routing) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The kept (token, choice) pairs sorted by expert: ``(token, choice, counts)``.

    ``token``/``choice`` (M,): row index and choice of each kept pair, grouped by expert (a
    stable sort, so token order inside an expert); ``counts`` (E,) = ``kept_load``. Gathering
    ``x[token]`` gives the rows an all-to-all sends, expert by expert; ``counts`` splits them.
    """
    n, k = routing.experts.shape
    flat_expert = routing.experts.reshape(-1)  # (n*k,), index t*k + c
    flat_kept = routing.kept.reshape(-1).nonzero().squeeze(1)  # (M,) kept flat indices
    order = torch.sort(flat_expert[flat_kept], stable=True).indices  # (M,)
    pairs = flat_kept[order]  # (M,) flat indices grouped by expert
    return pairs // k, pairs % k, routing.kept_load


def load_balancing_loss(routing: Routing) -> torch.Tensor:
    """``E * sum_e f_e * P_e`` (Switch eq. 4): 1.0 when balanced; gradient flows through P."""
    n, E = routing.probs.shape
    f = routing.load.to(routing.probs.dtype) / max(routing.experts.numel(), 1)  # (E,)
    P = routing.probs.mean(0) if n else routing.probs.sum(0)  # (E,)
    return E * (f * P).sum()


def router_z_loss(logits: torch.Tensor) -> torch.Tensor:
    """Mean over tokens of ``logsumexp(logits)^2`` (ST-MoE eq. 5); 0 for an empty group."""
    if logits.shape[0] == 0:
        return logits.sum() * 0.0
    wide = torch.promote_types(logits.dtype, torch.float32)
    return torch.logsumexp(logits.to(wide), dim=-1).square().mean().to(logits.dtype)


class TopKRouter(nn.Module):
    """A bias-free linear map d -> E and :func:`route`. Initialised at N(0, 0.02) like the GPT."""

    def __init__(
        self,
        d: int,
        n_experts: int,
        top_k: int,
        capacity_factor: float | None = None,
        normalize: bool = True,
    ) -> None:
        super().__init__()
        capacity(1, n_experts, top_k, capacity_factor)  # validate the factor early
        if not 1 <= top_k <= n_experts:
            raise ValueError(f"top_k={top_k} must be in [1, n_experts={n_experts}]")
        self.proj = nn.Linear(d, n_experts, bias=False)
        nn.init.normal_(self.proj.weight, std=0.02)
        self.n_experts, self.top_k = n_experts, top_k
        self.capacity_factor, self.normalize = capacity_factor, normalize

    def forward(self, x: torch.Tensor) -> Routing:
        """x (n, d) -> the group's :class:`Routing`."""
        return route(self.proj(x), self.top_k, self.capacity_factor, self.normalize)
