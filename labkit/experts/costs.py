"""Pure formulas of mixture of experts and expert parallelism (no processes, no tensors).

The planner and the memory estimate call these; the tests check them against counted bytes
(:class:`labkit.experts.parallel.ExpertParallelMoE` counts the rows it sends) and against
the published models' stated sizes (:mod:`labkit.models.moe`).

* FLOPs per token of a MoE FFN: ``2 * (k + shared) * P_expert`` forward (a matmul's 2 FLOPs
  per weight per token), against ``(E + shared) * P_expert`` parameters held:
  :func:`ffn_flops_per_token`.
* capacity: ``C = ceil(cf * k * n / E)`` slots per expert (Switch eq. 3); a padded
  (fixed-shape, GShard) dispatch moves ``E * C`` slots where ``k * n`` are routed:
  :func:`capacity_padding` is the fraction of wasted slots.
* all-to-all bytes, per rank and per direction: ``k n (ep-1)/ep d b`` when routing is uniform
  (each token-choice lands on a uniformly random rank, ``1/ep`` of them on this one); a
  layer's forward has two (dispatch, combine) and its backward two more: :func:`all_to_all_bytes`.
* all-to-all time, pairwise exchange (Thakur, Rabenseifner, Gropp 2005): ``p - 1`` steps of
  ``alpha + D/p * beta``; across nodes the ``p - g`` off-node pieces ride the slow link
  (``g`` ranks per node): :func:`all_to_all_time`. An all-reduce of the same ``D`` moves
  ``2(p-1)/p D``, twice the all-to-all's bytes, but only to ring neighbours.
* expert memory per rank: expert parameters (and their gradients and optimizer state) divide
  by ``ep``; everything else does not: :func:`expert_memory_per_rank`.
"""

from __future__ import annotations

import math

__all__ = [
    "all_to_all_bytes",
    "all_to_all_time",
    "capacity_padding",
    "expert_memory_per_rank",
    "ffn_flops_per_token",
    "ffn_params",
    "imbalance",
    "ring_all_reduce_bytes",
]


def _positive(**values: float) -> None:
    for name, v in values.items():
        if not v > 0:
            raise ValueError(f"{name}={v!r} must be > 0 ({values})")


def ffn_params(d: int, d_ff: int, glu: bool = True, bias: bool = False) -> int:
    """One expert: ``3 d f`` (SwiGLU: gate, up, down) or ``2 d f`` (GELU), + ``f + d`` biases."""
    return (3 if glu else 2) * d * d_ff + (d_ff + d if bias else 0)


def ffn_flops_per_token(
    d: int, d_ff: int, top_k: int, n_shared: int = 0, glu: bool = True, n_experts: int = 0
) -> float:
    """Forward FLOPs per token of one MoE FFN: ``2 (k + shared) P_expert`` plus the router's
    ``2 d E``; backward is twice this (the usual 1:2 of matmuls)."""
    return 2.0 * (top_k + n_shared) * ffn_params(d, d_ff, glu) + 2.0 * d * n_experts


def capacity_padding(tokens: int, n_experts: int, top_k: int, capacity_factor: float) -> float:
    """Fraction of a padded dispatch's slots that carry no token: ``1 - k n / (E C)`` with
    ``C = ceil(cf k n / E)`` (at least ``1 - 1/cf``; more when routing is uneven, since
    overflowing tokens are dropped, not sent); 0 when ``cf <= 1`` (fewer slots than rows)."""
    _positive(tokens=tokens, n_experts=n_experts, top_k=top_k, capacity_factor=capacity_factor)
    cap = math.ceil(capacity_factor * top_k * tokens / n_experts)
    return max(0.0, 1.0 - top_k * tokens / (n_experts * cap))  # cf < 1: no slot is spare


def all_to_all_bytes(
    tokens: int,
    d: int,
    top_k: int,
    ep: int,
    itemsize: int = 2,
    *,
    capacity_factor: float | None = None,
    n_experts: int | None = None,
) -> float:
    """Bytes one rank sends to *other* ranks in one dispatch (a combine sends the same back).

    Uniform routing: ``k n (ep-1)/ep d itemsize``. Padded (``capacity_factor`` and
    ``n_experts`` given): ``E C (ep-1)/ep d itemsize``, every slot sent, full or not.
    One MoE layer, one training step: 4x this (dispatch + combine, forward and backward).
    """
    _positive(d=d, top_k=top_k, ep=ep, itemsize=itemsize)
    rows: float = top_k * tokens
    if capacity_factor is not None:
        if n_experts is None:
            raise ValueError("a padded dispatch needs n_experts (E C slots are sent)")
        rows = n_experts * math.ceil(capacity_factor * top_k * tokens / n_experts)
    return rows * (ep - 1) / ep * d * itemsize


def ring_all_reduce_bytes(nbytes: float, p: int) -> float:
    """What one rank sends in a ring all-reduce of ``nbytes``: ``2 (p-1)/p nbytes``."""
    return 2 * (p - 1) / p * nbytes


def all_to_all_time(
    nbytes: float,
    p: int,
    alpha: float,
    bandwidth: float,
    *,
    ranks_per_node: int | None = None,
    inter_alpha: float | None = None,
    inter_bandwidth: float | None = None,
) -> float:
    """Seconds for an all-to-all where every rank sends ``nbytes`` in all (``nbytes / p`` to
    each rank, its own piece a local copy): pairwise exchange, ``p - 1`` steps.

    One node: ``(p-1) (alpha + nbytes/p / bandwidth)``. With ``ranks_per_node = g < p``: the
    ``g - 1`` on-node pieces ride ``bandwidth``, the ``p - g`` off-node pieces ride
    ``inter_bandwidth`` (a rank's share of its node's uplink) with ``inter_alpha``.
    """
    _positive(p=p, bandwidth=bandwidth)
    g = p if ranks_per_node is None else ranks_per_node
    if not 1 <= g <= p or p % g:
        raise ValueError(f"ranks_per_node={g} must divide the group size p={p}")
    piece = nbytes / p
    t = (g - 1) * (alpha + piece / bandwidth)
    if g < p:
        if inter_alpha is None or inter_bandwidth is None:
            raise ValueError("a group across nodes needs inter_alpha and inter_bandwidth")
        t += (p - g) * (inter_alpha + piece / inter_bandwidth)
    return t


def expert_memory_per_rank(
    expert_params: int, ep: int, bytes_per_param: float = 16.0, expert_dp_shards: int = 1
) -> float:
    """Bytes per rank for the experts' weights, gradients and optimizer state: ``P_experts *
    bytes_per_param / ep`` (16 B/param: mixed-precision Adam, ZeRO's ``2 + 2 + 12``), further
    divided by ``expert_dp_shards`` when ZeRO shards them over the expert-dp group."""
    _positive(ep=ep, bytes_per_param=bytes_per_param, expert_dp_shards=expert_dp_shards)
    return expert_params * bytes_per_param / ep / expert_dp_shards


def imbalance(load: list[int] | list[float]) -> float:
    """``max / mean`` of the per-expert (or per-rank) load: 1.0 is perfect balance, and the
    step waits for the busiest expert, so compute time scales with it."""
    if not load:
        raise ValueError("imbalance of an empty load")
    mean = sum(load) / len(load)
    return max(load) / mean if mean else 1.0
