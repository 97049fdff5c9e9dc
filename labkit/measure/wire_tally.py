"""Counted messages (:mod:`labkit.measure.wire_count`) turned into the planner's quantities, and
the planner asked for the same ones: which link class each axis rides, and the bytes each
axis puts on the wire per step. Pure functions: no processes.

Attribution. A collective belongs to the axis (tp, dp, pp) whose group of
:func:`labkit.parallel.layout.rank_grid` has exactly its ranks; a point-to-point message to
the axis with a group holding both ends. A message fitting no group is "other" (a job whose
groups are not the rank grid's shows up there). Its link class: "inter" when its ranks span
more than one node (global rank ``r`` on node ``r // gpus_per_node``, the emulated cluster's
and the planner's placement), else "intra". A collective over a group spanning nodes counts
as "inter" whole, as the planner prices it: the ring is paced by its slow hop.

Terms. Inside an axis a message is given a term by :func:`term_of`. The planner prices
(:data:`PRICED`, each beside the step-time term it is, :data:`PLANNER_TERM`): on tp "layers"
(the per-layer all-reduces) and "ends" (the all-reduce after the vocab-parallel embedding and
the one into the head's input gradient, per micro-batch on the first and last stage); on pp
"activations" (the sends) and "tied_embedding" (the tied weight's gradient summed over the
first and last stage, Megatron's embedding group: a pp-axis group); on dp "gradients" (every
gradient and parameter collective, ZeRO-3's extra gather of a tied unit included). Two small
bookkeeping terms it does not price: "loss" (the vocab-parallel cross-entropy's per-token
all-reduces: 3 values a token) and "used_flags" (one all-reduce per step of a flag per
parameter, :mod:`labkit.zero.sharded`).

The planner's side (:func:`planner_bytes`): :func:`labkit.planner.predict` itself, on a unit
cluster (one node, every link 1 byte/s, no latency): each communication term's seconds are
then its bytes on the wire per GPU and step (a ring's ``2(p-1)/p`` included), with nothing
re-derived here. :func:`dp_bytes` prices the dp collectives of
:func:`labkit.planner.space.wire_bytes` for any parameter count (a rank other than the one the
planner charges), converted by :func:`labkit.measure.wire_count.wire_bytes`.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable

from labkit.measure.wire_count import Message, wire_bytes
from labkit.memory.model import Precision
from labkit.models.gpt import GPTConfig
from labkit.parallel.layout import ParallelDegrees, rank_grid
from labkit.planner.cluster import Cluster
from labkit.planner.plan import predict
from labkit.planner.space import WIRE_OPS, Candidate
from labkit.planner.space import wire_bytes as planner_wire

__all__ = [
    "AXES", "BOOKKEEPING", "PLANNER_TERM", "PRICED", "Record", "counted_placement", "dp_bytes",
    "p2p_pairs", "planner_bytes", "tally", "term_of",
]  # fmt: skip

AXES = ("tp", "pp", "dp")
PRICED = {"tp": ("layers", "ends"), "pp": ("activations", "tied_embedding"),
          "dp": ("gradients",)}  # fmt: skip
PLANNER_TERM = {"layers": "tp_comm", "ends": "tp_ends_comm", "activations": "pp_comm",
                "tied_embedding": "tied_comm", "gradients": "dp_comm"}  # fmt: skip
BOOKKEEPING = ("loss", "used_flags")  # small and unpriced (module docstring)
Record = tuple[Message, str]  # a message and its term


def term_of(msg: Message, labels: dict[int, str]) -> str:
    """The term of ``msg`` (module docstring); ``labels``: ``{id(Comm): term}`` for the
    ``Comm`` objects the caller knows (a tensor-parallel block's, the embedding's, ...)."""
    if msg.site.endswith("apply_step"):  # ShardedAdamW: who used which parameter
        return "used_flags"
    if "sum_tied_grads" in msg.site:
        return "tied_embedding"
    if msg.owner is not None and msg.owner in labels:
        return labels[msg.owner]
    if msg.op in ("send", "recv"):
        return "activations"
    return "unlabelled"


def _index(degrees: ParallelDegrees, order: str) -> tuple[dict, dict]:
    """``{group ranks: axis}`` and ``{(a, b): axis}`` for both ends of every group's pairs."""
    groups, pairs = {}, {}
    for axis, lists in rank_grid(degrees, order).items():
        if axis not in AXES:
            continue
        for g in lists:
            if len(g) > 1:
                groups[tuple(g)] = axis
                pairs.update({(a, b): axis for a in g for b in g if a != b})
            if axis == "pp" and len(g) > 2:  # the embedding group: the pipeline's two ends
                groups[(g[0], g[-1])] = axis
    return groups, pairs


def _axis(msg: Message, groups: dict, pairs: dict) -> str:
    if msg.op in ("send", "recv"):
        return pairs.get(msg.ranks, "other")
    return groups.get(msg.ranks, "other")


def _link(ranks: Iterable[int], gpus_per_node: int) -> str:
    return "inter" if len({r // gpus_per_node for r in ranks if r >= 0}) > 1 else "intra"


def tally(
    records: list[Record], degrees: ParallelDegrees, order: str, gpus_per_node: int
) -> dict[tuple[str, str, str], float]:
    """One rank's wire bytes (a ring's, :func:`~labkit.measure.wire_count.wire_bytes`) by
    ``(axis, term, link)`` for the messages ``records`` (one step's, say)."""
    groups, pairs = _index(degrees, order)
    out: dict[tuple[str, str, str], float] = defaultdict(float)
    for msg, term in records:
        if msg.op == "recv":  # the sender counts the bytes
            continue
        out[(_axis(msg, groups, pairs), term, _link(msg.ranks, gpus_per_node))] += wire_bytes(msg)
    return dict(out)


def p2p_pairs(records_by_rank: list[list[Record]]) -> dict[tuple[int, int], float]:
    """Bytes sent from global rank a to b, summed over all ranks' ``send`` messages."""
    out: dict[tuple[int, int], float] = defaultdict(float)
    for records in records_by_rank:
        for msg, _ in records:
            if msg.op == "send":
                out[(msg.ranks[0], msg.ranks[1])] += msg.nbytes
    return dict(out)


def counted_placement(
    records_by_rank: list[list[Record]], degrees: ParallelDegrees, order: str, gpus_per_node: int
) -> dict[str, tuple[int, int, bool]]:
    """``{axis: (ranks_per_node, nodes, balanced)}`` as :func:`labkit.planner.links.placement`
    states it, read off the groups that really carried traffic: a collective's ranks, and for
    point-to-point the ranks joined by messages (a pipeline: its stages chained by sends)."""
    groups, pairs = _index(degrees, order)
    seen: dict[str, list[set[int]]] = defaultdict(list)
    for records in records_by_rank:
        for msg, _ in records:
            axis = _axis(msg, groups, pairs)
            if axis == "other" or -1 in msg.ranks:
                continue
            ranks, merged = set(msg.ranks), []
            for g in seen[axis]:  # union with every group it touches
                if g & ranks:
                    ranks |= g
                else:
                    merged.append(g)
            seen[axis] = [*merged, ranks]
    out = {}
    for axis, found in seen.items():
        fewest, most, balanced = gpus_per_node, 1, True
        for g in found:
            counts: dict[int, int] = defaultdict(int)
            for r in g:
                counts[r // gpus_per_node] += 1
            fewest, most = min(fewest, *counts.values()), max(most, len(counts))
            balanced = balanced and len(set(counts.values())) == 1
        out[axis] = (fewest, most, balanced)
    return out


def planner_bytes(
    model: GPTConfig, cand: Candidate, global_batch: int, precision: Precision,
    *, efficiency: float | None = None,
) -> dict[str, float]:  # fmt: skip
    """``{term: bytes}`` per GPU and step the planner charges, for every term of
    :data:`PLANNER_TERM` (module docstring: :func:`~labkit.planner.predict` on a unit cluster,
    ring dp, no overlap; a term the prediction lacks is 0). "layers": ``4 (+2 full
    recompute)`` all-reduces of the ``2 b s h`` 16-bit hidden states per layer of the fullest
    stage and micro-batch; "ends": the embedding's and head's all-reduce (2 at p = 1, 1 on an
    end stage) per micro-batch; "activations": ``2 m v`` sends of ``2 b s h / t`` (Megatron's
    scatter/gather) per boundary; "tied_embedding": one all-reduce of the ``V/t x h`` tied
    gradient over the two ends at ``precision``; "gradients": the fullest stage's dp
    collectives at ``precision``. ``efficiency``: the old single-constant planner instead
    (16-bit dp traffic, no ends, no tied gradient)."""
    world = cand.degrees.world_size
    unit = Cluster(nodes=1, gpus_per_node=world, memory_bytes=1e30, peak_flops=1e30,  # not hardware
                   intra_bandwidth=1.0, inter_bandwidth=1.0, intra_latency=0.0,
                   inter_latency=0.0, name="unit", mem_bandwidth=1e30)  # fmt: skip; not hardware
    time = predict(model, unit, global_batch, cand, precision=precision,
                   efficiency=efficiency).time  # fmt: skip
    return {term: time.get(name, 0.0) for term, name in PLANNER_TERM.items()}


def dp_bytes(cand: Candidate, psi: float, precision: Precision, micro_batches: int,
             tied: float = 0.0) -> float:  # fmt: skip
    """Wire bytes per step of the dp collectives :func:`labkit.planner.space.wire_bytes` lists
    for ``psi`` parameters (ZeRO over the whole dp group; ``tied``: the parameters of a tied
    embedding and head on this rank), each converted as its ring sends."""
    total = 0.0
    for name, (nbytes, ranks, count) in planner_wire(cand, psi, precision, cand.dp,
                                                     micro_batches, tied).items():  # fmt: skip
        one = Message(WIRE_OPS[name], tuple(range(ranks)), int(nbytes), "planner")
        total += count * wire_bytes(one)
    return total
