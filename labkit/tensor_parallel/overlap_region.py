"""A GPT block's tensor-parallel regions with overlapped SP (``TPConfig(overlap=True)``).

Under plain SP a region (``transform.ParallelRegion``) all-gathers its (B, T/t, d) input once
and its column-parallel layers (q, k and v; or fc) read the gathered (B, T, d). Overlapped, the
gather cannot happen first: it is decomposed *into* the column GEMM
(:func:`labkit.tensor_parallel.overlap.all_gather_linear`). So the region runs one
all-gather-matmul over the column layers' weights concatenated along the output (q, k and v
become one (3h/t, h) GEMM, as Megatron fuses QKV; autograd splits the gradient back to each
parameter), hands each layer its slice, and runs the inner module on a (B, T, 0) placeholder
whose shape is all the module reads of its input. The row-parallel projection at the end is an
:class:`~labkit.tensor_parallel.overlap.OverlappedRowLinear` (its reduce-scatter decomposed).

The model still never knows: the attention and the MLP call ``self.q(x)`` and ``self.fc(x)``
as before; :class:`TakeOutput` answers with the slice the region computed.
"""

from __future__ import annotations

import torch
from torch import nn

from labkit.collectives import Comm
from labkit.tensor_parallel.layers import ColumnParallelLinear
from labkit.tensor_parallel.overlap import all_gather_linear

__all__ = ["OverlappedRegion", "TakeOutput"]


class TakeOutput(nn.Module):
    """Stands where a column-parallel layer was; returns the product its region computed."""

    def __init__(self, inner: ColumnParallelLinear) -> None:
        super().__init__()
        self.inner = inner  # owns the parameters (named ...q.inner.weight: ".inner" is dropped)
        self.out_features = inner.out_features  # the attention reads its head count here
        self.value: torch.Tensor | None = None

    def forward(self, placeholder: torch.Tensor) -> torch.Tensor:
        if self.value is None:
            raise RuntimeError("TakeOutput: called outside its OverlappedRegion's forward")
        value, self.value = self.value, None  # used once: no activation outlives the forward
        return value


class OverlappedRegion(nn.Module):
    """Enter a region by one decomposed all-gather-matmul over the column layers ``names`` of
    ``inner`` (each replaced by a :class:`TakeOutput`), then run ``inner``."""

    def __init__(self, inner: nn.Module, names: tuple[str, ...], comm: Comm) -> None:
        super().__init__()
        self.inner, self.comm = inner, comm
        self.takes: list[TakeOutput] = []
        for name in names:
            take = TakeOutput(getattr(inner, name))
            setattr(inner, name, take)
            self.takes.append(take)
        if len({t.inner.bias is None for t in self.takes}) > 1:
            raise ValueError(f"columns {names}: all or none must have a bias (fused into one GEMM)")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        layers = [t.inner for t in self.takes]
        weight = torch.cat([layer.weight for layer in layers])  # (sum of o/t, d)
        biases = [layer.bias for layer in layers]
        bias = None if biases[0] is None else torch.cat(biases)  # type: ignore[arg-type]
        y = all_gather_linear(x, weight, bias, self.comm.group)  # (B, T, sum of o/t)
        for take, part in zip(self.takes, y.split([la.out_features for la in layers], dim=-1)):
            take.value = part
        B, n, _ = x.shape
        return self.inner(x.new_empty(B, n * self.comm.world_size, 0))  # (B, T, 0): shape only
