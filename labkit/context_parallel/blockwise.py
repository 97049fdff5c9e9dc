"""Attention one block at a time: the online-softmax (log-sum-exp) merge and its backward.

The invariant (Milakov & Gimelshein 2018, "Online normalizer calculation for softmax"; used
by FlashAttention, Dao et al. 2022, and ring attention, Liu et al. 2023): attention of a query
row over keys split into blocks ``K = [K_1, K_2]`` is recovered exactly from each block's
result ``O_i = softmax(q K_i^T) V_i`` and its log-sum-exp ``L_i = log sum_j exp(q k_j)``::

    L = log(exp(L_1) + exp(L_2))                 (logaddexp)
    O = exp(L_1 - L) * O_1 + exp(L_2 - L) * O_2

because ``softmax`` over all keys weighs block i's keys by ``exp(L_i - L)`` relative to its own
normaliser. No full score matrix is ever needed: a block's scores are ``n_q x n_k``.

The backward needs only the saved ``L`` (FlashAttention-2's recomputation, Dao 2023): with
``P = exp(S - L)`` recomputed per block and ``D = rowsum(dO * O)``::

    dV = P^T dO,   dP = dO V^T,   dS = P * (dP - D),   dQ = scale * dS K,   dK = scale * dS^T Q

``D`` is the same for every block (it uses the final ``O``), so blocks are independent.
Everything here runs in the accumulation dtype :func:`acc_dtype` (float32, the precision of
flash kernels: 16-bit inputs are upcast; float64 stays float64, as the fused kernel's own
float64 path expects a float64 LSE). A row whose keys are all masked has ``L = -inf`` and
output 0; the merge keeps it -inf-safe (no NaN from ``-inf - -inf``).

Shapes: ``q`` (b, h, n_q, d), ``k``/``v`` (b, h, n_k, d), ``L`` (b, h, n_q).
"""

from __future__ import annotations

import math

import torch

__all__ = [
    "acc_dtype",
    "block_backward",
    "block_forward",
    "blockwise_attention",
    "causal_mask",
    "fused_tiles",
    "merge",
    "tile_backward",
    "tile_forward",
]


def _finite(lse: torch.Tensor) -> torch.Tensor:
    """``lse`` with -inf replaced by 0, so ``exp(x - lse)`` of a fully masked row is 0."""
    return torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype scores, outputs, LSE and gradients are kept in: float32, or float64."""
    return torch.promote_types(dtype, torch.float32)


def causal_mask(n: int, device: torch.device | None = None) -> torch.Tensor:
    """(n, n) bool, True where key position <= query position (a diagonal block)."""
    return torch.ones(n, n, dtype=torch.bool, device=device).tril()


def _scores(
    q: torch.Tensor, k: torch.Tensor, scale: float, mask: torch.Tensor | None
) -> torch.Tensor:
    acc = acc_dtype(q.dtype)
    s = torch.matmul(q.to(acc), k.to(acc).transpose(-1, -2)) * scale  # (b, h, n_q, n_k)
    return s if mask is None else s.masked_fill(~mask, float("-inf"))


def block_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, mask: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """One block: ``(O_i, L_i)`` in :func:`acc_dtype`; ``mask`` (n_q, n_k) True = attend."""
    s = _scores(q, k, scale, mask)
    lse = torch.logsumexp(s, dim=-1)  # (b, h, n_q)
    p = torch.exp(s - _finite(lse).unsqueeze(-1))
    return torch.matmul(p, v.to(s.dtype)), lse


def merge(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The online-softmax merge of two blocks' results over the same query rows."""
    lse = torch.logaddexp(lse_a, lse_b)
    safe = _finite(lse)
    wa = torch.exp(lse_a - safe).unsqueeze(-1)  # exp(-inf) = 0 for an empty block
    wb = torch.exp(lse_b - safe).unsqueeze(-1)
    return wa * out_a + wb * out_b, lse


def block_backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dout: torch.Tensor,
    lse: torch.Tensor,
    delta: torch.Tensor,
    scale: float,
    mask: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One block's ``(dQ_i, dK_i, dV_i)`` in :func:`acc_dtype` from the *final* ``lse`` and
    ``delta = rowsum(dO * O)`` (module docstring); nothing else is saved."""
    p = torch.exp(_scores(q, k, scale, mask) - _finite(lse).unsqueeze(-1))  # (b, h, n_q, n_k)
    acc = p.dtype
    do = dout.to(acc)
    dv = torch.matmul(p.transpose(-1, -2), do)
    dp = torch.matmul(do, v.to(acc).transpose(-1, -2))
    ds = p * (dp - delta.unsqueeze(-1))
    dq = torch.matmul(ds, k.to(acc)) * scale
    dk = torch.matmul(ds.transpose(-1, -2), q.to(acc)) * scale
    return dq, dk, dv


def blockwise_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    block: int,
    causal: bool = False,
    scale: float | None = None,
) -> torch.Tensor:
    """Single-process attention over key blocks of ``block`` positions, merged online: the
    flash-style loop, whose largest temporary is one (n_q, block) score tile per head
    instead of the (n_q, n_k) matrix. Equal to softmax attention (the tests check it)."""
    n_k = k.shape[-2]
    if block < 1:
        raise ValueError(f"block={block} must be >= 1")
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    acc = acc_dtype(q.dtype)
    out = torch.zeros(q.shape, dtype=acc, device=q.device)
    lse = torch.full(q.shape[:-1], float("-inf"), dtype=acc, device=q.device)
    rows = torch.arange(q.shape[-2], device=q.device).unsqueeze(
        1
    )  # top-left aligned, as torch's SDPA
    for start in range(0, n_k, block):
        stop = min(start + block, n_k)
        mask = None
        if causal:
            mask = rows >= torch.arange(start, stop, device=q.device).unsqueeze(0)
        o, l_ = block_forward(q, k[..., start:stop, :], v[..., start:stop, :], scale, mask)
        out, lse = merge(out, lse, o, l_)
    return out.to(q.dtype)


def fused_tiles(q: torch.Tensor) -> bool:
    """Whether torch's fused CPU flash kernel can compute tiles for ``q`` (it returns the LSE
    and its backward takes the *global* O and LSE, exactly :func:`block_backward`'s terms)."""
    return q.device.type == "cpu" and hasattr(
        torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward"
    )


def tile_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, diag: bool, fused: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """One (n, n) tile: :func:`block_forward`, or the fused kernel (``diag``: a causal
    tile on the diagonal, top-left aligned). Output and LSE in :func:`acc_dtype`."""
    if fused:
        o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, diag, attn_mask=None, scale=scale
        )
        return o.to(acc_dtype(q.dtype)), lse
    return block_forward(q, k, v, scale, causal_mask(q.shape[-2], q.device) if diag else None)


def tile_backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dout: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    delta: torch.Tensor,
    scale: float,
    diag: bool,
    fused: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One tile's (dQ, dK, dV) in :func:`acc_dtype` from the global ``out`` and ``lse`` (the
    fused kernel recomputes ``delta`` from ``out``; the reference takes it). The fused kernel
    wants the LSE in its own accumulation dtype: float32, float64 for float64 inputs."""
    if fused:
        acc = acc_dtype(q.dtype)
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse.to(acc), 0.0, diag, attn_mask=None, scale=scale
        )
        return dq.to(acc), dk.to(acc), dv.to(acc)
    mask = causal_mask(q.shape[-2], q.device) if diag else None
    return block_backward(q, k, v, dout, lse, delta, scale, mask)
