"""Turn a labkit GPT into its tensor-parallel (and sequence-parallel) version, shard by shard.

The GPT never knows it is distributed: :func:`tensor_parallel` copies it and replaces modules,
taking each rank's shard of the *full* model's weights, so a run built from the same seed is
comparable element by element with the single-process model. Per block (Shoeybi et al. 2019,
Figure 3; Korthikanti et al. 2022, Figure 5 for SP)::

    attention  f | q, k, v column-parallel (heads r h/t .. (r+1) h/t) | core | proj row | g
    MLP        f | fc column-parallel (4d/t)      | GeLU               | proj row      | g
    embedding  wte vocab-parallel | g ;  head: f | column-parallel on the same wte shard
    loss       vocab-parallel cross-entropy on the (B, T, V/t) logits

One f serves q, k and v together (Megatron fuses them into one QKV matmul; our GPT keeps
three for readability), so a block costs exactly 2 all-reduces forward and 2 backward.

With ``overlap`` (SP only) the blocks' gathers and scatters are decomposed under their GEMMs
(``overlap_region.py``); the head's and the embedding's stay whole.

With ``sequence_parallel`` every f becomes an all-gather along the sequence and every g a
reduce-scatter, so LayerNorms, dropouts and residual adds run on (B, T/t, d). The gathered
input of q/k/v, fc and the head is *not* kept for backward: only this rank's shard is, and it
is gathered again when backward needs it (Korthikanti section 4.2.2): that is what makes the
stored activation 34/t instead of 10 + 24/t. Parameters used on sequence shards (LayerNorms,
the row-parallel biases, the position embedding) get partial gradients, summed over the group
once per step by :meth:`TensorParallelGPT.finish_grads` (Megatron's ``sequence_parallel``
parameters).

Dropout: every ``nn.Dropout`` becomes a :class:`~labkit.tensor_parallel.random.RegionDropout`
that knows whether its tensor is replicated or sharded (see ``random.py``). The attention-
probability dropout of ``attention="sdpa"`` happens inside ``F.scaled_dot_product_attention``
with the default generator, out of reach: use ``attention="explicit"`` to control it.
"""

from __future__ import annotations

import copy
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from labkit.collectives import Comm
from labkit.models.gpt import GPT, GPTConfig
from labkit.parallel.layout import ParallelDegrees
from labkit.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from labkit.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from labkit.tensor_parallel.mappings import all_gather_seq, copy_to_tp, gather_from_sp
from labkit.tensor_parallel.overlap import OverlappedRowLinear
from labkit.tensor_parallel.overlap_region import OverlappedRegion
from labkit.tensor_parallel.random import DropoutClock, RegionDropout, dropout_sites

__all__ = ["TPConfig", "TensorParallelGPT", "agree_on_config", "check_tp", "tensor_parallel"]


@dataclass(frozen=True)
class TPConfig:
    """How to parallelise: sequence parallelism, which collectives, which dropout masks."""

    sequence_parallel: bool = False
    impl: str = "torch"  # "torch" or "ring" (labkit's own collectives), see labkit.collectives.Comm
    masks: str = "per_rank"  # "per_rank" (Megatron) or "sliced" (equal to the unsharded run)
    seed: int = 0  # dropout seed, the same on every rank
    overlap: bool = False  # SP's gather / scatter decomposed under the blocks' GEMMs (overlap.py)

    def __post_init__(self) -> None:
        if self.overlap and not self.sequence_parallel:
            raise ValueError(
                "TPConfig(overlap=True) decomposes sequence parallelism's all-gather and "
                "reduce-scatter under the GEMMs: it needs sequence_parallel=True, got False"
            )


def check_tp(cfg: GPTConfig, tp: int) -> None:
    """Raise before any process starts unless hidden size, heads and vocabulary divide by tp."""
    ParallelDegrees(tp=tp).check_model(hidden=cfg.n_embd, heads=cfg.n_head, vocab=cfg.vocab_size)


def agree_on_config(fields: dict[str, Any], group: Any) -> None:
    """Every rank of ``group`` must hold the same ``fields``: one small all-gather, then every
    rank raises the same error naming the fields that differ (rather than hanging later in a
    collective whose sizes do not match)."""
    everyone: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, fields, group=group)
    differ = sorted(k for k in fields if any(other.get(k) != fields[k] for other in everyone))
    if differ:
        per_rank = "; ".join(
            f"rank {r}: " + ", ".join(f"{k}={o.get(k)!r}" for k in differ)
            for r, o in enumerate(everyone)
        )
        raise ValueError(f"tensor-parallel ranks disagree on {', '.join(differ)}: {per_rank}")


class _Regather:
    """Saved-tensor hooks: a tensor saved for backward that lives in the gathered (B, T, d)
    input is stored as this rank's (B, T/t, d) shard and all-gathered again, once, on first
    use in backward; the copy is dropped after its last use (q, k and v share one)."""

    def __init__(self, full: torch.Tensor, shard: torch.Tensor, comm: Comm) -> None:
        self.ptr = full.untyped_storage().data_ptr()
        self.shard, self.comm = shard.detach(), comm
        self.cache: torch.Tensor | None = None
        self.pending = 0

    def pack(self, t: torch.Tensor) -> Any:
        if t.untyped_storage().data_ptr() != self.ptr:
            return t
        self.pending += 1
        return (self, t.shape, t.stride(), t.storage_offset())

    def unpack(self, packed: Any) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        _, shape, stride, offset = packed
        if self.cache is None:
            self.cache = all_gather_seq(self.shard, self.comm)  # (B, T, d), contiguous
        out = self.cache.as_strided(shape, stride, offset)
        self.pending -= 1
        if self.pending <= 0:
            self.cache = None
        return out


class ParallelRegion(nn.Module):
    """Enter a tensor-parallel region: f (or the SP all-gather) once, then ``inner``, whose
    last layer is row-parallel and leaves it with g (or the SP reduce-scatter)."""

    def __init__(self, inner: nn.Module, comm: Comm, sequence_parallel: bool) -> None:
        super().__init__()
        self.inner, self.comm, self.sequence_parallel = inner, comm, sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.sequence_parallel:
            return self.inner(copy_to_tp(x, self.comm))
        full = gather_from_sp(x, self.comm)  # (B, T/t, d) -> (B, T, d)
        hooks = _Regather(full, x, self.comm)
        with torch.autograd.graph.saved_tensors_hooks(hooks.pack, hooks.unpack):
            return self.inner(full)


class SequenceShard(nn.Module):
    """The position embedding under SP: only this rank's positions [r T/t, (r+1) T/t)."""

    def __init__(self, inner: nn.Embedding, rank: int, world_size: int) -> None:
        super().__init__()
        self.inner, self.rank, self.world_size = inner, rank, world_size

    def forward(self, pos: torch.Tensor) -> torch.Tensor:
        n = pos.shape[0] // self.world_size
        return self.inner(pos[self.rank * n : (self.rank + 1) * n])  # (T/t, d)


def _mark_sequence_parallel(module: nn.Module) -> None:
    for p in module.parameters():
        p.sequence_parallel = True  # type: ignore[attr-defined]


def _dropouts(model: nn.Module, config: TPConfig, rank: int, t: int) -> None:
    """Replace every dropout by a RegionDropout that knows whether its tensor is sharded."""
    sp = config.sequence_parallel
    for site, name in enumerate(dropout_sites(model)):
        sharded = name.endswith("attn_drop") or (
            sp and (name == "drop" or name.endswith(".dropout"))
        )
        old: Any = model.get_submodule(name)  # nn.Dropout or RegionDropout
        p = float(old.p)
        new = RegionDropout(
            p, config.seed, site, region="sharded" if sharded else "replicated", masks=config.masks,
            rank=rank, world_size=t, dim=1,  # heads of (B, h, T, T), tokens of (B, T, d)
        )  # fmt: skip
        parent, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, leaf, new)


def tensor_parallel(
    model: GPT, group: Any = None, config: TPConfig | None = None
) -> TensorParallelGPT:
    """The tensor-parallel version of ``model`` for this rank of ``group`` (``model`` itself
    is left untouched; every rank must pass the same full model, e.g. built from one seed)."""
    config = config or TPConfig()
    cfg = model.cfg
    rank, t = dist.get_rank(group), dist.get_world_size(group)
    check_tp(cfg, t)
    checksum = float(sum(p.detach().double().sum() for p in model.parameters()))
    agree_on_config({**asdict(cfg), **asdict(config), "tp": t, "weights checksum": checksum}, group)
    sp = config.sequence_parallel
    out_mode = "reduce_scatter" if sp else "reduce"
    comms = {name: Comm(group, config.impl) for name in ["embed", "head", "loss", "grads"]}

    gpt: Any = copy.deepcopy(model)  # Any: its modules are about to change type
    _dropouts(gpt, config, rank, t)
    DropoutClock().attach(gpt)
    gpt.wte = VocabParallelEmbedding(model.wte, comms["embed"], out_mode)
    if sp:
        gpt.wpe = SequenceShard(gpt.wpe, rank, t)
        _mark_sequence_parallel(gpt.wpe)
        _mark_sequence_parallel(gpt.ln_f)
    for i, block in enumerate(gpt.blocks):
        comms[f"block{i}"] = c = Comm(group, config.impl)
        attn, mlp = block.attn, block.mlp
        attn.q, attn.k, attn.v = (
            ColumnParallelLinear(lin, c, "none") for lin in (attn.q, attn.k, attn.v)
        )
        mlp.fc = ColumnParallelLinear(mlp.fc, c, "none")
        if config.overlap:  # the regions' gathers and scatters decomposed (overlap_region.py)
            attn.proj, mlp.proj = (
                OverlappedRowLinear(attn.proj, c),
                OverlappedRowLinear(mlp.proj, c),
            )
            block.attn = OverlappedRegion(attn, ("q", "k", "v"), c)
            block.mlp = OverlappedRegion(mlp, ("fc",), c)
        else:
            attn.proj = RowParallelLinear(attn.proj, c, out_mode)
            mlp.proj = RowParallelLinear(mlp.proj, c, out_mode)
            block.attn, block.mlp = ParallelRegion(attn, c, sp), ParallelRegion(mlp, c, sp)
        if sp:  # used on sequence shards: partial gradients
            for m in (block.ln1, block.ln2, attn.proj.bias, mlp.proj.bias):
                if isinstance(m, nn.Module):
                    _mark_sequence_parallel(m)
                elif m is not None:
                    m.sequence_parallel = True  # type: ignore[attr-defined]
    head = ColumnParallelLinear(model.head, comms["head"], "none")
    if cfg.tie_weights:
        head.weight = gpt.wte.weight  # one Parameter: the vocab shard of wte is the head's shard
    gpt.head = ParallelRegion(head, comms["head"], sp)  # type: ignore[assignment]
    return TensorParallelGPT(gpt, comms, config, group)


class TensorParallelGPT(nn.Module):
    """One rank's shard of a GPT. ``forward`` returns this rank's (B, T, V/t) logits."""

    def __init__(self, gpt: GPT, comms: dict[str, Comm], config: TPConfig, group: Any) -> None:
        super().__init__()
        self.gpt, self.comms, self.config, self.group = gpt, comms, config, group
        self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.gpt(idx)

    def loss(
        self, idx: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100
    ) -> torch.Tensor:
        """Mean cross-entropy over the full vocabulary, never building the full logits; the
        targets equal to ``ignore_index`` are not counted (``F.cross_entropy``'s semantics)."""
        return self.loss_from_logits(self(idx), targets, ignore_index)

    def loss_from_logits(
        self, logits: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100
    ) -> torch.Tensor:
        """The same, from this rank's (B, T, V/t) logits of a forward already run."""
        comm = self.comms["loss"]
        return vocab_parallel_cross_entropy(logits, targets, comm, ignore_index=ignore_index)

    def finish_grads(self) -> None:
        """Sum the partial gradients of sequence-parallel parameters over the group (one flat
        all-reduce). Call after the last micro-batch's backward, before the optimizer step."""
        grads = [
            p.grad
            for p in self.parameters()
            if getattr(p, "sequence_parallel", False) and p.grad is not None
        ]
        if not grads:
            return
        flat = torch.cat([g.reshape(-1) for g in grads])  # (sum of numel,)
        self.comms["grads"].all_reduce(flat)
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()

    def reset_counts(self) -> None:
        for c in self.comms.values():
            c.reset()

    def gather_full(self, grads: bool = False) -> dict[str, torch.Tensor]:
        """Every parameter (or gradient) at full shape, named as in the unsharded GPT; sharded
        ones are all-gathered along ``tp_shard_dim`` (uncounted: this is for inspection)."""
        out = {}
        for name, p in self.gpt.named_parameters():
            src = p.grad if grads else p
            if src is None:
                raise ValueError(f"{name} has no gradient: call backward first")
            t = src.detach()
            dim = getattr(p, "tp_shard_dim", None)
            if dim is not None:
                parts = [torch.empty_like(t) for _ in range(self.world_size)]
                dist.all_gather(parts, t.contiguous(), group=self.group)
                t = torch.cat(parts, dim=dim)
            # the unsharded GPT's name: drop the wrappers (ours, and a CheckpointedBlock's)
            out[name.replace(".inner", "").replace(".block.", ".")] = t
        return out
