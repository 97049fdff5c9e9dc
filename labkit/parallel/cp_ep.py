"""Context and expert parallelism as :func:`labkit.parallel.compose` hooks: module swaps and a
sequence split, so the GPT never knows it is distributed.

Context parallelism (``cp`` ranks hold one sequence between them):

* :class:`ContextParallelAttention` replaces a block's attention *core* and keeps its q/k/v and
  output projections (already the tensor-parallel shards when tp > 1): the local (B, h/tp,
  T/cp, hd) queries attend over the whole sequence by ring attention over ``cp_group``
  (:func:`labkit.context_parallel.ring_attention`, zigzag split, causal) or by Ulysses'
  all-to-all (:func:`labkit.context_parallel.ulysses_attention`, contiguous split).
* :class:`ShardPositions` makes the position embedding look up this rank's *global* positions
  (zigzag: chunks r and 2cp-1-r of 2cp), the only other place a GPT reads the sequence index.
* :func:`split_sequence` gives each cp rank its chunks of the tokens and targets. Every cp
  rank's loss is the mean over its T/cp positions, so the mean over the cp ranks (the dp
  wrapper's average over ``dp_cp_group``) is the mean over the whole sequence.

Expert parallelism: a MoE GPT's :class:`~labkit.experts.layer.MoELayer` blocks become
:class:`~labkit.experts.parallel.ExpertParallelMoE` over ``ep_group`` (ep = 1: a group of one).
Tensor parallelism only knows dense MLPs, so :func:`lift_experts` takes the MoE layers out
(a dense stub in their place) before tp and :func:`place_experts` puts them back, their ``f``
dimension sliced over tp, after. Expert gradients are reduced over ``edp_group`` (SUM, then
/ (dp x cp)); :func:`hidden_experts` keeps them out of a dp wrapper, whose group is wrong for them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from labkit.collectives import Comm
from labkit.context_parallel import ring_attention, shard_sequence, ulysses_attention
from labkit.experts.layer import Experts, MoELayer
from labkit.experts.parallel import ExpertParallelMoE
from labkit.models.gpt import CausalSelfAttention, MLPBlock

__all__ = [
    "CP_SCHEMES",
    "ContextParallelAttention",
    "ShardPositions",
    "context_parallel",
    "expert_full_size",
    "hidden_experts",
    "lift_experts",
    "place_experts",
    "reduce_expert_grads",
    "split_sequence",
]

CP_SCHEMES = {"ring": "zigzag", "ulysses": "contiguous"}  # attention -> its sequence split


class ContextParallelAttention(nn.Module):
    """``inner``'s projections around a context-parallel core: x (B, T/cp, d) -> (B, T/cp, d)."""

    def __init__(self, inner: nn.Module, group: Any, attention: str) -> None:
        super().__init__()
        if attention not in CP_SCHEMES:
            raise ValueError(f"attention={attention!r}: expected one of {list(CP_SCHEMES)}")
        self.inner, self.group, self.attention = inner, group, attention

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a: Any = self.inner
        B, T, _ = x.shape
        heads = a.q.out_features // a.head_dim  # h / tp under tensor parallelism
        # (B, T/cp, heads * hd) -> (B, heads, T/cp, hd)
        q, k, v = (lin(x).view(B, T, heads, a.head_dim).transpose(1, 2) for lin in (a.q, a.k, a.v))
        if self.attention == "ring":
            y = ring_attention(q, k, v, group=self.group, causal=True, scheme="zigzag")
        else:
            y = ulysses_attention(q, k, v, group=self.group, causal=True)
        y = y.to(q.dtype).transpose(1, 2).reshape(B, T, heads * a.head_dim)  # -> (B, T/cp, d')
        return a.dropout(a.proj(y))


class ShardPositions(nn.Module):
    """A position embedding that maps local position i to this rank's global ``positions[i]``."""

    def __init__(self, inner: nn.Embedding, positions: torch.Tensor) -> None:
        super().__init__()
        self.inner = inner
        # a plain attribute, not a buffer: a dp wrapper broadcasts buffers from its rank 0,
        # and these differ on every cp rank of a dp x cp group
        self.positions = positions

    @property
    def weight(self) -> Any:
        return self.inner.weight

    def forward(self, pos: torch.Tensor) -> torch.Tensor:
        # (T/cp,) local -> global -> (T/cp, d)
        return self.inner(self.positions.to(pos.device)[pos])


def split_sequence(x: torch.Tensor, cp: int, rank: int, attention: str) -> torch.Tensor:
    """(..., T) -> (..., T/cp): this cp rank's chunks (zigzag for the ring, contiguous for
    Ulysses). T must split into 2 cp equal chunks (clear error otherwise)."""
    return shard_sequence(x, cp, rank, CP_SCHEMES[attention], dim=-1)


def context_parallel(model: nn.Module, group: Any, attention: str, seq: int) -> nn.Module:
    """In place: every attention core over ``group``, the positions this rank's (of ``seq``)."""
    gpt: Any = getattr(model, "gpt", model)  # the tp wrapper keeps the GPT as .gpt
    if gpt.cfg.dropout:
        raise ValueError(f"dropout={gpt.cfg.dropout}: the context-parallel cores run without it")
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    for name, mod in list(gpt.named_modules()):
        if isinstance(mod, CausalSelfAttention):
            parent, _, leaf = name.rpartition(".")
            setattr(
                gpt.get_submodule(parent), leaf, ContextParallelAttention(mod, group, attention)
            )
    owner: Any = gpt
    attr = "wpe"
    while not isinstance(getattr(owner, attr), nn.Embedding):  # under SP: SequenceShard.inner
        owner, attr = getattr(owner, attr), "inner"
    positions = split_sequence(torch.arange(seq), cp, rank, attention)  # (T/cp,) global ids
    setattr(owner, attr, ShardPositions(getattr(owner, attr), positions))
    return model


def lift_experts(model: nn.Module) -> dict[int, MoELayer]:
    """Take every block's MoE layer out (a dense MLP stub in its place, built without touching
    the global RNG) so tensor parallelism can shard the rest; returns {block index: layer}."""
    gpt: Any = getattr(model, "gpt", model)
    lifted = {}
    for i, block in enumerate(gpt.blocks):
        if isinstance(block.mlp, MoELayer):
            lifted[i] = block.mlp
            with torch.random.fork_rng():
                block.mlp = MLPBlock(gpt.cfg)
    return lifted


def place_experts(
    model: nn.Module, lifted: dict[int, MoELayer], ep_group: Any, tp_comm: Comm | None
) -> nn.Module:
    """Block i's MLP (the stub, or tp's shard of it) becomes ``lifted[i]`` sharded over
    ``ep_group`` (``E / ep`` experts each), its expert width over ``tp_comm``'s ranks."""
    gpt: Any = getattr(model, "gpt", model)
    for i, layer in lifted.items():
        moe = ExpertParallelMoE(layer, ep_group, tp_comm=tp_comm, impl="labkit")
        tp = 1 if tp_comm is None else tp_comm.world_size
        for pname, p in moe.experts.named_parameters():
            p.ep_shard = True  # type: ignore[attr-defined]  # experts sliced along dim 0
            dim = {"w1": 2, "b1": 1, "w2": 1}.get(pname)
            if tp > 1 and dim is not None:
                p.tp_shard_dim = dim  # type: ignore[attr-defined]  # f sliced over tp
        gpt.blocks[i].mlp = moe
    return model


def expert_modules(model: nn.Module) -> list[ExpertParallelMoE]:
    return [m for m in model.modules() if isinstance(m, ExpertParallelMoE)]


@contextlib.contextmanager
def hidden_experts(model: nn.Module) -> Iterator[None]:
    """While open, the expert-parallel layers hold no experts, so a dp wrapper built inside
    neither broadcasts (each rank's experts differ) nor reduces them (edp's job)."""
    layers = expert_modules(model)
    kept = [m.experts for m in layers]
    for m in layers:
        m.experts = nn.Identity()  # type: ignore[assignment]
    try:
        yield
    finally:
        for m, e in zip(layers, kept):
            m.experts = e


def reduce_expert_grads(model: nn.Module, edp_group: Any, divisor: int) -> None:
    """Expert grads: SUM over the ranks holding the same experts, / (dp x cp) (the loss is the
    mean over every dp x cp rank's tokens; the all-to-all's backward already summed the ep
    group's contributions). Zeros join for an expert no token reached: collectives match."""
    ps = [p for m in model.modules() if isinstance(m, Experts) for p in m.parameters()]
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in ps]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])  # one message
    dist.all_reduce(flat, group=edp_group)
    flat /= divisor
    for p, part in zip(ps, flat.split([g.numel() for g in grads])):
        p.grad = part.view_as(p).clone()


def expert_full_size(p: nn.Parameter, x: torch.Tensor, ep_group: Any) -> torch.Tensor:
    """An expert shard's value gathered over ``ep_group`` along the expert dim (others: x)."""
    if not getattr(p, "ep_shard", False) or dist.get_world_size(ep_group) == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(ep_group))]
    dist.all_gather(parts, x.contiguous(), group=ep_group)
    return torch.cat(parts, dim=0)
