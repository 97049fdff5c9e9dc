"""The time side of context and expert parallelism: ring K/V traffic, all-to-alls, MoE GEMMs.

Pure arithmetic on :mod:`labkit.context_parallel.cost` and :mod:`labkit.experts.costs`;
:mod:`steptime` adds the terms, named:

``cp_comm``  ring attention (Liu et al. 2023): per layer and micro-batch, ``cp - 1`` forward
             steps each passing one chunk's K and V (``2 b (s/cp) h/t`` elements), then ``cp``
             backward steps passing K/V and their float32 gradients, and the gradients' last hop
             (:func:`labkit.context_parallel.cost.ring_sent_per_step`), on the cp group's link
             at ``GroupLink.ring_bandwidth``. **Overlap assumption**: each step's transfer runs
             behind that step's block of attention (double-buffered, as the ring sends the next
             block while computing this one), so a step exposes only ``max(0, transfer -
             block)``, the block being ``1/cp`` of the rank's attention forward (or backward);
             the gradients' last hop has nothing to hide behind. Full recompute runs the
             forward ring again.
``ep_comm``  per MoE layer and micro-batch, 2 all-to-alls forward (dispatch, combine) and 2
             backward (their gradients), 2 more under full recompute; each rank sends its slots'
             rows (``E C`` with a capacity factor, ``k T`` dropless; ``h`` 16-bit elements each,
             ``1/t`` of them per tp rank: Megatron-Core splits the tp group's tokens before
             dispatch) by pairwise exchange (:func:`labkit.experts.costs.all_to_all_time`): the
             pieces for ranks on the same node at NVLink, the others at the inter-node per-GPU
             share (every GPU of a node sends across at once, so the per-GPU share is right
             here, unlike a ring). Exposed: the experts wait for the dispatch, the next layer
             for the combine. Routing is taken as uniform (no load imbalance).
MoE GEMMs    the MLP's two GEMMs replaced by the router ``(T, E, h)``, the ``E / ep`` local
             experts' batched GEMMs over ``C ep`` rows each (padding included: an empty slot
             costs FLOPs too) and a shared expert's GEMMs: ``top_k``, not ``E``, sets the FLOPs.
"""

from __future__ import annotations

from labkit.context_parallel.cost import ring_sent_per_step
from labkit.experts.costs import all_to_all_time
from labkit.memory.moe_cp import MoESpec
from labkit.models.gpt import GPTConfig
from labkit.planner.cluster import Cluster
from labkit.planner.links import GroupLink

__all__ = ["a2a_seconds", "moe_mlp_shapes", "moe_model_flops", "ring_exposed"]

Shape = tuple[float, float, float, float]  # (m, n, k, batch): batch matmuls of (m, k) @ (k, n)


def moe_mlp_shapes(spec: MoESpec, tokens: float, h: int, tp: int, ep: int) -> list[Shape]:
    """The forward GEMMs of one MoE layer on one rank for ``tokens`` (module docstring)."""
    routed, pad = spec.slots(tokens)
    rows = (routed + pad) / spec.n_experts * ep  # each local expert's rows, from ep ranks
    f, local = spec.expert_d_ff / tp, spec.n_experts / ep
    up = 2 * f if spec.glu else f  # SwiGLU's gate and up in one GEMM
    out: list[Shape] = [(tokens, spec.n_experts, h, 1), (rows, up, h, local), (rows, h, f, local)]
    if spec.shared_d_ff:
        fs = spec.shared_d_ff / tp
        out += [(tokens, 2 * fs if spec.glu else fs, h, 1), (tokens, h, fs, 1)]
    return out


def a2a_seconds(spec: MoESpec, tokens: float, h: int, tp: int, ep: int, link: GroupLink,
                cluster: Cluster) -> float:  # fmt: skip
    """One all-to-all of the dispatch (module docstring) over the ep group on ``link``."""
    if ep == 1:
        return 0.0
    routed, pad = spec.slots(tokens)
    nbytes = (routed + pad) * h * 2 / tp
    if not link.crosses_nodes:
        return all_to_all_time(nbytes, ep, cluster.intra_latency, cluster.intra_bandwidth)
    g = link.ranks_per_node if link.balanced else 1  # ragged: price every piece as remote
    return all_to_all_time(nbytes, ep, cluster.intra_latency, cluster.intra_bandwidth,
                           ranks_per_node=g, inter_alpha=cluster.inter_latency,
                           inter_bandwidth=cluster.inter_bandwidth)  # fmt: skip


def ring_exposed(cfg: GPTConfig, b: int, tp: int, cp: int, attn_fwd: float, attn_bwd: float,
                 link: GroupLink, recompute: str) -> tuple[float, float]:  # fmt: skip
    """(exposed, hidden) seconds of one layer's ring K/V traffic for one micro-batch; the
    ``attn_*`` are the rank's whole attention forward / backward (module docstring)."""
    if cp == 1:
        return 0.0, 0.0
    heads, d = cfg.n_head // tp, cfg.n_embd // cfg.n_head
    sent = ring_sent_per_step(b, heads, cfg.block_size, d, cp, elem=2)
    fwd, bwd = sent[: cp - 1], sent[cp - 1 :]  # cp - 1 forward, cp + 1 backward transfers
    bw = link.ring_bandwidth

    def xfer(x: float) -> float:
        return link.alpha + x / bw

    blocks = [(xfer(x), attn_fwd / cp) for x in fwd]
    if recompute == "full":
        blocks *= 2
    blocks += [(xfer(x), attn_bwd / cp) for x in bwd[:-1]] + [(xfer(bwd[-1]), 0.0)]
    exposed = sum(max(0.0, x - c) for x, c in blocks)
    return exposed, sum(x for x, _ in blocks) - exposed


def moe_model_flops(cfg: GPTConfig, spec: MoESpec, global_batch: int) -> float:
    """Model FLOPs a MoE iteration needs beyond Megatron's dense count: each MoE layer's dense
    MLP (``3 x 2 x 8 h^2`` a token, forward and backward) swapped for the router, the ``top_k``
    experts and the shared one (``3 x 2`` FLOPs per weight a token). Add it to
    :func:`labkit.planner.flops.megatron_flops_per_iteration`."""
    h, tokens = cfg.n_embd, global_batch * cfg.block_size
    glu = 3 if spec.glu else 2
    active = spec.top_k * spec.expert_params(h) + glu * h * spec.shared_d_ff + h * spec.n_experts
    return spec.moe_layers(cfg.n_layer) * tokens * 6 * (active - 8 * h * h)
